//! diffmesh-sim: replay a workload through a placement policy in the discrete-event simulator;
//! with `--elastic`, GF-DiT's elastic parallelism instead (`diffmesh_sched::elastic::cli`).
//!
//! Human-readable lines first; the last line is one JSON object with the run's measures.
use anyhow::{bail, ensure, Context};
use clap::Parser;
use diffmesh_sched::batching::BatchLimits;
use diffmesh_sched::cost_model::CostModels;
use diffmesh_sched::policy::{policy_by_name, ActiveRequest, Footprint, RequestInfo, WorkerState};
use diffmesh_sched::queue_order::QueueOrder;
use diffmesh_sched::sim::{
    simulate_with_latencies, workload, SharedCpu, SimConfig, SimControlNets,
};
use diffmesh_sched::synthetic;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::PathBuf;
use std::time::Instant;

/// Simulate a diffmesh cluster under a placement policy.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Placement policy: round-robin, request-count, token-count, mask-aware,
    /// mask-aware-marginal, mask-aware-deferring, flashps-greedy.
    #[arg(long, env = "DIFFMESH_SIM_POLICY", default_value = "mask-aware")]
    policy: String,
    /// Mask-ratio file (one ratio in [0, 1] a line) to draw Poisson requests' masks from.
    #[arg(long, env = "DIFFMESH_SIM_MASK_RATIOS")]
    mask_ratios: Option<PathBuf>,
    /// Poisson arrival rate (requests/s).
    #[arg(long, env = "DIFFMESH_SIM_RPS", conflicts_with_all = ["load", "trace"])]
    rps: Option<f64>,
    /// Arrival rate as a fraction of the estimated cluster capacity.
    #[arg(long, env = "DIFFMESH_SIM_LOAD", conflicts_with = "trace")]
    load: Option<f64>,
    /// Arrival trace instead of Poisson: CSV `arrival_s,mask_ratio[,template_id]`.
    #[arg(long, env = "DIFFMESH_SIM_TRACE")]
    trace: Option<PathBuf>,
    /// Number of workers (one GPU each).
    #[arg(long, env = "DIFFMESH_SIM_WORKERS", default_value_t = 8)]
    workers: u32,
    /// Seconds of Poisson arrivals (the run then drains every admitted request).
    #[arg(long, env = "DIFFMESH_SIM_DURATION", default_value_t = 600.0)]
    duration: f64,
    /// Seed of arrivals, mask draws and step noise.
    #[arg(long, env = "DIFFMESH_SIM_SEED", default_value_t = 0)]
    seed: u64,
    /// Profile to fit the cost models from: a built-in one's name (tiny-cpu, medium-cpu,
    /// tiny-h100, medium-h100) or a file; without it a labelled synthetic profile is used.
    #[arg(long, env = "DIFFMESH_SIM_PROFILE")]
    profile: Option<PathBuf>,
    /// Print only the final JSON line.
    #[arg(long, env = "DIFFMESH_SIM_JSON")]
    json: bool,
    /// Most requests in a worker's running batch.
    #[arg(long, env = "DIFFMESH_SIM_MAX_BATCH", default_value_t = 8)]
    max_batch: u32,
    /// Most computed tokens in a worker's running batch.
    #[arg(long, env = "DIFFMESH_SIM_TOKEN_BUDGET", default_value_t = 16_384)]
    token_budget: u64,
    /// Denoising steps per request (default: the profile's model shape).
    #[arg(long, env = "DIFFMESH_SIM_STEPS")]
    steps: Option<u32>,
    /// Deadline = arrival + this x the request's standalone service time.
    #[arg(long, env = "DIFFMESH_SIM_SLO_FACTOR", default_value_t = 3.0)]
    slo_factor: f64,
    /// Std-dev of multiplicative noise on step latencies (model error the policy cannot see).
    #[arg(long, env = "DIFFMESH_SIM_STEP_NOISE", default_value_t = 0.0)]
    step_noise: f64,
    /// Seconds each request spends outside the denoisers (live mesh: uploads, codec, NATS
    /// hops, download), added to every latency; 0 models the denoisers alone.
    #[arg(long, env = "DIFFMESH_SIM_REQUEST_OVERHEAD_S", default_value_t = 0.0)]
    request_overhead_s: f64,
    /// CPU deployment: the workers share this many cores with each other and with the rest of
    /// the mesh (steps that overlap slow each other down; see `SharedCpu`). Absent: each
    /// worker has its own device.
    #[arg(long, env = "DIFFMESH_SIM_SHARED_CORES")]
    shared_cores: Option<f64>,
    /// With --shared-cores: extra step latency per other core kept busy while a step runs
    /// (another worker's step, or the rest of the mesh's work); fitted to a live run's mean
    /// latency (docs/BENCHMARKS.md, "Simulator fidelity").
    #[arg(
        long,
        env = "DIFFMESH_SIM_CO_RUN_SLOWDOWN",
        default_value_t = 0.0,
        requires = "shared_cores"
    )]
    co_run_slowdown: f64,
    /// With --shared-cores: CPU seconds each request costs the rest of the mesh (gateway,
    /// codec, NATS, router; measured from the processes' CPU time under load).
    #[arg(
        long,
        env = "DIFFMESH_SIM_BACKGROUND_CPU_S",
        default_value_t = 0.0,
        requires = "shared_cores"
    )]
    background_cpu_s: f64,
    /// Per worker, how much longer its steps take than the profile predicts, comma-separated
    /// (worker i gets entry i mod len): a fleet of unlike machines, e.g. `1,1,1,1,2,2,2,2`.
    #[arg(long, env = "DIFFMESH_SIM_WORKER_STEP_FACTORS", value_delimiter = ',')]
    worker_step_factors: Vec<f64>,
    /// Policies see each worker's step-time factor learned from its steps, as the live router
    /// does (false: they trust the profile for every worker).
    #[arg(long, env = "DIFFMESH_SIM_CALIBRATE", default_value_t = true, action = clap::ArgAction::Set)]
    calibrate: bool,
    /// Most requests the router holds while no worker takes them (the live router's
    /// `--max-queue`); arrivals beyond it are rejected.
    #[arg(long, env = "DIFFMESH_SIM_ROUTER_QUEUE", default_value_t = 1_000_000)]
    router_queue: usize,
    /// Longest a policy may hold a request back while a worker would take it (seconds; the
    /// live router holds at most half its `--admission-wait-ms`). Default: no limit.
    #[arg(long, env = "DIFFMESH_SIM_MAX_HOLD_S", default_value_t = f64::INFINITY)]
    max_hold_s: f64,
    /// The order each worker admits its queue in: fcfs, srtf (least remaining work first) or
    /// edf (earliest SLO deadline first), as the denoiser's `--queue-order`.
    #[arg(long, env = "DIFFMESH_SIM_QUEUE_ORDER", value_enum, default_value_t = QueueOrder::Fcfs)]
    queue_order: QueueOrder,
    /// With --queue-order srtf or edf: running jobs compete for the batch slots again at every
    /// step boundary and those left out wait with their progress kept (the engine does not
    /// preempt yet: a what-if).
    #[arg(long, env = "DIFFMESH_SIM_PREEMPT")]
    preempt: bool,
    /// Every request runs with true classifier-free guidance: two batch rows per image (what
    /// the live mesh serves with `cargo xtask up`'s default `--true-cfg-scale 4`).
    #[arg(long, env = "DIFFMESH_SIM_TRUE_CFG")]
    true_cfg: bool,
    /// Fraction of requests steered by a ControlNet (0 to 1, drawn per request from the seed).
    #[arg(long, env = "DIFFMESH_SIM_CONTROLNET_SHARE", default_value_t = 0.0)]
    controlnet_share: f64,
    /// Per worker, the seconds a step of its loop spends on each steered request outside the
    /// batched forward, comma-separated (worker i gets entry i mod len), e.g. `0.2,0` for
    /// workers that compute ControlNets themselves beside workers with ControlNet workers.
    #[arg(long, env = "DIFFMESH_SIM_CONTROLNET_STEP_S", value_delimiter = ',')]
    controlnet_step_s: Vec<f64>,
    /// Policies see those costs, as the live router does from heartbeats (false: they do not).
    #[arg(long, env = "DIFFMESH_SIM_CONTROLNET_COSTS_VISIBLE", default_value_t = true, action = clap::ArgAction::Set)]
    controlnet_costs_visible: bool,
    /// Write the synthetic profile to this file and exit.
    #[arg(long, env = "DIFFMESH_SIM_WRITE_PROFILE")]
    write_profile: Option<PathBuf>,
    /// Time this many placement decisions (16 workers, batches of 8) and exit.
    #[arg(long, env = "DIFFMESH_SIM_BENCH")]
    bench: Option<usize>,
    /// Also write the run (summary and every latency) to this JSON file, the format
    /// `cargo xtask load --out-dir` keeps, so simulated and live runs share one CDF plot.
    #[arg(long, env = "DIFFMESH_SIM_LATENCIES_OUT")]
    latencies_out: Option<PathBuf>,
    /// Name of the run in `--latencies-out` (default: `sim-<policy>`).
    #[arg(long, env = "DIFFMESH_SIM_LABEL")]
    label: Option<String>,
}

