//! FLUX.1-dev's whole text-to-image pipeline with random weights, timed by phase: CLIP-L and
//! T5-XXL prompt encoding, every denoising step, the VAE decode, and the whole
//! `text_to_image` call. `python/gpu/diffusers_flux_e2e.py` times the same pipeline in diffusers
//! on the same device, so the two JSON lines compare (docs/GPU.md).
//!
//! `diffmesh-flux-e2e-bench [--config flux-dev|small] [--device cpu|cuda] [--size 1024]
//! [--steps 28] [--runs 2]` prints a line per run, then one JSON line with the medians last.
//! `small` is a reduced configuration for trying the bench on a CPU.
use anyhow::{bail, Result};
use clap::Parser;
use diffmesh_model::bench_inputs::flux_dev_config;
use diffmesh_model::components::{TextEmbeddings, TextEncoder};
use diffmesh_model::flux::{FluxConfig, FluxTransformer};
use diffmesh_model::noise_scheduler::{
    FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig,
};
use diffmesh_model::pipeline::{
    text_to_image, FluxPipeline, GenerateOptions, GenerationRequest, StepEvent,
};
use diffmesh_model::tch::{self, Device, Kind, Tensor};
use diffmesh_model::text::clip::{ClipTextConfig, ClipTextModel};
use diffmesh_model::text::t5::{T5Config, T5EncoderModel};
use diffmesh_model::vae::{AutoencoderKL, AutoencoderKLConfig};
use diffmesh_model::weights::new_store;
use serde_json::json;
use std::time::Instant;

#[derive(Debug, Parser)]
#[command(about = "FLUX.1 text-to-image pipeline latency by phase (random weights)")]
struct Args {
    /// `flux-dev` (full size: 12B transformer, T5-XXL, CLIP-L; a GPU) or `small` (a CPU try).
    #[arg(long, default_value = "small")]
    config: String,
    /// `cpu` (f32) or `cuda` (bf16).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Image side in pixels.
    #[arg(long, default_value_t = 1024)]
    size: i64,
    #[arg(long, default_value_t = 28)]
    steps: usize,
    /// T5 tokens (FLUX.1-dev's `max_sequence_length`).
    #[arg(long, default_value_t = 512)]
    t5_tokens: i64,
    /// Timed runs after one warm-up run; medians are reported.
    #[arg(long, default_value_t = 2)]
    runs: usize,
}

/// The four components' configurations.
struct Configs {
    clip: ClipTextConfig,
    t5: T5Config,
    transformer: FluxConfig,
    vae: AutoencoderKLConfig,
}

/// FLUX.1-dev's published configurations (CLIP ViT-L/14 text tower, T5 v1.1 XXL, the 19+38
/// block transformer with guidance embedding, the 16-channel VAE).
fn flux_dev() -> Configs {
    Configs {
        clip: ClipTextConfig {
            hidden_size: 768,
            intermediate_size: 3072,
            num_attention_heads: 12,
            eos_token_id: 2,
            ..ClipTextConfig::default()
        },
        t5: T5Config {
            d_model: 4096,
            d_kv: 64,
            d_ff: 10240,
            num_layers: 24,
            num_heads: 64,
            feed_forward_proj: "gated-gelu".into(),
            ..T5Config::default()
        },
        transformer: flux_dev_config(),
        vae: flux_vae(vec![128, 256, 512, 512], 2),
    }
}

/// The same shapes, shrunk so a CPU runs them in seconds.
fn small() -> Configs {
    Configs {
        clip: ClipTextConfig {
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            eos_token_id: 2,
            ..ClipTextConfig::default()
        },
        t5: T5Config {
            d_model: 128,
            d_kv: 32,
            d_ff: 256,
            num_layers: 2,
            num_heads: 4,
            feed_forward_proj: "gated-gelu".into(),
            ..T5Config::default()
        },
        transformer: FluxConfig {
            num_layers: 1,
            num_single_layers: 1,
            attention_head_dim: 32,
            num_attention_heads: 2,
            joint_attention_dim: 128,
            pooled_projection_dim: 64,
            guidance_embeds: true,
            axes_dims_rope: vec![8, 12, 12],
            ..FluxConfig::default()
        },
        vae: flux_vae(vec![32, 32], 1),
    }
}

