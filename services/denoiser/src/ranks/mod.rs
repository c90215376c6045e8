//! Elastic ranks (issue 47, GF-DiT §3, §5): a denoiser started with `--ranks R` owns R ranks
//! (one per device; worker threads on a CPU machine), each with a replica of the transformer.
//! Every denoising step of a job is a task the node's elastic policy binds, at each step
//! boundary, to a group of free ranks (its degree); the ranks compute it as a
//! sequence-parallel forward ([`pool`]). The policy is `diffmesh-sim`'s, unchanged
//! (`diffmesh_sched::elastic::policies`), and it plans with the step costs the node measured
//! on its own ranks at start ([`calibrate`]).
//!
//! The artifacts between steps (latents, scheduler position) stay with the job's state on the
//! engine thread: each step's members all end with the whole velocity, the first hands it
//! back, and the next step's group, whatever its degree and ranks, starts from the state.
//! Moving a job from 4 ranks to 2 or to other ranks therefore never recomputes a step.
pub mod calibrate;
pub mod metrics;
pub mod pool;

use calibrate::SizeToMeasure;
use diffmesh_model::tch::{Device, Kind};
use diffmesh_sched::elastic::cost::{Class, MeasuredTable, StepCost};
use diffmesh_sched::elastic::policies::{by_name, ElasticPolicy, Ready, View};
use pool::RankPool;
use std::path::Path;
use std::time::Instant;

/// How a node's ranks are set up (`--ranks`, `--elastic-policy`, `--elastic-sizes`).
#[derive(Debug, Clone)]
pub struct ElasticSettings {
    pub ranks: usize,
    /// A `diffmesh_sched::elastic::policies::by_name` name.
    pub policy: String,
    /// Square image sides (pixels) whose step costs are measured at start; a job is planned
    /// with the cost of the nearest size.
    pub sizes: Vec<u32>,
    /// Intra-op threads per rank.
    pub threads_per_rank: i32,
    /// Timed rounds per size and degree at start.
    pub calibration_repeats: usize,
    /// A cost table to plan with instead of measuring one at start (`--elastic-cost`).
    pub table: Option<MeasuredTable>,
}

/// The ranks, the policy that places steps on them, and the costs it plans with.
pub struct ElasticRanks {
    pub pool: RankPool,
    policy: Box<dyn ElasticPolicy>,
    /// What the node measured at start (what the heartbeat's capacity and the simulator use).
    pub table: MeasuredTable,
    classes: Vec<Class>,
    cost: StepCost,
    epoch: Instant,
    next_task: u64,
}

impl ElasticRanks {
    /// Start the ranks on the transformer of `model_dir` and measure the step costs.
    /// `token_pixels`: image pixels per token side; `text_tokens`: the prompt length.
    pub fn start(
        model_dir: &Path,
        settings: &ElasticSettings,
        device: Device,
        kind: Kind,
        token_pixels: u32,
        text_tokens: i64,
    ) -> Result<Self, String> {
        let policy = by_name(&settings.policy).ok_or_else(|| {
            format!(
                "elastic_policy: unknown policy {:?} (static-sp<k>, fcfs-elastic, srtf-elastic, \
                 edf-bestfit, slo-elastic)",
                settings.policy
            )
        })?;
        if settings.sizes.is_empty() {
            return Err("elastic_sizes: give at least one image side".into());
        }
        let dir = diffmesh_model::flux::component_dir(model_dir);
        let mut pool = RankPool::start(
            &dir,
            settings.ranks,
            device,
            kind,
            settings.threads_per_rank,
        )?;
        let started = Instant::now();
        let table = match &settings.table {
            Some(table) => table.clone(),
            None => measure(&mut pool, settings, token_pixels, text_tokens)?,
        };
        tracing::info!(ranks = settings.ranks, policy = %policy.name(),
            seconds = started.elapsed().as_secs_f64(), table = ?table, "elastic ranks ready");
        if table.classes.is_empty() {
            return Err("elastic_cost: the table has no classes".into());
        }
        let (cost, classes) = StepCost::measured(table.clone());
        Ok(Self {
            pool,
            policy,
            table,
            classes,
            cost,
            epoch: Instant::now(),
            next_task: 1,
        })
    }

    /// Seconds on the policy's clock.
    pub fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    /// Seconds on the policy's clock of a wall-clock instant given in Unix milliseconds.
    pub fn clock_of_unix_ms(&self, unix_ms: u64) -> f64 {
        let now_ms = diffmesh_shared::stores::job::now_ms();
        self.now() + (unix_ms as f64 - now_ms as f64) / 1000.0
    }

    /// The class (measured size) nearest `image_tokens`.
    pub fn class_of(&self, image_tokens: f64) -> usize {
        let gap = |c: &Class| (c.image_tokens.max(1.0) / image_tokens.max(1.0)).ln().abs();
        (0..self.classes.len())
            .min_by(|&a, &b| gap(&self.classes[a]).total_cmp(&gap(&self.classes[b])))
            .unwrap_or(0)
    }

    /// The policy's decision for the ready tasks on `free` ranks: `(task id, degree)`.
    pub fn decide(&mut self, free: u32, ready: &[Ready]) -> Vec<(usize, u32)> {
        let view = View {
            now: self.now(),
            free,
            classes: &self.classes,
            cost: &self.cost,
        };
        self.policy.assign(&view, ready)
    }

    pub fn next_task_id(&mut self) -> u64 {
        self.next_task += 1;
        self.next_task
    }
}

/// Measure the step costs of `settings.sizes` on the pool's ranks.
fn measure(
    pool: &mut RankPool,
    settings: &ElasticSettings,
    token_pixels: u32,
    text_tokens: i64,
) -> Result<MeasuredTable, String> {
    let sizes: Vec<SizeToMeasure> = settings
        .sizes
        .iter()
        .map(|&side| SizeToMeasure {
            name: format!("{side}px"),
            token_side: i64::from((side / token_pixels.max(1)).max(1)),
        })
        .collect();
    let cfg = pool.config().clone();
    calibrate::measure(
        pool,
        &cfg,
        text_tokens,
        &sizes,
        settings.calibration_repeats,
    )
}
