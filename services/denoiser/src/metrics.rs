//! Denoiser metrics, registered in the registry the health server exposes on /metrics.
use std::time::Instant;

use diffmesh_model::controlnets::Lookup;
use diffmesh_model::pipeline::conditioning_cache::{ConditioningCounts, ReuseCounts};
use diffmesh_shared::process::metrics::LATENCY_BUCKETS_SECONDS;
use prometheus::{
    Counter, CounterVec, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

/// Kinds of entry in the engine's conditioning cache, as metric labels.
pub const CONDITIONING_KINDS: [&str; 3] = ["prompt", "template_latents", "template_noise"];

/// Phases of the engine loop, in order: `commands` (submits, cancels), `admit` (preparing the
/// jobs joining the batch: prompt, template latents, noise), `step`, `retire` (decoding finished
/// jobs), `status` (the view heartbeats report). [`EnginePhase`] indexes it.
pub const ENGINE_PHASES: [&str; 5] = ["commands", "admit", "step", "retire", "status"];

/// A phase of the engine loop, as the index of its label in [`ENGINE_PHASES`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum EnginePhase {
    Commands,
    Admit,
    Step,
    Retire,
    Status,
}

#[derive(Clone)]
pub struct DenoiserMetrics {
    /// Wall time of one engine step over the whole batch.
    pub step_seconds: Histogram,
    /// One job preview on the step loop (`crate::previews`).
    pub preview_seconds: Histogram,
    /// Image rows in each step's batch.
    pub batch_rows: Histogram,
    /// Submit to Done, per job.
    pub job_seconds: Histogram,
    /// Accepted to admitted into the running batch: queueing on this worker, per job.
    pub queue_wait_seconds: Histogram,
    pub jobs_done: IntCounter,
    /// Restarts of the engine actor after a panic of its own (its running jobs failed).
    pub engine_restarts: IntCounter,
    /// Times the denoiser took itself out after jobs failed in a row (`sickness`).
    pub sick_episodes: IntCounter,
    /// 1 while the denoiser takes itself out (`sickness`), else 0.
    pub sick: IntGauge,
    /// Memory of the device it computes on, by state (`used`, `free`; `device_memory`).
    pub device_memory_bytes: IntGaugeVec,
    pub queued: IntGauge,
    pub running: IntGauge,
    /// Jobs and submits that failed, by reason.
    pub failures: IntCounterVec,
    /// Image rows stepped, by mode (`mask_aware` with a template cache, `reused`: step caching
    /// reused the last computed step's residual, `full`).
    pub step_rows: IntCounterVec,
    /// Blocks of the steps with mask-aware rows, by how the planner ran them (`full`: over
    /// every token, else the cache format they read: `raw`, `prepared`, `hidden`).
    pub planned_blocks: IntCounterVec,
    /// Time a step's compute waited for the cache loader, per step with cached rows.
    pub load_wait_seconds: Histogram,
    /// Template caches looked up in the local tier, by result (`hit`, `miss`: fetched from the
    /// cachestore, `unavailable`: neither; the edit ran in full compute).
    pub local_cache_lookups: IntCounterVec,
    pub local_cache_bytes: IntGauge,
    /// Whole template caches read from the cachestore into the local tier.
    pub template_fetch_seconds: Histogram,
    /// Capture broadcasts of other denoisers, by what this one did with them.
    pub capture_warmups: IntCounterVec,
    /// Templates whose cache an edit found gone from every tier, captured again here, by
    /// outcome (`labels::RecaptureOutcome`).
    pub recaptures: IntCounterVec,
    pub template_pixels_lookups: IntCounterVec,
    /// Capture passes (template registration), whole pass.
    pub capture_seconds: Histogram,
    /// Engine thread's busy time by phase of its loop ([`ENGINE_PHASES`]): what the step loop
    /// spends besides the steps themselves (the `step` phase also counts the step's trace spans
    /// and events, which `step_seconds` leaves out).
    pub engine_busy_seconds: CounterVec,
    /// Its series per phase, resolved once (the loop adds to them every iteration).
    engine_busy_by_phase: [Counter; ENGINE_PHASES.len()],
    /// Lookups in the engine's conditioning cache when admitting jobs, by kind
    /// ([`CONDITIONING_KINDS`]) and result (`hit`, `miss`: encoded or drawn on the step loop).
    pub conditioning_lookups: IntCounterVec,
    /// Bytes the conditioning cache holds, by kind.
    pub conditioning_bytes: IntGaugeVec,
    /// Bytes the served model's weights take, by model and component (`transformer`,
    /// `text_encoders`, `vae`).
    pub model_resident_bytes: IntGaugeVec,
    pub lora: crate::lora::metrics::LoraMetrics,
    pub controlnet: ControlNetMetrics,
    pub elastic: crate::ranks::metrics::ElasticMetrics,
}

