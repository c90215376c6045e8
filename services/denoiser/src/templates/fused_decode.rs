//! The fused fp8 decode of streamed cache blocks on the GPU (`kernels/dequant_fp8.cu`, compiled
//! at run time with NVRTC through cudarc).
//!
//! An fp8 block in a ring buffer decodes through tch in three tensors per part (fp8 -> f32,
//! times the per-row scales, f32 -> bf16): about 19 bytes of memory traffic per element and
//! three launches, on the compute stream. On the H100 that made an fp8 cache's streamed step
//! slower than a bf16 one's (docs/GPU.md). The kernel reads the ring buffer once and writes the
//! bf16 K or V: 3 bytes per element, one launch per part, bit-exact with the tch path (the GPU
//! test `gpu_fused_fp8_decode_matches_tch` checks it). Any other dtype pair, or a machine whose
//! NVRTC cannot be loaded, keeps the tch decode.
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use diffmesh_model::flux::kv_codec::{BlobHeader, CacheDtype, HEADER};
use diffmesh_model::tch::{Kind, Tensor};
use std::sync::Arc;

/// The kernel's source, shared with `kernels/`.
pub const SOURCE: &str = include_str!("../../../../kernels/dequant_fp8.cu");
const KERNEL: &str = "dequant_fp8_rows_to_bf16";
const THREADS: u32 = 256;

/// Compile the kernel to PTX (needs NVRTC, not a GPU). `Err` where NVRTC cannot be loaded or
/// the source does not compile.
pub fn compile() -> Result<Ptx, String> {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("NVRTC (libnvrtc) could not be loaded".into());
    }
    compile_ptx_with_opts(SOURCE, CompileOptions::default()).map_err(|e| format!("NVRTC: {e:?}"))
}

/// The loaded kernel of one device.
#[derive(Debug)]
pub struct Fp8Decoder {
    function: CudaFunction,
}

