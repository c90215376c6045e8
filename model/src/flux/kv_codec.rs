//! Byte encoding of one block's cached image K/V, for the cache tiers (memory, disk, object
//! store) and the network: a 16-byte header, then K, then V (a `Hidden` block: the hidden
//! stream only).
//!
//! Header: `b"DMKV"`, version (1), [`CacheDtype`] code, [`KvFormat`] code, 0, rows (u32 LE),
//! cols (u32 LE). Payloads are row-major; `Fp8` stores per-row f32 scales first (absmax / 448,
//! the e4m3 range), then one byte per element. Decoding checks every length, so a truncated or
//! foreign blob is an error naming the field, never a panic.
use super::kv::KvFormat;
use crate::error::{ModelError, Result};
use tch::{Device, Kind, Tensor};

const MAGIC: &[u8; 4] = b"DMKV";
const VERSION: u8 = 1;
/// Bytes of a blob's header, before its payload.
pub const HEADER: usize = 16;
/// Largest finite float8 e4m3fn value.
const FP8_MAX: f64 = 448.0;

/// Storage precision of a cache. Caches are computed in the model's dtype; storing them in a
/// narrower type halves (or quarters) the bytes every tier moves, at a quality cost the engine
/// bench measures (SSIM against full compute).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum CacheDtype {
    F32,
    F16,
    #[default]
    Bf16,
    /// float8 e4m3 with a per-row scale (lossy compression).
    Fp8,
}

impl CacheDtype {
    pub fn code(self) -> u8 {
        match self {
            CacheDtype::F32 => 0,
            CacheDtype::F16 => 1,
            CacheDtype::Bf16 => 2,
            CacheDtype::Fp8 => 3,
        }
    }

    fn from_code(c: u8) -> Result<Self> {
        Ok(match c {
            0 => CacheDtype::F32,
            1 => CacheDtype::F16,
            2 => CacheDtype::Bf16,
            3 => CacheDtype::Fp8,
            other => return Err(bad("dtype", format!("unknown dtype code {other}"))),
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CacheDtype::F32 => "f32",
            CacheDtype::F16 => "f16",
            CacheDtype::Bf16 => "bf16",
            CacheDtype::Fp8 => "fp8",
        }
    }

    /// Parse `f32|f16|bf16|fp8` (flags, config).
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "f32" => CacheDtype::F32,
            "f16" => CacheDtype::F16,
            "bf16" => CacheDtype::Bf16,
            "fp8" => CacheDtype::Fp8,
            other => {
                return Err(ModelError::input(
                    "cache_dtype",
                    format!("expected f32, f16, bf16 or fp8, got {other:?}"),
                ))
            }
        })
    }

    /// Bytes per element of the payload (fp8 adds 4 bytes of scale per row).
    pub fn element_bytes(self) -> usize {
        match self {
            CacheDtype::F32 => 4,
            CacheDtype::F16 | CacheDtype::Bf16 => 2,
            CacheDtype::Fp8 => 1,
        }
    }

    fn kind(self) -> Kind {
        match self {
            CacheDtype::F32 => Kind::Float,
            CacheDtype::F16 => Kind::Half,
            CacheDtype::Bf16 => Kind::BFloat16,
            CacheDtype::Fp8 => Kind::Float8e4m3fn,
        }
    }
}

fn bad(field: &str, message: impl Into<String>) -> ModelError {
    ModelError::input(format!("cache_blob.{field}"), message)
}

fn format_code(f: KvFormat) -> u8 {
    match f {
        KvFormat::Raw => 0,
        KvFormat::Prepared => 1,
        KvFormat::Hidden => 2,
    }
}

/// Encoded size of one block (`format.parts()` tensors of `rows x cols`).
pub fn encoded_len(rows: usize, cols: usize, dtype: CacheDtype, format: KvFormat) -> usize {
    let scales = if dtype == CacheDtype::Fp8 {
        4 * rows
    } else {
        0
    };
    HEADER + format.parts() * (scales + rows * cols * dtype.element_bytes())
}

