//! Latency benchmarks of the model layer.
//!
//! `diffmesh-bench model [--threads N]`: per-forward latency (median after warm-up) of the Flux
//! transformer's full pass and its mask-aware pass (K/V cache resident in memory, in both cache
//! formats: `Prepared`, reported as `masked_ms`, and `Raw`, as `masked_raw_ms`) at several mask
//! ratios, for a medium random-weight config and (if present) the tiny trained model, plus the same
//! medium full pass run by diffusers in a Python subprocess at the same thread count. Prints
//! human-readable lines, then one JSON line with every figure last.
use anyhow::Result;
use clap::{Parser, Subcommand};
use diffmesh_model::bench_worker::{median, minimum, DiffusersWorker};
use diffmesh_model::flux::{CapturedKv, FluxTransformer, KvFormat, MaskedRequest};
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::time::Instant;

const MASK_RATIOS: [f64; 6] = [0.05, 0.1, 0.2, 0.35, 0.5, 1.0];

#[derive(Debug, Parser)]
#[command(about = "diffmesh latency benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Flux full vs mask-aware forward latency, and ours vs diffusers.
    Model(ModelArgs),
}

#[derive(Debug, clap::Args)]
struct ModelArgs {
    /// Intra-op threads for both tch and the diffusers subprocess (default: all cores).
    #[arg(long, env = "DIFFMESH_BENCH_THREADS")]
    threads: Option<usize>,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Untimed warm-up runs before each measurement.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Python interpreter with diffusers installed.
    #[arg(
        long,
        env = "DIFFMESH_PYTHON",
        default_value = "/root/.cache/diffmesh/venv/bin/python"
    )]
    python: String,
    /// Skip the diffusers comparison.
    #[arg(long)]
    no_diffusers: bool,
    /// Tiny model directory (with a `transformer/` folder); skipped when absent.
    #[arg(long, default_value = "weights/tiny")]
    tiny_dir: PathBuf,
    /// Image tokens per side for the tiny model (N = side^2).
    #[arg(long, default_value_t = 16)]
    tiny_side: i64,
    /// Mask ratios to measure (comma-separated; include 0.2 for the summary ratio).
    #[arg(long, value_delimiter = ',', default_values_t = MASK_RATIOS)]
    mask_ratios: Vec<f64>,
    /// Text tokens for the tiny model.
    #[arg(long, default_value_t = 32)]
    tiny_txt_tokens: i64,
}

use diffmesh_model::bench_inputs::{medium_config, random_inputs, MEDIUM_SIDE, MEDIUM_TXT};

fn main() -> Result<()> {
    let Cmd::Model(args) = Cli::parse().cmd;
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    tch::set_num_threads(threads as i32);
    println!(
        "threads: {threads}, runs: {} (median), warm-up: {}",
        args.runs, args.warmup
    );
    let mut report = Map::new();

    let cfg = medium_config();
    println!(
        "medium: {cfg:?}, image tokens {}, text tokens {MEDIUM_TXT}",
        MEDIUM_SIDE * MEDIUM_SIDE
    );
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = FluxTransformer::new(&vs.root(), cfg.clone())?;
    let mut diffusers = if args.no_diffusers {
        None
    } else {
        // diffusers' `FluxTransformer2DModel` with the same config, shapes and thread count.
        let spec =
            json!({ "config": cfg, "side": MEDIUM_SIDE, "txt": MEDIUM_TXT, "threads": threads });
        Some(DiffusersWorker::start(
            &args.python,
            DIFFUSERS_BENCH,
            &spec,
        )?)
    };
    let medium = bench_model(&model, MEDIUM_SIDE, MEDIUM_TXT, &args, diffusers.as_mut())?;
    drop(diffusers);
    report.insert("medium".into(), Value::Object(medium));
    drop(model);
    drop(vs);

    let tiny_dir = args.tiny_dir.join("transformer");
    if tiny_dir.join("config.json").is_file() {
        let (tiny, _vs) = FluxTransformer::load(&tiny_dir, Device::Cpu, Kind::Float)?;
        println!(
            "tiny: {:?}, image tokens {}, text tokens {}",
            tiny.cfg,
            args.tiny_side * args.tiny_side,
            args.tiny_txt_tokens
        );
        let t = bench_model(&tiny, args.tiny_side, args.tiny_txt_tokens, &args, None)?;
        report.insert("tiny".into(), Value::Object(t));
    } else {
        println!("tiny: {} not found, skipped", tiny_dir.display());
    }
    report.insert("threads".into(), json!(threads));
    println!("{}", Value::Object(report));
    Ok(())
}

