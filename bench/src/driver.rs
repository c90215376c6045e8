//! The real engine in-process for the bench (CPU, no NATS): the model from a directory, the
//! engine thread, its per-step cost by batch size, and an open-loop run of timed submits.
use crate::workload::ModelGrid;
use anyhow::{bail, Context, Result};
use diffmesh_denoiser::engine::{
    spawn_engine, EngineConfig, EngineDrained, EngineEvent, EngineHandle, EngineJob,
};
use diffmesh_denoiser::metrics::DenoiserMetrics;
use diffmesh_denoiser::model::{step_requests, EngineModel};
use diffmesh_denoiser::templates::TemplateEntry;
use diffmesh_model::flux::MaskedAttention;
use diffmesh_model::pipeline::stepper::{step_batch, DenoiseState};
use diffmesh_model::tch::{Device, Kind};
use diffmesh_model::tiny::IMAGE_SIZE;
use diffmesh_shared::wire::messages::DenoiseJob;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tracing::Span;

/// Bench engines never reject for room: every request of a run may wait at once.
const QUEUE: usize = 100_000;
const CHANNEL: usize = 4096;

/// The model a bench runs: its directory, the dtype of its weights and activations, and the
/// device its engine steps on (a CUDA engine gets the copy stream, as the denoiser's does).
#[derive(Debug, Clone)]
pub struct BenchModel {
    pub dir: PathBuf,
    pub kind: Kind,
    pub device: Device,
    /// Attention of the engine's packed mask-aware batches.
    pub masked_attention: MaskedAttention,
}

impl BenchModel {
    pub fn load(&self) -> Result<EngineModel> {
        let mut model = EngineModel::load(
            &self.dir,
            self.device,
            self.kind,
            "bench".into(),
            Some(IMAGE_SIZE),
        )
        .with_context(|| format!("--model-dir {}: cannot load the model", self.dir.display()))?;
        model.model.transformer.masked_attention = self.masked_attention;
        Ok(model)
    }
}

/// The image-token grid the model runs at by default.
pub fn model_grid(model: &EngineModel) -> ModelGrid {
    let g = &model.card.geometry;
    ModelGrid {
        pixels: g.default_width,
        tokens_per_side: g.default_width / g.token_pixels,
    }
}

/// A finished job as the engine reports it (model-resolution RGB images).
pub struct Finished {
    pub job: DenoiseJob,
    pub images: Vec<Vec<u8>>,
    /// Seconds since the run's start.
    pub at_s: f64,
}

/// What the engine's own metrics say about a run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    pub steps: u64,
    pub step_seconds: f64,
    pub rows: f64,
    /// Rows stepped mask-aware from a template cache (the rest ran in full).
    pub mask_aware_rows: u64,
}

impl StepStats {
    fn add(self, other: StepStats) -> StepStats {
        StepStats {
            steps: self.steps + other.steps,
            step_seconds: self.step_seconds + other.step_seconds,
            rows: self.rows + other.rows,
            mask_aware_rows: self.mask_aware_rows + other.mask_aware_rows,
        }
    }

    fn since(self, before: StepStats) -> StepStats {
        StepStats {
            steps: self.steps - before.steps,
            step_seconds: self.step_seconds - before.step_seconds,
            rows: self.rows - before.rows,
            mask_aware_rows: self.mask_aware_rows - before.mask_aware_rows,
        }
    }

    /// Mean wall time of one image row through one step (the engine's cost, contention included).
    pub fn ms_per_row(&self) -> f64 {
        self.step_seconds * 1e3 / self.rows.max(1.0)
    }

    /// Fraction of `wall_s` the engine spent stepping (its measured utilisation).
    pub fn busy(&self, wall_s: f64) -> f64 {
        self.step_seconds / wall_s.max(1e-9)
    }
}

pub struct BenchEngine {
    pub handle: EngineHandle,
    pub grid: ModelGrid,
    events: mpsc::Receiver<EngineEvent>,
    drained: EngineDrained,
    metrics: DenoiserMetrics,
    at_start: StepStats,
    /// When each job was admitted (seconds since [`BenchEngine::mark_start`]).
    pub started_s: HashMap<String, f64>,
    start: Instant,
}

