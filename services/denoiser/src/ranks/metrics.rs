//! Metrics of a node's elastic ranks: steps by degree, degree changes, busy ranks.
use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

#[derive(Clone)]
pub struct ElasticMetrics {
    /// Job-steps run on the ranks, by degree (ranks in the step's group).
    pub steps: IntCounterVec,
    /// Seconds from dispatch to the last member's end of a step task, by degree.
    pub step_seconds: HistogramVec,
    /// Steps whose degree differed from the same job's previous step.
    pub degree_changes: IntCounter,
    /// Ranks of the node (0: no elastic ranks).
    pub ranks: IntGauge,
    pub ranks_busy: IntGauge,
}

impl ElasticMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let steps = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_elastic_steps_total",
                "Job-steps run on the node's ranks, by degree (ranks in the step's group)",
            ),
            &["degree"],
        )?;
        let step_seconds = HistogramVec::new(
            HistogramOpts::new(
                "diffmesh_denoiser_elastic_step_seconds",
                "Seconds of a step task on the node's ranks, dispatch to the last member's end, by degree",
            )
            .buckets(diffmesh_shared::process::metrics::LATENCY_BUCKETS_SECONDS.to_vec()),
            &["degree"],
        )?;
        let degree_changes = IntCounter::new(
            "diffmesh_denoiser_elastic_degree_changes_total",
            "Steps whose degree differed from the same job's previous step",
        )?;
        let ranks = IntGauge::new(
            "diffmesh_denoiser_ranks",
            "Ranks of the node (0: no elastic ranks)",
        )?;
        let ranks_busy = IntGauge::new(
            "diffmesh_denoiser_ranks_busy",
            "Ranks running a step task now",
        )?;
        registry.register(Box::new(steps.clone()))?;
        registry.register(Box::new(step_seconds.clone()))?;
        registry.register(Box::new(degree_changes.clone()))?;
        registry.register(Box::new(ranks.clone()))?;
        registry.register(Box::new(ranks_busy.clone()))?;
        Ok(Self {
            steps,
            step_seconds,
            degree_changes,
            ranks,
            ranks_busy,
        })
    }
}
