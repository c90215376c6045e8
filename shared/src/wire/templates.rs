//! Template activation caches as the mesh stores them: the cache key, the cachestore key of each
//! step, and the byte layout of one step (every block's encoded K/V, see the model crate's
//! `flux::kv_codec`).
//!
//! A template's cache is `steps` entries in the cachestore, `<cache_key>/s<step>`, each holding
//! all blocks of that step, plus `<cache_key>/meta` (JSON [`CacheMeta`]). One entry per step keeps
//! the number of round trips at `steps`, while the denoiser still streams blocks to the engine one
//! at a time from its local copy.
//!
//! A template's images live in `subjects::TEMPLATE_BUCKET` for as long as the template does: the
//! upload ([`image_key`]) and, from its capture on, its model-resolution pixels
//! ([`prepared_image_key`]). Jobs on a template read them there by key, so no job copies them.

use crate::wire::messages::TemplateRef;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Template-bucket key of a template's uploaded image.
pub fn image_key(template_id: &str) -> String {
    format!("{template_id}/image")
}

/// Template-bucket key of a template's model-resolution pixels (packed RGB u8), which the codec
/// writes when it prepares the template's capture and its edits read instead of a copy.
pub fn prepared_image_key(template_id: &str) -> String {
    format!("{template_id}/prepared-image.rgb")
}

/// Everything that changes a template's activations, hashed into its cache key.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheKeyParts<'a> {
    /// Model id and its scheduler settings (the denoiser's model identity).
    pub model: &'a str,
    /// SHA-256 of the prepared template pixels (`PreparedInputs::template_id`).
    pub content: &'a str,
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    pub seed: u64,
    pub prompt: &'a str,
    /// `guidance_scale` as bits, so equal floats hash equally.
    pub guidance_bits: u32,
    /// Key layout (`raw`/`prepared`) and storage dtype (`bf16`, ...).
    pub format: &'a str,
    pub dtype: &'a str,
}

impl<'a> CacheKeyParts<'a> {
    pub fn new(
        model: &'a str,
        content: &'a str,
        width: u32,
        height: u32,
        template: &'a TemplateRef,
        format: &'a str,
        dtype: &'a str,
    ) -> Self {
        Self {
            model,
            content,
            width,
            height,
            steps: template.steps,
            seed: template.seed,
            prompt: &template.prompt,
            guidance_bits: template.guidance_scale.to_bits(),
            format,
            dtype,
        }
    }
}

/// The content key of a template cache: `tpl-` + hex SHA-256 of the parts (as JSON).
pub fn cache_key(parts: &CacheKeyParts<'_>) -> String {
    let json = serde_json::to_vec(parts).expect("plain struct serialises");
    let digest = Sha256::digest(&json);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("tpl-{hex}")
}

/// Cachestore key of one step of a cache.
pub fn step_key(cache_key: &str, step: u32) -> String {
    format!("{cache_key}/s{step}")
}

/// Cachestore key of a cache's metadata.
pub fn meta_key(cache_key: &str) -> String {
    format!("{cache_key}/meta")
}

/// What a capture's quality guard measured (the denoiser's `--cache-quality-floor`): the SSIM,
/// over the mask's box grown by 8 pixels, of a typical edit of the template read from its cache
/// against the same edit in full compute.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CacheQuality {
    pub box_ssim: f64,
    pub floor: f64,
    /// Below the floor: the cache stored holds no steps and the template's edits compute in
    /// full.
    pub full_compute: bool,
}

/// What a stored cache holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheMeta {
    pub cache_key: String,
    pub steps: u32,
    pub blocks: u32,
    /// Total bytes of all step entries.
    pub bytes: u64,
    pub format: String,
    pub dtype: String,
}

/// Why a step entry could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("template cache entry: {0}")]
pub struct StepBlobError(pub String);

const STEP_MAGIC: &[u8; 4] = b"DMST";

/// One step's entry: `b"DMST"`, block count (u32 LE), each block's length (u64 LE), then the
/// blocks back to back.
pub fn pack_step(blocks: &[Vec<u8>]) -> Vec<u8> {
    let payload: usize = blocks.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(8 + 8 * blocks.len() + payload);
    out.extend_from_slice(STEP_MAGIC);
    out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    for b in blocks {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    }
    for b in blocks {
        out.extend_from_slice(b);
    }
    out
}

