// Fused decode of one fp8 cache part (K or V of a block, services/denoiser's streamed cache):
// out[r][c] = bf16(f32(data[r][c]) * scale[r]), in one pass over the ring buffer the copy
// stream filled. The tch fallback (`kv_codec::decode_block_bytes`) makes three tensors for it
// (fp8 -> f32, times the scales, f32 -> bf16); this reads 1 byte and writes 2 per element.
//
// Bit-exact with the fallback: e4m3fn -> f32 is exact, the product is one f32 multiply, and the
// cast rounds to nearest even with NaN as 0x7FC0, as c10::BFloat16 does. No CUDA headers are
// included, so NVRTC needs no include path.

__device__ __forceinline__ float e4m3fn_to_float(unsigned char x) {
  const unsigned int sign = (x & 0x80u) << 24;
  const unsigned int exponent = (x >> 3) & 0xFu;
  const unsigned int mantissa = x & 0x7u;
  float magnitude;
  if (exponent == 0xFu && mantissa == 0x7u) {
    magnitude = __int_as_float(0x7FC00000);  // e4m3fn has NaN and no infinities
  } else if (exponent == 0u) {
    magnitude = (float)mantissa * 0.001953125f;  // subnormal: mantissa/8 * 2^-6
  } else {
    // Exponent bias 7 -> 127; the 3 mantissa bits on top of f32's 23.
    magnitude = __int_as_float((int)(((exponent + 120u) << 23) | (mantissa << 20)));
  }
  return __int_as_float(__float_as_int(magnitude) | (int)sign);
}

__device__ __forceinline__ unsigned short float_to_bf16_rne(float f) {
  unsigned int u = (unsigned int)__float_as_int(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    return 0x7FC0;
  }
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

// The scales sit in the blob right after its header, at any byte offset: read them bytewise.
__device__ __forceinline__ float read_f32_le(const unsigned char* p) {
  const unsigned int bits = (unsigned int)p[0] | ((unsigned int)p[1] << 8) |
                            ((unsigned int)p[2] << 16) | ((unsigned int)p[3] << 24);
  return __int_as_float((int)bits);
}

extern "C" __global__ void dequant_fp8_rows_to_bf16(const unsigned char* __restrict__ data,
                                                    const unsigned char* __restrict__ scales,
                                                    unsigned short* __restrict__ out,
                                                    unsigned long long rows,
                                                    unsigned long long cols) {
  const unsigned long long n = rows * cols;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float scale = read_f32_le(scales + 4 * (i / cols));
    out[i] = float_to_bf16_rne(e4m3fn_to_float(data[i]) * scale);
  }
}
