//! Whole engine steps over batches of mask-aware edits, written into a scheduler profile
//! (`Profile::engine_steps`). The profiler times the transformer blocks alone; a denoiser's step
//! also runs the scheduler, the inpainting blend, the cache loader and the planner, which the
//! cost models then add as an overhead per step and per row (`CostModels::step_overhead`), so
//! the router's forecasts and the simulator predict what a live denoiser takes. It also times
//! the step loop's work per job outside the steps (preparing an admitted edit, decoding a
//! finished one: `Profile::engine_jobs`), which the simulator charges to the steps around it.
//! Edits are prepared as the engine prepares them, reusing its conditioning cache (one
//! template per step count and one prompt, as a template's edits usually are); the bench also
//! times each preparation without the cache and reports both.
//!
//! Each sample is one batch of `b` edits by template (masks drawn from the trace, caches
//! captured by the real engine), stepped by the engine's own [`CachedStepper`] after a warm-up
//! step; the median of the timed steps is kept. A fully masked edit steps in full compute, as
//! the cost models predict it (its cached FLOPs are the full pass's, its cache bytes 0). Wall
//! clock: run it on an idle machine.
use crate::driver::{model_grid, BenchModel};
use crate::report::Report;
use crate::template_caches::BenchTemplates;
use crate::workload::{engine_job, BenchRequest};
use anyhow::{ensure, Context, Result};
use diffmesh_denoiser::cached_step::{CacheSettings, CachedStepper};
use diffmesh_denoiser::model::{step_requests, tensor_to_rgb};
use diffmesh_model::pipeline::conditioning_cache::ConditioningCache;
use diffmesh_model::pipeline::stepper::DenoiseState;
use diffmesh_sched::cost_model::{
    BatchTotals, CostModels, EngineJobWork, EngineStepSample, Profile,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

pub struct EngineStepsOptions {
    pub model: BenchModel,
    pub mask_ratios: Vec<f64>,
    /// Largest batch measured (every size from 1 up).
    pub max_batch: usize,
    /// Denoising steps of each edit (the first is a warm-up, the rest are timed).
    pub steps: u32,
    /// Sweeps over the batch sizes, each with new masks.
    pub rounds: usize,
    pub seed: u64,
    /// The profile (of this machine) that gets the samples.
    pub profile: PathBuf,
}

/// Measure, write the samples into the profile and report the fitted overhead.
pub async fn run(opts: &EngineStepsOptions, report: &mut Report) -> Result<()> {
    ensure!(opts.steps >= 2, "--engine-steps-steps must be at least 2");
    ensure!(opts.rounds >= 1, "--engine-steps-rounds must be at least 1");
    let mut profile = Profile::read(&opts.profile)
        .with_context(|| format!("--engine-steps-profile {}", opts.profile.display()))?;
    let started = Instant::now();
    let templates = BenchTemplates::capture(&opts.model, opts.steps, opts.steps, opts.seed)
        .await
        .context("capturing the template the edits read")?;
    let (samples, job_work, uncached_admit_s) = measure(opts, &templates)?;
    let bare = CostModels::fit(&profile)?;
    for s in samples.iter().take(opts.max_batch) {
        let mut totals = BatchTotals::default();
        for &m in &s.masked {
            totals.add(&bare.shape, m);
        }
        report.say(format!(
            "engine-steps: batch {}: {:.2} ms measured, blocks alone predict {:.2} ms",
            s.masked.len(),
            s.latency_s * 1e3,
            bare.step_latency(&totals) * 1e3
        ));
    }
    report.say(format!(
        "engine-steps: per job, preparing {:.2} ms ({:.2} ms without the conditioning cache), \
         decoding {:.2} ms (medians)",
        job_work.admit_s * 1e3,
        uncached_admit_s * 1e3,
        job_work.retire_s * 1e3
    ));
    report.insert("engine_job_admit_ms", job_work.admit_s * 1e3);
    report.insert("engine_job_admit_uncached_ms", uncached_admit_s * 1e3);
    report.insert("engine_job_retire_ms", job_work.retire_s * 1e3);
    profile.engine_steps = samples;
    profile.engine_jobs = Some(job_work);
    profile.engine_label = format!(
        "measured: whole engine steps of mask-aware edits ({} steps each, batches 1..={}, {} rounds, \
         {} torch threads, wall clock), `cargo xtask bench engine --parts engine-steps` (seed {})",
        opts.steps,
        opts.max_batch,
        opts.rounds,
        diffmesh_model::tch::get_num_threads(),
        opts.seed
    );
    let models = CostModels::fit(&profile)?;
    let overhead = models
        .step_overhead
        .context("the engine steps gave no overhead fit")?;
    profile.write(&opts.profile)?;
    report.say(format!(
        "engine-steps: overhead beyond the blocks {:.3} ms + {:.3} ms/row (R^2 {:.3}, {} samples, \
         {:.0}s); wrote {}",
        overhead.intercept * 1e3,
        overhead.slope * 1e3,
        overhead.r2,
        overhead.samples,
        started.elapsed().as_secs_f64(),
        opts.profile.display()
    ));
    report.insert("engine_step_overhead_ms", overhead.intercept * 1e3);
    report.insert("engine_step_overhead_ms_per_row", overhead.slope * 1e3);
    report.insert("engine_step_overhead_r2", overhead.r2);
    report.insert("engine_step_samples", json!(overhead.samples));
    Ok(())
}

/// Median of the samples (0 for none).
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

/// One step sample per (round, batch size), in that order, the median per-job work of the
/// step loop (preparing a job as the engine admits it, decoding it as the engine retires it)
/// and the median preparation without the conditioning cache.
fn measure(
    opts: &EngineStepsOptions,
    templates: &BenchTemplates,
) -> Result<(Vec<EngineStepSample>, EngineJobWork, f64)> {
    let model = opts.model.load()?;
    let grid = model_grid(&model);
    let _guard = diffmesh_model::tch::no_grad_guard();
    let pipeline = model.pipeline();
    let mut stepper = CachedStepper::new(CacheSettings::default(), None).context("cache loader")?;
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut samples = Vec::new();
    let (mut admit, mut retire, mut uncached) = (Vec::new(), Vec::new(), Vec::new());
    let mut conditioning = ConditioningCache::new(
        diffmesh_denoiser::engine::EngineConfig::default().conditioning_cache_bytes,
    );
    for round in 0..opts.rounds {
        for b in 1..=opts.max_batch {
            let (mut states, mut caches, mut masked) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..b {
                let req = BenchRequest {
                    id: format!("engine-steps-{round}-{b}-{i}"),
                    unit_arrival: 0.0,
                    steps: opts.steps,
                    seed: rng.random(),
                    prompt: "a red circle on the left on a blue background".into(),
                    mask_ratio: Some(opts.mask_ratios[rng.random_range(0..opts.mask_ratios.len())]),
                };
                let job = templates.attach(engine_job(&req, grid));
                let cache = job
                    .template
                    .as_ref()
                    .and_then(|s| s.get().cloned().flatten());
                // Both timings include building the requests, as the engine's admission does.
                let t = Instant::now();
                for r in step_requests(&job.job, job.edit.as_ref(), &model)? {
                    DenoiseState::new(&pipeline, &r)?;
                }
                uncached.push(t.elapsed().as_secs_f64());
                let template = job.job.inputs.template_id.as_deref();
                let t = Instant::now();
                for r in step_requests(&job.job, job.edit.as_ref(), &model)? {
                    states.push(DenoiseState::new_cached(
                        &pipeline,
                        &r,
                        &mut conditioning,
                        template,
                    )?);
                    caches.push(cache.clone());
                    masked.push(job.job.inputs.masked_tokens);
                }
                admit.push(t.elapsed().as_secs_f64());
            }
            let mut refs: Vec<&mut DenoiseState> = states.iter_mut().collect();
            stepper.step(&pipeline, &mut refs, &caches)?;
            let mut times = Vec::with_capacity(opts.steps as usize - 1);
            for _ in 1..opts.steps {
                let t = Instant::now();
                stepper.step(&pipeline, &mut refs, &caches)?;
                times.push(t.elapsed().as_secs_f64());
            }
            samples.push(EngineStepSample {
                masked,
                latency_s: median(times),
            });
            // Every edit has run all its steps: decode them as the engine's retire does.
            for state in &states {
                let t = Instant::now();
                tensor_to_rgb(&state.decode(&pipeline)?)?;
                retire.push(t.elapsed().as_secs_f64());
            }
        }
    }
    let work = EngineJobWork {
        admit_s: median(admit),
        retire_s: median(retire),
    };
    Ok((samples, work, median(uncached)))
}
