//! `POST /v1/loras`: the multipart form (`weights`, the `.safetensors` file diffusers'
//! `save_lora_weights` writes; optional `name`) read and checked. The file is streamed to the
//! spool directory as it arrives (`spool`), never held whole in memory; its header must be a
//! LoRA the denoisers can apply (`lora::LoraFile::parse_header`); a 400 names `weights` and,
//! in its message, the tensor or metadata key at fault.
use std::path::Path;

use actix_multipart::Multipart;
use diffmesh_shared::wire::lora::{LoraFile, LoraRecord};
use diffmesh_shared::wire::messages::FieldError;
use futures::StreamExt;

use crate::error::ApiError;
use crate::loras::spool::{SpooledWeights, Spooler};
use crate::upload::{read_limited, Parts, MAX_TEXT_FIELD_BYTES};

/// Longest `name`, in characters.
pub const MAX_NAME_CHARS: usize = 200;

/// A checked registration: the file (on disk), what its header says, and the client's label.
#[derive(Debug)]
pub struct LoraUpload {
    pub weights: SpooledWeights,
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
            bytes: self.weights.len(),
            parameters: self.file.parameters,
            modules: self.file.modules.len(),
            max_rank: self.file.max_rank(),
            dtype: self.file.dtype.clone(),
            sha256: self.weights.sha256().to_string(),
            created_at,
            target: self.file.target,
            text_encoder_keys: self.file.text_encoder_keys,
        }
    }
}

/// Read the form: `weights` up to `max_weights_bytes` (413 naming `weights`), streamed into
/// `spool_dir`; every other part a small text field (together at most `MAX_TEXT_FIELD_BYTES`,
/// 413 naming the part); at most `MAX_PARTS` parts.
pub async fn read(
    payload: Multipart,
    max_weights_bytes: usize,
    spool_dir: &Path,
) -> Result<LoraUpload, ApiError> {
    let mut parts = Parts::new(payload);
    let mut text_budget = MAX_TEXT_FIELD_BYTES;
    let mut weights = None;
    let mut name = None;
    while let Some(mut field) = parts.next().await? {
        let field_name = field.name().unwrap_or_default().to_string();
        if field_name == "weights" {
            // One file per registration: a second would double what is spooled.
            if weights.is_some() {
                return Err(FieldError::invalid("weights", "sent twice; send one file").into());
            }
            let mut spooler = Spooler::new(spool_dir, "weights", max_weights_bytes)?;
            while let Some(chunk) = field.next().await {
                let chunk = chunk.map_err(|e| {
                    FieldError::invalid("weights", format!("reading the upload failed: {e}"))
                })?;
                spooler.push(&chunk)?;
            }
            weights = Some(spooler.finish()?);
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
    let (file, name) = check(
        weights.head(),
        weights.len(),
        &mut |offset, len| weights.read_at(offset, len),
        name,
    )?;
    Ok(LoraUpload {
        weights,
        file,
        name,
    })
}

/// Check an upload's name and the file's header: `head` holds at least the file's first
/// `8 + header length` bytes (or the whole file), `len` is the file's length, `read_at`
/// reads other bytes of it (`alpha` scalars).
pub fn check(
    head: &[u8],
    len: u64,
    read_at: &mut dyn FnMut(u64, usize) -> std::io::Result<Vec<u8>>,
    name: Option<String>,
) -> Result<(LoraFile, Option<String>), FieldError> {
    let name = check_name(name)?;
    let file = LoraFile::parse_header(head, len, read_at)
        .map_err(|e| FieldError::invalid("weights", format!("not a LoRA we can apply: {e}")))?;
    Ok((file, name))
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
    use sha2::{Digest, Sha256};

    /// `read_at` over a file in memory.
    fn in_memory(bytes: &[u8]) -> impl FnMut(u64, usize) -> std::io::Result<Vec<u8>> + '_ {
        |offset, len| {
            let start = offset as usize;
            bytes
                .get(start..start + len)
                .map(<[u8]>::to_vec)
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))
        }
    }

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
        let dir = tempfile::tempdir().unwrap();
        let mut spooler = Spooler::new(dir.path(), "weights", 1 << 20).unwrap();
        spooler.push(&bytes).unwrap();
        let weights = spooler.finish().unwrap();
        let mut read_at = |offset, len| weights.read_at(offset, len);
        let (file, name) = check(
            weights.head(),
            weights.len(),
            &mut read_at,
            Some("style".into()),
        )
        .unwrap();
        let upload = LoraUpload {
            weights,
            file,
            name,
        };
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
        let e = check(&half, half.len() as u64, &mut in_memory(&half), None).unwrap_err();
        assert_eq!(e.field, "weights");
        assert!(
            e.message
                .contains(&format!("{Q}: needs both lora_A.weight and lora_B.weight")),
            "{}",
            e.message
        );
        let e = check(b"not a safetensors file", 22, &mut in_memory(b""), None).unwrap_err();
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
