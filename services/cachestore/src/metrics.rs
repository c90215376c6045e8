//! Per-tier hit/miss/size metrics of the cachestore.
use diffmesh_shared::wire::cachestore::CacheTier;
use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry};

#[derive(Clone)]
pub struct CacheMetrics {
    hits: IntCounterVec,
    misses: IntCounterVec,
    bytes: IntGaugeVec,
    entries: IntGaugeVec,
    /// Bytes served by gets, by the tier that answered.
    read_bytes: IntCounterVec,
    /// Keys a prefetch handled, by outcome (see `store::Promotion::as_str`).
    prefetches: IntCounterVec,
    pub puts: IntCounter,
    /// Values served by gets, by how they travel (`inline`, `ranged`, `object_store`).
    served: IntCounterVec,
    /// Bytes sent in ranges of ranged reads.
    range_bytes: IntCounter,
    /// Requests that failed, by reason.
    pub failures: IntCounterVec,
    /// Caches deleted from the cluster tier to keep it within `--cluster-bytes`.
    pub cluster_evictions: IntCounter,
}

impl CacheMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let hits = IntCounterVec::new(
            Opts::new("diffmesh_cachestore_hits_total", "Gets answered by a tier"),
            &["tier"],
        )?;
        let misses = IntCounterVec::new(
            Opts::new(
                "diffmesh_cachestore_misses_total",
                "Gets a tier could not answer",
            ),
            &["tier"],
        )?;
        let bytes = IntGaugeVec::new(
            Opts::new("diffmesh_cachestore_bytes", "Bytes held per tier"),
            &["tier"],
        )?;
        let entries = IntGaugeVec::new(
            Opts::new("diffmesh_cachestore_entries", "Entries held per tier"),
            &["tier"],
        )?;
        let read_bytes = IntCounterVec::new(
            Opts::new(
                "diffmesh_cachestore_read_bytes_total",
                "Bytes served by gets, by the tier that answered",
            ),
            &["tier"],
        )?;
        let prefetches = IntCounterVec::new(
            Opts::new(
                "diffmesh_cachestore_prefetches_total",
                "Keys handled by prefetch requests, by outcome",
            ),
            &["outcome"],
        )?;
        let puts = IntCounter::new("diffmesh_cachestore_puts_total", "Values stored")?;
        let served = IntCounterVec::new(
            Opts::new(
                "diffmesh_cachestore_served_total",
                "Values served by gets, by how they travel: inline, ranged (straight from this \
                 instance), object_store",
            ),
            &["path"],
        )?;
        let range_bytes = IntCounter::new(
            "diffmesh_cachestore_range_bytes_total",
            "Bytes sent in ranges of ranged reads",
        )?;
        let failures = IntCounterVec::new(
            Opts::new(
                "diffmesh_cachestore_failures_total",
                "Cachestore requests that failed, by reason",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(hits.clone()))?;
        registry.register(Box::new(misses.clone()))?;
        registry.register(Box::new(bytes.clone()))?;
        registry.register(Box::new(entries.clone()))?;
        registry.register(Box::new(read_bytes.clone()))?;
        registry.register(Box::new(prefetches.clone()))?;
        registry.register(Box::new(puts.clone()))?;
        registry.register(Box::new(served.clone()))?;
        registry.register(Box::new(range_bytes.clone()))?;
        for path in ["inline", "ranged", "object_store"] {
            served.with_label_values(&[path]);
        }
        registry.register(Box::new(failures.clone()))?;
        let cluster_evictions = IntCounter::new(
            "diffmesh_cachestore_cluster_evictions_total",
            "Template caches deleted from the cluster tier, least recently used first, to keep \
             it within --cluster-bytes",
        )?;
        registry.register(Box::new(cluster_evictions.clone()))?;
        // Every tier's series exist at 0 from the start: the hit rate and size panels (and
        // `rate()`) see a tier before its first get.
        for tier in [CacheTier::Memory, CacheTier::Disk, CacheTier::Cluster] {
            let label = [tier.as_str()];
            hits.with_label_values(&label);
            misses.with_label_values(&label);
            bytes.with_label_values(&label);
            entries.with_label_values(&label);
            read_bytes.with_label_values(&label);
        }
        // The store's own failure reasons (`StoreError::reason`; cluster-tier errors add the
        // shared `MeshError` reasons when they happen).
        for reason in [
            "invalid_key",
            "disk",
            "no_cluster_tier",
            "bad_request",
            "bad_range",
            "too_many_keys",
        ] {
            failures.with_label_values(&[reason]);
        }
        // Every prefetch outcome (`store::Promotion::as_str`, and `failed`).
        for outcome in [
            "already_in_memory",
            "from_disk",
            "from_cluster",
            "missing",
            "failed",
        ] {
            prefetches.with_label_values(&[outcome]);
        }
        Ok(Self {
            hits,
            misses,
            bytes,
            entries,
            read_bytes,
            prefetches,
            puts,
            served,
            range_bytes,
            failures,
            cluster_evictions,
        })
    }

    /// A get's value travels by `path` (`inline`, `ranged`, `object_store`).
    pub fn served(&self, path: &str) {
        self.served.with_label_values(&[path]).inc();
    }

    pub fn served_of(&self, path: &str) -> u64 {
        self.served.with_label_values(&[path]).get()
    }

    /// A range of `bytes` bytes was sent.
    pub fn ranged(&self, bytes: usize) {
        self.range_bytes.inc_by(bytes as u64);
    }

    /// A get answered by `tier` with a value of `bytes` bytes.
    pub fn hit(&self, tier: CacheTier, bytes: usize) {
        self.hits.with_label_values(&[tier.as_str()]).inc();
        self.read_bytes
            .with_label_values(&[tier.as_str()])
            .inc_by(bytes as u64);
    }

    pub fn read_bytes_of(&self, tier: CacheTier) -> u64 {
        self.read_bytes.with_label_values(&[tier.as_str()]).get()
    }

    pub fn prefetched(&self, outcome: &str) {
        self.prefetches.with_label_values(&[outcome]).inc();
    }

    pub fn prefetches_of(&self, outcome: &str) -> u64 {
        self.prefetches.with_label_values(&[outcome]).get()
    }

    pub fn miss(&self, tier: CacheTier) {
        self.misses.with_label_values(&[tier.as_str()]).inc();
    }

    pub fn hits_of(&self, tier: CacheTier) -> u64 {
        self.hits.with_label_values(&[tier.as_str()]).get()
    }

    pub fn misses_of(&self, tier: CacheTier) -> u64 {
        self.misses.with_label_values(&[tier.as_str()]).get()
    }

    pub fn set_size(&self, tier: CacheTier, entries: u64, bytes: u64) {
        self.entries
            .with_label_values(&[tier.as_str()])
            .set(entries as i64);
        self.bytes
            .with_label_values(&[tier.as_str()])
            .set(bytes as i64);
    }
}