fn main() -> anyhow::Result<()> {
    // GF-DiT's elastic parallelism: a simulation of its own, with its own flags.
    if std::env::args().any(|a| a == "--elastic") {
        let args = diffmesh_sched::elastic::cli::ElasticArgs::parse();
        return diffmesh_sched::elastic::cli::run(&args);
    }
    let args = Args::parse();
    if let Some(path) = &args.write_profile {
        synthetic::profile(0).write(path)?;
        println!("wrote synthetic profile to {}", path.display());
        return Ok(());
    }
    let model = match &args.profile {
        Some(p) => CostModels::fit(&diffmesh_sched::profiles::load(p)?)?,
        None => synthetic::default_models(),
    };
    let say = |s: String| {
        if !args.json {
            println!("{s}");
        }
    };
    say(format!(
        "cost models: {}{}",
        if model.synthetic {
            "SYNTHETIC PROFILE - "
        } else {
            ""
        },
        model.label
    ));
    say(format!("  {}", model.describe()));
    if let Some(n) = args.bench {
        return bench(&args, &model, n);
    }
    let limits = BatchLimits {
        max_batch: args.max_batch,
        token_budget: args.token_budget,
        ..BatchLimits::default()
    };
    if args.max_batch == 0 {
        bail!("--max-batch must be > 0");
    }
    ensure!(
        (0.0..=1.0).contains(&args.controlnet_share),
        "--controlnet-share must be between 0 and 1, got {}",
        args.controlnet_share
    );
    for &c in &args.controlnet_step_s {
        ensure!(
            c >= 0.0 && c.is_finite(),
            "--controlnet-step-s entries must be finite numbers >= 0, got {c}"
        );
    }
    for &f in &args.worker_step_factors {
        ensure!(
            f > 0.0 && f.is_finite(),
            "--worker-step-factors: each factor must be a finite number > 0, got {f}"
        );
    }
    ensure!(
        args.max_hold_s >= 0.0,
        "--max-hold-s must be >= 0, got {}",
        args.max_hold_s
    );
    let cfg = SimConfig {
        workers: args.workers,
        limits,
        slo_factor: args.slo_factor,
        step_noise: args.step_noise,
        seed: args.seed,
        request_overhead_s: args.request_overhead_s,
        shared_cpu: args.shared_cores.map(|cores| SharedCpu {
            cores,
            co_run_slowdown: args.co_run_slowdown,
            background_cpu_s: args.background_cpu_s,
        }),
        worker_step_factors: args.worker_step_factors.clone(),
        calibrate: args.calibrate,
        router_queue: args.router_queue,
        max_hold_s: args.max_hold_s,
        queue_order: args.queue_order,
        preempt: args.preempt,
        controlnets: SimControlNets {
            step_s: args.controlnet_step_s.clone(),
            visible: args.controlnet_costs_visible,
        },
    };
    let steps = args.steps.unwrap_or(model.shape.steps);
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let footprint = Footprint::new(1, args.true_cfg);
    let mut arrivals = if let Some(t) = &args.trace {
        workload::read_trace(t, &model.shape, steps)?
    } else {
        let path = args
            .mask_ratios
            .as_ref()
            .context("--mask-ratios is required without --trace")?;
        let ratios = workload::read_mask_ratios(path)?;
        let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
        let workers = cfg.effective_workers();
        let cap = workload::capacity_rps(&model, &limits, workers, mean, steps, footprint);
        let rps = match (args.rps, args.load) {
            (Some(r), None) if r > 0.0 => r,
            (None, Some(f)) if f > 0.0 => f * cap,
            _ => bail!("give exactly one of --rps R or --load F (> 0), or --trace FILE"),
        };
        say(format!(
            "workload: Poisson {rps:.3} req/s for {}s, masks from {} (mean ratio {mean:.3}); estimated capacity {cap:.3} req/s ({:.2} load)",
            args.duration,
            path.display(),
            rps / cap
        ));
        workload::poisson(&mut rng, rps, args.duration, &ratios, &model.shape, steps)
    };
    // Steered requests from a stream of their own: the arrivals stay those of the same seed.
    let mut steer = ChaCha8Rng::seed_from_u64(args.seed ^ 0xc0de_c0de);
    for a in &mut arrivals {
        a.footprint = footprint;
        a.steered = args.controlnet_share > 0.0 && steer.random::<f64>() < args.controlnet_share;
    }
    if let Some(c) = args.shared_cores {
        ensure!(
            c > 0.0 && c.is_finite(),
            "--shared-cores must be a finite number > 0, got {c}"
        );
    }
    for (name, v) in [
        ("--request-overhead-s", args.request_overhead_s),
        ("--co-run-slowdown", args.co_run_slowdown),
        ("--background-cpu-s", args.background_cpu_s),
    ] {
        ensure!(
            v >= 0.0 && v.is_finite(),
            "{name} must be a finite number >= 0, got {v}"
        );
    }
    let mut policy = policy_by_name(&args.policy)?;
    let started = Instant::now();
    let (s, latencies) = simulate_with_latencies(&cfg, &model, policy.as_mut(), &arrivals);
    say(format!(
        "policy {}, queue order {}: {} workers, max batch {}, {} steps, step noise {}; simulated in {:.2}s",
        s.policy,
        args.queue_order,
        args.workers,
        args.max_batch,
        steps,
        args.step_noise,
        started.elapsed().as_secs_f64()
    ));
    say(format!(
        "  completed {}/{} (rejected {}), latency p50 {:.3}s p95 {:.3}s p99 {:.3}s mean {:.3}s, mean queue {:.3}s",
        s.completed, s.submitted, s.rejected, s.p50, s.p95, s.p99, s.mean_latency, s.mean_queue
    ));
    say(format!(
        "  no-contention floor: p95 of standalone times {:.3}s (no policy's p95 is lower)",
        s.standalone_p95
    ));
    say(format!(
        "  throughput {:.3} req/s ({:.1} images/min), SLO attainment {:.3} (deadline {}x standalone), mean batch {:.2}, utilization {:.3}",
        s.throughput,
        s.throughput * 60.0,
        s.slo_attainment,
        args.slo_factor,
        s.mean_batch,
        s.utilization
    ));
    let mut out = serde_json::to_value(&s)?;
    if let Some(o) = out.as_object_mut() {
        o.insert("synthetic_profile".into(), model.synthetic.into());
        o.insert("seed".into(), args.seed.into());
        o.insert("workers".into(), args.workers.into());
        o.insert("calibrate".into(), args.calibrate.into());
        o.insert("queue_order".into(), args.queue_order.name().into());
        o.insert("preempt".into(), args.preempt.into());
        o.insert("true_cfg".into(), args.true_cfg.into());
        if args.controlnet_share > 0.0 {
            o.insert("controlnet_share".into(), args.controlnet_share.into());
            o.insert(
                "controlnet_step_s".into(),
                args.controlnet_step_s.clone().into(),
            );
            o.insert(
                "controlnet_costs_visible".into(),
                args.controlnet_costs_visible.into(),
            );
        }
        if !args.worker_step_factors.is_empty() {
            o.insert(
                "worker_step_factors".into(),
                args.worker_step_factors.clone().into(),
            );
        }
        if let Some(l) = args.load {
            o.insert("load".into(), l.into());
        }
    }
    if let Some(path) = &args.latencies_out {
        let label = args
            .label
            .clone()
            .unwrap_or_else(|| format!("sim-{}", s.policy));
        let record = serde_json::json!({ "label": label, "summary": out, "latencies": latencies });
        std::fs::write(path, serde_json::to_string_pretty(&record)?)
            .with_context(|| format!("--latencies-out {}", path.display()))?;
    }
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

/// p50/p99 decision latency of every policy on 16 workers with full batches of 8.
fn bench(args: &Args, model: &CostModels, n: usize) -> anyhow::Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let shape = &model.shape;
    let draw = |rng: &mut ChaCha8Rng| shape.masked_tokens(rng.random_range(0.0..0.45));
    let states: Vec<Vec<WorkerState>> = (0..64)
        .map(|_| {
            (0..16)
                .map(|_| {
                    let mut w = WorkerState::idle(BatchLimits::default());
                    w.running = (0..8)
                        .map(|_| ActiveRequest {
                            masked_tokens: draw(&mut rng),
                            footprint: Footprint::ONE_ROW,
                            remaining_steps: rng.random_range(0..28),
                        })
                        .collect();
                    w.queued = (0..rng.random_range(0..3))
                        .map(|_| ActiveRequest {
                            masked_tokens: draw(&mut rng),
                            footprint: Footprint::ONE_ROW,
                            remaining_steps: 28,
                        })
                        .collect();
                    w.step_remaining_s = rng.random_range(0.0..0.3);
                    w
                })
                .collect()
        })
        .collect();
    let reqs: Vec<RequestInfo> = (0..256)
        .map(|_| RequestInfo {
            masked_tokens: draw(&mut rng),
            footprint: Footprint::ONE_ROW,
            steps: 28,
            template: None,
            loras: diffmesh_sched::policy::NameKeys::NONE,
            controlnets: diffmesh_sched::policy::NameKeys::NONE,
            waiting_behind: Some(0),
        })
        .collect();
    for name in diffmesh_sched::policy::POLICY_NAMES {
        let mut p = policy_by_name(name)?;
        let mut times = Vec::with_capacity(n);
        let mut sink = 0usize;
        for i in 0..n {
            let t = Instant::now();
            let w = p.place(&reqs[i % reqs.len()], &states[i % states.len()], model);
            times.push(t.elapsed().as_secs_f64() * 1e6);
            sink = sink.wrapping_add(w.unwrap_or(0));
        }
        times.sort_by(f64::total_cmp);
        let pct = |q: f64| times[((q * n as f64) as usize).min(n - 1)];
        println!(
            "bench {name}: {n} decisions, 16 workers x batch 8 (+0-2 queued): p50 {:.2} us, p99 {:.2} us (checksum {sink})",
            pct(0.5),
            pct(0.99)
        );
    }
    Ok(())
}
