//! Metric naming and registration helpers so every service spells metrics the same way:
//! `diffmesh_<subsystem>_<name>_<unit>`, explicit histogram buckets, and one failure counter
//! per service labelled by reason.
//!
//! Besides each service's own registry there is one [`process_registry`] for metrics that
//! shared code records (NATS request round trips, [`NatsMetrics`]); the health server's
//! `/metrics` serves both.
use std::sync::OnceLock;

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
/// Measured over predicted (1: the prediction held), 1/4 to 8x.
pub const PREDICTION_RATIO_BUCKETS: &[f64] = &[
    0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0,
];
/// Payload sizes: 1 KiB to 64 MiB.
pub const SIZE_BUCKETS_BYTES: &[f64] = &[
    1024.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0, 67108864.0,
];

/// NATS request/reply round trips: 0.5 ms to 30 s (request deadlines are seconds).
pub const NATS_BUCKETS_SECONDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Metrics whose name carries no unit suffix on purpose: counts of things at one moment
/// (gauges) or per event (histograms). Every other diffmesh metric ends in `_seconds`,
/// `_bytes`, `_ratio` or (counters) `_total`; see [`naming_problem`]. Name and what it counts.
pub const UNITLESS_METRICS: &[(&str, &str)] = &[
    (
        "diffmesh_router_live_workers",
        "denoisers with recent heartbeats",
    ),
    (
        "diffmesh_router_policy",
        "1 for the placement policy in use, by `name` (an info gauge)",
    ),
    (
        "diffmesh_router_admission_waiting",
        "submits queued in the router waiting for a denoiser slot",
    ),
    (
        "diffmesh_denoiser_queued_jobs",
        "jobs waiting for a batch slot",
    ),
    (
        "diffmesh_denoiser_running_jobs",
        "jobs in the running batch",
    ),
    (
        "diffmesh_denoiser_batch_rows",
        "images denoised together in one step (histogram)",
    ),
    (
        "diffmesh_denoiser_sick",
        "1 while the denoiser takes itself out after failing jobs (a state gauge)",
    ),
    (
        "diffmesh_denoiser_ranks",
        "elastic ranks of the denoiser (0 without `--ranks`)",
    ),
    (
        "diffmesh_denoiser_ranks_busy",
        "elastic ranks running a step task now",
    ),
    ("diffmesh_cachestore_entries", "entries held per tier"),
    (
        "diffmesh_controlnet_sessions",
        "sessions open on a ControlNet worker",
    ),
];

/// Why `name` (of Prometheus type `kind`: "counter", "gauge", "histogram", "summary") breaks the
/// naming convention, or `None` when it follows it.
pub fn naming_problem(name: &str, kind: &str) -> Option<String> {
    let Some(rest) = name.strip_prefix(&format!("{PREFIX}_")) else {
        return Some(format!("{name}: does not start with `{PREFIX}_`"));
    };
    if rest.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Some(format!("{name}: not lower snake case"));
    }
    let documented = UNITLESS_METRICS.iter().any(|(n, _)| *n == name);
    match kind {
        "counter" if name.ends_with("_total") => None,
        "counter" => Some(format!("{name}: a counter must end in `_total`")),
        _ if name.ends_with("_total") => Some(format!("{name}: only counters end in `_total`")),
        _ if ["_seconds", "_bytes", "_ratio"]
            .iter()
            .any(|u| name.ends_with(u)) =>
        {
            None
        }
        _ if documented => None,
        _ => Some(format!(
            "{name}: a {kind} needs a unit suffix (`_seconds`, `_bytes`, `_ratio`) or an entry \
             in `shared::process::metrics::UNITLESS_METRICS`"
        )),
    }
}

/// Registry of metrics recorded by shared code rather than by one service; the health
/// server's `/metrics` serves it next to the service's own registry. Services in one process
/// (integration tests) share it.
pub fn process_registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Registry::new)
}

/// Round trips of the NATS request helpers (`shared::nats::request_msgpack*`), by subject.
///
/// Request subjects name a service and at most a worker id, so the `subject` label stays
/// bounded.
#[derive(Clone)]
pub struct NatsMetrics {
    /// `diffmesh_nats_request_duration_seconds{subject}`: send to decoded reply, answered
    /// requests only.
    pub request_duration: HistogramVec,
    /// `diffmesh_nats_request_failures_total{subject, reason}`: timeouts, no responders, errors.
    pub request_failures: IntCounterVec,
    /// `diffmesh_nats_request_resends_total{subject, reason}`: requests sent again because the
    /// client reconnected while they waited for their reply (`reconnect`), no responder
    /// was subscribed yet (`no_responders`), or, for work kept across a service's restart,
    /// no instance took it within the request's deadline (`unanswered`, `crate::nats::unanswered`).
    pub request_resends: IntCounterVec,
    /// `diffmesh_nats_connection_events_total{event}`: the client's connection events
    /// ([`NATS_CONNECTION_EVENTS`]): connects and drops, slow consumers, server errors.
    pub connection_events: IntCounterVec,
}