impl Fp8Decoder {
    /// Compile and load the kernel into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, String> {
        let ptx = compile()?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| format!("loading the fp8 kernel: {e:?}"))?;
        let function = module
            .load_function(KERNEL)
            .map_err(|e| format!("loading the fp8 kernel: {e:?}"))?;
        Ok(Self { function })
    }

    /// Whether this decoder serves a block of `header` wanted as `kind`.
    pub fn serves(header: &BlobHeader, kind: Kind) -> bool {
        header.dtype == CacheDtype::Fp8 && kind == Kind::BFloat16
    }

    /// K and V of an fp8 block whose encoded bytes are `raw` (u8, on the device), as bf16
    /// `[rows, cols]` tensors (a hidden-stream block's one part as both, as the tch decode gives), queued on `stream` (the compute stream: the output's memory
    /// comes from libtorch's allocator, which orders its reuse on that stream).
    pub fn decode(
        &self,
        stream: &Arc<CudaStream>,
        header: &BlobHeader,
        raw: &Tensor,
    ) -> Result<(Tensor, Tensor), String> {
        let (rows, cols) = (header.rows as u64, header.cols as u64);
        let part = rows * cols;
        let parts = header.format.parts() as u64;
        let expect = HEADER as u64 + parts * (4 * rows + part);
        let len = raw.size().first().copied().unwrap_or(0) as u64;
        if raw.kind() != Kind::Uint8 || raw.dim() != 1 || len != expect {
            return Err(format!(
                "fp8 block of {rows}x{cols} needs {expect} u8 bytes, got {:?} {:?}",
                raw.kind(),
                raw.size()
            ));
        }
        let base = raw.data_ptr() as u64;
        let mut at = base + HEADER as u64;
        let mut next = || -> Result<Tensor, String> {
            let out = Tensor::f_empty([rows as i64, cols as i64], (Kind::BFloat16, raw.device()))
                .map_err(|e| e.to_string())?;
            let (scales, data) = (at, at + 4 * rows);
            at = data + part;
            let dst = out.data_ptr() as u64;
            let blocks = part.div_ceil(u64::from(THREADS)).clamp(1, 65_535) as u32;
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = stream.launch_builder(&self.function);
            launch
                .arg(&data)
                .arg(&scales)
                .arg(&dst)
                .arg(&rows)
                .arg(&cols);
            // SAFETY: the kernel reads `part` bytes at `data` and `4 * rows` at `scales`, both
            // inside `raw` (length checked above), and writes `part` bf16 into `out`, which
            // holds exactly that; all three live until the work queued on `stream` is done
            // (libtorch's allocator reuses memory in the order of that stream).
            unsafe { launch.launch(cfg) }.map_err(|e| format!("fp8 kernel launch: {e:?}"))?;
            Ok(out)
        };
        let k = next()?;
        let v = match parts {
            1 => k.shallow_clone(),
            _ => next()?,
        };
        Ok((k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel source compiles wherever NVRTC loads (a CUDA torch wheel brings it; a
    /// CPU-only machine without it skips, and the GPU test below runs the kernel).
    #[test]
    fn kernel_compiles_where_nvrtc_loads() {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("no libnvrtc here: the compile is checked on the GPU machine");
            return;
        }
        let ptx = compile().expect("the fp8 kernel compiles");
        assert!(ptx.to_src().contains(KERNEL));
    }

    /// The kernel gives exactly what the tch decode gives, on blocks with zeros, subnormal and
    /// largest fp8 values, negative rows and a width the block size does not divide. Run where
    /// a GPU is: `cargo test -p diffmesh-denoiser --lib -- --ignored gpu_fused`.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_fused_fp8_decode_matches_tch() {
        use diffmesh_model::flux::kv::KvFormat;
        use diffmesh_model::flux::kv_codec::{decode_block_bytes, encode_block, read_header};
        use diffmesh_model::tch::Device;
        let ctx = CudaContext::new(0).unwrap();
        let decoder = Fp8Decoder::load(&ctx).unwrap();
        let stream = ctx.default_stream();
        let cuda = Device::Cuda(0);
        for (rows, cols) in [(1, 1), (7, 129), (300, 3072)] {
            let k = Tensor::randn([rows, cols], (Kind::Float, Device::Cpu)) * 3.0;
            // Row 0 spans fp8's range: zeros, subnormals after scaling, the largest values.
            let v = Tensor::linspace(-1e4, 1e4, rows * cols, (Kind::Float, Device::Cpu))
                .view([rows, cols]);
            let _ = v.get(0).fill_(0.0);
            let blob = encode_block(&k, &v, KvFormat::Raw, CacheDtype::Fp8).unwrap();
            let header = read_header(&blob).unwrap();
            assert!(Fp8Decoder::serves(&header, Kind::BFloat16));
            let raw = Tensor::from_slice(&blob).to_device(cuda);
            let (fk, fv) = decoder.decode(&stream, &header, &raw).unwrap();
            let (tk, tv) = decode_block_bytes(&header, &raw, Kind::BFloat16).unwrap();
            assert!(fk.equal(&tk), "K of {rows}x{cols}");
            assert!(fv.equal(&tv), "V of {rows}x{cols}");
            // A hidden-stream block: one part, read as both.
            let blob = encode_block(&v, &v, KvFormat::Hidden, CacheDtype::Fp8).unwrap();
            let header = read_header(&blob).unwrap();
            let raw = Tensor::from_slice(&blob).to_device(cuda);
            let (fh, fh2) = decoder.decode(&stream, &header, &raw).unwrap();
            let (th, _) = decode_block_bytes(&header, &raw, Kind::BFloat16).unwrap();
            assert!(fh.equal(&th) && fh2.equal(&th), "hidden {rows}x{cols}");
        }
        // A block of the wrong length is an error, not an out-of-bounds read.
        let blob = encode_block(
            &Tensor::ones([2, 2], (Kind::Float, Device::Cpu)),
            &Tensor::ones([2, 2], (Kind::Float, Device::Cpu)),
            KvFormat::Raw,
            CacheDtype::Fp8,
        )
        .unwrap();
        let header = read_header(&blob).unwrap();
        let short = Tensor::from_slice(&blob[..blob.len() - 1]).to_device(cuda);
        assert!(decoder.decode(&stream, &header, &short).is_err());
    }
}
