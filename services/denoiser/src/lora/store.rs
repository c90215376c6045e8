//! The denoiser's LoRA cache: adapters by id in host memory (LRU, weighed in bytes), each read
//! once from the `LORA_BUCKET` object store however many jobs ask for it at the same time.
use super::LoraBlob;
use crate::metrics::DenoiserMetrics;
use diffmesh_shared::error::MeshError;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::wire::lora::{weights_key, LoraRef};
use diffmesh_shared::wire::messages::error_types;
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tracing::Instrument;

/// One adapter of a job, with the weight the job applies it with.
#[derive(Debug, Clone)]
pub struct LoadedLora {
    pub blob: Arc<LoraBlob>,
    pub weight: f64,
}

/// A job's adapters, set once they are in memory (or why they cannot be): the engine steps the
/// job on the base model until then, for at most its asynchrony bound.
pub type LoraSlot = Arc<OnceLock<Result<Vec<LoadedLora>, LoraFailure>>>;

/// Why an adapter could not be had, with the error type its job fails with: the client's
/// (deleted since the gateway checked it: `invalid_request_error`), the mesh's for now (the
/// store did not answer in time: `service_unavailable`, worth a retry), or an internal one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct LoraFailure {
    pub message: String,
    pub error_type: &'static str,
}

impl LoraFailure {
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            error_type: error_types::INTERNAL,
        }
    }

    /// A failed read of adapter `id`'s weights from the store.
    fn of_read(id: &str, e: &MeshError) -> Self {
        let error_type = match e {
            MeshError::BlobNotFound { .. } => error_types::INVALID_REQUEST,
            MeshError::Timeout { .. }
            | MeshError::Request { .. }
            | MeshError::NoResponders { .. }
            | MeshError::Connect { .. }
            | MeshError::BlobStalled { .. }
            | MeshError::BlobRead { .. }
            | MeshError::BlobGet(_)
            | MeshError::Io(_) => error_types::UNAVAILABLE,
            _ => error_types::INTERNAL,
        };
        let message = match e {
            MeshError::BlobNotFound { .. } => {
                format!("LoRA {id} was deleted after the request was accepted (not found)")
            }
            other => format!("LoRA {id}: cannot read its weights: {other}"),
        };
        Self {
            message,
            error_type,
        }
    }
}

/// Sets a slot to an error unless it was filled, so a fetch that panics never leaves its job
/// waiting forever.
struct SlotGuard(LoraSlot);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let _ = self.0.set(Err(LoraFailure::internal(
            "LoRA fetch ended without a result",
        )));
    }
}

#[derive(Clone)]
pub struct LoraStore {
    blobs: Option<BlobStore>,
    cache: moka::future::Cache<String, Arc<LoraBlob>>,
    /// Largest weights file read (a bound on what one fetch holds in memory).
    max_bytes: usize,
    metrics: Option<DenoiserMetrics>,
}

impl LoraStore {
    /// A cache of `capacity` bytes over `blobs` (the LoRA object store); `None` serves only what
    /// was inserted (tests, benches).
    pub fn new(
        blobs: Option<BlobStore>,
        capacity: u64,
        max_bytes: usize,
        metrics: Option<DenoiserMetrics>,
    ) -> Self {
        let cache = moka::future::Cache::builder()
            .max_capacity(capacity)
            .weigher(|_: &String, a: &Arc<LoraBlob>| {
                u32::try_from(a.bytes.len()).unwrap_or(u32::MAX)
            })
            .build();
        Self {
            blobs,
            cache,
            max_bytes,
            metrics,
        }
    }

    /// Put an adapter in the cache (tests, benches, warm-up).
    pub async fn insert(&self, blob: Arc<LoraBlob>) {
        self.cache.insert(blob.id.clone(), blob).await;
    }

    /// Ids of the adapters held (the heartbeat reports them, so the router can prefer this
    /// denoiser for their jobs).
    pub fn ids(&self) -> Vec<String> {
        self.cache
            .iter()
            .map(|(id, _)| id.as_ref().clone())
            .collect()
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.cache.weighted_size()
    }

