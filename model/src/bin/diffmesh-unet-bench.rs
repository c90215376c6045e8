//! `cargo xtask bench unet`: the UNet2DConditionModel's full forward, ours against diffusers, and
//! against our mask-aware forward at mask 0.2 (FlashPS for UNets: 2.2x for SDXL on an H800), on
//! a medium SDXL-shaped config with random weights (issue 48: ours/diffusers <= 1.0). A diffusers
//! subprocess builds the model and saves it; this process loads the same weights; both time a
//! guided step's batch of two on the same inputs at the same thread count, interleaved in rounds
//! so a load change on a shared machine hits both alike. Prints human-readable lines, then one
//! JSON line with every figure last.
use anyhow::Result;
use clap::Parser;
use diffmesh_model::bench_worker::{median, minimum, DiffusersWorker};
use diffmesh_model::tch::{self, Device, Kind, Tensor};
use diffmesh_model::unet::{UNet2DConditionModel, UNetInputs};
use serde_json::json;
use std::time::Instant;

#[derive(Debug, Parser)]
#[command(about = "UNet full forward: diffmesh against diffusers")]
struct Args {
    /// Intra-op threads for both (default: all cores).
    #[arg(long, env = "DIFFMESH_BENCH_THREADS")]
    threads: Option<usize>,
    /// Timed rounds (the median and the minimum are reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Untimed warm-up rounds.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Latent side (the image is 8 times as wide).
    #[arg(long, default_value_t = 64)]
    side: i64,
    /// Python interpreter with diffusers installed.
    #[arg(
        long,
        env = "DIFFMESH_PYTHON",
        default_value = "/root/.cache/diffmesh/venv/bin/python"
    )]
    python: String,
}

/// SDXL's structure at about a tenth of its width: a plain first level, then 2 and 4
/// transformer layers per attention, head dim 64, text_time conditioning.
fn medium_config() -> serde_json::Value {
    json!({
        "block_out_channels": [128, 256, 384],
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "attention_head_dim": [2, 4, 6],
        "transformer_layers_per_block": [1, 2, 4],
        "cross_attention_dim": 512,
        "layers_per_block": 2,
        "norm_num_groups": 32,
        "use_linear_projection": true,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 64,
        "projection_class_embeddings_input_dim": 256 + 6 * 64,
    })
}

const TEXT_TOKENS: i64 = 77;
const POOLED: i64 = 256;

