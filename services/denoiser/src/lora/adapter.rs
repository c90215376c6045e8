//! LoRA files as the denoiser holds them ([`LoraBlob`]: the bytes and their checked header, safe
//! to share across threads), and their tensors, read on the engine thread when it patches.
use diffmesh_model::lora::{LoraAdapter, LoraDelta};
use diffmesh_model::tch::{Kind, Tensor};
use diffmesh_shared::wire::lora::{LoraFile, LoraFormatError};
use safetensors::tensor::{Dtype, SafeTensors};

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
        // One parse of the header for all tensors (a parse per tensor cost as much as the patch).
        let st = SafeTensors::deserialize(&self.bytes).map_err(|e| LoraFormatError {
            key: "file".into(),
            message: format!("is not a safetensors file: {e}"),
        })?;
        let deltas = self
            .file
            .modules
            .iter()
            .map(|m| {
                Ok(LoraDelta {
                    down: read_tensor(&st, &m.down_key)?,
                    up: read_tensor(&st, &m.up_key)?,
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

fn read_tensor(st: &SafeTensors<'_>, key: &str) -> Result<Tensor, LoraFormatError> {
    let view = st.tensor(key).map_err(|e| LoraFormatError {
        key: key.to_string(),
        message: format!("cannot be read: {e}"),
    })?;
    let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
    let kind = kind_of(view.dtype(), key)?;
    Tensor::f_from_data_size(view.data(), &shape, kind).map_err(|e| LoraFormatError {
        key: key.to_string(),
        message: format!("cannot be read: {e}"),
    })
}

/// Parse and read a LoRA file in one go (tests, tools).
pub fn adapter_from_bytes(id: &str, bytes: &[u8]) -> Result<LoraAdapter, LoraFormatError> {
    LoraBlob::new(id, bytes::Bytes::copy_from_slice(bytes))?.adapter()
}