fn flux_vae(block_out_channels: Vec<i64>, layers_per_block: i64) -> AutoencoderKLConfig {
    let blocks = block_out_channels.len();
    AutoencoderKLConfig {
        down_block_types: vec!["DownEncoderBlock2D".into(); blocks],
        up_block_types: vec!["UpDecoderBlock2D".into(); blocks],
        block_out_channels,
        layers_per_block,
        latent_channels: 16,
        scaling_factor: 0.3611,
        shift_factor: Some(0.1159),
        use_quant_conv: false,
        use_post_quant_conv: false,
        ..AutoencoderKLConfig::default()
    }
}

/// CLIP pooled + T5 hidden states from token ids derived from the prompt's bytes: the models'
/// cost without tokenizer files (a tokenizer's own cost is microseconds beside them).
struct IdsEncoder {
    clip: ClipTextModel,
    t5: T5EncoderModel,
    t5_tokens: i64,
}

impl IdsEncoder {
    fn ids(prompt: &str, length: i64, vocab: i64) -> Vec<i64> {
        let bytes = prompt.as_bytes();
        (0..length)
            .map(|i| {
                let b = bytes.get(i as usize % bytes.len().max(1)).copied();
                (i64::from(b.unwrap_or(0)) * 131 + i) % vocab
            })
            .collect()
    }

    fn batch_ids(prompts: &[String], length: i64, vocab: i64) -> Result<Tensor, tch::TchError> {
        let ids: Vec<i64> = prompts
            .iter()
            .flat_map(|p| Self::ids(p, length, vocab))
            .collect();
        Tensor::from_slice(&ids).f_view([prompts.len() as i64, length])
    }
}

impl TextEncoder for IdsEncoder {
    fn encode(&self, prompts: &[String]) -> diffmesh_model::Result<TextEmbeddings> {
        tch::no_grad(|| {
            let (device, _) = self.t5.device_kind();
            let clip_cfg = &self.clip.config;
            let clip_ids = Self::batch_ids(
                prompts,
                clip_cfg.max_position_embeddings,
                clip_cfg.vocab_size,
            )?
            .f_to_device(device)?;
            let pooled = self.clip.forward(&clip_ids)?.pooler_output;
            let t5_ids = Self::batch_ids(prompts, self.t5_tokens, self.t5.config.vocab_size)?
                .f_to_device(device)?;
            let hidden = self.t5.forward(&t5_ids)?;
            Ok(TextEmbeddings { hidden, pooled })
        })
    }