impl DenoiserMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let preview_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_preview_duration_seconds",
                "One job preview (latents projected to RGB) on the step loop",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
            ]),
        )?;
        registry.register(Box::new(preview_seconds.clone()))?;
        let step_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_step_duration_seconds",
                "One batched denoising step",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
        )?;
        let batch_rows = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_batch_rows",
                "Images denoised together in one step",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
        )?;
        let job_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_job_duration_seconds",
                "Submit to finished outputs, per job",
            )
            .buckets(LATENCY_BUCKETS_SECONDS.to_vec()),
        )?;
        let queue_wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_queue_wait_seconds",
                "Time a job waited in this denoiser's queue before joining the running batch",
            )
            .buckets(LATENCY_BUCKETS_SECONDS.to_vec()),
        )?;
        let jobs_done = IntCounter::new(
            "diffmesh_denoiser_jobs_done_total",
            "Jobs whose denoising finished",
        )?;
        let engine_restarts = IntCounter::new(
            "diffmesh_denoiser_engine_restarts_total",
            "Restarts of the engine after a panic of its own (its running jobs failed, its queued jobs kept)",
        )?;
        let sick_episodes = IntCounter::new(
            "diffmesh_denoiser_sick_episodes_total",
            "Times the denoiser took itself out (unready, draining) after jobs failed in a row",
        )?;
        let sick = IntGauge::new(
            "diffmesh_denoiser_sick",
            "1 while the denoiser takes itself out (unready, draining) after failing jobs in a row",
        )?;
        let device_memory_bytes = IntGaugeVec::new(
            Opts::new(
                "diffmesh_denoiser_device_memory_bytes",
                "Memory of the device the denoiser computes on (its CUDA device, or the host's \
                 on the CPU), by state: used, free",
            ),
            &["state"],
        )?;
        let queued = IntGauge::new(
            "diffmesh_denoiser_queued_jobs",
            "Jobs waiting for a batch slot",
        )?;
        let running = IntGauge::new(
            "diffmesh_denoiser_running_jobs",
            "Jobs in the running batch",
        )?;
        let failures = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_failures_total",
                "Denoiser failures by reason",
            ),
            &["reason"],
        )?;
        let step_rows = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_step_rows_total",
                "Image rows stepped, by mode (mask_aware, reused or full)",
            ),
            &["mode"],
        )?;
        let planned_blocks = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_planned_blocks_total",
                "Blocks of mask-aware steps, by how the planner ran them (full or the cache format)",
            ),
            &["choice"],
        )?;
        let load_wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_cache_load_wait_seconds",
                "Time a mask-aware step waited for its cache blocks",
            )
            .buckets(vec![0.0, 0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0]),
        )?;
        let local_cache_lookups = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_local_cache_lookups_total",
                "Template cache lookups in the denoiser's local tier, by result",
            ),
            &["result"],
        )?;
        for result in ["hit", "miss", "unavailable"] {
            local_cache_lookups.with_label_values(&[result]);
        }
        let local_cache_bytes = IntGauge::new(
            "diffmesh_denoiser_local_cache_bytes",
            "Bytes of template caches held in the local tier",
        )?;
        let template_fetch_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_template_fetch_duration_seconds",
                "Whole template caches read from the cachestore into the local tier \
                 (an edit's miss or a capture warm-up)",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
        )?;
        let recaptures = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_template_recaptures_total",
                "Templates whose cache an edit found gone from every tier (evicted from the \
                 cluster tier), captured again by this denoiser, by outcome",
            ),
            &["outcome"],
        )?;
        for outcome in crate::labels::RecaptureOutcome::ALL {
            recaptures.with_label_values(&[outcome.as_str()]);
        }
        let capture_warmups = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_capture_warmups_total",
                "Template captures announced by other denoisers (broadcast, or replayed at \
                 start), by what this one did (loaded: fetched into the local tier ahead of \
                 its edits)",
            ),
            &["outcome"],
        )?;
        for outcome in crate::labels::WarmOutcome::ALL {
            capture_warmups.with_label_values(&[outcome.as_str()]);
        }
        let template_pixels_lookups = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_template_pixels_lookups_total",
                "Reads of registered templates' pixels, by result (hit: held in memory)",
            ),
            &["result"],
        )?;
        let capture_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_capture_duration_seconds",
                "Template capture passes",
            )
            .buckets(LATENCY_BUCKETS_SECONDS.to_vec()),
        )?;
        let engine_busy_seconds = CounterVec::new(
            Opts::new(
                "diffmesh_denoiser_engine_busy_seconds_total",
                "Engine thread busy time by loop phase (commands, admit, step, retire, status)",
            ),
            &["phase"],
        )?;
        let engine_busy_by_phase =
            ENGINE_PHASES.map(|p| engine_busy_seconds.with_label_values(&[p]));
        let conditioning_lookups = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_conditioning_cache_lookups_total",
                "Prompt embeddings, template latents and template noise looked up when admitting \
                 a job, by kind and result (miss: computed on the step loop)",
            ),
            &["kind", "result"],
        )?;
        let conditioning_bytes = IntGaugeVec::new(
            Opts::new(
                "diffmesh_denoiser_conditioning_cache_bytes",
                "Bytes held in the engine's conditioning cache, by kind",
            ),
            &["kind"],
        )?;
        for kind in CONDITIONING_KINDS {
            conditioning_bytes.with_label_values(&[kind]);
            for result in ["hit", "miss"] {
                conditioning_lookups.with_label_values(&[kind, result]);
            }
        }
        let model_resident_bytes = IntGaugeVec::new(
            Opts::new(
                "diffmesh_denoiser_model_resident_bytes",
                "Bytes the served model's weights take, by model and component",
            ),
            &["model", "component"],
        )?;
        registry.register(Box::new(model_resident_bytes.clone()))?;
        registry.register(Box::new(conditioning_lookups.clone()))?;
        registry.register(Box::new(conditioning_bytes.clone()))?;
        registry.register(Box::new(engine_busy_seconds.clone()))?;
        registry.register(Box::new(step_rows.clone()))?;
        registry.register(Box::new(planned_blocks.clone()))?;
        registry.register(Box::new(load_wait_seconds.clone()))?;
        registry.register(Box::new(local_cache_lookups.clone()))?;
        registry.register(Box::new(local_cache_bytes.clone()))?;
        registry.register(Box::new(capture_warmups.clone()))?;
        registry.register(Box::new(recaptures.clone()))?;
        registry.register(Box::new(template_fetch_seconds.clone()))?;
        registry.register(Box::new(template_pixels_lookups.clone()))?;
        registry.register(Box::new(capture_seconds.clone()))?;
        registry.register(Box::new(step_seconds.clone()))?;
        registry.register(Box::new(batch_rows.clone()))?;
        registry.register(Box::new(job_seconds.clone()))?;
        registry.register(Box::new(queue_wait_seconds.clone()))?;
        registry.register(Box::new(jobs_done.clone()))?;
        registry.register(Box::new(engine_restarts.clone()))?;
        registry.register(Box::new(sick_episodes.clone()))?;
        registry.register(Box::new(device_memory_bytes.clone()))?;
        registry.register(Box::new(sick.clone()))?;
        registry.register(Box::new(queued.clone()))?;
        registry.register(Box::new(running.clone()))?;
        registry.register(Box::new(failures.clone()))?;
        Ok(Self {
            step_seconds,
            preview_seconds,
            batch_rows,
            job_seconds,
            queue_wait_seconds,
            jobs_done,
            engine_restarts,
            sick_episodes,
            sick,
            device_memory_bytes,
            queued,
            running,
            failures,
            step_rows,
            planned_blocks,
            load_wait_seconds,
            local_cache_lookups,
            local_cache_bytes,
            template_fetch_seconds,
            capture_warmups,
            recaptures,
            template_pixels_lookups,
            capture_seconds,
            engine_busy_seconds,
            engine_busy_by_phase,
            conditioning_lookups,
            conditioning_bytes,
            model_resident_bytes,
            lora: crate::lora::metrics::LoraMetrics::new(registry)?,
            controlnet: ControlNetMetrics::new(registry)?,
            elastic: crate::ranks::metrics::ElasticMetrics::new(registry)?,
        })
    }

    /// Counts the conditioning cache's lookups between two readings of it and sets its bytes.
    pub(crate) fn record_conditioning(
        &self,
        before: ConditioningCounts,
        after: ConditioningCounts,
    ) {
        let kinds: [(ReuseCounts, ReuseCounts); 3] = [
            (before.prompts, after.prompts),
            (before.template_latents, after.template_latents),
            (before.template_noise, after.template_noise),
        ];
        for (kind, (b, a)) in CONDITIONING_KINDS.iter().zip(kinds) {
            for (result, n) in [("hit", a.hits - b.hits), ("miss", a.misses - b.misses)] {
                if n > 0 {
                    self.conditioning_lookups
                        .with_label_values(&[kind, result])
                        .inc_by(n);
                }
            }
            self.conditioning_bytes
                .with_label_values(&[kind])
                .set(a.bytes as i64);
        }
    }
}

