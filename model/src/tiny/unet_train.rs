//! The tiny UNet (issue 48, item 7): a `UNet2DConditionModel` in the SDXL layout (a ResNet-only
//! first level, then two levels with `Transformer2DModel` blocks) trained on the tiny model's
//! procedural data, so what mask-aware UNet edits and UNet adapters do to an image is
//! measurable on any machine.
//!
//! It conditions on the tiny Flux model's text encoder, kept frozen (it already tells the
//! attributes apart), and denoises its pixel codec's latents (RGB 64x64 unshuffled to 12
//! channels at 32x32), with SD 2.1's v-prediction objective over the scaled-linear schedule SD
//! uses. (Epsilon prediction was tried first: in pixel space its error at the noisiest steps,
//! multiplied by sigma ~ 14.6 in the sampler's estimate of the image, left the samples noise;
//! v's image estimate carries its error unamplified.)
//! Prompts are dropped (to "") with a small probability for classifier-free guidance; the
//! saved weights are an EMA. The folder is a `StableDiffusionPipeline` whose text encoder,
//! tokenizer and VAE are diffmesh's tiny ones.
use super::codec::write_json;
use super::data::{batch, Generator, Split};
use super::train::{cosine_lr, fitted_steps, io_err, Ema, LossLog, FIT_AFTER_STEPS};
use crate::autocast::{Bf16Mode, CpuAutocast};
use crate::components::LatentCodec;
use crate::error::{read_json, ModelError, Result};
use crate::schedulers::{alphas_cumprod, DiscreteSchedulerConfig};
use crate::tiny::{DiffmeshPixelCodec, DiffmeshTinyTextEncoder};
use crate::unet::{UNet2DConditionModel, UNetConfig, UNetInputs};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};

/// Flags of `diffmesh-train-tiny unet`.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct UNetTrainArgs {
    /// The tiny model folder whose text encoder, tokenizer and pixel codec the UNet uses
    /// (copied into `--out`; the text encoder stays frozen).
    #[arg(long, default_value = "weights/tiny")]
    pub text_from: PathBuf,
    /// Output pipeline folder (diffusers layout); overwritten.
    #[arg(long, default_value = "weights/tiny-unet")]
    pub out: PathBuf,
    /// Optimiser steps (the learning-rate schedule's length).
    #[arg(long, default_value_t = 12000)]
    pub steps: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// libtorch intra-op threads (1 when other processes share the cores).
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Peak learning rate (AdamW, linear warmup, cosine decay to `lr * lr_final`).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 0.1)]
    pub lr_final: f64,
    #[arg(long, default_value_t = 200)]
    pub warmup: usize,
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    /// EMA decay of the saved weights (ramped in as min(decay, (1+s)/(10+s))).
    #[arg(long, default_value_t = 0.995)]
    pub ema_decay: f64,
    /// Probability of training a sample with the empty prompt.
    #[arg(long, default_value_t = 0.1)]
    pub uncond_prob: f64,
    /// Channels of the first level (the others have 2x and 4x).
    #[arg(long, default_value_t = 32)]
    pub width: i64,
    /// CPU bf16 autocast of the forward and backward passes.
    #[arg(long, value_enum, default_value_t = Bf16Mode::Off)]
    pub bf16: Bf16Mode,
    /// Steps per row of `train_log.csv`.
    #[arg(long, default_value_t = 50)]
    pub log_every: usize,
    /// Save the EMA weights every this many steps (0: only at the end).
    #[arg(long, default_value_t = 1000)]
    pub save_every: usize,
    /// Stop after the first step that ends past this wall time (minutes); after the first
    /// 300 steps the schedule is shortened to the steps that fit, so the learning rate decays.
    #[arg(long)]
    pub max_minutes: Option<f64>,
}

/// What `train_meta.json` records.
#[derive(Debug, Clone, Serialize)]
pub struct UNetTrainSummary {
    pub args: UNetTrainArgs,
    /// Steps of the learning-rate schedule that ran (`--steps`, or fewer to fit
    /// `--max-minutes`).
    pub schedule_steps: usize,
    pub steps_done: usize,
    pub bf16_autocast: bool,
    pub wall_time_s: f64,
    pub mean_step_s: f64,
    /// Mean loss of the last 100 steps.
    pub final_loss: f64,
    pub unet_params: i64,
}