fn main() -> Result<()> {
    let args = Args::parse();
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    tch::set_num_threads(threads as i32);
    // Where diffusers saves the model for us (removed at the end).
    let dir = std::env::temp_dir().join(format!("diffmesh-unet-bench-{}", std::process::id()));
    let cfg = medium_config();
    println!(
        "threads: {threads}, runs: {} (median), latents 2x4x{side}x{side}, text {TEXT_TOKENS}",
        args.runs,
        side = args.side
    );
    println!("config: {cfg}");
    let spec = json!({ "config": cfg, "dir": dir, "side": args.side, "threads": threads,
        "txt": TEXT_TOKENS, "pooled": POOLED });
    let mut theirs = DiffusersWorker::start(&args.python, DIFFUSERS_BENCH, &spec)?;
    let unet = UNet2DConditionModel::load(&dir, Device::Cpu, Kind::Float);
    let _ = std::fs::remove_dir_all(&dir);
    let unet = unet?;
    tch::manual_seed(0);
    let opts = (Kind::Float, Device::Cpu);
    let inputs = UNetInputs {
        sample: Tensor::randn([2, 4, args.side, args.side], opts),
        timestep: Tensor::from_slice(&[500.0f32]),
        encoder_hidden_states: Tensor::randn([2, TEXT_TOKENS, 512], opts),
        text_embeds: Some(Tensor::randn([2, POOLED], opts)),
        time_ids: Some(
            Tensor::from_slice(&[1024.0f32, 1024.0, 0.0, 0.0, 1024.0, 1024.0]).repeat([2, 1]),
        ),
    };
    let _guard = tch::no_grad_guard();
    // A template's cache (its own inputs: the timing does not depend on the values) and a
    // mask as edits have them: one rectangle, a fifth of the latent pixels (scattered pixels
    // would mask nearly every token of the deeper levels, which pool 2x2 per level).
    let (_, cache) = unet.forward_capture(&inputs)?;
    let rect_h = ((args.side * args.side) as f64 * 0.2).sqrt().round() as i64;
    let rect_w = ((args.side * args.side) as f64 * 0.2 / rect_h as f64).round() as i64;
    let mask = Tensor::zeros([args.side, args.side], opts);
    let _ = mask
        .narrow(0, (args.side - rect_h) / 2, rect_h)
        .narrow(1, (args.side - rect_w) / 2, rect_w)
        .fill_(1.0);
    let (mut ours, mut diffusers, mut masked) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.warmup + args.runs.max(1) {
        let t = Instant::now();
        let _ = unet.forward(&inputs)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let theirs_ms = theirs.run()?;
        let t = Instant::now();
        let _ = unet.forward_masked(&inputs, &mask, &cache)?;
        let masked_ms = t.elapsed().as_secs_f64() * 1e3;
        if round >= args.warmup {
            ours.push(ms);
            diffusers.push(theirs_ms);
            masked.push(masked_ms);
        }
    }
    let masked_min = minimum(&masked);
    let masked_ms = median(masked);
    let (ours_min, theirs_min) = (minimum(&ours), minimum(&diffusers));
    let (ours_ms, theirs_ms) = (median(ours), median(diffusers));
    println!(
        "  ours {ours_ms:.1} ms (min {ours_min:.1}), diffusers {theirs_ms:.1} ms (min {theirs_min:.1}): ours/diffusers {:.3} (of minima {:.3})",
        ours_ms / theirs_ms,
        ours_min / theirs_min
    );
    println!(
        "  mask-aware at 0.2: {masked_ms:.1} ms (min {masked_min:.1}); full/masked {:.2} (of minima {:.2}); cache {} MB a step",
        ours_ms / masked_ms,
        ours_min / masked_min,
        cache.bytes() / 1_000_000
    );
    let report = json!({
        "unet_medium": {
            "masked_ms_at_0_2": masked_ms,
            "masked_min_ms_at_0_2": masked_min,
            "full_over_masked_at_0_2": ours_ms / masked_ms,
            "full_over_masked_at_0_2_of_minima": ours_min / masked_min,
            "cache_bytes_per_step": cache.bytes(),
            "full_ms": ours_ms,
            "full_min_ms": ours_min,
            "diffusers_full_ms": theirs_ms,
            "diffusers_full_min_ms": theirs_min,
            "ours_over_diffusers": ours_ms / theirs_ms,
            "ours_over_diffusers_of_minima": ours_min / theirs_min,
            "latent_side": args.side,
            "batch": 2,
        },
        "threads": threads,
    });
    println!("{report}");
    Ok(())
}

const DIFFUSERS_BENCH: &str = r#"
import json, sys, time
import torch
from diffusers import UNet2DConditionModel
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
torch.manual_seed(0)
model = UNet2DConditionModel(**spec["config"]).eval()
model.save_pretrained(spec["dir"], safe_serialization=True)
side = spec["side"]
sample = torch.randn(2, 4, side, side)
context = torch.randn(2, spec["txt"], spec["config"]["cross_attention_dim"])
added = {"text_embeds": torch.randn(2, spec["pooled"]),
         "time_ids": torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0]] * 2)}
print("ready", flush=True)
with torch.no_grad():
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t = time.perf_counter()
        model(sample, torch.tensor([500.0]), context, added_cond_kwargs=added, return_dict=False)
        print((time.perf_counter() - t) * 1e3, flush=True)
"#;
