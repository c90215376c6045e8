//! Host-memory tier: a moka cache weighed in bytes. Entries evicted for size spill to the disk
//! tier (when one is attached), so memory pressure demotes rather than drops.
use crate::disk::DiskTier;
use bytes::Bytes;
use moka::notification::RemovalCause;
use moka::policy::EvictionPolicy;
use moka::sync::Cache;
use std::sync::Arc;

#[derive(Clone)]
pub struct MemoryTier {
    cache: Cache<String, Bytes>,
}

impl MemoryTier {
    /// `capacity_bytes` bounds the sum of value sizes; `spill` receives size-evicted entries.
    pub fn new(capacity_bytes: u64, spill: Option<Arc<DiskTier>>) -> Self {
        // Plain LRU: a template's activations are reused in bursts, and LRU (unlike moka's
        // default TinyLFU admission) always admits the newest entry, so promotions stick.
        let mut builder = Cache::builder()
            .eviction_policy(EvictionPolicy::lru())
            .max_capacity(capacity_bytes)
            .weigher(|key: &String, value: &Bytes| -> u32 {
                (key.len() + value.len()).try_into().unwrap_or(u32::MAX)
            });
        if let Some(disk) = spill {
            builder = builder.eviction_listener(move |key: Arc<String>, value: Bytes, cause| {
                if cause == RemovalCause::Size {
                    match disk.put(&key, &value) {
                        Ok(true) => {
                            tracing::debug!(key = %key, bytes = value.len(), "spilled to disk")
                        }
                        Ok(false) => {
                            tracing::debug!(key = %key, "too large for the disk tier; dropped")
                        }
                        Err(err) => {
                            tracing::warn!(key = %key, error = %err, "spilling to disk failed")
                        }
                    }
                }
            });
        }
        Self {
            cache: builder.build(),
        }
    }

    pub fn get(&self, key: &str) -> Option<Bytes> {
        self.cache.get(key)
    }

    pub fn put(&self, key: &str, value: Bytes) {
        self.cache.insert(key.to_string(), value);
    }

    /// Whether the key is held, without counting as a use (eviction order unchanged).
    pub fn contains(&self, key: &str) -> bool {
        self.cache.contains_key(key)
    }

    /// Keys held that start with `prefix`.
    pub fn keys_with_prefix(&self, prefix: &str) -> Vec<String> {
        self.cache
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.as_ref().clone())
            .collect()
    }

    /// Remove without spilling; true when present.
    pub fn delete(&self, key: &str) -> bool {
        self.cache.remove(key).is_some()
    }

    /// Run moka's pending evictions now (tests and stats want settled numbers).
    pub fn settle(&self) {
        self.cache.run_pending_tasks();
    }

    pub fn entries(&self) -> u64 {
        self.cache.entry_count()
    }

    pub fn bytes(&self) -> u64 {
        self.cache.weighted_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_by_bytes_and_spills_to_disk() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(DiskTier::open(dir.path(), 1 << 20).unwrap());
        let mem = MemoryTier::new(1000, Some(disk.clone()));
        for i in 0..10 {
            mem.put(&format!("k{i}"), Bytes::from(vec![i as u8; 300]));
            mem.settle();
        }
        assert!(mem.bytes() <= 1000, "memory holds {} bytes", mem.bytes());
        assert!(mem.entries() <= 3);
        // Everything evicted from memory is on disk, byte for byte.
        for i in 0..10 {
            let key = format!("k{i}");
            let found = mem
                .get(&key)
                .map(|b| b.to_vec())
                .or_else(|| disk.get(&key).unwrap());
            assert_eq!(found, Some(vec![i as u8; 300]), "{key}");
        }
        assert!(disk.entries() >= 7);
    }

    #[test]
    fn delete_does_not_spill() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(DiskTier::open(dir.path(), 1 << 20).unwrap());
        let mem = MemoryTier::new(1000, Some(disk.clone()));
        mem.put("a", Bytes::from_static(b"xyz"));
        assert!(mem.delete("a"));
        mem.settle();
        assert!(mem.get("a").is_none());
        assert_eq!(disk.entries(), 0);
    }
}
