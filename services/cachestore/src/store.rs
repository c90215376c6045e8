//! The tiered store: memory (moka, bytes-weighed) -> local disk -> JetStream object store.
//!
//! Reads fall through the tiers and promote hits into memory; writes go to memory and through to
//! the cluster tier (so other nodes find them); memory evictions spill to disk. The cluster
//! tier keeps to its own budget by deleting the least recently used caches (`cluster_lru`).
use crate::cluster_lru::{group_of, ClusterLru};
use crate::disk::DiskTier;
use crate::memory::MemoryTier;
use crate::metrics::CacheMetrics;
use bytes::Bytes;
use diffmesh_shared::error::MeshError;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::wire::cachestore::{CacheStatsReply, CacheTier, KeyLocation, TierStats};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid `key` {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },
    #[error("disk tier at {dir}: {source}")]
    Disk {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cluster tier: {0}")]
    Cluster(#[from] MeshError),
    #[error("value for `{key}` is not inline and no cluster tier is configured")]
    NoClusterTier { key: String },
}

impl StoreError {
    pub fn reason(&self) -> &'static str {
        match self {
            StoreError::InvalidKey { .. } => "invalid_key",
            StoreError::Disk { .. } => "disk",
            StoreError::Cluster(e) => e.reason(),
            StoreError::NoClusterTier { .. } => "no_cluster_tier",
        }
    }
}

/// Keys must be valid object-store names too: `[-/_=.a-zA-Z0-9]`, 1..=512 bytes, no leading '/'.
pub fn validate_key(key: &str) -> Result<(), StoreError> {
    let bad = |reason| {
        Err(StoreError::InvalidKey {
            key: key.chars().take(80).collect(),
            reason,
        })
    };
    if key.is_empty() || key.len() > 512 {
        return bad("must be 1 to 512 bytes long");
    }
    if key.starts_with('/') || key.starts_with('.') {
        return bad("must not start with '/' or '.'");
    }
    if !key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-/_=.".contains(&b))
    {
        return bad("may only contain letters, digits and -/_=.");
    }
    Ok(())
}

/// What a prefetch did with one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promotion {
    AlreadyInMemory,
    FromDisk,
    FromCluster,
    /// No tier holds the key.
    Missing,
}

impl Promotion {
    /// Label of `diffmesh_cachestore_prefetches_total{outcome}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Promotion::AlreadyInMemory => "already_in_memory",
            Promotion::FromDisk => "from_disk",
            Promotion::FromCluster => "from_cluster",
            Promotion::Missing => "missing",
        }
    }
}

pub struct TieredStore {
    memory: MemoryTier,
    disk: Arc<DiskTier>,
    disk_dir: PathBuf,
    cluster: Option<BlobStore>,
    /// Use order and sizes of the cluster tier's caches (no budget until `with_cluster_budget`).
    lru: ClusterLru,
    metrics: CacheMetrics,
}

impl TieredStore {
    pub fn new(
        memory_bytes: u64,
        disk_dir: PathBuf,
        disk_bytes: u64,
        cluster: Option<BlobStore>,
        metrics: CacheMetrics,
    ) -> Result<Self, StoreError> {
        let disk =
            Arc::new(
                DiskTier::open(&disk_dir, disk_bytes).map_err(|source| StoreError::Disk {
                    dir: disk_dir.clone(),
                    source,
                })?,
            );
        let memory = MemoryTier::new(memory_bytes, Some(disk.clone()));
        Ok(Self {
            memory,
            disk,
            disk_dir,
            cluster,
            lru: ClusterLru::new(0),
            metrics,
        })
    }

    /// Keep the cluster tier within `bytes` (0: only the bucket's own bound) by deleting the
    /// least recently used caches; seed their order from what the bucket holds now.
    pub async fn with_cluster_budget(mut self, bytes: u64) -> Self {
        self.lru = ClusterLru::new(bytes);
        if let Some(cluster) = &self.cluster {
            match cluster.list().await {
                Ok(objects) => self.lru.seed(objects),
                Err(err) => tracing::warn!(
                    error = %err,
                    "could not list the cluster tier; its caches count from their next write"
                ),
            }
        }
        self
    }