/// Adds the time since the last lap to the engine's busy time of the named phase.
pub(crate) struct PhaseClock {
    last: Instant,
}

impl PhaseClock {
    pub(crate) fn new() -> Self {
        Self {
            last: Instant::now(),
        }
    }

    pub(crate) fn lap(&mut self, metrics: Option<&DenoiserMetrics>, phase: EnginePhase) {
        if let Some(m) = metrics {
            let now = Instant::now();
            m.engine_busy_by_phase[phase as usize].inc_by((now - self.last).as_secs_f64());
            self.last = now;
        }
    }
}

/// ControlNet metrics of the denoiser.
#[derive(Clone)]
pub struct ControlNetMetrics {
    /// ControlNets looked up for a steered step, by outcome (`hit`: loaded already, `loaded`).
    pub lookups: IntCounterVec,
    /// One ControlNet forward (one request's residuals for one step), loading included.
    pub seconds: Histogram,
    /// Steered rows' steps by where their residuals came from with `--controlnet-remote`:
    /// `remote` (a ControlNet worker), `fallback_local` (computed here after a worker failed
    /// or none came yet), `failed` (neither: the job fails).
    pub remote: IntCounterVec,
    /// The engine thread's wait for ControlNet workers' residuals, per step.
    pub remote_wait_seconds: Histogram,
    /// Per ControlNet, what one steered request costs the step loop a step (smoothed; the
    /// figure heartbeats give the router).
    pub step_seconds: GaugeVec,
}