/// Encode one block's `[N, inner]` K and V (any float dtype, any device); a `Hidden` block
/// stores `k` (the hidden stream) only.
pub fn encode_block(
    k: &Tensor,
    v: &Tensor,
    format: KvFormat,
    dtype: CacheDtype,
) -> Result<Vec<u8>> {
    let size = k.size();
    if size.len() != 2 || v.size() != size {
        return Err(ModelError::input(
            "cache",
            format!(
                "K and V must both be [N, inner], got {:?} and {:?}",
                size,
                v.size()
            ),
        ));
    }
    let (rows, cols) = (size[0] as usize, size[1] as usize);
    let mut out = Vec::with_capacity(encoded_len(rows, cols, dtype, format));
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[VERSION, dtype.code(), format_code(format), 0]);
    out.extend_from_slice(&(rows as u32).to_le_bytes());
    out.extend_from_slice(&(cols as u32).to_le_bytes());
    for t in [k, v].into_iter().take(format.parts()) {
        append_payload(&mut out, t, dtype)?;
    }
    Ok(out)
}

fn append_payload(out: &mut Vec<u8>, t: &Tensor, dtype: CacheDtype) -> Result<()> {
    let t = t.f_to_device(Device::Cpu)?;
    let t = if dtype == CacheDtype::Fp8 {
        let t = t.f_to_kind(Kind::Float)?;
        let scale = t
            .f_abs()?
            .f_amax(&[1i64][..], true)?
            .f_clamp_min(1e-12)?
            .f_div_scalar(FP8_MAX)?;
        append_raw(out, &scale)?;
        t.f_div(&scale)?.f_to_kind(Kind::Float8e4m3fn)?
    } else {
        t.f_to_kind(dtype.kind())?
    };
    append_raw(out, &t)
}

fn append_raw(out: &mut Vec<u8>, t: &Tensor) -> Result<()> {
    let t = t.f_contiguous()?;
    let numel = t.numel();
    let bytes = numel * t.kind().elt_size_in_bytes();
    let start = out.len();
    out.resize(start + bytes, 0);
    t.f_copy_data_u8(&mut out[start..], numel)?;
    Ok(())
}

/// Header of an encoded block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobHeader {
    pub dtype: CacheDtype,
    pub format: KvFormat,
    pub rows: usize,
    pub cols: usize,
}

/// Read and check the header (and the total length) of an encoded block.
pub fn read_header(blob: &[u8]) -> Result<BlobHeader> {
    if blob.len() < HEADER || &blob[..4] != MAGIC {
        return Err(bad("magic", "not a diffmesh K/V block"));
    }
    if blob[4] != VERSION {
        return Err(bad("version", format!("unsupported version {}", blob[4])));
    }
    let dtype = CacheDtype::from_code(blob[5])?;
    let format = match blob[6] {
        0 => KvFormat::Raw,
        1 => KvFormat::Prepared,
        2 => KvFormat::Hidden,
        other => return Err(bad("format", format!("unknown format code {other}"))),
    };
    let word = |at: usize| u32::from_le_bytes([blob[at], blob[at + 1], blob[at + 2], blob[at + 3]]);
    let (rows, cols) = (word(8) as usize, word(12) as usize);
    let expect = encoded_len(rows, cols, dtype, format);
    if blob.len() != expect {
        return Err(bad(
            "length",
            format!(
                "{rows}x{cols} {} needs {expect} bytes, got {}",
                dtype.as_str(),
                blob.len()
            ),
        ));
    }
    Ok(BlobHeader {
        dtype,
        format,
        rows,
        cols,
    })
}

/// Decode one block into `[N, inner]` K and V of `kind` (on the CPU); a `Hidden` block's
/// hidden stream comes back as both.
pub fn decode_block(blob: &[u8], kind: Kind) -> Result<(Tensor, Tensor, KvFormat)> {
    let h = read_header(blob)?;
    // `from_data_size` copies: every part is a tensor of its own.
    let read = |at: usize, len: usize, part: Kind, shape: [i64; 2]| -> Result<Tensor> {
        Ok(Tensor::f_from_data_size(&blob[at..at + len], &shape, part)?)
    };
    let (k, v) = decode_parts(&h, kind, read, true)?;
    Ok((k, v, h.format))
}

