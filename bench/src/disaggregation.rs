//! Pre/post-processing inline in the step loop (the strawman of FlashPS Fig. 10-Top) against
//! disaggregated onto codec worker threads (Fig. 10-Bottom), on the same seeded arrivals.
//!
//! Inline: the engine thread itself runs each request's pre-processing at the first step
//! boundary after it arrives ([`EngineHandle::run_inline`]) and its post-processing as it
//! retires (in the engine's [`EventTap`], on its `Finished` event), so every running request
//! waits for it. Disaggregated: worker threads do that work and the engine only steps. An
//! interruption of a request is one pause of the step loop for pre/post work while the request
//! was in the running batch (admitted, not yet retired), tracked from the engine's own events.
//!
//! [`EngineHandle::run_inline`]: diffmesh_denoiser::engine::EngineHandle::run_inline
use crate::codec_work::{postprocess, preprocess, uploads, Uploads};
use crate::driver::{
    continuous_capacity_rps, BenchEngine, BenchModel, Pooled, RunTimes, StepStats,
};
use crate::report::{Latencies, Report};
use crate::workload::{requests, BenchRequest, ModelGrid, WorkloadSpec};
use anyhow::{anyhow, bail, Context, Result};
use diffmesh_denoiser::engine::{EngineConfig, EngineEvent, EngineJob, EventTap, InlineWork};
use diffmesh_shared::wire::messages::DenoiseJob;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::Span;

#[derive(Debug, Clone)]
pub struct DisaggregationOptions {
    pub model: BenchModel,
    pub workload: WorkloadSpec,
    pub mask_ratios: Vec<f64>,
    /// Arrival rate as a fraction of the engine's full-batch denoising capacity.
    pub utilisation: f64,
    pub max_batch: usize,
    /// Side of the uploaded PNGs (pixels).
    pub image_size: u32,
    /// Distinct template images the edits use.
    pub templates: usize,
    /// Codec worker threads of the disaggregated mode.
    pub codec_workers: usize,
    /// Times both modes run (new arrivals each round; figures pooled per mode).
    pub rounds: usize,
}

/// What the pre/post work of a run recorded.
#[derive(Default)]
struct Shared {
    /// Jobs in the engine's running batch (inline mode, from its events).
    running: HashSet<String>,
    done_s: HashMap<String, f64>,
    interruptions: HashMap<String, u32>,
    pre_s: Vec<f64>,
    post_s: Vec<f64>,
    errors: Vec<String>,
}

type SharedRef = Arc<Mutex<Shared>>;

fn with<T>(shared: &SharedRef, f: impl FnOnce(&mut Shared) -> T) -> T {
    // A poisoned lock only means another worker panicked mid-update; the data is still usable.
    let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
    f(&mut g)
}

/// One request's pre-processing, timed; errors are collected (the run fails at its end).
fn timed_pre(
    req: &BenchRequest,
    up: &Uploads,
    grid: ModelGrid,
    shared: &SharedRef,
) -> Option<EngineJob> {
    let t = Instant::now();
    let job = preprocess(req, up, grid);
    with(shared, |s| {
        s.pre_s.push(t.elapsed().as_secs_f64());
        match job {
            Ok(j) => Some(j),
            Err(e) => {
                s.errors.push(format!("pre-processing {}: {e:#}", req.id));
                None
            }
        }
    })
}

/// One finished job's post-processing, timed; the request is done when it ends.
fn timed_post(
    job: &DenoiseJob,
    images: &[Vec<u8>],
    up: &Uploads,
    start: Instant,
    shared: &SharedRef,
) {
    let t = Instant::now();
    let result: Result<Vec<Vec<u8>>> = images
        .iter()
        .map(|image| postprocess(job, up, image.clone()))
        .collect();
    let now = start.elapsed().as_secs_f64();
    with(shared, |s| {
        s.post_s.push(t.elapsed().as_secs_f64());
        match result {
            Ok(_) => {
                s.done_s.insert(job.job_id.clone(), now);
            }
            Err(e) => s
                .errors
                .push(format!("post-processing {}: {e:#}", job.job_id)),
        }
    });
}

/// Count a pause of the step loop against every request in the running batch now.
fn note_pause(shared: &SharedRef) {
    with(shared, |s| {
        for id in &s.running {
            *s.interruptions.entry(id.clone()).or_default() += 1;
        }
    });
}

