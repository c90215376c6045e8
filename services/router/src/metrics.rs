//! Router metrics, registered in the registry the health server exposes on /metrics.
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

#[derive(Clone)]
pub struct RouterMetrics {
    /// Time from a submit's arrival to the worker's acceptance (or the rejection).
    pub decision_seconds: Histogram,
    pub placements: IntCounter,
    pub replacements: IntCounter,
    /// Submits and jobs that could not be placed, by reason.
    pub failures: IntCounterVec,
    pub live_workers: IntGauge,
    pub admission_waiting: IntGauge,
}

impl RouterMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let decision_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_router_decision_duration_seconds",
                "Time from submit arrival to placement or rejection",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ]),
        )?;
        let placements = IntCounter::new(
            "diffmesh_router_placements_total",
            "Jobs placed on a denoiser",
        )?;
        let replacements = IntCounter::new(
            "diffmesh_router_replacements_total",
            "Jobs placed again after their denoiser was lost",
        )?;
        let failures = IntCounterVec::new(
            Opts::new(
                "diffmesh_router_failures_total",
                "Submits rejected and jobs failed by the router",
            ),
            &["reason"],
        )?;
        let live_workers = IntGauge::new(
            "diffmesh_router_live_workers",
            "Denoisers with recent heartbeats",
        )?;
        let admission_waiting = IntGauge::new(
            "diffmesh_router_admission_waiting",
            "Submits waiting for a free denoiser slot",
        )?;
        registry.register(Box::new(decision_seconds.clone()))?;
        registry.register(Box::new(placements.clone()))?;
        registry.register(Box::new(replacements.clone()))?;
        registry.register(Box::new(failures.clone()))?;
        registry.register(Box::new(live_workers.clone()))?;
        registry.register(Box::new(admission_waiting.clone()))?;
        Ok(Self {
            decision_seconds,
            placements,
            replacements,
            failures,
            live_workers,
            admission_waiting,
        })
    }
}