    /// One adapter: from the cache, else read once from the object store.
    pub async fn get(&self, id: &str) -> Result<Arc<LoraBlob>, LoraFailure> {
        if let Some(a) = self.cache.get(id).await {
            self.count("hit");
            return Ok(a);
        }
        let started = Instant::now();
        let result = self
            .cache
            .try_get_with(id.to_string(), self.read(id))
            .await
            .map_err(|e| (*e).clone());
        match &result {
            Ok(_) => {
                self.count("miss");
                if let Some(m) = &self.metrics {
                    m.lora
                        .lora_fetch_seconds
                        .observe(started.elapsed().as_secs_f64());
                    m.lora
                        .lora_cache_bytes
                        .set(self.cache.weighted_size() as i64);
                }
            }
            Err(_) => self.count("failed"),
        }
        result
    }

    async fn read(&self, id: &str) -> Result<Arc<LoraBlob>, LoraFailure> {
        let blobs = self.blobs.as_ref().ok_or_else(|| {
            LoraFailure::internal(format!(
                "LoRA {id} is not loaded and no LoRA store is configured"
            ))
        })?;
        let bytes = blobs
            .get_limited(&weights_key(id), self.max_bytes)
            .await
            .map_err(|e| LoraFailure::of_read(id, &e))?;
        // The gateway checked the file at upload: one that does not parse now is corrupt.
        let blob = LoraBlob::new(id, bytes.into())
            .map_err(|e| LoraFailure::internal(format!("LoRA {id}: {e}")))?;
        Ok(Arc::new(blob))
    }

    fn count(&self, result: &str) {
        if let Some(m) = &self.metrics {
            m.lora.lora_cache_lookups.with_label_values(&[result]).inc();
        }
    }

    /// Start fetching a job's adapters; the slot is filled when all are in memory (or with the
    /// first error). `None` for a job without LoRAs. Adapters all in the cache fill it at once.
    pub async fn slot(&self, loras: &[LoraRef]) -> Option<LoraSlot> {
        if loras.is_empty() {
            return None;
        }
        let slot: LoraSlot = Default::default();
        let weighted = |blob, l: &LoraRef| LoadedLora {
            blob,
            weight: f64::from(l.scale),
        };
        let mut cached = Vec::with_capacity(loras.len());
        for l in loras {
            match self.cache.get(&l.id).await {
                Some(adapter) => cached.push(weighted(adapter, l)),
                None => break,
            }
        }
        if cached.len() == loras.len() {
            self.count_n("hit", cached.len());
            let _ = slot.set(Ok(cached));
            return Some(slot);
        }
        let guard = SlotGuard(slot.clone());
        let (store, loras) = (self.clone(), loras.to_vec());
        tokio::spawn(
            async move {
                let mut set = Vec::with_capacity(loras.len());
                for l in &loras {
                    match store.get(&l.id).await {
                        Ok(adapter) => set.push(weighted(adapter, l)),
                        Err(e) => {
                            tracing::warn!(lora = %l.id, error = %e, "LoRA fetch failed");
                            let _ = guard.0.set(Err(e));
                            return;
                        }
                    }
                }
                let _ = guard.0.set(Ok(set));
            }
            .instrument(tracing::Span::current()),
        );
        Some(slot)
    }

    fn count_n(&self, result: &str, n: usize) {
        if let Some(m) = &self.metrics {
            m.lora
                .lora_cache_lookups
                .with_label_values(&[result])
                .inc_by(n as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A deleted adapter is the client's (400), a store that did not answer is the mesh's for
    /// now (503, worth a retry); the message names the adapter either way.
    #[test]
    fn read_failures_carry_the_error_type_their_job_fails_with() {
        let gone = LoraFailure::of_read(
            "a",
            &MeshError::BlobNotFound {
                key: weights_key("a"),
            },
        );
        assert_eq!(gone.error_type, error_types::INVALID_REQUEST);
        assert!(gone.message.contains("LoRA a"), "{gone}");
        let slow = LoraFailure::of_read(
            "b",
            &MeshError::Timeout {
                subject: "blobs".into(),
                timeout: Duration::from_secs(1),
            },
        );
        assert_eq!(slow.error_type, error_types::UNAVAILABLE);
        assert!(slow.message.contains("LoRA b"), "{slow}");
        let odd = LoraFailure::of_read(
            "c",
            &MeshError::BlobTooLarge {
                key: weights_key("c"),
                size: 2,
                limit: 1,
            },
        );
        assert_eq!(odd.error_type, error_types::INTERNAL);
    }
}
