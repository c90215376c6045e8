//! diffmesh-profile: measure the cost-model inputs of the scheduler on this machine and write
//! one profile file (`diffmesh_sched::Profile`, JSON) per model.
//!
//! - Compute: latency of the Flux transformer's block stack, reported per block (one forward
//!   divided by the number of blocks, so embeddings and the final layer are spread over the
//!   blocks as a step pays them), for full passes over token counts and batch sizes and for
//!   mask-aware passes (cache resident) over masked-token counts and batch sizes. Each sample
//!   carries the batch's FLOPs (FlashPS Table 1), the x of the compute fit. The medium model is
//!   timed on a stack of 1 double + 2 single blocks of its exact block shapes (the served model
//!   has 4 + 8, the same 1:2 mix): per-block cost does not depend on the depth, and the shorter
//!   stack leaves time for enough rounds on a 2-core machine.
//! - Load: copying a cache block of a given size into a preallocated tensor (host memory to the
//!   compute device; a memory copy on a CPU), and reading one from a file into a tensor (the
//!   slower tier a cold template comes from; a freshly written file is mostly in the page cache,
//!   so this is an optimistic disk figure).
//!
//! Compute and memory-load samples are measured in interleaved rounds (one run of each sample
//! per round; file reads run back to back per size, after writing its file), so a load
//! change on a shared machine hits every sample alike, and each keeps its fastest run: other
//! processes only ever add time, so the minimum is the least disturbed measurement. On a CPU
//! with one intra-op thread (the default) compute is timed with the thread's CPU clock, which
//! does not count the time other processes hold the core, so a busy machine still yields the
//! profile of an idle one; a worker with more threads is faster by its parallel efficiency.
//! Memory loads use the same clock (a copy on a CPU is CPU work); file reads always use the
//! wall clock, since waiting for the disk is their cost. Prints each fit's R^2; the last line is one JSON
//! object with the files written and their fits.
use anyhow::{bail, Context, Result};
use clap::Parser;
use diffmesh_model::bench_inputs::random_inputs_on;
use diffmesh_model::flux::{
    CapturedKv, FluxConfig, FluxInputs, FluxTransformer, KvFormat, MaskedRequest,
};
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use diffmesh_sched::cost_model::{
    block_flops, ComputeSample, CostModels, LoadSample, ModelShape, Profile,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Measure per-block compute and cache-load latency and write scheduler profiles.
#[derive(Debug, Parser)]
#[command(name = "diffmesh-profile")]
struct Args {
    /// Models to profile: `tiny` (the trained default model) and/or `medium` (random weights:
    /// hidden 1024, 4 double + 8 single blocks, 1024 image + 64 text tokens).
    #[arg(long, value_delimiter = ',', default_values_t = ["tiny".to_string(), "medium".to_string()])]
    models: Vec<String>,
    /// Tiny model directory (with a `transformer/` folder).
    #[arg(long, default_value = "weights/tiny")]
    tiny_dir: PathBuf,
    /// Where the profiles go, one `<model>-<device>.json` each.
    #[arg(long, default_value = "sched/profiles")]
    out_dir: PathBuf,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Intra-op threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Compute clock: `cpu` (the thread's CPU time; only with --threads 1 on a CPU), `wall`,
    /// or `auto` (cpu where allowed, else wall).
    #[arg(long, default_value = "auto")]
    clock: String,
    /// Timed rounds for the tiny model (the fastest run of each sample is kept).
    #[arg(long, default_value_t = 9)]
    tiny_runs: usize,
    /// Timed rounds for the medium model (a CPU forward takes seconds: keep this small).
    #[arg(long, default_value_t = 4)]
    medium_runs: usize,
    /// Seed of the random weights, inputs and mask draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Denoising steps per request recorded in the tiny profile's shape (the gateway default).
    #[arg(long, default_value_t = 20)]
    tiny_steps: u32,
    /// Denoising steps per request recorded in the medium profile's shape (Flux's default).
    #[arg(long, default_value_t = 28)]
    medium_steps: u32,
}

/// One model to profile and the sample grid it gets.
struct Spec {
    name: &'static str,
    model: FluxTransformer,
    _vs: nn::VarStore,
    /// Blocks per step of the served model (the profile's shape); `model` may be shorter.
    served_blocks: u32,
    /// Image tokens per side at the served resolution.
    side: i64,
    txt: i64,
    steps: u32,
    runs: usize,
    /// (image tokens per side, batch sizes) of the full-pass samples.
    full_grid: Vec<(i64, Vec<i64>)>,
    /// Batch sizes of the mask-aware samples, and mask draws per batch size.
    masked_batches: Vec<i64>,
    draws: usize,
}

/// The medium config's block shapes in a 1 double + 2 single stack (see the module docs).
fn medium_config() -> FluxConfig {
    FluxConfig {
        num_layers: 1,
        num_single_layers: 2,
        attention_head_dim: 128,
        num_attention_heads: 8,
        guidance_embeds: true,
        ..FluxConfig::default()
    }
}

fn parse_device(s: &str) -> Result<Device> {
    Ok(match s {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        d => match d.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(i) => Device::Cuda(i),
            None => bail!("--device: `{d}` is not cpu, cuda or cuda:N"),
        },
    })
}

fn spec(name: &str, args: &Args, device: Device) -> Result<Spec> {
    match name {
        "tiny" => {
            let dir = args.tiny_dir.join("transformer");
            let (model, vs) = FluxTransformer::load(&dir, device, Kind::Float)
                .with_context(|| format!("--tiny-dir: loading {}", dir.display()))?;
            Ok(Spec {
                name: "tiny",
                served_blocks: model.num_blocks() as u32,
                model,
                _vs: vs,
                side: 16,
                txt: 16,
                steps: args.tiny_steps,
                runs: args.tiny_runs.max(1),
                full_grid: vec![
                    (8, vec![1, 2, 4, 8]),
                    (12, vec![1, 2, 4, 8]),
                    (16, vec![1, 2, 4, 8]),
                ],
                masked_batches: vec![1, 2, 4, 8],
                draws: 6,
            })
        }
        "medium" => {
            tch::manual_seed(args.seed as i64);
            let mut vs = nn::VarStore::new(device);
            let model = FluxTransformer::new(&vs.root(), medium_config())?;
            vs.freeze();
            Ok(Spec {
                name: "medium",
                // The served medium model: 4 double + 8 single blocks.
                served_blocks: 12,
                model,
                _vs: vs,
                side: 32,
                txt: 64,
                steps: args.medium_steps,
                runs: args.medium_runs.max(1),
                full_grid: vec![(16, vec![1, 2, 4]), (24, vec![1, 2]), (32, vec![1, 2])],
                masked_batches: vec![1, 2, 4],
                draws: 3,
            })
        }
        other => bail!("--models: unknown model `{other}` (known: tiny, medium)"),
    }
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Which clock times the compute samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Clock {
    Wall,
    /// CPU time of the calling thread (all compute runs on it with one intra-op thread).
    ThreadCpu,
}

impl Clock {
    fn parse(s: &str, device: Device, threads: usize) -> Result<Clock> {
        let cpu_ok = !device.is_cuda() && threads == 1;
        match s {
            "wall" => Ok(Clock::Wall),
            "cpu" if cpu_ok => Ok(Clock::ThreadCpu),
            "cpu" => bail!("--clock cpu needs --device cpu and --threads 1"),
            "auto" if cpu_ok => Ok(Clock::ThreadCpu),
            "auto" => Ok(Clock::Wall),
            other => bail!("--clock: `{other}` is not auto, cpu or wall"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Clock::Wall => "wall clock",
            Clock::ThreadCpu => "thread CPU time",
        }
    }

    fn now(self) -> f64 {
        match self {
            Clock::Wall => {
                static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
                START.get_or_init(Instant::now).elapsed().as_secs_f64()
            }
            Clock::ThreadCpu => {
                let mut ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant.
                let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
                if rc != 0 {
                    return f64::NAN;
                }
                ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
            }
        }
    }
}

/// Seconds of one call on `clock`, the device synchronised before and after.
fn time_s(device: Device, clock: Clock, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    sync(device);
    let t = clock.now();
    f()?;
    sync(device);
    Ok(clock.now() - t)
}

fn fastest(v: &[f64]) -> f64 {
    v.iter().copied().reduce(f64::min).unwrap_or(f64::NAN)
}

/// One compute sample to measure: its description and the work it runs.
struct Work<'a> {
    sample: ComputeSample,
    run: Box<dyn Fn() -> Result<()> + 'a>,
}

/// Full-pass samples over the spec's (side, batch) grid.
fn full_work<'a>(s: &'a Spec, shape: &ModelShape, device: Device) -> Vec<Work<'a>> {
    let mut out = Vec::new();
    for (side, batches) in &s.full_grid {
        let tokens = (side * side + s.txt) as u64;
        for &b in batches {
            let inputs = random_inputs_on(&s.model.cfg, *side, s.txt, b, device);
            let flops = b as f64 * block_flops(shape.hidden, tokens, tokens);
            out.push(Work {
                sample: ComputeSample {
                    tokens: b as u64 * tokens,
                    batch: b as u32,
                    attended: b as u64 * tokens,
                    flops,
                    latency_s: f64::NAN,
                },
                run: Box::new(move || {
                    let _ = s.model.forward(&inputs)?;
                    Ok(())
                }),
            });
        }
    }
    out
}

