//! The codec's Prometheus metrics.
use diffmesh_shared::process::metrics::{
    counter_vec, histogram_vec, FailureCounter, Unit, LATENCY_BUCKETS_SECONDS, RATIO_BUCKETS,
};
use prometheus::{HistogramVec, IntCounterVec, Registry};

/// Operations and outcomes, exported at 0 from the start so every series exists before the
/// first request (dashboards' `rate()` then sees the first one).
const OPS: &[&str] = &["pre", "post"];
const OUTCOMES: &[&str] = &["ok", "invalid", "failed"];
/// The reasons `CodecError::reason` gives for failures the codec counts, plus `reply`
/// (sending the answer failed).
const FAILURE_REASONS: &[&str] = &[
    "encode",
    "bad_message",
    "panic",
    "timeout",
    "reply",
    "blob_not_found",
    "blob_too_large",
    "object_store",
    "codec",
    "nats",
];

#[derive(Clone)]
pub struct CodecMetrics {
    /// `diffmesh_codec_duration_seconds{op="pre"|"post"}`.
    pub duration: HistogramVec,
    /// `diffmesh_codec_requests_total{op, outcome="ok"|"invalid"|"failed"}`.
    pub requests: IntCounterVec,
    /// `diffmesh_codec_mask_ratio`: fraction of image tokens repainted per edit.
    pub mask_ratio: HistogramVec,
    /// `diffmesh_codec_decoded_cache_total{outcome="hit"|"miss"}`: template images taken
    /// decoded from the cache or decoded.
    pub decoded_cache: IntCounterVec,
    pub failures: FailureCounter,
}

impl CodecMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let metrics = Self {
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
            decoded_cache: counter_vec(
                registry,
                "codec",
                "decoded_cache",
                "Template images taken decoded from the cache (hit) or decoded (miss)",
                &["outcome"],
            )?,
            failures: FailureCounter::register_with_reasons(registry, "codec", FAILURE_REASONS)?,
        };
        for op in OPS {
            metrics.duration.with_label_values(&[*op]);
            for outcome in OUTCOMES {
                metrics.requests.with_label_values(&[*op, *outcome]);
            }
        }
        metrics.mask_ratio.with_label_values(&[] as &[&str]);
        for outcome in ["hit", "miss"] {
            metrics.decoded_cache.with_label_values(&[outcome]);
        }
        Ok(metrics)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family is on /metrics before the first request.
    #[test]
    fn every_family_is_exported_from_the_start() {
        let registry = Registry::new();
        CodecMetrics::register(&registry).unwrap();
        let mut names: Vec<String> = registry
            .gather()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "diffmesh_codec_decoded_cache_total",
                "diffmesh_codec_duration_seconds",
                "diffmesh_codec_failures_total",
                "diffmesh_codec_mask_ratio",
                "diffmesh_codec_requests_total",
            ]
        );
    }
}