/// Decode one block from `raw`, a 1-D u8 tensor holding exactly the blob whose header (read on
/// the host) is `h`, on whatever device `raw` lives: the GPU cache pipeline copies the encoded
/// bytes to the device and decodes there, so only the narrow form crosses the bus. K and V are
/// always fresh tensors, never views of `raw` (its buffer is reused for the next block).
pub fn decode_block_bytes(h: &BlobHeader, raw: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
    let expect = encoded_len(h.rows, h.cols, h.dtype, h.format);
    if raw.kind() != Kind::Uint8 || raw.dim() != 1 || raw.size()[0] as usize != expect {
        return Err(bad(
            "length",
            format!(
                "{}x{} {} needs {expect} u8 elements, got {:?} {:?}",
                h.rows,
                h.cols,
                h.dtype.as_str(),
                raw.kind(),
                raw.size()
            ),
        ));
    }
    // Reinterpret the bytes in place; an offset the element size does not divide is copied to
    // a fresh (aligned) buffer first.
    let view = |at: usize, len: usize, part: Kind, shape: [i64; 2]| -> Result<Tensor> {
        let bytes = raw.f_narrow(0, at as i64, len as i64)?;
        let bytes = if at.is_multiple_of(part.elt_size_in_bytes()) {
            bytes
        } else {
            fresh(&bytes)?
        };
        Ok(bytes.f_view_dtype(part)?.f_view(shape)?)
    };
    decode_parts(h, kind, view, false)
}

/// K then V of `kind` from a blob's payload, each part (`rows x cols`, fp8's scales first)
/// read by `read(offset, bytes, kind, shape)`; `owned`: what `read` returns is not shared with
/// anything (else a part already of `kind` is copied, since `to_kind` would return it as is).
fn decode_parts(
    h: &BlobHeader,
    kind: Kind,
    read: impl Fn(usize, usize, Kind, [i64; 2]) -> Result<Tensor>,
    owned: bool,
) -> Result<(Tensor, Tensor)> {
    let (rows, cols) = (h.rows as i64, h.cols as i64);
    let scales = if h.dtype == CacheDtype::Fp8 {
        4 * h.rows
    } else {
        0
    };
    let data = h.rows * h.cols * h.dtype.element_bytes();
    let mut at = HEADER;
    let mut next = || -> Result<Tensor> {
        let scale = if scales > 0 {
            let s = read(at, scales, Kind::Float, [rows, 1])?;
            at += scales;
            Some(s)
        } else {
            None
        };
        let t = read(at, data, h.dtype.kind(), [rows, cols])?;
        at += data;
        Ok(match scale {
            Some(s) => t.f_to_kind(Kind::Float)?.f_mul(&s)?.f_to_kind(kind)?,
            None if t.kind() == kind && !owned => fresh(&t)?,
            None => t.f_to_kind(kind)?,
        })
    };
    let k = next()?;
    let v = match h.format.parts() {
        1 => k.shallow_clone(),
        _ => next()?,
    };
    Ok((k, v))
}

