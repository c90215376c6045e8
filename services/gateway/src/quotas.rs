//! Per-key storage quotas: how many templates and LoRAs one API key may keep, and how many
//! bytes they may take together (template images and their activation caches, LoRA weights),
//! so one tenant cannot fill the mesh's JetStream storage for everyone; and a cap on LoRA
//! uploads read at once, which bounds the memory they hold (each at most --max-lora-bytes).
//!
//! Checked at registration against the key's records (a count over the bucket, as listing
//! does); a LoRA's count before its body is read, its bytes after. Two registrations of one
//! key at the same moment may both pass: the overshoot is at most the key's requests in
//! flight, which its concurrency limit (`--max-concurrent-per-key`) bounds where it is set.
use crate::error::ApiError;
use crate::state::ApiState;

/// The limits (0: none), from `--max-templates-per-key`, `--max-loras-per-key` and
/// `--max-stored-bytes-per-key`.
#[derive(Debug, Clone, Copy)]
pub struct StorageQuotas {
    pub templates: usize,
    pub loras: usize,
    pub bytes: u64,
}

/// What a key keeps now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub templates: usize,
    pub loras: usize,
    pub bytes: u64,
}

/// What a registration adds.
#[derive(Debug, Clone, Copy)]
pub enum Adding {
    Template { bytes: u64 },
    Lora { bytes: u64 },
}

impl StorageQuotas {
    /// Whether `adding` fits beside `usage`: a count over its quota is a 429, bytes over theirs
    /// a 413, each naming the quota's flag, what the key holds and how to make room.
    pub fn check(&self, usage: &Usage, adding: Adding) -> Result<(), ApiError> {
        let (count, limit, flag, what, bytes) = match adding {
            Adding::Template { bytes } => (
                usage.templates,
                self.templates,
                "--max-templates-per-key",
                "templates",
                bytes,
            ),
            Adding::Lora { bytes } => (
                usage.loras,
                self.loras,
                "--max-loras-per-key",
                "LoRAs",
                bytes,
            ),
        };
        if limit > 0 && count >= limit {
            return Err(ApiError::QuotaExceeded {
                quota: flag,
                too_large: false,
                message: format!(
                    "this API key keeps {count} {what}, its quota ({flag}): delete one first"
                ),
            });
        }
        let total = usage.bytes.saturating_add(bytes);
        if self.bytes > 0 && total > self.bytes {
            return Err(ApiError::QuotaExceeded {
                quota: "--max-stored-bytes-per-key",
                too_large: true,
                message: format!(
                    "this API key's templates and LoRAs take {} bytes; {bytes} more would pass its \
                     quota of {} bytes (--max-stored-bytes-per-key): delete some first",
                    usage.bytes, self.bytes
                ),
            });
        }
        Ok(())
    }
}

/// What the key `owner` (None: the mesh without keys) keeps now.
pub async fn usage(state: &ApiState, owner: Option<&str>) -> Result<Usage, ApiError> {
    let mut usage = Usage::default();
    for t in state.templates.store.list().await? {
        if t.owner.as_deref() == owner {
            usage.templates += 1;
            usage.bytes = usage
                .bytes
                .saturating_add(t.image_bytes)
                .saturating_add(t.cache_bytes);
        }
    }
    for l in state.loras.list().await? {
        if l.owner.as_deref() == owner {
            usage.loras += 1;
            usage.bytes = usage.bytes.saturating_add(l.bytes);
        }
    }
    Ok(usage)
}

/// Check `adding` for `owner` against the configured quotas (no read when there are none);
/// returns the usage it read, for a second check once the upload's size is known.
pub async fn admit(
    state: &ApiState,
    owner: Option<&str>,
    adding: Adding,
) -> Result<Option<Usage>, ApiError> {
    let q = state.quotas;
    let counted = match adding {
        Adding::Template { .. } => q.templates,
        Adding::Lora { .. } => q.loras,
    };
    if counted == 0 && q.bytes == 0 {
        return Ok(None);
    }
    let usage = usage(state, owner).await?;
    q.check(&usage, adding)?;
    Ok(Some(usage))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_answer_429_and_bytes_413_each_naming_its_quota() {
        let q = StorageQuotas {
            templates: 2,
            loras: 1,
            bytes: 1000,
        };
        let usage = Usage {
            templates: 1,
            loras: 1,
            bytes: 900,
        };
        assert!(q.check(&usage, Adding::Template { bytes: 100 }).is_ok());
        let err = q.check(&usage, Adding::Lora { bytes: 10 }).unwrap_err();
        assert!(
            matches!(
                err,
                ApiError::QuotaExceeded {
                    quota: "--max-loras-per-key",
                    too_large: false,
                    ..
                }
            ),
            "{err}"
        );
        let err = q
            .check(&usage, Adding::Template { bytes: 101 })
            .unwrap_err();
        assert!(
            matches!(
                err,
                ApiError::QuotaExceeded {
                    quota: "--max-stored-bytes-per-key",
                    too_large: true,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("900"), "{err}");
        let none = StorageQuotas {
            templates: 0,
            loras: 0,
            bytes: 0,
        };
        let full = Usage {
            templates: 1_000_000,
            loras: 1_000_000,
            bytes: u64::MAX,
        };
        assert!(none.check(&full, Adding::Lora { bytes: u64::MAX }).is_ok());
    }
}