/// The inline mode's tap: tracks the running batch and post-processes each job as it retires.
fn inline_tap(ups: HashMap<String, Arc<Uploads>>, start: Instant, shared: SharedRef) -> EventTap {
    Box::new(move |event| match event {
        EngineEvent::Started { job_id } => {
            with(&shared, |s| s.running.insert(job_id.clone()));
        }
        EngineEvent::Finished { job, images, .. } => {
            with(&shared, |s| s.running.remove(&job.job_id));
            // The warm-up job has no uploads and is not timed.
            if let Some(up) = ups.get(&job.job_id) {
                note_pause(&shared);
                timed_post(job, images, up, start, &shared);
            }
        }
        EngineEvent::Failed { job, .. } => {
            with(&shared, |s| s.running.remove(&job.job_id));
        }
        EngineEvent::Cancelled { job_id } => {
            with(&shared, |s| s.running.remove(job_id));
        }
        _ => {}
    })
}

struct Run<'a> {
    reqs: &'a [BenchRequest],
    ups: &'a [Arc<Uploads>],
    rate: f64,
}

impl Run<'_> {
    fn arrivals(&self) -> Vec<(f64, BenchRequest, Arc<Uploads>)> {
        self.reqs
            .iter()
            .zip(self.ups)
            .map(|(r, u)| (r.arrival_s(self.rate), r.clone(), u.clone()))
            .collect()
    }
}

async fn inline(engine: &mut BenchEngine, run: &Run<'_>) -> Result<(RunTimes, Shared)> {
    let shared = SharedRef::default();
    let start = engine.mark_start();
    let ups = run
        .reqs
        .iter()
        .map(|r| r.id.clone())
        .zip(run.ups.iter().cloned())
        .collect();
    engine
        .handle
        .set_event_tap(Some(inline_tap(ups, start, shared.clone())))
        .await
        .context("installing the event tap")?;
    let t0 = tokio::time::Instant::from_std(start);
    let grid = engine.grid;
    let arrivals = run.arrivals();
    let (h, sh) = (engine.handle.clone(), shared.clone());
    let submitter = tokio::spawn(async move {
        let mut sent = Vec::new();
        for (at, req, up) in arrivals {
            tokio::time::sleep_until(t0 + Duration::from_secs_f64(at)).await;
            let sh = sh.clone();
            let work: InlineWork = Box::new(move || {
                note_pause(&sh);
                timed_pre(&req, &up, grid, &sh)
            });
            let h = h.clone();
            sent.push(tokio::spawn(async move {
                h.run_inline(work, Span::none()).await
            }));
        }
        for s in sent {
            s.await.context("inline pre task")?.context("inline pre")?;
        }
        anyhow::Ok(())
    });
    // The tap post-processed each job before its Finished event was sent.
    for _ in 0..run.reqs.len() {
        engine.next_finished().await?;
    }
    submitter.await.context("submitter")??;
    engine
        .handle
        .set_event_tap(None)
        .await
        .context("removing the event tap")?;
    finish(engine, run, shared)
}

/// Worker threads taking boxed tasks from one bounded queue.
fn codec_pool(
    workers: usize,
    capacity: usize,
) -> Result<(std_mpsc::SyncSender<Task>, Vec<std::thread::JoinHandle<()>>)> {
    let (tx, rx) = std_mpsc::sync_channel::<Task>(capacity);
    let rx = Arc::new(Mutex::new(rx));
    let handles = (0..workers.max(1))
        .map(|i| {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("bench-codec-{i}"))
                .spawn(move || loop {
                    let task = match rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    match task {
                        Ok(task) => task(),
                        Err(_) => return, // every sender dropped: the run is over
                    }
                })
        })
        .collect::<std::io::Result<_>>()
        .context("starting codec workers")?;
    Ok((tx, handles))
}

type Task = Box<dyn FnOnce() + Send>;