impl ControlNetMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let lookups = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_controlnet_lookups_total",
                "ControlNets looked up for a steered step, by outcome (loaded: read from its folder)",
            ),
            &["outcome"],
        )?;
        for outcome in [Lookup::Hit, Lookup::Loaded] {
            lookups.with_label_values(&[outcome.as_str()]);
        }
        let seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_controlnet_duration_seconds",
                "One ControlNet forward for one request's step (loading included)",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
        )?;
        let remote = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_controlnet_remote_total",
                "Steered rows' steps by where their ControlNet residuals came from (remote, fallback_local, failed)",
            ),
            &["outcome"],
        )?;
        for outcome in ["remote", "fallback_local", "failed"] {
            remote.with_label_values(&[outcome]);
        }
        let remote_wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_controlnet_wait_duration_seconds",
                "The engine thread's wait for ControlNet workers' residuals, per step",
            )
            .buckets(vec![
                0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ]),
        )?;
        let step_seconds = GaugeVec::new(
            Opts::new(
                "diffmesh_denoiser_controlnet_step_seconds",
                "Per ControlNet, the step loop's seconds per steered request and step (smoothed; what the router costs)",
            ),
            &["controlnet"],
        )?;
        registry.register(Box::new(step_seconds.clone()))?;
        registry.register(Box::new(lookups.clone()))?;
        registry.register(Box::new(seconds.clone()))?;
        registry.register(Box::new(remote.clone()))?;
        registry.register(Box::new(remote_wait_seconds.clone()))?;
        Ok(Self {
            lookups,
            seconds,
            remote,
            remote_wait_seconds,
            step_seconds,
        })
    }
}
