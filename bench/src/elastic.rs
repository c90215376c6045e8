//! `cargo xtask bench engine --parts elastic`: a live run of a denoiser engine on elastic
//! ranks (issue 47) against `diffmesh-sim --elastic` on the same arrivals.
//!
//! The engine starts its ranks as `diffmesh-denoiser --ranks R` does (replicas, step costs
//! measured with every rank busy); the requests are drawn exactly as the simulator draws
//! them (`diffmesh_sched::elastic::workload`: Poisson arrivals at a fraction of the ranks'
//! SP1 capacity, classes by weight, deadlines from each class's SP1 service time), from that
//! measured table, and replayed into the engine at their arrival times. The simulator then
//! runs the same requests with the same policy and table. Reported: both runs' SLO
//! attainment, mean latency, p95 and throughput, the live steps by degree and degree
//! changes, and the p95 gap.
use crate::driver::BenchModel;
use crate::report::Report;
use anyhow::{ensure, Context, Result};
use diffmesh_denoiser::engine::{spawn_engine, EngineConfig, EngineEvent, EngineJob};
use diffmesh_denoiser::metrics::DenoiserMetrics;
use diffmesh_denoiser::ranks::ElasticSettings;
use diffmesh_sched::elastic::cost::{image_classes, MeasuredTable, StepCost};
use diffmesh_sched::elastic::policies::by_name;
use diffmesh_sched::elastic::{simulate, workload, Outcome, Request, WorkloadSpec};
use diffmesh_shared::stores::job::now_ms;
use serde_json::json;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tracing::Span;

#[derive(Debug, Clone)]
pub struct ElasticOptions {
    pub model: BenchModel,
    pub ranks: usize,
    pub policy: String,
    /// Square image sides of the classes (pixels).
    pub sizes: Vec<u32>,
    /// Denoising steps of every request.
    pub steps: u32,
    /// Weight of each class.
    pub mix: Vec<f64>,
    pub load: f64,
    pub slo_scale: f64,
    /// Seconds of arrivals.
    pub duration: f64,
    pub seed: u64,
    pub threads_per_rank: i32,
    /// Where to write the measured table (for `diffmesh-sim --elastic --cost FILE`).
    pub cost_out: Option<PathBuf>,
}