async fn disaggregated(
    engine: &mut BenchEngine,
    run: &Run<'_>,
    workers: usize,
) -> Result<(RunTimes, Shared)> {
    let shared = SharedRef::default();
    let n = run.reqs.len();
    let (pool, threads) = codec_pool(workers, 2 * n + 1)?;
    let start = engine.mark_start();
    let t0 = tokio::time::Instant::from_std(start);
    let grid = engine.grid;
    // Prepared jobs go from the codec workers to the engine through this task.
    let (jobs_tx, mut jobs_rx) = tokio::sync::mpsc::channel::<EngineJob>(n.max(1));
    let h = engine.handle.clone();
    let forwarder = tokio::spawn(async move {
        let mut sent = Vec::new();
        while let Some(job) = jobs_rx.recv().await {
            let h = h.clone();
            sent.push(tokio::spawn(
                async move { h.submit(job, Span::none()).await },
            ));
        }
        for s in sent {
            s.await.context("submit task")?.context("submit")?;
        }
        anyhow::Ok(())
    });
    let arrivals = run.arrivals();
    let (p, sh) = (pool.clone(), shared.clone());
    let submitter = tokio::spawn(async move {
        for (at, req, up) in arrivals {
            tokio::time::sleep_until(t0 + Duration::from_secs_f64(at)).await;
            let (sh, tx) = (sh.clone(), jobs_tx.clone());
            let task: Task = Box::new(move || {
                if let Some(job) = timed_pre(&req, &up, grid, &sh) {
                    let _ = tx.blocking_send(job);
                }
            });
            p.send(task).map_err(|_| anyhow!("codec pool closed"))?;
        }
        anyhow::Ok(())
    });
    let by_id: HashMap<&str, &Arc<Uploads>> = run
        .reqs
        .iter()
        .map(|r| r.id.as_str())
        .zip(run.ups)
        .collect();
    for _ in 0..n {
        let f = engine.next_finished().await?;
        let up = (*by_id.get(f.job.job_id.as_str()).context("unknown job")?).clone();
        let sh = shared.clone();
        pool.send(Box::new(move || {
            timed_post(&f.job, &f.images, &up, start, &sh)
        }))
        .map_err(|_| anyhow!("codec pool closed"))?;
    }
    submitter.await.context("submitter")??;
    forwarder.await.context("forwarder")??;
    drop(pool);
    tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await
    .context("joining codec workers")?;
    finish(engine, run, shared)
}

