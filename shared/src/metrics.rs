//! Metric naming and registration helpers so every service spells metrics the same way:
//! `diffmesh_<subsystem>_<name>_<unit>`, explicit histogram buckets, and one failure counter
//! per service labelled by reason.
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

/// Prefix of every diffmesh metric.
pub const PREFIX: &str = "diffmesh";

/// The unit suffix of a metric name (Prometheus naming conventions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Seconds,
    Bytes,
    /// A count that only grows: counters end in `_total`.
    Total,
    Ratio,
    /// Dimensionless gauges (queue length, batch size).
    None,
}

impl Unit {
    fn suffix(self) -> &'static str {
        match self {
            Unit::Seconds => "_seconds",
            Unit::Bytes => "_bytes",
            Unit::Total => "_total",
            Unit::Ratio => "_ratio",
            Unit::None => "",
        }
    }
}

/// `diffmesh_<subsystem>_<name><unit suffix>`, e.g. `diffmesh_codec_pre_duration_seconds`.
pub fn metric_name(subsystem: &str, name: &str, unit: Unit) -> String {
    format!("{PREFIX}_{subsystem}_{name}{}", unit.suffix())
}

/// Request and stage latencies: 5 ms to 2 minutes (diffusion jobs take seconds).
pub const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Fractions in [0, 1] such as mask ratios.
pub const RATIO_BUCKETS: &[f64] = &[0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0];
/// Payload sizes: 1 KiB to 64 MiB.
pub const SIZE_BUCKETS_BYTES: &[f64] = &[
    1024.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0, 67108864.0,
];

/// Register a histogram with explicit buckets.
pub fn histogram_vec(
    registry: &Registry,
    subsystem: &str,
    name: &str,
    unit: Unit,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> Result<HistogramVec, prometheus::Error> {
    let opts =
        HistogramOpts::new(metric_name(subsystem, name, unit), help).buckets(buckets.to_vec());
    let h = HistogramVec::new(opts, labels)?;
    registry.register(Box::new(h.clone()))?;
    Ok(h)
}

/// Register a counter (`_total` suffix).
pub fn counter_vec(
    registry: &Registry,
    subsystem: &str,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, prometheus::Error> {
    let c = IntCounterVec::new(
        Opts::new(metric_name(subsystem, name, Unit::Total), help),
        labels,
    )?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

/// `diffmesh_<subsystem>_failures_total{reason=...}`: the one failure counter of a service.
#[derive(Clone)]
pub struct FailureCounter(IntCounterVec);

impl FailureCounter {
    pub fn register(registry: &Registry, subsystem: &str) -> Result<Self, prometheus::Error> {
        counter_vec(
            registry,
            subsystem,
            "failures",
            "Failures by reason",
            &["reason"],
        )
        .map(Self)
    }

    pub fn inc(&self, reason: &str) {
        self.0.with_label_values(&[reason]).inc();
    }

    pub fn get(&self, reason: &str) -> u64 {
        self.0.with_label_values(&[reason]).get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_prefixed_and_suffixed() {
        assert_eq!(
            metric_name("codec", "pre_duration", Unit::Seconds),
            "diffmesh_codec_pre_duration_seconds"
        );
        assert_eq!(
            metric_name("gateway", "requests", Unit::Total),
            "diffmesh_gateway_requests_total"
        );
    }

    #[test]
    fn failure_counter_counts_by_reason() {
        let registry = Registry::new();
        let failures = FailureCounter::register(&registry, "test").unwrap();
        failures.inc("timeout");
        failures.inc("timeout");
        assert_eq!(failures.get("timeout"), 2);
        assert_eq!(failures.get("other"), 0);
        let text = registry.gather();
        assert_eq!(text[0].name(), "diffmesh_test_failures_total");
        // Registering the same name twice is an error, not a silent duplicate.
        assert!(FailureCounter::register(&registry, "test").is_err());
    }
}
