//! Router metrics, registered in the registry the health server exposes on /metrics.
use prometheus::{
    GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Buckets of the policy decision: 1 us to 10 ms (the bound is a 100 us p99).
const DECISION_BUCKETS_SECONDS: &[f64] = &[
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2,
];

#[derive(Clone)]
pub struct RouterMetrics {
    /// Time from a submit's arrival to the worker's acceptance (or the rejection), admission
    /// waits and the round trip to the denoiser included.
    pub submit_seconds: Histogram,
    /// Time of one policy decision (building the workers' views and choosing), the router's
    /// own overhead per placement.
    pub decision_seconds: Histogram,
    /// 1 for the placement policy in use, by name.
    pub policy: IntGaugeVec,
    pub placements: IntCounter,
    pub replacements: IntCounter,
    /// Submits and jobs that could not be placed, by reason.
    pub failures: IntCounterVec,
    pub live_workers: IntGauge,
    pub admission_waiting: IntGauge,
    /// Jobs adopted after their gateway died before placing them, by outcome (`placed`:
    /// async, placed by the router; `cancelled`: synchronous, its client gone).
    pub adoptions: IntCounterVec,
    /// Each step a denoiser reports, measured over the cost model's prediction (1: the
    /// profile fits the hardware).
    pub step_prediction_ratio: Histogram,
    /// Per denoiser, the factor its forecasts are scaled by (its smoothed measured/predicted
    /// step time; 1 until it has reported enough steps).
    pub step_time_factor: GaugeVec,
    /// Async jobs taken from the durable queue into this router's admission line.
    pub async_taken: IntCounter,
}

impl RouterMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let submit_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_router_decision_duration_seconds",
                "Time from submit arrival to placement or rejection",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ]),
        )?;
        let decision_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_router_decision_seconds",
                "One placement-policy decision (worker views built, worker chosen)",
            )
            .buckets(DECISION_BUCKETS_SECONDS.to_vec()),
        )?;
        let policy = IntGaugeVec::new(
            Opts::new(
                "diffmesh_router_policy",
                "1 for the placement policy in use (label: its name)",
            ),
            &["name"],
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
            "Submits waiting in the router's admission queue for a free denoiser slot",
        )?;
        let adoptions = IntCounterVec::new(
            Opts::new(
                "diffmesh_router_adoptions_total",
                "Jobs whose gateway died before placing them: placed, cancelled (synchronous) or failed (never prepared)",
            ),
            &["outcome"],
        )?;
        let step_prediction_ratio = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_router_step_prediction_ratio",
                "Denoiser engine steps: measured time over the cost model's prediction",
            )
            .buckets(diffmesh_shared::process::metrics::PREDICTION_RATIO_BUCKETS.to_vec()),
        )?;
        let step_time_factor = GaugeVec::new(
            Opts::new(
                "diffmesh_router_worker_step_time_ratio",
                "Factor the router scales a denoiser's predicted steps by: its smoothed measured \
                 over predicted step time (label: worker)",
            ),
            &["worker"],
        )?;
        let async_taken = IntCounter::new(
            "diffmesh_router_async_jobs_taken_total",
            "Async jobs taken from the durable queue to be placed",
        )?;
        registry.register(Box::new(async_taken.clone()))?;
        registry.register(Box::new(step_prediction_ratio.clone()))?;
        registry.register(Box::new(step_time_factor.clone()))?;
        registry.register(Box::new(submit_seconds.clone()))?;
        registry.register(Box::new(decision_seconds.clone()))?;
        registry.register(Box::new(policy.clone()))?;
        registry.register(Box::new(placements.clone()))?;
        registry.register(Box::new(replacements.clone()))?;
        registry.register(Box::new(failures.clone()))?;
        registry.register(Box::new(live_workers.clone()))?;
        registry.register(Box::new(admission_waiting.clone()))?;
        registry.register(Box::new(adoptions.clone()))?;
        Ok(Self {
            submit_seconds,
            decision_seconds,
            policy,
            placements,
            replacements,
            failures,
            live_workers,
            admission_waiting,
            adoptions,
            step_prediction_ratio,
            step_time_factor,
            async_taken,
        })
    }

    /// Mark `name` as the policy in use (and only it).
    pub fn set_policy(&self, name: &str) {
        self.policy.reset();
        self.policy.with_label_values(&[name]).set(1);
    }
}