/// Byte ranges of the blocks inside a step entry (checked against its length).
pub fn step_block_ranges(entry: &[u8]) -> Result<Vec<std::ops::Range<usize>>, StepBlobError> {
    if entry.len() < 8 || &entry[..4] != STEP_MAGIC {
        return Err(StepBlobError("not a step entry (bad magic)".into()));
    }
    let count = u32::from_le_bytes([entry[4], entry[5], entry[6], entry[7]]) as usize;
    let table_end = count
        .checked_mul(8)
        .and_then(|t| t.checked_add(8))
        .filter(|&end| end <= entry.len())
        .ok_or_else(|| {
            StepBlobError(format!(
                "{count} blocks do not fit in {} bytes",
                entry.len()
            ))
        })?;
    let mut at = table_end;
    let mut ranges = Vec::with_capacity(count);
    for i in 0..count {
        let o = 8 + 8 * i;
        let mut len = [0u8; 8];
        len.copy_from_slice(&entry[o..o + 8]);
        let len = usize::try_from(u64::from_le_bytes(len))
            .map_err(|_| StepBlobError(format!("block {i}: length overflows")))?;
        let end = at
            .checked_add(len)
            .filter(|&e| e <= entry.len())
            .ok_or_else(|| StepBlobError(format!("block {i} runs past the end")))?;
        ranges.push(at..end);
        at = end;
    }
    if at != entry.len() {
        return Err(StepBlobError(format!(
            "{} trailing bytes",
            entry.len() - at
        )));
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> TemplateRef {
        TemplateRef {
            template_id: "t1".into(),
            prompt: "a blue background".into(),
            seed: 7,
            steps: 8,
            guidance_scale: 1.0,
            cache_key: String::new(),
        }
    }

    #[test]
    fn cache_key_changes_with_every_part() {
        let t = template();
        let base = CacheKeyParts::new("tiny", "abc", 64, 64, &t, "prepared", "bf16");
        let key = cache_key(&base);
        assert!(key.starts_with("tpl-") && key.len() == 68, "{key}");
        assert_eq!(key, cache_key(&base.clone()));
        let variants = [
            CacheKeyParts {
                model: "other",
                ..base.clone()
            },
            CacheKeyParts {
                content: "abd",
                ..base.clone()
            },
            CacheKeyParts {
                width: 128,
                ..base.clone()
            },
            CacheKeyParts {
                steps: 9,
                ..base.clone()
            },
            CacheKeyParts {
                seed: 8,
                ..base.clone()
            },
            CacheKeyParts {
                prompt: "",
                ..base.clone()
            },
            CacheKeyParts {
                guidance_bits: 2.0f32.to_bits(),
                ..base.clone()
            },
            CacheKeyParts {
                format: "raw",
                ..base.clone()
            },
            CacheKeyParts {
                dtype: "fp8",
                ..base.clone()
            },
        ];
        for v in variants {
            assert_ne!(cache_key(&v), key, "{v:?}");
        }
    }

    #[test]
    fn step_entries_round_trip_and_reject_damage() {
        let blocks = vec![vec![1u8; 5], vec![], vec![9u8; 300]];
        let entry = pack_step(&blocks);
        let ranges = step_block_ranges(&entry).unwrap();
        let back: Vec<Vec<u8>> = ranges.into_iter().map(|r| entry[r].to_vec()).collect();
        assert_eq!(back, blocks);
        assert!(step_block_ranges(&entry[..entry.len() - 1]).is_err());
        assert!(step_block_ranges(b"nope").is_err());
        let mut huge = entry.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(step_block_ranges(&huge).is_err());
        let mut extra = entry;
        extra.push(0);
        assert!(step_block_ranges(&extra).is_err());
    }

    #[test]
    fn keys_name_steps_and_meta() {
        assert_eq!(step_key("tpl-x", 3), "tpl-x/s3");
        assert_eq!(meta_key("tpl-x"), "tpl-x/meta");
    }
}
