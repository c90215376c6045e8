//! Per-tier hit/miss/size metrics of the cachestore.
use diffmesh_shared::cachestore::CacheTier;
use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry};

#[derive(Clone)]
pub struct CacheMetrics {
    hits: IntCounterVec,
    misses: IntCounterVec,
    bytes: IntGaugeVec,
    entries: IntGaugeVec,
    pub puts: IntCounter,
    /// Requests that failed, by reason.
    pub failures: IntCounterVec,
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
        let puts = IntCounter::new("diffmesh_cachestore_puts_total", "Values stored")?;
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
        registry.register(Box::new(puts.clone()))?;
        registry.register(Box::new(failures.clone()))?;
        Ok(Self {
            hits,
            misses,
            bytes,
            entries,
            puts,
            failures,
        })
    }

    pub fn hit(&self, tier: CacheTier) {
        self.hits.with_label_values(&[tier.as_str()]).inc();
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