impl BenchEngine {
    pub fn start(model: &BenchModel, config: EngineConfig) -> Result<Self> {
        let model = model.load()?;
        let grid = model_grid(&model);
        let (tx, events) = mpsc::channel(CHANNEL);
        let config = EngineConfig {
            max_queue: QUEUE,
            ..config
        };
        let metrics = DenoiserMetrics::new(&prometheus::Registry::new())?;
        let (handle, drained) = spawn_engine(model, config, CHANNEL, tx, Some(metrics.clone()))
            .context("starting the engine")?;
        Ok(Self {
            handle,
            grid,
            events,
            drained,
            metrics,
            at_start: StepStats::default(),
            started_s: HashMap::new(),
            start: Instant::now(),
        })
    }

    /// Times from now on are relative to this instant.
    pub fn mark_start(&mut self) -> Instant {
        self.start = Instant::now();
        self.started_s.clear();
        self.at_start = self.step_totals();
        self.start
    }

    fn step_totals(&self) -> StepStats {
        StepStats {
            steps: self.metrics.step_seconds.get_sample_count(),
            step_seconds: self.metrics.step_seconds.get_sample_sum(),
            rows: self.metrics.batch_rows.get_sample_sum(),
            mask_aware_rows: self
                .metrics
                .step_rows
                .with_label_values(&["mask_aware"])
                .get(),
        }
    }

    /// Steps since [`BenchEngine::mark_start`] (read once the run's jobs are done).
    pub fn step_stats(&self) -> StepStats {
        self.step_totals().since(self.at_start)
    }

    /// The next finished job; a failed or cancelled job is an error (the bench sends no bad
    /// input, so one means the engine is broken).
    pub async fn next_finished(&mut self) -> Result<Finished> {
        loop {
            let event = self
                .events
                .recv()
                .await
                .context("the engine stopped before every job finished")?;
            let now = self.start.elapsed().as_secs_f64();
            match event {
                EngineEvent::Started { job_id } => {
                    self.started_s.insert(job_id, now);
                }
                EngineEvent::Finished { job, images, .. } => {
                    return Ok(Finished {
                        job,
                        images,
                        at_s: now,
                    })
                }
                EngineEvent::Failed { job, error, .. } => {
                    bail!("job {} failed in the engine: {error}", job.job_id)
                }
                EngineEvent::Cancelled { job_id } => bail!("job {job_id} was cancelled"),
                _ => {}
            }
        }
    }

    /// The cache of the next capture job to finish capturing.
    pub async fn next_captured(&mut self) -> Result<Arc<TemplateEntry>> {
        loop {
            let event = self
                .events
                .recv()
                .await
                .context("the engine stopped before the capture finished")?;
            match event {
                EngineEvent::Captured { entry, .. } => return Ok(entry),
                EngineEvent::Failed { job, error, .. } => {
                    bail!("capture {} failed in the engine: {error}", job.job_id)
                }
                _ => {}
            }
        }
    }

    pub async fn submit(&self, job: EngineJob) -> Result<()> {
        let id = job.job.job_id.clone();
        self.handle
            .submit(job, Span::none())
            .await
            .with_context(|| format!("submitting {id}"))?;
        Ok(())
    }

    pub async fn stop(self) {
        self.handle.begin_shutdown().await;
        drop(self.events);
        self.drained.wait().await;
    }
}

/// Per-request times of one run, seconds since its start.
#[derive(Debug, Clone, Default)]
pub struct RunTimes {
    pub arrival_s: HashMap<String, f64>,
    pub started_s: HashMap<String, f64>,
    pub done_s: HashMap<String, f64>,
}

impl RunTimes {
    /// End-to-end latencies (arrival to done) of every request.
    pub fn latencies(&self) -> Result<Vec<f64>> {
        self.arrival_s
            .iter()
            .map(|(id, a)| {
                let d = self
                    .done_s
                    .get(id)
                    .with_context(|| format!("{id} never finished"))?;
                Ok(d - a)
            })
            .collect()
    }