/// The tiny UNet's `config.json` for first-level width `w`: SDXL's block layout at three
/// levels (32x32 ResNets only; 16x16 and 8x8 with one transformer layer each, heads of 32
/// channels where the width allows), conditioned on the tiny text encoder's 128-wide states.
pub fn tiny_unet_config_json(w: i64, latent_channels: i64, text_width: i64) -> serde_json::Value {
    serde_json::json!({
        "_class_name": crate::unet::CLASS_NAME,
        "_diffusers_version": "0.42.1",
        "sample_size": 32,
        "in_channels": latent_channels,
        "out_channels": latent_channels,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "mid_block_type": "UNetMidBlock2DCrossAttn",
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "block_out_channels": [w, 2 * w, 4 * w],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "cross_attention_dim": text_width,
        "attention_head_dim": [(w / 32).max(1), (2 * w / 32).max(1), (4 * w / 32).max(1)],
        "use_linear_projection": true,
    })
}

/// The scheduler the tiny UNet trains and samples with: SD's scaled-linear betas, v
/// prediction, Euler sampling from the last training timestep ("trailing").
pub fn tiny_unet_scheduler_json() -> serde_json::Value {
    serde_json::json!({
        "_class_name": "EulerDiscreteScheduler",
        "_diffusers_version": "0.42.1",
        "num_train_timesteps": 1000,
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "prediction_type": "v_prediction",
        "timestep_spacing": "trailing",
        "steps_offset": 1,
        "interpolation_type": "linear",
        "use_karras_sigmas": false,
    })
}

fn model_index_json() -> serde_json::Value {
    serde_json::json!({
        "_class_name": crate::stable_diffusion::SD_PIPELINE_CLASS,
        "_diffusers_version": "0.42.1",
        "requires_safety_checker": false,
        "scheduler": ["diffusers", "EulerDiscreteScheduler"],
        "text_encoder": ["diffmesh", super::text_encoder::CLASS_NAME],
        "tokenizer": ["diffmesh", "DiffmeshWordTokenizer"],
        "unet": ["diffusers", crate::unet::CLASS_NAME],
        "vae": ["diffmesh", super::codec::CLASS_NAME],
    })
}

/// Copy the plain files of `from/<name>` into `to/<name>`.
fn copy_folder(from: &Path, to: &Path, name: &str) -> Result<()> {
    let (src, dst) = (from.join(name), to.join(name));
    std::fs::create_dir_all(&dst).map_err(io_err(&dst))?;
    for entry in std::fs::read_dir(&src).map_err(io_err(&src))? {
        let path = entry.map_err(io_err(&src))?.path();
        if path.is_file() {
            let target = dst.join(path.file_name().unwrap_or_default());
            std::fs::copy(&path, &target).map_err(io_err(&target))?;
        }
    }
    Ok(())
}

/// Write the pipeline folder: the configs, the copied tiny components, and `unet` weights.
fn save(args: &UNetTrainArgs, config: &serde_json::Value, unet: &[(String, Tensor)]) -> Result<()> {
    for name in ["text_encoder", "tokenizer", "vae"] {
        copy_folder(&args.text_from, &args.out, name)?;
    }
    write_json(&args.out.join("model_index.json"), &model_index_json())?;
    write_json(
        &args.out.join("scheduler").join("scheduler_config.json"),
        &tiny_unet_scheduler_json(),
    )?;
    let dir = args.out.join("unet");
    write_json(&dir.join("config.json"), config)?;
    let mut vars: Vec<(String, Tensor)> = unet
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.f_contiguous()?)))
        .collect::<Result<_>>()?;
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let path = dir.join("diffusion_pytorch_model.safetensors");
    Tensor::write_safetensors(&vars, &path)?;
    Ok(())
}