    /// Record a write to the cluster tier and delete the caches the budget no longer has room
    /// for. A delete that fails is logged: the bucket's own bound still holds.
    async fn stored_in_cluster(&self, cluster: &BlobStore, key: &str, size: u64) {
        let victims = self.lru.stored(key, size);
        let mut caches = std::collections::HashSet::new();
        for victim in &victims {
            caches.insert(group_of(victim).to_string());
            if let Err(err) = cluster.delete(victim).await {
                tracing::warn!(key = %victim, error = %err, "could not evict from the cluster tier");
            }
        }
        if !caches.is_empty() {
            tracing::info!(caches = ?caches, keys = victims.len(), "least recently used caches evicted from the cluster tier");
            self.metrics.cluster_evictions.inc_by(caches.len() as u64);
        }
    }

    fn disk_err(&self, source: std::io::Error) -> StoreError {
        StoreError::Disk {
            dir: self.disk_dir.clone(),
            source,
        }
    }

    /// Find a value in the fastest tier holding it.
    pub async fn get(&self, key: &str) -> Result<Option<(CacheTier, Bytes)>, StoreError> {
        validate_key(key)?;
        self.lru.touch(key);
        if let Some(v) = self.memory.get(key) {
            self.metrics.hit(CacheTier::Memory, v.len());
            return Ok(Some((CacheTier::Memory, v)));
        }
        self.metrics.miss(CacheTier::Memory);
        if let Some(v) = self.disk.get(key).map_err(|e| self.disk_err(e))? {
            self.metrics.hit(CacheTier::Disk, v.len());
            let v = Bytes::from(v);
            self.memory.put(key, v.clone());
            return Ok(Some((CacheTier::Disk, v)));
        }
        self.metrics.miss(CacheTier::Disk);
        let Some(cluster) = &self.cluster else {
            return Ok(None);
        };
        match cluster.get(key).await {
            Ok(v) => {
                self.metrics.hit(CacheTier::Cluster, v.len());
                let v = Bytes::from(v);
                self.memory.put(key, v.clone());
                Ok(Some((CacheTier::Cluster, v)))
            }
            Err(MeshError::BlobNotFound { .. }) => {
                self.metrics.miss(CacheTier::Cluster);
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Which tiers hold `key` (fastest first) and its size. Does not count as a use: eviction
    /// order and hit/miss counters stay as they were.
    pub async fn locate(&self, key: &str) -> Result<KeyLocation, StoreError> {
        validate_key(key)?;
        let mut tiers = Vec::new();
        let mut size = None;
        let in_memory = self.memory.contains(key);
        if in_memory {
            tiers.push(CacheTier::Memory);
        }
        if let Some(s) = self.disk.size_of(key) {
            tiers.push(CacheTier::Disk);
            size = Some(s);
        }
        if let Some(s) = self.cluster_size(key).await? {
            tiers.push(CacheTier::Cluster);
            size = size.or(Some(s));
        }
        if in_memory && size.is_none() {
            // Only in memory (no cluster tier): reading it is the one way to learn its size.
            size = self.memory.get(key).map(|v| v.len() as u64);
        }
        Ok(KeyLocation {
            key: key.to_string(),
            tiers,
            size,
        })
    }

    /// Size of `key` in the cluster tier (object metadata only), `None` when absent.
    async fn cluster_size(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let Some(cluster) = &self.cluster else {
            return Ok(None);
        };
        match cluster.get_limited(key, 0).await {
            Ok(v) => Ok(Some(v.len() as u64)),
            Err(MeshError::BlobTooLarge { size, .. }) => Ok(Some(size as u64)),
            Err(MeshError::BlobNotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Bring `key` into the memory tier from the fastest lower tier holding it (a prefetch).
    /// Counted in `prefetches_total{outcome}`, not as a get's hit or miss.
    pub async fn promote(&self, key: &str) -> Result<Promotion, StoreError> {
        validate_key(key)?;
        self.lru.touch(key);
        let outcome = self.promote_inner(key).await?;
        self.metrics.prefetched(outcome.as_str());
        Ok(outcome)
    }

    async fn promote_inner(&self, key: &str) -> Result<Promotion, StoreError> {
        if self.memory.contains(key) {
            return Ok(Promotion::AlreadyInMemory);
        }
        if let Some(v) = self.disk.get(key).map_err(|e| self.disk_err(e))? {
            self.memory.put(key, Bytes::from(v));
            return Ok(Promotion::FromDisk);
        }
        let Some(cluster) = &self.cluster else {
            return Ok(Promotion::Missing);
        };
        match cluster.get(key).await {
            Ok(v) => {
                self.memory.put(key, Bytes::from(v));
                Ok(Promotion::FromCluster)
            }
            Err(MeshError::BlobNotFound { .. }) => Ok(Promotion::Missing),
            Err(e) => Err(e.into()),
        }
    }

    /// Store a value. `in_cluster` says the caller already wrote it to the cluster tier.
    pub async fn put(&self, key: &str, value: Bytes, in_cluster: bool) -> Result<u64, StoreError> {
        validate_key(key)?;
        let size = value.len() as u64;
        // An older copy on disk would be served after this one is evicted from memory.
        self.disk.delete(key).map_err(|e| self.disk_err(e))?;
        if let Some(cluster) = &self.cluster {
            if !in_cluster {
                cluster.put(key, &value).await?;
            }
            self.stored_in_cluster(cluster, key, size).await;
        }
        self.memory.put(key, value);
        self.metrics.puts.inc();
        Ok(size)
    }

    /// Read a value the caller wrote to the cluster tier, then store it locally.
    pub async fn put_from_cluster(&self, key: &str) -> Result<u64, StoreError> {
        validate_key(key)?;
        let cluster = self
            .cluster
            .as_ref()
            .ok_or_else(|| StoreError::NoClusterTier {
                key: key.to_string(),
            })?;
        let value = Bytes::from(cluster.get(key).await?);
        self.put(key, value, true).await
    }

    /// Remove a value from every tier; true when any tier held it.
    pub async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        validate_key(key)?;
        let in_memory = self.memory.delete(key);
        let on_disk = self.disk.delete(key).map_err(|e| self.disk_err(e))?;
        let mut in_cluster = false;
        if let Some(cluster) = &self.cluster {
            in_cluster = !matches!(
                cluster.get_limited(key, 0).await,
                Err(MeshError::BlobNotFound { .. })
            );
            cluster.delete(key).await?;
            self.lru.forget(key);
        }
        Ok(in_memory || on_disk || in_cluster)
    }

    /// Drop this instance's memory and disk copies of every key under `prefix` (a deleted
    /// template's cache; the shared cluster tier is left to `delete`). Returns how many copies
    /// were dropped.
    pub fn drop_local(&self, prefix: &str) -> Result<usize, StoreError> {
        let mut dropped = 0;
        for key in self.memory.keys_with_prefix(prefix) {
            dropped += usize::from(self.memory.delete(&key));
        }
        for key in self.disk.keys_with_prefix(prefix) {
            dropped += usize::from(self.disk.delete(&key).map_err(|e| self.disk_err(e))?);
        }
        Ok(dropped)
    }

    /// Make sure a large value can be read from the cluster tier (it is written through on put,
    /// but a value may have arrived before the cluster tier was configured).
    pub async fn ensure_in_cluster(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let cluster = self
            .cluster
            .as_ref()
            .ok_or_else(|| StoreError::NoClusterTier {
                key: key.to_string(),
            })?;
        match cluster.get_limited(key, 0).await {
            Err(MeshError::BlobNotFound { .. }) => {
                cluster.put(key, value).await?;
                self.stored_in_cluster(cluster, key, value.len() as u64)
                    .await;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    pub fn metrics(&self) -> &CacheMetrics {
        &self.metrics
    }

    pub fn has_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// Settled per-tier numbers (also refreshes the entry/byte gauges).
    pub fn stats(&self) -> CacheStatsReply {
        self.memory.settle();
        let tier = |t: CacheTier, entries: u64, bytes: u64| {
            self.metrics.set_size(t, entries, bytes);
            TierStats {
                entries,
                bytes,
                hits: self.metrics.hits_of(t),
                misses: self.metrics.misses_of(t),
            }
        };
        CacheStatsReply {
            memory: tier(
                CacheTier::Memory,
                self.memory.entries(),
                self.memory.bytes(),
            ),
            disk: tier(CacheTier::Disk, self.disk.entries(), self.disk.bytes()),
            cluster: {
                let (_, keys, bytes) = self.lru.size();
                tier(CacheTier::Cluster, keys, bytes)
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(dir: &std::path::Path, memory: u64) -> TieredStore {
        let metrics = CacheMetrics::new(&prometheus::Registry::new()).unwrap();
        TieredStore::new(memory, dir.to_path_buf(), 1 << 20, None, metrics).unwrap()
    }

    #[tokio::test]
    async fn falls_through_tiers_and_promotes() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1000);
        assert_eq!(s.get("tpl/a").await.unwrap(), None);
        for i in 0..6u8 {
            s.put(&format!("tpl/{i}"), Bytes::from(vec![i; 300]), false)
                .await
                .unwrap();
            s.memory.settle();
        }
        // The first keys were pushed out of memory onto disk; a get finds them there and
        // promotes them back into memory.
        let (tier, v) = s.get("tpl/0").await.unwrap().unwrap();
        assert_eq!(tier, CacheTier::Disk);
        assert_eq!(v, Bytes::from(vec![0; 300]));
        let (tier, _) = s.get("tpl/0").await.unwrap().unwrap();
        assert_eq!(tier, CacheTier::Memory);
        let stats = s.stats();
        assert_eq!(stats.disk.hits, 1);
        assert!(stats.memory.hits >= 1);
        assert!(stats.memory.misses >= 2);
        assert!(stats.memory.bytes <= 1000);
    }

    #[tokio::test]
    async fn overwrite_and_delete_reach_every_tier() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1000);
        s.put("k", Bytes::from_static(b"old"), false).await.unwrap();
        s.disk.put("k", b"old").unwrap(); // as if spilled earlier
        s.put("k", Bytes::from_static(b"new"), false).await.unwrap();
        assert!(
            !s.disk.contains("k"),
            "stale disk copy must go on overwrite"
        );
        assert_eq!(
            s.get("k").await.unwrap().unwrap().1,
            Bytes::from_static(b"new")
        );
        assert!(s.delete("k").await.unwrap());
        assert_eq!(s.get("k").await.unwrap(), None);
        assert!(!s.delete("k").await.unwrap());
    }

    #[tokio::test]
    async fn locate_and_promote_leave_get_counters_alone() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1000);
        s.put("k", Bytes::from(vec![1; 300]), false).await.unwrap();
        let loc = s.locate("k").await.unwrap();
        assert_eq!((loc.tiers, loc.size), (vec![CacheTier::Memory], Some(300)));
        // Push k down to disk with newer entries.
        for i in 0..4u8 {
            s.put(&format!("n{i}"), Bytes::from(vec![i; 300]), false)
                .await
                .unwrap();
            s.memory.settle();
        }
        let loc = s.locate("k").await.unwrap();
        assert_eq!((loc.tiers, loc.size), (vec![CacheTier::Disk], Some(300)));
        assert!(s.locate("none").await.unwrap().tiers.is_empty());
        let before = s.stats();
        assert_eq!(s.promote("k").await.unwrap(), Promotion::FromDisk);
        assert_eq!(s.promote("k").await.unwrap(), Promotion::AlreadyInMemory);
        assert_eq!(s.promote("none").await.unwrap(), Promotion::Missing);
        let after = s.stats();
        assert_eq!(
            (before.memory.hits, before.disk.hits),
            (after.memory.hits, after.disk.hits)
        );
        assert_eq!(s.metrics.prefetches_of("from_disk"), 1);
        let (tier, v) = s.get("k").await.unwrap().unwrap();
        assert_eq!((tier, v.len()), (CacheTier::Memory, 300));
        assert_eq!(s.metrics.read_bytes_of(CacheTier::Memory), 300);
    }

    #[tokio::test]
    async fn bad_keys_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1000);
        for key in ["", "/abs", "sp ace", "../up"] {
            let err = s.get(key).await.unwrap_err().to_string();
            assert!(err.contains("`key`"), "{err}");
        }
        let err = s.put_from_cluster("k").await.unwrap_err();
        assert_eq!(err.reason(), "no_cluster_tier");
    }
}