    /// Mean time from arrival to admission into the running batch.
    pub fn mean_queueing_s(&self) -> f64 {
        let waits: Vec<f64> = self
            .arrival_s
            .iter()
            .filter_map(|(id, a)| self.started_s.get(id).map(|s| s - a))
            .collect();
        waits.iter().sum::<f64>() / waits.len().max(1) as f64
    }

    /// Seconds from the run's start to its last request done.
    pub fn makespan_s(&self) -> f64 {
        self.done_s.values().copied().fold(0.0, f64::max)
    }

    /// Mean number of requests in the running batch over the run (Little's law on the
    /// admission-to-done intervals).
    pub fn mean_running(&self) -> f64 {
        let busy: f64 = self
            .started_s
            .iter()
            .filter_map(|(id, s)| self.done_s.get(id).map(|d| d - s))
            .sum();
        let first = self
            .arrival_s
            .values()
            .copied()
            .fold(f64::INFINITY, f64::min);
        let last = self.done_s.values().copied().fold(0.0, f64::max);
        busy / (last - first).max(1e-9)
    }
}

/// One mode's figures pooled over the rounds of a part (rounds alternate between the modes, so
/// a slow spell of the machine weighs on both alike).
#[derive(Debug, Clone, Default)]
pub struct Pooled {
    pub latencies: Vec<f64>,
    queueing_s: Vec<f64>,
    running: Vec<f64>,
    wall_s: f64,
    pub stats: StepStats,
}

impl Pooled {
    pub fn add(&mut self, times: &RunTimes, stats: StepStats) -> Result<()> {
        self.latencies.extend(times.latencies()?);
        self.queueing_s.push(times.mean_queueing_s());
        self.running.push(times.mean_running());
        self.wall_s += times.makespan_s();
        self.stats = self.stats.add(stats);
        Ok(())
    }

    fn mean(v: &[f64]) -> f64 {
        v.iter().sum::<f64>() / v.len().max(1) as f64
    }

    /// Mean time from arrival to admission, averaged over rounds.
    pub fn mean_queueing_s(&self) -> f64 {
        Self::mean(&self.queueing_s)
    }

    /// Mean requests in the running batch, averaged over rounds.
    pub fn mean_running(&self) -> f64 {
        Self::mean(&self.running)
    }

    /// Fraction of the runs' wall time the engine spent stepping (its measured utilisation).
    pub fn busy(&self) -> f64 {
        self.stats.busy(self.wall_s)
    }

    /// Say so in `report` when the engine stepped over 90% of mode `name`'s run: the machine
    /// ran slower than calibrated, so the set utilisation was not what the mode saw.
    pub fn note_saturation(&self, name: &str, report: &mut crate::report::Report) {
        if self.busy() > 0.9 {
            report.say(format!(
                "  note: the engine stepped {:.0}% of the {name} run: the machine ran slower than \
                 calibrated, so this mode ran near saturation, not at the set utilisation",
                self.busy() * 100.0
            ));
        }
    }
}

/// Submit each job at its arrival time and wait until every one finished; done = the engine's
/// `Finished` event (no post-processing).
pub async fn open_loop(engine: &mut BenchEngine, jobs: Vec<(f64, EngineJob)>) -> Result<RunTimes> {
    let n = jobs.len();
    let mut times = RunTimes::default();
    let start = tokio::time::Instant::from_std(engine.mark_start());
    let handle = engine.handle.clone();
    for (at, job) in &jobs {
        times.arrival_s.insert(job.job.job_id.clone(), *at);
    }
    let submitter = tokio::spawn(async move {
        let mut pending = Vec::with_capacity(jobs.len());
        for (at, job) in jobs {
            tokio::time::sleep_until(start + std::time::Duration::from_secs_f64(at)).await;
            let h = handle.clone();
            pending.push(tokio::spawn(
                async move { h.submit(job, Span::none()).await },
            ));
        }
        for p in pending {
            p.await.context("submit task")?.context("submit")?;
        }
        anyhow::Ok(())
    });
    while times.done_s.len() < n {
        let f = engine.next_finished().await?;
        times.done_s.insert(f.job.job_id, f.at_s);
    }
    submitter.await.context("submitter task")??;
    times.started_s = engine.started_s.clone();
    Ok(times)
}