/// The tiny UNet's training objective on a batch: noise `images` (`[B, 3, 64, 64]` in
/// [-1, 1]) to uniform timesteps and score the predicted velocity
/// `v = sqrt(a) noise - sqrt(1 - a) x0` (mean squared error).
pub fn v_prediction_loss(
    unet: &UNet2DConditionModel,
    text: &DiffmeshTinyTextEncoder,
    codec: &DiffmeshPixelCodec,
    alphas_cumprod: &Tensor,
    images: &Tensor,
    prompts: &[String],
) -> Result<Tensor> {
    let x0 = codec.encode(images)?;
    let b = x0.size()[0];
    let train_steps = alphas_cumprod.size()[0];
    let t = Tensor::f_randint(train_steps, [b], (Kind::Int64, x0.device()))?;
    let ac = alphas_cumprod.f_index_select(0, &t)?.f_view([b, 1, 1, 1])?;
    let noise = x0.f_randn_like()?;
    let (signal, spread) = (ac.f_sqrt()?, ac.f_neg()?.f_add_scalar(1.0)?.f_sqrt()?);
    let xt = x0.f_mul(&signal)?.f_add(&noise.f_mul(&spread)?)?;
    let v = noise.f_mul(&signal)?.f_sub(&x0.f_mul(&spread)?)?;
    let hidden = tch::no_grad(|| text.forward_ids(&text.tokenize(prompts)?))?.hidden;
    let predicted = unet.forward(&UNetInputs {
        sample: xt,
        timestep: t.f_to_kind(Kind::Float)?,
        encoder_hidden_states: hidden,
        text_embeds: None,
        time_ids: None,
    })?;
    Ok(predicted.f_sub(&v)?.f_square()?.f_mean(Kind::Float)?)
}

/// Train the tiny UNet and write the pipeline folder, `train_log.csv` and `train_meta.json`.
pub fn train_unet(args: &UNetTrainArgs) -> Result<UNetTrainSummary> {
    if args.steps == 0 || args.batch_size == 0 || args.log_every == 0 {
        return Err(ModelError::input(
            "steps/batch_size/log_every",
            "must each be at least 1",
        ));
    }
    if args.width < 8 || args.width % 8 != 0 {
        return Err(ModelError::input(
            "width",
            format!("must be a positive multiple of 8, got {}", args.width),
        ));
    }
    tch::set_num_threads(args.threads);
    tch::manual_seed(args.seed as i64);
    let (text, _text_vs) =
        DiffmeshTinyTextEncoder::load(&args.text_from.join("text_encoder"), Device::Cpu)?;
    let codec = DiffmeshPixelCodec::load(&args.text_from.join("vae"), Device::Cpu)?;
    let config_json = tiny_unet_config_json(
        args.width,
        codec.latent_channels(),
        text.config().hidden_size,
    );
    let config: UNetConfig = serde_json::from_value(config_json.clone())
        .map_err(|e| ModelError::config("unet", e.to_string()))?;
    let vs = nn::VarStore::new(Device::Cpu);
    let unet = UNet2DConditionModel::new(&vs.root(), config)?;
    let params: i64 = vs
        .trainable_variables()
        .iter()
        .map(Tensor::numel)
        .sum::<usize>() as i64;
    eprintln!("tiny UNet: {params} params");
    let scheduler: DiscreteSchedulerConfig = serde_json::from_value(tiny_unet_scheduler_json())
        .map_err(|e| ModelError::config("scheduler", e.to_string()))?;
    let alphas = Tensor::from_slice(&alphas_cumprod(&scheduler)?);
    let bf16 = args.bf16.enabled();
    let mut gen = Generator::new(Split::new().train, args.seed);
    let mut drop_rng = ChaCha8Rng::seed_from_u64(args.seed.wrapping_add(0x00d1_0b0e));
    let mut opt = nn::adamw(0.9, 0.99, args.weight_decay).build(&vs, args.lr)?;
    let mut ema = Ema::new(&vs);

    std::fs::create_dir_all(&args.out).map_err(io_err(&args.out))?;
    let csv_path = args.out.join("train_log.csv");
    let mut csv = std::fs::File::create(&csv_path).map_err(io_err(&csv_path))?;
    writeln!(csv, "step,loss,lr,elapsed_s").map_err(io_err(&csv_path))?;
    let mut losses = LossLog::default();
    let start = Instant::now();
    let mut steps_done = 0;
    // The schedule that runs: `--steps`, or fewer where `--max-minutes` would cut it short, so
    // the learning rate still decays to its end.
    let mut schedule = args.steps;
    let mut step = 0;
    while step < schedule {
        step += 1;
        let lr = cosine_lr(args.lr, args.lr_final, args.warmup, schedule, step);
        opt.set_lr(lr);
        let (images, mut prompts) = batch(&mut gen, args.batch_size);
        for p in prompts.iter_mut() {
            if drop_rng.random::<f64>() < args.uncond_prob {
                p.clear();
            }
        }
        let loss = {
            let _autocast = bf16.then(CpuAutocast::enter).transpose()?;
            v_prediction_loss(&unet, &text, &codec, &alphas, &images, &prompts)?
        };
        opt.zero_grad();
        loss.f_backward()?;
        opt.clip_grad_norm(1.0);
        opt.step();
        ema.update(
            args.ema_decay
                .min((1.0 + step as f64) / (10.0 + step as f64)),
        )?;
        losses.record(step, loss.f_double_value(&[])?)?;
        steps_done = step;
        if step == FIT_AFTER_STEPS {
            if let Some(minutes) = args.max_minutes {
                let elapsed = start.elapsed().as_secs_f64();
                let fitted = fitted_steps(schedule, step, elapsed, minutes * 60.0);
                if fitted < schedule {
                    eprintln!("--max-minutes {minutes}: the schedule now ends at step {fitted}");
                    schedule = fitted;
                }
            }
        }
        let stop_now = args
            .max_minutes
            .is_some_and(|m| start.elapsed().as_secs_f64() > m * 60.0);
        if step % args.log_every == 0 || step == schedule || stop_now {
            let mean = losses.take_window_mean();
            let elapsed = start.elapsed().as_secs_f64();
            writeln!(csv, "{step},{mean:.6},{lr:.3e},{elapsed:.1}").map_err(io_err(&csv_path))?;
            csv.flush().map_err(io_err(&csv_path))?;
            eprintln!(
                "step {step}/{schedule} loss {mean:.4} lr {lr:.2e} {:.3}s/step",
                elapsed / step as f64
            );
        }
        if args.save_every > 0 && step % args.save_every == 0 && step < schedule {
            save(args, &config_json, &ema.named())?;
        }
        if stop_now {
            eprintln!("stopping after step {step} (--max-minutes)");
            break;
        }
    }
    let wall = start.elapsed().as_secs_f64();
    save(args, &config_json, &ema.named())?;
    let summary = UNetTrainSummary {
        args: args.clone(),
        schedule_steps: schedule,
        steps_done,
        bf16_autocast: bf16,
        wall_time_s: wall,
        mean_step_s: wall / steps_done.max(1) as f64,
        final_loss: losses.recent_mean(),
        unet_params: params,
    };
    write_json(&args.out.join("train_meta.json"), &summary)?;
    Ok(summary)
}