/// Inputs of the mask-aware samples: one captured template and per-sample token index sets.
struct MaskedSet {
    inputs: FluxInputs,
    cache: CapturedKv,
    /// Per sample: the token indices of each request in the batch.
    batches: Vec<Vec<Tensor>>,
}

fn masked_set(s: &Spec, rng: &mut ChaCha8Rng, device: Device) -> Result<MaskedSet> {
    let inputs = random_inputs_on(&s.model.cfg, s.side, s.txt, 1, device);
    let mut cache = CapturedKv::new(KvFormat::Prepared);
    let _ = s.model.forward_capture(&inputs, &mut cache)?;
    let n = s.side * s.side;
    let mut batches = Vec::new();
    for &b in &s.masked_batches {
        for _ in 0..s.draws {
            // Ratios spread over the range production masks take, plus a few large ones.
            let reqs = (0..b)
                .map(|_| {
                    let ratio: f64 = if rng.random_bool(0.8) {
                        rng.random_range(0.01..0.45)
                    } else {
                        rng.random_range(0.45..1.0)
                    };
                    let m = ((ratio * n as f64).round() as i64).clamp(1, n);
                    Tensor::randperm(n, (Kind::Int64, device)).narrow(0, 0, m)
                })
                .collect();
            batches.push(reqs);
        }
    }
    Ok(MaskedSet {
        inputs,
        cache,
        batches,
    })
}