    fn max_tokens(&self) -> i64 {
        self.t5_tokens
    }
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One run's phases in ms.
struct RunTimes {
    encode: f64,
    steps: Vec<f64>,
    decode: f64,
    total: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let configs = match args.config.as_str() {
        "flux-dev" => flux_dev(),
        "small" => small(),
        other => bail!("config: `{other}` is not flux-dev or small"),
    };
    let (device, kind) = match args.device.as_str() {
        "cpu" => (Device::Cpu, Kind::Float),
        "cuda" => (Device::Cuda(0), Kind::BFloat16),
        other => bail!("device: `{other}` is not cpu or cuda"),
    };
    tch::manual_seed(0);
    let _guard = tch::no_grad_guard();
    let built = Instant::now();
    let clip_vs = new_store(device, kind);
    let clip = ClipTextModel::new(&clip_vs.root(), configs.clip)?;
    let t5_vs = new_store(device, kind);
    let t5 = T5EncoderModel::new(&t5_vs.root(), configs.t5)?;
    let flux_vs = new_store(device, kind);
    let transformer = FluxTransformer::new(&flux_vs.root(), configs.transformer)?;
    let vae_vs = new_store(device, kind);
    let vae = AutoencoderKL::new(&vae_vs.root(), configs.vae)?;
    let scheduler = FlowMatchEulerDiscreteScheduler::new(FlowMatchEulerDiscreteSchedulerConfig {
        shift: 3.0,
        use_dynamic_shifting: true,
        ..FlowMatchEulerDiscreteSchedulerConfig::default()
    })?;
    let encoder = IdsEncoder {
        clip,
        t5,
        t5_tokens: args.t5_tokens,
    };
    sync(device);
    let build_s = built.elapsed().as_secs_f64();
    let params: i64 = [&clip_vs, &t5_vs, &flux_vs, &vae_vs]
        .iter()
        .flat_map(|vs| vs.trainable_variables())
        .map(|t| t.numel() as i64)
        .sum();
    println!(
        "{} on {}: {:.2}B parameters built in {build_s:.1} s",
        args.config,
        args.device,
        params as f64 / 1e9
    );
    let pipeline = FluxPipeline {
        transformer: &transformer,
        text_encoder: &encoder,
        codec: &vae,
        scheduler: &scheduler,
    };
    let requests = [GenerationRequest {
        prompt: "a photograph of a lighthouse on a cliff at dusk".into(),
        seed: 7,
    }];
    let opts = GenerateOptions {
        height: args.size,
        width: args.size,
        steps: args.steps,
        ..GenerateOptions::default()
    };
    let prompts: Vec<String> = requests.iter().map(|r| r.prompt.clone()).collect();
    let mut runs = Vec::new();
    for run in 0..args.runs + 1 {
        sync(device);
        let t = Instant::now();
        encoder.encode(&prompts)?;
        sync(device);
        let encode = t.elapsed().as_secs_f64() * 1e3;
        // Step ends, device-synchronised, relative to the pipeline's start.
        let mut ends: Vec<f64> = Vec::with_capacity(args.steps);
        let start = Instant::now();
        let mut observe = |_: &StepEvent<'_>| -> diffmesh_model::Result<()> {
            sync(device);
            ends.push(start.elapsed().as_secs_f64() * 1e3);
            Ok(())
        };
        let out = text_to_image(&pipeline, &requests, &opts, Some(&mut observe))?;
        sync(device);
        let total = start.elapsed().as_secs_f64() * 1e3;
        let finite = out.images.isfinite().all().int64_value(&[]) != 0;
        let steps: Vec<f64> = ends.windows(2).map(|w| w[1] - w[0]).collect();
        let decode = total - ends.last().copied().unwrap_or(0.0);
        println!(
            "run {run}{}: encode {encode:.1} ms, step median {:.1} ms, decode {decode:.1} ms, pipeline {total:.1} ms (images finite: {finite})",
            if run == 0 { " (warm-up)" } else { "" },
            median(steps.clone())
        );
        if run > 0 {
            runs.push(RunTimes {
                encode,
                steps,
                decode,
                total,
            });
        }
    }
    let pick = |f: &dyn Fn(&RunTimes) -> f64| median(runs.iter().map(f).collect());
    let step_ms = median(runs.iter().flat_map(|r| r.steps.clone()).collect());
    println!(
        "{}",
        json!({
            "impl": "diffmesh",
            "config": args.config,
            "device": args.device,
            "dtype": format!("{kind:?}"),
            "size": args.size,
            "steps": args.steps,
            "t5_tokens": args.t5_tokens,
            "parameters": params,
            "build_s": build_s,
            "encode_ms": pick(&|r| r.encode),
            "step_ms": step_ms,
            "decode_ms": pick(&|r| r.decode),
            "pipeline_ms": pick(&|r| r.total),
            "runs": runs.len(),
        })
    );
    Ok(())
}