/// The UNet config a trained folder holds (for checks and tests).
pub fn saved_config(dir: &Path) -> Result<UNetConfig> {
    read_json(&dir.join("unet").join("config.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_reduce_the_loss_on_a_fixed_draw_and_the_folder_loads_as_a_pipeline() {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny");
        let out = tempfile::tempdir().unwrap();
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: UNetTrainArgs,
        }
        let mut args = <Cli as clap::Parser>::parse_from(["test"]).args;
        (args.text_from, args.out) = (shipped.clone(), out.path().to_path_buf());
        (args.steps, args.batch_size, args.threads, args.width) = (2, 2, 1, 16);
        train_unet(&args).unwrap();
        let pipe = crate::stable_diffusion::SdPipeline::load(out.path(), Device::Cpu, Kind::Float)
            .unwrap();
        assert!(!pipe.is_xl());
        assert_eq!(
            saved_config(out.path()).unwrap().block_out_channels,
            [16, 32, 64]
        );

        // The objective itself: a few steps on one fixed draw lower it.
        tch::manual_seed(0);
        let (text, _) =
            DiffmeshTinyTextEncoder::load(&shipped.join("text_encoder"), Device::Cpu).unwrap();
        let codec = DiffmeshPixelCodec::load(&shipped.join("vae"), Device::Cpu).unwrap();
        let config: UNetConfig =
            serde_json::from_value(tiny_unet_config_json(16, 12, 128)).unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let unet = UNet2DConditionModel::new(&vs.root(), config).unwrap();
        let scheduler: DiscreteSchedulerConfig =
            serde_json::from_value(tiny_unet_scheduler_json()).unwrap();
        let alphas = Tensor::from_slice(&alphas_cumprod(&scheduler).unwrap());
        let (images, prompts) = batch(&mut Generator::new(Split::new().train, 1), 2);
        let fixed = || {
            tch::manual_seed(5);
            v_prediction_loss(&unet, &text, &codec, &alphas, &images, &prompts).unwrap()
        };
        let mut opt = nn::adamw(0.9, 0.99, 0.0).build(&vs, 2e-3).unwrap();
        let before = tch::no_grad(fixed).double_value(&[]);
        for _ in 0..10 {
            opt.backward_step(&fixed());
        }
        let after = tch::no_grad(fixed).double_value(&[]);
        assert!(after < 0.9 * before, "loss {before} -> {after}");
    }
}