/// Full and mask-aware latency of one model on random inputs of `side^2` image and `txt` text
/// tokens (plus diffusers' full pass when given). Measurements are interleaved in rounds (one run
/// of each per round), so a load change on a shared machine hits all of them alike and the ratios
/// stay meaningful; each figure is the median over rounds.
fn bench_model(
    model: &FluxTransformer,
    side: i64,
    txt: i64,
    args: &ModelArgs,
    mut diffusers: Option<&mut DiffusersWorker>,
) -> Result<Map<String, Value>> {
    let _guard = tch::no_grad_guard();
    let cfg = &model.cfg;
    let n = side * side;
    let inputs = random_inputs(cfg, side, txt);
    let mut caches = Vec::new();
    for format in [KvFormat::Prepared, KvFormat::Raw] {
        let mut cache = CapturedKv::new(format);
        let _ = model.forward_capture(&inputs, &mut cache)?;
        caches.push(cache);
    }
    for &r in &args.mask_ratios {
        anyhow::ensure!(r > 0.0 && r <= 1.0, "--mask-ratios: {r} is not in (0, 1]");
    }
    let masks: Vec<(f64, Tensor)> = args
        .mask_ratios
        .iter()
        .map(|&ratio| {
            let m = ((ratio * n as f64).round() as i64).clamp(1, n);
            (
                ratio,
                Tensor::randperm(n, (Kind::Int64, Device::Cpu)).narrow(0, 0, m),
            )
        })
        .collect();
    // Per format, one request per mask ratio.
    let requests: Vec<Vec<MaskedRequest>> = caches
        .iter()
        .map(|cache| {
            masks
                .iter()
                .map(|(_, index)| MaskedRequest {
                    hidden_states: inputs.hidden_states.squeeze_dim(0).index_select(0, index),
                    token_index: index.shallow_clone(),
                    encoder_hidden_states: inputs.encoder_hidden_states.squeeze_dim(0),
                    pooled_projections: inputs.pooled_projections.squeeze_dim(0),
                    timestep: 0.5,
                    guidance: cfg.guidance_embeds.then_some(3.5),
                    img_ids: inputs.img_ids.shallow_clone(),
                    txt_ids: inputs.txt_ids.shallow_clone(),
                    cache,
                    full_hidden_states: None,
                })
                .collect()
        })
        .collect();

    let mut full = Vec::new();
    let mut theirs = Vec::new();
    let mut masked: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); masks.len()]; caches.len()];
    for round in 0..args.warmup + args.runs.max(1) {
        let timed = round >= args.warmup;
        let ms = time_ms(|| model.forward(&inputs).map(drop))?;
        if timed {
            full.push(ms);
        }
        if let Some(d) = diffusers.as_deref_mut() {
            let ms = d.run()?;
            if timed {
                theirs.push(ms);
            }
        }
        for (reqs, by_mask) in requests.iter().zip(&mut masked) {
            for (req, times) in reqs.iter().zip(by_mask) {
                let ms = time_ms(|| model.forward_masked(std::slice::from_ref(req)).map(drop))?;
                if timed {
                    times.push(ms);
                }
            }
        }
    }
    // Minima too: on a shared machine the fastest run is the least disturbed one.
    let full_min = minimum(&full);
    let full_ms = median(full);
    println!("  full: {full_ms:.1} ms (min {full_min:.1})");
    let mut out = Map::new();
    if diffusers.is_some() {
        let min = minimum(&theirs);
        let ms = median(theirs);
        println!(
            "  diffusers full: {ms:.1} ms (min {min:.1}), ours/diffusers {:.3} (of minima {:.3})",
            full_ms / ms,
            full_min / min
        );
        out.insert("diffusers_full_min_ms".into(), json!(min));
        out.insert(
            "ours_over_diffusers_of_minima".into(),
            json!(full_min / min),
        );
        out.insert("diffusers_full_ms".into(), json!(ms));
        out.insert("ours_over_diffusers".into(), json!(full_ms / ms));
    }
    out.insert("full_ms".into(), json!(full_ms));
    out.insert("full_min_ms".into(), json!(full_min));
    for ((cache, by_mask), (key, ratio_key)) in caches.iter().zip(masked).zip([
        ("masked_ms", "full_over_masked_at_0_2"),
        ("masked_raw_ms", "full_over_masked_raw_at_0_2"),
    ]) {
        let mut by_ratio = Map::new();
        let mut by_ratio_min = Map::new();
        for ((ratio, index), times) in masks.iter().zip(by_mask) {
            let min = minimum(&times);
            let ms = median(times);
            println!(
                "  mask-aware ({:?} cache) at ratio {ratio}: {ms:.1} ms (min {min:.1}; {} of {n} tokens), full/masked {:.2} (of minima {:.2})",
                cache.format,
                index.size()[0],
                full_ms / ms,
                full_min / min
            );
            by_ratio.insert(ratio.to_string(), json!(ms));
            by_ratio_min.insert(ratio.to_string(), json!(min));
        }
        if let Some(min) = by_ratio_min.get("0.2").and_then(Value::as_f64) {
            out.insert(format!("{ratio_key}_of_minima"), json!(full_min / min));
        }
        out.insert(format!("{key}_min"), Value::Object(by_ratio_min));
        let at_02 = by_ratio
            .get("0.2")
            .and_then(Value::as_f64)
            .unwrap_or(f64::NAN);
        out.insert(key.into(), Value::Object(by_ratio));
        out.insert(ratio_key.into(), json!(full_ms / at_02));
    }
    out.insert("image_tokens".into(), json!(n));
    out.insert("text_tokens".into(), json!(txt));
    Ok(out)
}

fn time_ms(f: impl FnOnce() -> diffmesh_model::Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

const DIFFUSERS_BENCH: &str = r#"
import json, sys, time
import torch
from diffusers import FluxTransformer2DModel
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
torch.manual_seed(0)
cfg = {k: v for k, v in spec["config"].items()}
model = FluxTransformer2DModel(**cfg).eval()
side, txt = spec["side"], spec["txt"]
n = side * side
ids = torch.zeros(side, side, 3)
ids[..., 1] = torch.arange(side)[:, None]
ids[..., 2] = torch.arange(side)[None, :]
inputs = dict(
    hidden_states=torch.randn(1, n, cfg["in_channels"]),
    encoder_hidden_states=torch.randn(1, txt, cfg["joint_attention_dim"]),
    pooled_projections=torch.randn(1, cfg["pooled_projection_dim"]),
    timestep=torch.tensor([0.5]),
    img_ids=ids.reshape(n, 3),
    txt_ids=torch.zeros(txt, 3),
)
if cfg["guidance_embeds"]:
    inputs["guidance"] = torch.tensor([3.5])
print("ready", flush=True)
with torch.no_grad():
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t = time.perf_counter()
        model(**inputs, return_dict=False)
        print((time.perf_counter() - t) * 1e3, flush=True)
"#;
