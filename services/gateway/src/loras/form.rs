//! `POST /v1/loras`: the multipart form (`weights`, the `.safetensors` file diffusers'
//! `save_lora_weights` writes; optional `name`) read and checked. The file's header must be a
//! LoRA the denoisers can apply (`lora::LoraFile::parse`); a 400 names `weights` and, in its
//! message, the tensor or metadata key at fault.
use actix_multipart::Multipart;
use diffmesh_shared::wire::lora::{LoraFile, LoraRecord};
use diffmesh_shared::wire::messages::FieldError;
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::upload::{read_limited, Parts, MAX_TEXT_FIELD_BYTES};

/// Longest `name`, in characters.
pub const MAX_NAME_CHARS: usize = 200;

/// A checked registration: the file, what its header says, and the client's label.
#[derive(Debug)]
pub struct LoraUpload {
    pub weights: Vec<u8>,
    pub file: LoraFile,
    pub name: Option<String>,
}

impl LoraUpload {
    /// The record of this upload registered as `id` by `owner` (the caller's API key; `None`
    /// without API keys) at `created_at` (RFC 3339).
    pub fn record(&self, id: String, owner: Option<String>, created_at: String) -> LoraRecord {
        LoraRecord {
            id,
            name: self.name.clone(),
            owner,
            bytes: self.weights.len() as u64,
            parameters: self.file.parameters,
            modules: self.file.modules.len(),
            max_rank: self.file.max_rank(),
            dtype: self.file.dtype.clone(),
            sha256: Sha256::digest(&self.weights)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            created_at,
        }
    }
}

/// Read the form: `weights` up to `max_weights_bytes` (413 naming `weights`), every other part
/// a small text field (together at most `MAX_TEXT_FIELD_BYTES`, 413 naming the part); at most
/// `MAX_PARTS` parts.
pub async fn read(payload: Multipart, max_weights_bytes: usize) -> Result<LoraUpload, ApiError> {
    let mut parts = Parts::new(payload);
    let mut text_budget = MAX_TEXT_FIELD_BYTES;
    let mut weights = None;
    let mut name = None;
    while let Some(field) = parts.next().await? {
        let field_name = field.name().unwrap_or_default().to_string();
        if field_name == "weights" {
            // One file per registration: a second would double what is held in memory.
            if weights.is_some() {
                return Err(FieldError::invalid("weights", "sent twice; send one file").into());
            }
            weights = Some(read_limited(field, max_weights_bytes, "weights").await?);
            continue;
        }
        let bytes = read_limited(field, text_budget, &field_name).await?;
        text_budget -= bytes.len();
        if field_name == "name" {
            let value = String::from_utf8(bytes)
                .map_err(|_| FieldError::invalid("name", "must be UTF-8 text"))?;
            name = Some(value);
        }
        // Other text fields are ignored, as on the image endpoints.
    }
    let weights = weights.ok_or_else(|| {
        FieldError::invalid(
            "weights",
            "required (multipart file field): the .safetensors file of a diffusers LoRA",
        )
    })?;
    Ok(check(weights, name)?)
}

/// Check an upload's name and the file's header.
pub fn check(weights: Vec<u8>, name: Option<String>) -> Result<LoraUpload, FieldError> {
    let name = check_name(name)?;
    let file = LoraFile::parse(&weights)
        .map_err(|e| FieldError::invalid("weights", format!("not a LoRA we can apply: {e}")))?;
    Ok(LoraUpload {
        weights,
        file,
        name,
    })
}

/// At most `MAX_NAME_CHARS` characters; an empty name is no name.
fn check_name(name: Option<String>) -> Result<Option<String>, FieldError> {
    let Some(name) = name.filter(|n| !n.trim().is_empty()) else {
        return Ok(None);
    };
    let chars = name.chars().count();
    if chars > MAX_NAME_CHARS {
        return Err(FieldError::invalid(
            "name",
            format!("is {chars} characters, above the limit of {MAX_NAME_CHARS}"),
        ));
    }
    Ok(Some(name))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A safetensors file of f32 zero tensors `(key, shape)`, written by hand (the format is
    /// an 8-byte header length, a JSON header, then the data) so the crate needs no writer.
    pub(crate) fn safetensors(tensors: &[(&str, [usize; 2])]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut offset = 0;
        for (key, shape) in tensors {
            let len = shape[0] * shape[1] * 4;
            header.insert(
                key.to_string(),
                serde_json::json!({
                    "dtype": "F32",
                    "shape": shape,
                    "data_offsets": [offset, offset + len],
                }),
            );
            offset += len;
        }
        let header = serde_json::to_vec(&header).unwrap();
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(&header);
        file.resize(file.len() + offset, 0);
        file
    }

    const Q: &str = "transformer.transformer_blocks.0.attn.to_q";

    #[test]
    fn a_diffusers_lora_becomes_a_record() {
        let bytes = safetensors(&[
            (&format!("{Q}.lora_A.weight"), [4, 192]),
            (&format!("{Q}.lora_B.weight"), [192, 4]),
        ]);
        let upload = check(bytes.clone(), Some("style".into())).unwrap();
        let r = upload.record(
            "id-1".into(),
            Some("alice".into()),
            "2025-01-01T00:00:00.000Z".into(),
        );
        assert_eq!((r.id.as_str(), r.name.as_deref()), ("id-1", Some("style")));
        assert_eq!(r.owner.as_deref(), Some("alice"));
        assert_eq!((r.modules, r.max_rank, r.parameters), (1, 4, 2 * 4 * 192));
        assert_eq!((r.bytes, r.dtype.as_str()), (bytes.len() as u64, "F32"));
        let sha: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(r.sha256, sha);
        assert_eq!(r.sha256.len(), 64);
    }

    #[test]
    fn bad_files_name_weights_and_the_key_at_fault() {
        let half = safetensors(&[(&format!("{Q}.lora_A.weight"), [4, 192])]);
        let e = check(half, None).unwrap_err();
        assert_eq!(e.field, "weights");
        assert!(
            e.message
                .contains(&format!("{Q}: needs both lora_A.weight and lora_B.weight")),
            "{}",
            e.message
        );
        let e = check(b"not a safetensors file".to_vec(), None).unwrap_err();
        assert_eq!(e.field, "weights");
        assert!(e.message.contains("file: "), "{}", e.message);
    }

    #[test]
    fn names_are_optional_and_bounded() {
        assert_eq!(check_name(None).unwrap(), None);
        assert_eq!(check_name(Some("  ".into())).unwrap(), None);
        let longest = "é".repeat(MAX_NAME_CHARS);
        assert_eq!(check_name(Some(longest.clone())).unwrap(), Some(longest));
        let e = check_name(Some("x".repeat(MAX_NAME_CHARS + 1))).unwrap_err();
        assert_eq!(e.field, "name");
        assert!(e.message.contains("200"), "{}", e.message);
    }
}