/// Seconds per engine step at each batch size `1..=max_batch`: generations of the model's
/// default size, the median of `steps` timed steps (after one warm-up step) per size. The whole
/// sweep runs `rounds` times and the median round is kept per size; the result is a robust line
/// through those medians ([`fit_line`]), so a burst of other work on the machine during one
/// measurement does not set the arrival rate.
pub fn calibrate(
    model: &BenchModel,
    max_batch: usize,
    steps: u32,
    rounds: u32,
) -> Result<Vec<f64>> {
    let device = model.device;
    let model = model.load()?;
    let _guard = diffmesh_model::tch::no_grad_guard();
    let pipeline = model.pipeline();
    let mut per_size = vec![Vec::new(); max_batch];
    for _ in 0..rounds.max(1) {
        for (b, rounds) in (1..=max_batch).zip(per_size.iter_mut()) {
            let mut states: Vec<DenoiseState> = Vec::with_capacity(b);
            for i in 0..b {
                let job = diffmesh_shared::testing::generation_job(
                    &format!("calibrate-{i}"),
                    "a red circle on the left on a blue background",
                    i as u64,
                    steps + 1,
                );
                for r in step_requests(&job, None, &model)? {
                    states.push(DenoiseState::new(&pipeline, &r)?);
                }
            }
            let mut refs: Vec<&mut DenoiseState> = states.iter_mut().collect();
            step_batch(&pipeline, &mut refs)?;
            let mut times = Vec::with_capacity(steps as usize);
            for _ in 0..steps {
                let t = Instant::now();
                step_batch(&pipeline, &mut refs)?;
                // Kernels run asynchronously on a GPU: a step ends when the device is done.
                if let Device::Cuda(ordinal) = device {
                    diffmesh_model::tch::Cuda::synchronize(ordinal as i64);
                }
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            rounds.push(times[times.len() / 2]);
        }
    }
    let medians: Vec<f64> = per_size
        .into_iter()
        .map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect();
    Ok(fit_line(&medians))
}

/// A robust line (Theil-Sen: the median of pairwise slopes, then the median intercept) through
/// `ys[i]` at batch size `i + 1`, evaluated at every size; a few disturbed measurements do not
/// move it. Each value is kept at least a tenth of the smallest measurement.
pub fn fit_line(ys: &[f64]) -> Vec<f64> {
    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        }
    }
    if ys.len() < 2 {
        return ys.to_vec();
    }
    let x = |i: usize| (i + 1) as f64;
    let mut slopes = Vec::new();
    for i in 0..ys.len() {
        for j in i + 1..ys.len() {
            slopes.push((ys[j] - ys[i]) / (x(j) - x(i)));
        }
    }
    let slope = median(slopes);
    let intercept = median(
        ys.iter()
            .enumerate()
            .map(|(i, y)| y - slope * x(i))
            .collect(),
    );
    let floor = ys.iter().copied().fold(f64::INFINITY, f64::min) / 10.0;
    (0..ys.len())
        .map(|i| (intercept + slope * x(i)).max(floor))
        .collect()
}

/// Requests per second the engine completes when its batch is always full.
pub fn continuous_capacity_rps(step_s: &[f64], mean_steps: f64) -> f64 {
    debug_assert!(!step_s.is_empty());
    let b = step_s.len();
    b as f64 / (mean_steps * step_s[b - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_fit_ignores_outliers() {
        let exact: Vec<f64> = (1..=8).map(|b| 2.0 + 10.0 * b as f64).collect();
        let fit = fit_line(&exact);
        assert!(fit.iter().zip(&exact).all(|(a, b)| (a - b).abs() < 1e-9));
        // Two disturbed measurements (one slow, one fast) leave the line where it was.
        let mut noisy = exact.clone();
        noisy[7] *= 1.5;
        noisy[4] *= 0.6;
        let fit = fit_line(&noisy);
        assert!(
            fit.iter()
                .zip(&exact)
                .all(|(a, b)| (a / b - 1.0).abs() < 0.05),
            "{fit:?}"
        );
        assert_eq!(fit_line(&[3.0]), vec![3.0]);
    }
}