/// A copy of `t` in a buffer of its own.
fn fresh(t: &Tensor) -> Result<Tensor> {
    let mut out = t.f_empty_like()?;
    out.f_copy_(t)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv() -> (Tensor, Tensor) {
        tch::manual_seed(3);
        let opts = (Kind::Float, Device::Cpu);
        (
            Tensor::randn([37, 24], opts) * 3.0,
            Tensor::randn([37, 24], opts),
        )
    }

    fn max_rel_err(a: &Tensor, b: &Tensor) -> f64 {
        let num = (a - b).abs().max().double_value(&[]);
        num / b.abs().max().double_value(&[])
    }

    #[test]
    fn round_trips_within_each_dtypes_precision() {
        let (k, v) = kv();
        for (dtype, tol) in [
            (CacheDtype::F32, 0.0),
            (CacheDtype::F16, 1e-3),
            (CacheDtype::Bf16, 8e-3),
            (CacheDtype::Fp8, 7e-2),
        ] {
            let blob = encode_block(&k, &v, KvFormat::Prepared, dtype).unwrap();
            assert_eq!(blob.len(), encoded_len(37, 24, dtype, KvFormat::Prepared));
            let (k2, v2, f) = decode_block(&blob, Kind::Float).unwrap();
            assert_eq!(f, KvFormat::Prepared);
            let (ek, ev) = (max_rel_err(&k2, &k), max_rel_err(&v2, &v));
            assert!(ek <= tol && ev <= tol, "{dtype:?}: {ek} {ev}");
        }
    }

    /// The device-side decode (the GPU cache pipeline's) gives what the host decode gives, for
    /// every dtype, into f32 and bf16, at an odd row count (fp8's second scale block then sits
    /// at an offset 4 does not divide) and from a buffer that is then overwritten.
    #[test]
    fn decoding_the_bytes_as_a_tensor_matches_the_host_decode() {
        let opts = (Kind::Float, Device::Cpu);
        tch::manual_seed(5);
        let (k, v) = (
            Tensor::randn([37, 23], opts),
            Tensor::randn([37, 23], opts) * 2.0,
        );
        for dtype in [
            CacheDtype::F32,
            CacheDtype::F16,
            CacheDtype::Bf16,
            CacheDtype::Fp8,
        ] {
            for kind in [Kind::Float, Kind::BFloat16] {
                let blob = encode_block(&k, &v, KvFormat::Prepared, dtype).unwrap();
                let h = read_header(&blob).unwrap();
                let mut raw = Tensor::from_slice(&blob);
                let (k1, v1) = decode_block_bytes(&h, &raw, kind).unwrap();
                let (k2, v2, _) = decode_block(&blob, kind).unwrap();
                let _ = raw.fill_(0);
                assert_eq!((k1.kind(), k1.size()), (kind, vec![37, 23]), "{dtype:?}");
                assert!(k1.equal(&k2) && v1.equal(&v2), "{dtype:?} into {kind:?}");
            }
        }
        let blob = encode_block(&k, &v, KvFormat::Raw, CacheDtype::Bf16).unwrap();
        let h = read_header(&blob).unwrap();
        let short = Tensor::from_slice(&blob[..blob.len() - 2]);
        let err = decode_block_bytes(&h, &short, Kind::Float).unwrap_err();
        assert!(err.to_string().contains("cache_blob.length"), "{err}");
    }

    /// A hidden-stream block keeps one tensor: half a K/V block's payload, the same header,
    /// and it decodes (on the host and from device bytes) into that tensor twice.
    #[test]
    fn hidden_blocks_hold_one_tensor() {
        let (h, other) = kv();
        for dtype in [CacheDtype::F32, CacheDtype::Bf16, CacheDtype::Fp8] {
            let blob = encode_block(&h, &h, KvFormat::Hidden, dtype).unwrap();
            let kv_len = encoded_len(37, 24, dtype, KvFormat::Prepared);
            assert_eq!(blob.len(), (kv_len - HEADER) / 2 + HEADER, "{dtype:?}");
            let (a, b, f) = decode_block(&blob, Kind::Float).unwrap();
            assert_eq!(f, KvFormat::Hidden);
            assert!(a.equal(&b), "{dtype:?}");
            let full = encode_block(&h, &other, KvFormat::Prepared, dtype).unwrap();
            let (k, _, _) = decode_block(&full, Kind::Float).unwrap();
            assert!(
                a.equal(&k),
                "{dtype:?}: the hidden stream decodes as K would"
            );
            let head = read_header(&blob).unwrap();
            let (d, _) =
                decode_block_bytes(&head, &Tensor::from_slice(&blob), Kind::Float).unwrap();
            assert!(d.equal(&a), "{dtype:?}");
        }
        // A K/V blob relabelled hidden has the wrong length for its header.
        let mut blob = encode_block(&h, &other, KvFormat::Raw, CacheDtype::Bf16).unwrap();
        blob[6] = 2;
        let err = decode_block(&blob, Kind::Float).unwrap_err();
        assert!(err.to_string().contains("cache_blob.length"), "{err}");
    }

    #[test]
    fn narrower_dtypes_are_smaller() {
        let sizes: Vec<usize> = [CacheDtype::F32, CacheDtype::Bf16, CacheDtype::Fp8]
            .iter()
            .map(|&d| encoded_len(1024, 1024, d, KvFormat::Raw))
            .collect();
        assert!(sizes[0] > sizes[1] && sizes[1] > sizes[2], "{sizes:?}");
    }

    #[test]
    fn damaged_blobs_are_errors_naming_the_field() {
        let (k, v) = kv();
        let blob = encode_block(&k, &v, KvFormat::Raw, CacheDtype::Bf16).unwrap();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (blob[..blob.len() - 1].to_vec(), "cache_blob.length"),
            (b"nope".to_vec(), "cache_blob.magic"),
            (
                {
                    let mut b = blob.clone();
                    b[4] = 9;
                    b
                },
                "cache_blob.version",
            ),
            (
                {
                    let mut b = blob.clone();
                    b[5] = 9;
                    b
                },
                "cache_blob.dtype",
            ),
            (
                {
                    let mut b = blob.clone();
                    b[6] = 9;
                    b
                },
                "cache_blob.format",
            ),
        ];
        for (b, field) in cases {
            let err = decode_block(&b, Kind::Float).unwrap_err().to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
        assert!(CacheDtype::parse("int4")
            .unwrap_err()
            .to_string()
            .contains("cache_dtype"));
    }
}
