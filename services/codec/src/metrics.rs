//! The codec's Prometheus metrics.
use diffmesh_shared::metrics::{
    counter_vec, histogram_vec, FailureCounter, Unit, LATENCY_BUCKETS_SECONDS, RATIO_BUCKETS,
};
use prometheus::{HistogramVec, IntCounterVec, Registry};

#[derive(Clone)]
pub struct CodecMetrics {
    /// `diffmesh_codec_duration_seconds{op="pre"|"post"}`.
    pub duration: HistogramVec,
    /// `diffmesh_codec_requests_total{op, outcome="ok"|"invalid"|"failed"}`.
    pub requests: IntCounterVec,
    /// `diffmesh_codec_mask_ratio`: fraction of image tokens repainted per edit.
    pub mask_ratio: HistogramVec,
    pub failures: FailureCounter,
}

impl CodecMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            duration: histogram_vec(
                registry,
                "codec",
                "duration",
                Unit::Seconds,
                "Time to pre- or post-process one request",
                &["op"],
                LATENCY_BUCKETS_SECONDS,
            )?,
            requests: counter_vec(
                registry,
                "codec",
                "requests",
                "Requests handled by operation and outcome",
                &["op", "outcome"],
            )?,
            mask_ratio: histogram_vec(
                registry,
                "codec",
                "mask",
                Unit::Ratio,
                "Fraction of image tokens an edit repaints",
                &[],
                RATIO_BUCKETS,
            )?,
            failures: FailureCounter::register(registry, "codec")?,
        })
    }
}
