//! LoRA files as the denoiser holds them ([`LoraBlob`]: the bytes and their checked header, safe
//! to share across threads), and their tensors, read on the engine thread when it patches.
use diffmesh_model::lora::{LoraAdapter, LoraDelta};
use diffmesh_model::tch::{Kind, Tensor};
use diffmesh_shared::lora::{LoraFile, LoraFormatError};
use safetensors::tensor::Dtype;

/// A LoRA file in memory, checked.
#[derive(Debug)]
pub struct LoraBlob {
    pub id: String,
    pub bytes: bytes::Bytes,
    pub file: LoraFile,
}

impl LoraBlob {
    /// Check a LoRA file ([`LoraFile::parse`]).
    pub fn new(id: &str, bytes: bytes::Bytes) -> Result<Self, LoraFormatError> {
        Ok(Self {
            id: id.to_string(),
            file: LoraFile::parse(&bytes)?,
            bytes,
        })
    }

    /// Its A and B matrices as tensors (CPU, the file's dtype).
    pub fn adapter(&self) -> Result<LoraAdapter, LoraFormatError> {
        let deltas = self
            .file
            .modules
            .iter()
            .map(|m| {
                Ok(LoraDelta {
                    down: read_tensor(&self.bytes, &m.down_key)?,
                    up: read_tensor(&self.bytes, &m.up_key)?,
                    module: m.module.clone(),
                    scale: m.scale,
                })
            })
            .collect::<Result<_, LoraFormatError>>()?;
        Ok(LoraAdapter {
            id: self.id.clone(),
            deltas,
        })
    }
}

fn kind_of(dtype: Dtype, key: &str) -> Result<Kind, LoraFormatError> {
    match dtype {
        Dtype::F32 => Ok(Kind::Float),
        Dtype::F16 => Ok(Kind::Half),
        Dtype::BF16 => Ok(Kind::BFloat16),
        d => Err(LoraFormatError {
            key: key.to_string(),
            message: format!("dtype {d:?} is not F32, F16 or BF16"),
        }),
    }
}

fn read_tensor(bytes: &[u8], key: &str) -> Result<Tensor, LoraFormatError> {
    let (data, dtype, shape) = LoraFile::tensor_data(bytes, key)?;
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    Tensor::f_from_data_size(data, &shape, kind_of(dtype, key)?).map_err(|e| LoraFormatError {
        key: key.to_string(),
        message: format!("cannot be read: {e}"),
    })
}

/// Parse and read a LoRA file in one go (tests, tools).
pub fn adapter_from_bytes(id: &str, bytes: &[u8]) -> Result<LoraAdapter, LoraFormatError> {
    LoraBlob::new(id, bytes::Bytes::copy_from_slice(bytes))?.adapter()
}