pub async fn run(opts: &ElasticOptions, report: &mut Report) -> Result<()> {
    ensure!(opts.ranks >= 2, "--elastic-ranks must be at least 2");
    ensure!(
        opts.sizes.len() == opts.mix.len() && !opts.sizes.is_empty(),
        "--elastic-sizes and --elastic-mix need one entry per class"
    );
    let mut model = opts.model.load()?;
    let settings = ElasticSettings {
        ranks: opts.ranks,
        policy: opts.policy.clone(),
        sizes: opts.sizes.clone(),
        threads_per_rank: opts.threads_per_rank,
        // More rounds than a denoiser's start takes: the comparison is only as good as the
        // table both runs use.
        calibration_repeats: 8,
        table: None,
    };
    let dir = opts.model.dir.clone();
    let model = tokio::task::spawn_blocking(move || {
        model
            .start_ranks(&dir, &settings)
            .map(|()| model)
            .map_err(anyhow::Error::msg)
    })
    .await??;
    let ranks = model.ranks.as_ref().context("the ranks did not start")?;
    let mut table: MeasuredTable = ranks.table.clone();
    for class in &mut table.classes {
        class.steps = opts.steps;
    }
    if let Some(path) = &opts.cost_out {
        std::fs::write(path, serde_json::to_string_pretty(&table)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    report.say(format!(
        "elastic: measured table (every rank busy): {}",
        serde_json::to_string(&table)?
    ));
    let (cost, mut classes) = StepCost::measured(table.clone());
    // GF-DiT's deadline factors of its small, medium and large classes, in size order.
    let factors = image_classes().map(|c| c.slo_factor);
    for (class, factor) in classes
        .iter_mut()
        .zip(factors.iter().chain(std::iter::repeat(&2.0)))
    {
        class.slo_factor = *factor;
    }
    let requests = workload(&WorkloadSpec {
        classes: &classes,
        cost: &cost,
        mix: &opts.mix,
        ranks: opts.ranks as u32,
        load: opts.load,
        slo_scale: opts.slo_scale,
        duration: opts.duration,
        seed: opts.seed,
    });
    ensure!(
        !requests.is_empty(),
        "the workload drew no request: raise --elastic-duration"
    );
    let mut policy = by_name(&opts.policy).context("--elastic-policy: unknown policy")?;
    let simulated = simulate(
        &requests,
        &classes,
        &cost,
        opts.ranks as u32,
        policy.as_mut(),
    );

    let registry = prometheus::Registry::new();
    let metrics = DenoiserMetrics::new(&registry)?;
    let config = EngineConfig {
        max_batch: 4096,
        max_queue: 4096,
        ..Default::default()
    };
    let (tx, mut events) = tokio::sync::mpsc::channel(4096);
    let (engine, _drained) = spawn_engine(model, config, 4096, tx, Some(metrics.clone()))?;
    let live = replay(&engine, &mut events, &requests, opts).await?;
    let live = outcome(&opts.policy, &requests, &live);
    let gap = (simulated.p95 - live.p95).abs() / live.p95.max(1e-9);
    let degrees: serde_json::Map<String, serde_json::Value> = (0..8)
        .map(|i| (1u32 << i).to_string())
        .filter_map(|d| {
            let n = metrics.elastic.steps.with_label_values(&[&d]).get();
            (n > 0).then(|| (d, json!(n)))
        })
        .collect();
    let changes = metrics.elastic.degree_changes.get();
    let step_ms: serde_json::Map<String, serde_json::Value> = degrees
        .keys()
        .map(|d| {
            let h = metrics.elastic.step_seconds.with_label_values(&[d]);
            let mean = h.get_sample_sum() / (h.get_sample_count().max(1) as f64);
            (d.clone(), json!(mean * 1000.0))
        })
        .collect();
    report.say(format!(
        "elastic live: mean step ms by degree (every class) {step_ms:?}"
    ));
    report.say(format!(
        "elastic live ({} requests, {} ranks, {}): SLO {:.3}, mean {:.3} s, p95 {:.3} s, {:.2} req/s; steps by degree {degrees:?}, {changes} degree changes",
        requests.len(), opts.ranks, opts.policy, live.slo_attainment, live.mean_latency, live.p95, live.throughput
    ));
    report.say(format!(
        "elastic simulated on the same arrivals: SLO {:.3}, mean {:.3} s, p95 {:.3} s, {:.2} req/s; p95 gap {:.1}%; steps by degree {:?}, mean step ms {:?}",
        simulated.slo_attainment, simulated.mean_latency, simulated.p95, simulated.throughput, gap * 100.0,
        simulated.steps_by_degree, simulated.mean_step_s_by_degree.iter().map(|s| s * 1000.0).collect::<Vec<_>>()
    ));
    report.insert(
        "elastic",
        json!({
            "ranks": opts.ranks,
            "policy": opts.policy,
            "load": opts.load,
            "slo_scale": opts.slo_scale,
            "requests": requests.len(),
            "table": table,
            "live": live,
            "live_steps_by_degree": degrees,
            "live_degree_changes": changes,
            "live_mean_step_ms_by_degree": step_ms,
            "simulated": simulated,
            "p95_gap": gap,
        }),
    );
    Ok(())
}

/// Submit each request at its arrival time; the seconds from submit to its image, by index.
async fn replay(
    engine: &diffmesh_denoiser::engine::EngineHandle,
    events: &mut tokio::sync::mpsc::Receiver<EngineEvent>,
    requests: &[Request],
    opts: &ElasticOptions,
) -> Result<HashMap<usize, f64>> {
    let start = Instant::now();
    let mut submitted: HashMap<String, (usize, Instant)> = HashMap::new();
    let mut latencies = HashMap::new();
    let mut next = 0;
    while latencies.len() < requests.len() {
        if let Some(r) = requests.get(next) {
            let due = start + Duration::from_secs_f64(r.arrival);
            let wait = due.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                let side = opts.sizes[r.class];
                let mut job = diffmesh_shared::testing::generation_job(
                    &format!("r{next}"),
                    "a red circle on a blue square",
                    next as u64,
                    opts.steps,
                );
                (job.params.width, job.params.height) = (side, side);
                (job.inputs.model_width, job.inputs.model_height) = (side, side);
                job.params.deadline_unix_ms =
                    Some(now_ms() + ((r.deadline - r.arrival) * 1000.0) as u64);
                engine
                    .submit(EngineJob::new(job, None), Span::none())
                    .await
                    .map_err(|e| anyhow::anyhow!("submit r{next}: {e}"))?;
                submitted.insert(format!("r{next}"), (next, Instant::now()));
                next += 1;
                continue;
            }
            match tokio::time::timeout(wait, events.recv()).await {
                Ok(Some(event)) => note(event, &submitted, &mut latencies)?,
                Ok(None) => anyhow::bail!("the engine stopped"),
                Err(_) => {}
            }
        } else {
            let event = tokio::time::timeout(Duration::from_secs(300), events.recv())
                .await
                .context("the engine stalled")?
                .context("the engine stopped")?;
            note(event, &submitted, &mut latencies)?;
        }
    }
    Ok(latencies)
}

fn note(
    event: EngineEvent,
    submitted: &HashMap<String, (usize, Instant)>,
    latencies: &mut HashMap<usize, f64>,
) -> Result<()> {
    match event {
        EngineEvent::Finished { job, .. } => {
            let (i, at) = submitted[&job.job_id];
            latencies.insert(i, at.elapsed().as_secs_f64());
        }
        EngineEvent::Failed { job, error, .. } => anyhow::bail!("{} failed: {error}", job.job_id),
        _ => {}
    }
    Ok(())
}

/// The live run in the simulator's terms (its percentile, attainment and throughput).
fn outcome(policy: &str, requests: &[Request], latencies: &HashMap<usize, f64>) -> Outcome {
    let done_at: Vec<Option<f64>> = (0..requests.len())
        .map(|i| latencies.get(&i).map(|l| requests[i].arrival + l))
        .collect();
    Outcome::of_completions(policy.into(), requests, &done_at)
}