fn masked_work<'a>(s: &'a Spec, set: &'a MaskedSet, shape: &ModelShape) -> Vec<Work<'a>> {
    let cfg = &s.model.cfg;
    let attended = shape.total_tokens();
    set.batches
        .iter()
        .map(|indices| {
            let mut flops = 0.0;
            let mut tokens = 0;
            for idx in indices {
                let computed = shape.computed_tokens(idx.size()[0] as u32);
                tokens += computed;
                flops += block_flops(shape.hidden, computed, attended);
            }
            let run = move || -> Result<()> {
                let reqs: Vec<MaskedRequest> = indices
                    .iter()
                    .map(|index| MaskedRequest {
                        hidden_states: set
                            .inputs
                            .hidden_states
                            .squeeze_dim(0)
                            .index_select(0, index),
                        token_index: index.shallow_clone(),
                        encoder_hidden_states: set.inputs.encoder_hidden_states.squeeze_dim(0),
                        pooled_projections: set.inputs.pooled_projections.squeeze_dim(0),
                        timestep: 0.5,
                        guidance: cfg.guidance_embeds.then_some(3.5),
                        img_ids: set.inputs.img_ids.shallow_clone(),
                        txt_ids: set.inputs.txt_ids.shallow_clone(),
                        cache: &set.cache,
                        full_hidden_states: None,
                    })
                    .collect();
                s.model.forward_masked(&reqs)?;
                Ok(())
            };
            Work {
                sample: ComputeSample {
                    tokens,
                    batch: indices.len() as u32,
                    attended: indices.len() as u64 * attended,
                    flops,
                    latency_s: f64::NAN,
                },
                run: Box::new(run),
            }
        })
        .collect()
}