/// Labels of `diffmesh_nats_connection_events_total`, one per `async_nats::Event` variant.
pub const NATS_CONNECTION_EVENTS: &[&str] = &[
    "connected",
    "disconnected",
    "lame_duck_mode",
    "draining",
    "closed",
    "slow_consumer",
    "server_error",
    "client_error",
];

impl NatsMetrics {
    /// The process-wide instance, registered in [`process_registry`] on first use.
    pub fn global() -> &'static NatsMetrics {
        static METRICS: OnceLock<NatsMetrics> = OnceLock::new();
        METRICS.get_or_init(|| {
            Self::register(process_registry())
                .expect("the NATS metrics are registered once, with valid names")
        })
    }

    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            request_duration: histogram_vec(
                registry,
                "nats",
                "request_duration",
                Unit::Seconds,
                "NATS request/reply round trip (send to decoded reply), answered requests",
                &["subject"],
                NATS_BUCKETS_SECONDS,
            )?,
            request_failures: counter_vec(
                registry,
                "nats",
                "request_failures",
                "NATS requests that got no usable reply, by subject and reason",
                &["subject", "reason"],
            )?,
            request_resends: counter_vec(
                registry,
                "nats",
                "request_resends",
                "NATS requests sent again: the client reconnected while they waited, no \
                 responder was subscribed yet, or no service instance took the work",
                &["subject", "reason"],
            )?,
            connection_events: {
                let events = counter_vec(
                    registry,
                    "nats",
                    "connection_events",
                    "Connection events of the process's NATS clients (connected, disconnected, \
                     slow consumer, ...), by event",
                    &["event"],
                )?;
                // Present at 0 from the start, so a dashboard's rate() sees the first drop.
                for event in NATS_CONNECTION_EVENTS {
                    events.with_label_values(&[*event]);
                }
                events
            },
        })
    }
}

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

    /// [`FailureCounter::register`] with `reasons` exported at 0 from the start, so the family
    /// is on `/metrics` before the first failure and `rate()` sees the first one.
    pub fn register_with_reasons(
        registry: &Registry,
        subsystem: &str,
        reasons: &[&str],
    ) -> Result<Self, prometheus::Error> {
        let counter = Self::register(registry, subsystem)?;
        for reason in reasons {
            counter.0.with_label_values(&[*reason]);
        }
        Ok(counter)
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

    #[test]
    fn known_failure_reasons_are_exported_before_any_failure() {
        let registry = Registry::new();
        FailureCounter::register_with_reasons(&registry, "test", &["timeout", "invalid"]).unwrap();
        let families = registry.gather();
        assert_eq!(families.len(), 1);
        assert_eq!(families[0].get_metric().len(), 2);
        assert!(families[0]
            .get_metric()
            .iter()
            .all(|m| m.get_counter().value() == 0.0));
    }

    #[test]
    fn naming_convention() {
        for (name, kind) in [
            ("diffmesh_gateway_requests_total", "counter"),
            ("diffmesh_codec_duration_seconds", "histogram"),
            ("diffmesh_cachestore_bytes", "gauge"),
            ("diffmesh_codec_mask_ratio", "histogram"),
            ("diffmesh_denoiser_queued_jobs", "gauge"),
        ] {
            assert_eq!(naming_problem(name, kind), None, "{name}");
        }
        for (name, kind) in [
            ("gateway_requests_total", "counter"),
            ("diffmesh_gateway_requests", "counter"),
            ("diffmesh_gateway_errors_total", "gauge"),
            ("diffmesh_codec_duration", "histogram"),
            ("diffmesh_codec_undocumented_jobs", "gauge"),
            ("diffmesh_Codec_duration_seconds", "histogram"),
        ] {
            assert!(naming_problem(name, kind).is_some(), "{name} passed");
        }
        for (name, _) in UNITLESS_METRICS {
            assert_eq!(naming_problem(name, "gauge"), None, "{name}");
        }
    }

    #[test]
    fn nats_metrics_live_in_the_process_registry() {
        let nats = NatsMetrics::global();
        nats.request_duration
            .with_label_values(&["diffmesh.test"])
            .observe(0.001);
        let names: Vec<String> = process_registry()
            .gather()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        assert!(names.contains(&"diffmesh_nats_request_duration_seconds".to_string()));
        // A second call is the same instance: registering twice would have failed.
        assert!(std::ptr::eq(nats, NatsMetrics::global()));
    }
}