fn finish(engine: &BenchEngine, run: &Run<'_>, shared: SharedRef) -> Result<(RunTimes, Shared)> {
    let shared = std::mem::take(&mut *shared.lock().unwrap_or_else(|e| e.into_inner()));
    if let Some(e) = shared.errors.first() {
        bail!("{} codec errors, first: {e}", shared.errors.len());
    }
    let times = RunTimes {
        arrival_s: run
            .reqs
            .iter()
            .map(|r| (r.id.clone(), r.arrival_s(run.rate)))
            .collect(),
        started_s: engine.started_s.clone(),
        done_s: shared.done_s.clone(),
    };
    Ok((times, shared))
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// One mode's run: a fresh engine, one warm-up job, then the timed requests.
async fn run_mode(
    opts: &DisaggregationOptions,
    name: &str,
    run: &Run<'_>,
) -> Result<(RunTimes, Shared, StepStats)> {
    let config = EngineConfig {
        max_batch: opts.max_batch,
        ..EngineConfig::default()
    };
    let mut engine = BenchEngine::start(&opts.model, config)?;
    let mut warm = crate::workload::engine_job(&run.reqs[0], engine.grid);
    warm.job.job_id = "warm-up".into();
    engine.submit(warm).await?;
    engine.next_finished().await?;
    let (times, shared) = match name {
        "inline" => inline(&mut engine, run).await,
        _ => disaggregated(&mut engine, run, opts.codec_workers).await,
    }
    .with_context(|| format!("{name} run"))?;
    let stats = engine.step_stats();
    engine.stop().await;
    Ok((times, shared, stats))
}

/// A mode's codec figures pooled over rounds.
#[derive(Default)]
struct CodecPooled {
    interruptions: Vec<f64>,
    pre_s: Vec<f64>,
    post_s: Vec<f64>,
}

/// Run both modes on the same arrivals, `opts.rounds` times (new arrivals each round, modes
/// alternating); `step_s` is the engine's step time by batch size.
pub async fn run(opts: &DisaggregationOptions, step_s: &[f64], report: &mut Report) -> Result<()> {
    let spec = &opts.workload;
    let capacity = continuous_capacity_rps(step_s, spec.mean_steps());
    let rate = opts.utilisation * capacity;
    report.say(format!(
        "disaggregation: {} rounds of {} requests, {}x{} PNG uploads ({} templates), {} codec \
         worker(s); arrivals {rate:.2} req/s = {:.0}% of the engine's capacity {capacity:.2} \
         req/s",
        opts.rounds,
        spec.requests,
        opts.image_size,
        opts.image_size,
        opts.templates,
        opts.codec_workers,
        opts.utilisation * 100.0
    ));
    let names = ["inline", "disaggregated"];
    let mut pooled = vec![Pooled::default(); names.len()];
    let mut codec: Vec<CodecPooled> = names.iter().map(|_| CodecPooled::default()).collect();
    for round in 0..opts.rounds.max(1) {
        let round_spec = WorkloadSpec {
            seed: spec.seed + round as u64,
            ..spec.clone()
        };
        let reqs = requests(&round_spec, &opts.mask_ratios)?;
        let ups: Vec<Arc<Uploads>> =
            uploads(&reqs, opts.image_size, opts.templates, round_spec.seed)?
                .into_iter()
                .map(Arc::new)
                .collect();
        let run = Run {
            reqs: &reqs,
            ups: &ups,
            rate,
        };
        for ((name, pool), c) in names.iter().zip(pooled.iter_mut()).zip(codec.iter_mut()) {
            let (times, shared, stats) = run_mode(opts, name, &run).await?;
            pool.add(&times, stats)?;
            c.interruptions.extend(
                reqs.iter()
                    .map(|r| f64::from(shared.interruptions.get(&r.id).copied().unwrap_or(0))),
            );
            c.pre_s.extend(&shared.pre_s);
            c.post_s.extend(&shared.post_s);
        }
    }
    let mut modes = serde_json::Map::new();
    let mut p95 = Vec::new();
    for ((name, pool), c) in names.iter().zip(&pooled).zip(&codec) {
        let lat = Latencies::of(&pool.latencies).context("no requests")?;
        let ints = Latencies::of(&c.interruptions).context("no requests")?;
        let (pre_ms, post_ms) = (mean(&c.pre_s) * 1e3, mean(&c.post_s) * 1e3);
        report.say(format!(
            "  {name:<13} {}; interruptions per request mean {:.2}, p50 {:.0}, p95 {:.0}, max \
             {:.0}; pre {pre_ms:.1} ms, post {post_ms:.1} ms per request; {:.1} ms per \
             row-step, stepping {:.0}% of the time",
            lat.line(),
            ints.mean_s,
            ints.p50_s,
            ints.p95_s,
            ints.max_s,
            pool.stats.ms_per_row(),
            pool.busy() * 100.0
        ));
        pool.note_saturation(name, report);
        report.insert(&format!("{name}_p50_s"), lat.p50_s);
        report.insert(&format!("{name}_p95_s"), lat.p95_s);
        report.insert(&format!("interruptions_per_request_{name}"), ints.mean_s);
        let mut m = lat.to_json();
        m["interruptions_mean"] = json!(ints.mean_s);
        m["interruptions_p50"] = json!(ints.p50_s);
        m["interruptions_p95"] = json!(ints.p95_s);
        m["interruptions_max"] = json!(ints.max_s);
        m["pre_ms_mean"] = json!(pre_ms);
        m["post_ms_mean"] = json!(post_ms);
        m["mean_running"] = json!(pool.mean_running());
        m["ms_per_row_step"] = json!(pool.stats.ms_per_row());
        m["engine_busy"] = json!(pool.busy());
        modes.insert(name.to_string(), m);
        p95.push(lat.p95_s);
    }
    let ratio = p95[1] / p95[0];
    // The engine thread's load in the inline mode: denoising plus every request's codec work.
    let inline_codec_s = mean(&codec[0].pre_s) + mean(&codec[0].post_s);
    let inline_utilisation = opts.utilisation + rate * inline_codec_s;
    report.say(format!(
        "  disaggregated_over_inline_p95 = {ratio:.3} (FlashPS: 0.71); engine-thread load \
         inline ~{:.0}%",
        inline_utilisation * 100.0
    ));
    report.insert("disaggregated_over_inline_p95", ratio);
    report.insert(
        "disaggregation",
        json!({
            "rounds": opts.rounds,
            "requests_per_round": spec.requests,
            "image_size": opts.image_size,
            "templates": opts.templates,
            "codec_workers": opts.codec_workers,
            "max_batch": opts.max_batch,
            "capacity_rps": capacity,
            "arrival_rps": rate,
            "utilisation": opts.utilisation,
            "utilisation_inline_est": inline_utilisation,
            "modes": modes,
        }),
    );
    Ok(())
}