/// Measure every work item in `runs` interleaved rounds, after an untimed warm-up of the
/// smallest and the largest item (first calls allocate and fill caches).
fn measure(
    works: &mut [Work],
    runs: usize,
    blocks: u32,
    (device, clock): (Device, Clock),
    what: &str,
) -> Result<Vec<ComputeSample>> {
    let started = Instant::now();
    let by_flops = |a: &&Work, b: &&Work| a.sample.flops.total_cmp(&b.sample.flops);
    for w in [works.iter().min_by(by_flops), works.iter().max_by(by_flops)]
        .into_iter()
        .flatten()
    {
        (w.run)()?;
    }
    println!(
        "  {what}: warm-up in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let mut times = vec![Vec::with_capacity(runs); works.len()];
    for round in 1..=runs {
        let started = Instant::now();
        for (w, t) in works.iter().zip(&mut times) {
            t.push(time_s(device, clock, || (w.run)())?);
        }
        println!(
            "  {what}: round {round}/{runs}: {} samples in {:.1}s",
            works.len(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(works
        .iter()
        .zip(times)
        .map(|(w, t)| ComputeSample {
            latency_s: fastest(&t) / blocks as f64,
            ..w.sample.clone()
        })
        .collect())
}

/// Cache-load sizes: `count` points from 1/20 of `max_bytes` to `max_bytes`.
fn load_sizes(max_bytes: u64, count: usize) -> Vec<u64> {
    (0..count)
        .map(|i| {
            let f = 0.05 + 0.95 * i as f64 / (count - 1).max(1) as f64;
            ((f * max_bytes as f64) as u64 / 4).max(1) * 4
        })
        .collect()
}

/// Bytes of the source buffer the memory loads cycle through, so every copy reads memory that
/// is not in the CPU's caches (as a cache block fetched from a memory tier would be).
const COLD_POOL_BYTES: u64 = 192 << 20;

/// Copy latency of each size's `bytes` of f32 from host memory into a preallocated tensor on
/// `device`, timed on `clock` (a copy on a CPU is CPU work, so the thread's CPU time is valid
/// for it). Interleaved like the compute samples: each round copies every size once (the
/// first round warms up and is not kept), so a disturbance spreads over all sizes instead of
/// bending the line at the few measured while it lasted.
fn memory_loads(
    sizes: &[u64],
    runs: usize,
    (device, clock): (Device, Clock),
) -> Result<Vec<LoadSample>> {
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let pool_len = ((COLD_POOL_BYTES + largest) / 4) as i64;
    let mut pool = Tensor::ones([pool_len], (Kind::Float, Device::Cpu));
    if device.is_cuda() {
        pool = pool.f_pin_memory(device)?;
    }
    let mut dsts = sizes
        .iter()
        .map(|&bytes| Tensor::f_empty([(bytes / 4) as i64], (Kind::Float, device)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut times = vec![Vec::with_capacity(runs); sizes.len()];
    let mut offset = 0i64;
    for r in 0..=runs {
        for (i, dst) in dsts.iter_mut().enumerate() {
            let n = (sizes[i] / 4) as i64;
            // The next slice of the pool: the previous reads are long out of the caches.
            if offset + n > pool_len {
                offset = 0;
            }
            let src = pool.f_narrow(0, offset, n)?;
            offset += n;
            let s = time_s(device, clock, || {
                dst.f_copy_(&src)?;
                Ok(())
            })?;
            if r > 0 {
                times[i].push(s);
            }
        }
    }
    Ok(sizes
        .iter()
        .zip(&times)
        .map(|(&bytes, t)| LoadSample {
            bytes,
            latency_s: fastest(t),
        })
        .collect())
}

/// Latency of reading `bytes` from a file into a tensor on `device` (wall clock).
fn file_loads(sizes: &[u64], runs: usize, device: Device, dir: &Path) -> Result<Vec<LoadSample>> {
    let mut out = Vec::new();
    for (i, &bytes) in sizes.iter().enumerate() {
        let path = dir.join(format!("load-{i}.bin"));
        // Content does not matter to a read (nothing compresses it).
        let data = vec![0x5au8; bytes as usize];
        std::fs::write(&path, &data).with_context(|| format!("writing {}", path.display()))?;
        let mut t = Vec::new();
        for r in 0..=runs {
            let s = time_s(device, Clock::Wall, || {
                let raw = std::fs::read(&path)?;
                let x = Tensor::f_from_data_size(&raw, &[(bytes / 4) as i64], Kind::Float)?;
                let _ = x.f_to_device(device)?;
                Ok(())
            })?;
            if r > 0 {
                t.push(s);
            }
        }
        std::fs::remove_file(&path).ok();
        out.push(LoadSample {
            bytes,
            latency_s: fastest(&t),
        });
    }
    Ok(out)
}

fn profile_one(
    s: &Spec,
    args: &Args,
    (device, clock): (Device, Clock),
    threads: usize,
) -> Result<(PathBuf, Value)> {
    let _guard = tch::no_grad_guard();
    let cfg = &s.model.cfg;
    let inner = cfg.inner_dim();
    let blocks = s.model.num_blocks() as u32;
    let shape = ModelShape {
        blocks: s.served_blocks,
        hidden: inner as u32,
        image_tokens: (s.side * s.side) as u32,
        text_tokens: s.txt as u32,
        // Raw K and V rows in f32 for every unmasked image token of a block.
        cache_bytes_per_token: 2 * inner as u64 * 4,
        steps: s.steps,
        cache_layout: Default::default(),
    };
    println!(
        "{}: {blocks} blocks timed ({} served), hidden {inner}, {} image + {} text tokens, {} timed rounds",
        s.name, s.served_blocks, shape.image_tokens, shape.text_tokens, s.runs
    );
    let started = Instant::now();
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut works = full_work(s, &shape, device);
    let mut compute = measure(&mut works, s.runs, blocks, (device, clock), "full")?;
    drop(works);
    let set = masked_set(s, &mut rng, device)?;
    let mut works = masked_work(s, &set, &shape);
    compute.extend(measure(
        &mut works,
        s.runs,
        blocks,
        (device, clock),
        "mask-aware",
    )?);
    drop(works);
    // Up to a batch of 8 requests' cache for one block (every image token unmasked).
    let max_bytes = 8 * shape.image_tokens as u64 * shape.cache_bytes_per_token;
    let sizes = load_sizes(max_bytes, 12);
    let load = memory_loads(&sizes, 9, (device, clock))?;
    let tmp = std::env::temp_dir().join(format!("diffmesh-profile-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let disk_load = file_loads(&sizes, 5, device, &tmp);
    std::fs::remove_dir_all(&tmp).ok();
    let disk_load = disk_load?;
    let dev = device_tag(device);
    let profile = Profile {
        label: format!(
            "measured: {} model on {dev} ({threads} intra-op threads, {} cores, compute in {}), per-block = forward of a {blocks}-block stack / {blocks}; \
             `cargo xtask profile --models {}` (seed {})",
            s.name,
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            clock.name(),
            s.name,
            args.seed
        ),
        synthetic: false,
        shape,
        compute,
        load,
        disk_load,
        // Engine steps are measured by the engine bench against these compute fits; a new
        // profile drops the old ones (`diffmesh-engine-bench --parts engine-steps` adds them).
        engine_steps: Vec::new(),
        engine_label: String::new(),
        engine_jobs: None,
    };
    let models = CostModels::fit(&profile)?;
    let (full, masked) = CostModels::fit_by_kind(&profile);
    println!(
        "  fitted in {:.1}s of measuring: {}",
        started.elapsed().as_secs_f64(),
        models.describe()
    );
    let r2 = |f: Option<diffmesh_sched::LinearFit>| f.map_or(f64::NAN, |f| f.r2);
    println!(
        "  compute R^2 by kind: full passes {:.4}, mask-aware passes {:.4}",
        r2(full),
        r2(masked)
    );
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("--out-dir: creating {}", args.out_dir.display()))?;
    let path = args.out_dir.join(format!("{}-{dev}.json", s.name));
    profile.write(&path)?;
    println!("  wrote {}", path.display());
    let summary = json!({
        "model": s.name,
        "file": path,
        "compute_r2": models.compute.r2,
        "load_r2": models.load.r2,
        "disk_load_r2": models.disk_load.map(|f| f.r2),
        "full_r2": r2(full),
        "masked_r2": r2(masked),
        "samples": profile.compute.len(),
    });
    Ok((path, summary))
}

fn device_tag(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda{i}"),
        _ => "cpu".into(),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = parse_device(&args.device)?;
    if device.is_cuda() && !tch::Cuda::is_available() {
        bail!("--device {}: CUDA is not available here", args.device);
    }
    let threads = args.threads.max(1);
    tch::set_num_threads(threads as i32);
    let clock = Clock::parse(&args.clock, device, threads)?;
    println!(
        "{threads} intra-op threads, compute timed in {}",
        clock.name()
    );
    let started = Instant::now();
    let mut summaries = Vec::new();
    for name in &args.models {
        let s = spec(name, &args, device)?;
        let (_, summary) = profile_one(&s, &args, (device, clock), threads)?;
        summaries.push(summary);
    }
    println!(
        "{}",
        json!({ "profiles": summaries, "seconds": started.elapsed().as_secs_f64() })
    );
    Ok(())
}
