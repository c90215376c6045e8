//! Flow-matching training of the tiny model on the procedural data (rectified flow, as Flux):
//! `x_t = (1 - t) x0 + t noise`, the transformer predicts `noise - x0`, `t` is logit-normal
//! (wide, unshifted by default, so the low-noise steps where outlines are drawn get trained too;
//! `--t-shift`, `--t-mean`, `--t-std` change it).
//! The text encoder trains jointly; prompts are dropped (replaced by "") with a small probability
//! so classifier-free guidance has an unconditional branch. Weights are saved as an EMA.
use super::data::{batch_with_boxes, Generator, Split};
use super::model::{
    flux_config, TinyModel, DEFAULT_DOUBLE_BLOCKS, DEFAULT_HEADS, DEFAULT_HEAD_DIM,
    DEFAULT_SINGLE_BLOCKS, SHIFT,
};
use super::plot;
use super::validate::Validation;
use crate::autocast::{Bf16Mode, CpuAutocast};
use crate::error::{ModelError, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};

/// Flags of `diffmesh-train-tiny` (train); the defaults are the shipped run's (all 16000
/// steps, 53 min on its AMX CPU). On a slower machine the schedule is shortened to what
/// `--max-minutes` holds (`--fit-schedule`), so the learning rate still decays to its end;
/// with the limit raised (`--max-minutes 600`) it trains the shipped run's steps (the same
/// weights bit for bit on a machine of the same kind).
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct TrainArgs {
    /// Output model folder (diffusers layout); overwritten.
    #[arg(long, env = "DIFFMESH_TINY_OUT", default_value = "weights/tiny")]
    pub out: PathBuf,
    /// Optimiser steps.
    #[arg(long, env = "DIFFMESH_TINY_STEPS", default_value_t = 16000)]
    pub steps: usize,
    /// Seed of weight init, noise, timesteps and the data stream.
    #[arg(long, env = "DIFFMESH_TINY_SEED", default_value_t = 0)]
    pub seed: u64,
    /// libtorch intra-op threads (2 on an idle 2-core machine; use 1 when other processes share
    /// the cores: OpenMP barriers stall when a core is taken; results differ from other counts
    /// only by float rounding).
    #[arg(long, env = "DIFFMESH_TINY_THREADS", default_value_t = 2)]
    pub threads: i32,
    /// Images per step.
    #[arg(long, env = "DIFFMESH_TINY_BATCH", default_value_t = 12)]
    pub batch_size: usize,
    /// Peak learning rate (AdamW, linear warmup, then cosine decay to `lr * lr_final` at the
    /// last of `--steps`).
    #[arg(long, env = "DIFFMESH_TINY_LR", default_value_t = 1e-3)]
    pub lr: f64,
    /// Learning rate at the last step as a fraction of `--lr` (1: constant after warmup, so
    /// stopping early at step k gives exactly the model `--steps k` gives).
    #[arg(long, env = "DIFFMESH_TINY_LR_FINAL", default_value_t = 0.1)]
    pub lr_final: f64,
    /// Warmup steps.
    #[arg(long, env = "DIFFMESH_TINY_WARMUP", default_value_t = 100)]
    pub warmup: usize,
    /// AdamW weight decay.
    #[arg(long, env = "DIFFMESH_TINY_WEIGHT_DECAY", default_value_t = 0.01)]
    pub weight_decay: f64,
    /// EMA decay of the saved weights (ramped in as min(decay, (1+s)/(10+s))).
    #[arg(long, env = "DIFFMESH_TINY_EMA", default_value_t = 0.995)]
    pub ema_decay: f64,
    /// Probability of training a sample with the empty prompt (for classifier-free guidance).
    #[arg(long, env = "DIFFMESH_TINY_UNCOND_PROB", default_value_t = 0.1)]
    pub uncond_prob: f64,
    /// Training timesteps are `shift(sigmoid(n))`, `n ~ N(t_mean, t_std)`: mean of `n`
    /// (negative spends more steps at low noise, where edges are drawn).
    #[arg(
        long,
        env = "DIFFMESH_TINY_T_MEAN",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub t_mean: f64,
    /// Standard deviation of `n` (see `--t-mean`).
    #[arg(long, env = "DIFFMESH_TINY_T_STD", default_value_t = 1.6)]
    pub t_std: f64,
    /// Time shift of the training timesteps (`shift(u) = s u / (1 + (s - 1) u)`; the
    /// scheduler samples with 2.0, but training with it leaves t < 0.2, where the last sampling
    /// steps run and edges are drawn, to 2% of the steps).
    #[arg(long, env = "DIFFMESH_TINY_T_SHIFT", default_value_t = 1.0)]
    pub t_shift: f64,
    /// Loss weight of the pixels in each object's bounding box (grown by `--box-margin`)
    /// relative to 1 elsewhere: the box is where shapes differ, ~15% of the image.
    #[arg(long, env = "DIFFMESH_TINY_OBJECT_WEIGHT", default_value_t = 1.0)]
    pub object_weight: f64,
    /// Pixels the weighted object box extends beyond the object's bounding box.
    #[arg(long, env = "DIFFMESH_TINY_BOX_MARGIN", default_value_t = 2.0)]
    pub box_margin: f64,
    /// Transformer attention heads (width = heads x head_dim).
    #[arg(long, env = "DIFFMESH_TINY_HEADS", default_value_t = DEFAULT_HEADS)]
    pub heads: i64,
    /// Channels per attention head (a multiple of 16).
    #[arg(long, env = "DIFFMESH_TINY_HEAD_DIM", default_value_t = DEFAULT_HEAD_DIM)]
    pub head_dim: i64,
    /// Transformer double-stream blocks.
    #[arg(long, env = "DIFFMESH_TINY_DOUBLE_BLOCKS", default_value_t = DEFAULT_DOUBLE_BLOCKS)]
    pub double_blocks: i64,
    /// Transformer single-stream blocks.
    #[arg(long, env = "DIFFMESH_TINY_SINGLE_BLOCKS", default_value_t = DEFAULT_SINGLE_BLOCKS)]
    pub single_blocks: i64,
    /// Run the forward and backward passes under CPU autocast to bfloat16 (weights, optimiser
    /// and EMA stay f32): 1.35x the steps per minute at the shipped width on a CPU with AMX
    /// (1.18x at width 128, 1.54x at 256); slower on CPUs without bf16 units, so `auto` turns
    /// it on only where the CPU has them (`on`/`true`, `off`/`false` force it).
    #[arg(long, env = "DIFFMESH_TINY_BF16", value_enum, default_value_t = Bf16Mode::Auto)]
    pub bf16: Bf16Mode,
    /// Steps per row of `train_log.csv` (mean loss over the window).
    #[arg(long, env = "DIFFMESH_TINY_LOG_EVERY", default_value_t = 10)]
    pub log_every: usize,
    /// Stop after the first step that ends past this wall time (minutes); `train_meta.json`
    /// records `steps_done`, and `--stop-after <steps_done>` (same `--steps`) reproduces it.
    #[arg(long, env = "DIFFMESH_TINY_MAX_MINUTES", default_value = "58")]
    pub max_minutes: Option<f64>,
    /// With `--max-minutes`: time the first steps and, when all of `--steps` would not fit in
    /// the limit, shorten the schedule to the steps that do (with a 3% margin), so the learning
    /// rate decays fully instead of the run being cut at its peak. `train_meta.json` records
    /// the steps asked for and the schedule run; `--steps <schedule>` reproduces the run.
    #[arg(long, env = "DIFFMESH_TINY_FIT_SCHEDULE", default_value_t = true, action = clap::ArgAction::Set)]
    pub fit_schedule: bool,
    /// Stop after this step while keeping the learning-rate schedule of `--steps`: reproduces a
    /// run that `--max-minutes` cut short.
    #[arg(long, env = "DIFFMESH_TINY_STOP_AFTER")]
    pub stop_after: Option<usize>,
    /// Score the EMA model on the fixed validation batch every this many steps, per noise band,
    /// into `val_log.csv` (0: never; it does not change the training run either way).
    #[arg(long, env = "DIFFMESH_TINY_VAL_EVERY", default_value_t = 250)]
    pub val_every: usize,
    /// Save the EMA model every this many steps (0: only at the end).
    #[arg(long, env = "DIFFMESH_TINY_SAVE_EVERY", default_value_t = 250)]
    pub save_every: usize,
    /// Start from the weights of this model folder instead of a fresh init (a second training
    /// stage: fresh optimiser state and learning-rate schedule; the transformer size flags must
    /// match the folder's config).
    #[arg(long, env = "DIFFMESH_TINY_INIT_FROM")]
    pub init_from: Option<PathBuf>,
}

/// What `train_meta.json` records.
#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    pub args: TrainArgs,
    /// Steps of the learning-rate schedule that ran: `args.steps`, or fewer when
    /// `--fit-schedule` shortened it to the time limit.
    pub schedule_steps: usize,
    pub steps_done: usize,
    /// Whether the run used bf16 autocast (`--bf16 auto` resolved on its CPU).
    pub bf16_autocast: bool,
    pub wall_time_s: f64,
    pub mean_step_s: f64,
    /// Mean loss of the last 100 steps.
    pub final_loss: f64,
    pub text_encoder_params: i64,
    pub transformer_params: i64,
    pub train_tuples: usize,
    pub held_out_tuples: usize,
}

/// Exponential moving average of a `VarStore`'s variables.
pub(super) struct Ema {
    names: Vec<String>,
    live: Vec<Tensor>,
    shadow: Vec<Tensor>,
}

impl Ema {
    pub(super) fn new(vs: &nn::VarStore) -> Self {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let shadow = vars.iter().map(|(_, t)| t.detach().copy()).collect();
        let (names, live) = vars.into_iter().unzip();
        Ema {
            names,
            live,
            shadow,
        }
    }

    pub(super) fn update(&mut self, decay: f64) -> Result<()> {
        tch::no_grad(|| {
            for (s, v) in self.shadow.iter_mut().zip(&self.live) {
                let _ = s.f_mul_scalar_(decay)?;
                let _ = s.f_add_(&v.f_mul_scalar(1.0 - decay)?)?;
            }
            Ok(())
        })
    }

    /// Exchange the live weights with the averaged ones (exact copies: twice restores both).
    fn swap(&mut self) -> Result<()> {
        tch::no_grad(|| {
            for (s, v) in self.shadow.iter_mut().zip(self.live.iter_mut()) {
                let mut live = v.f_empty_like()?;
                live.f_copy_(v)?;
                v.f_copy_(s)?;
                s.f_copy_(&live)?;
            }
            Ok(())
        })
    }

    pub(super) fn named(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .cloned()
            .zip(self.shadow.iter().map(|t| t.shallow_clone()))
            .collect()
    }
}

/// A training run's losses: the window since the last log row, and the last 100 steps.
#[derive(Default)]
pub(super) struct LossLog {
    window: Vec<f64>,
    recent: std::collections::VecDeque<f64>,
}

impl LossLog {
    /// Keep step `step`'s loss; a loss that is not finite ends the run.
    pub(super) fn record(&mut self, step: usize, value: f64) -> Result<()> {
        if !value.is_finite() {
            return Err(ModelError::input(
                "loss",
                format!("became {value} at step {step}; lower --lr"),
            ));
        }
        self.window.push(value);
        self.recent.push_back(value);
        if self.recent.len() > 100 {
            self.recent.pop_front();
        }
        Ok(())
    }

    /// Mean of the window, which starts again.
    pub(super) fn take_window_mean(&mut self) -> f64 {
        let mean = self.window.iter().sum::<f64>() / self.window.len().max(1) as f64;
        self.window.clear();
        mean
    }

    /// Mean of the last 100 steps.
    pub(super) fn recent_mean(&self) -> f64 {
        self.recent.iter().sum::<f64>() / self.recent.len().max(1) as f64
    }
}

/// Steps timed before `--fit-schedule` decides: past the warmup, one validation and one save,
/// so the rate includes their share.
pub(super) const FIT_AFTER_STEPS: usize = 300;
/// Share of `--max-minutes` a fitted schedule plans to use (the rest absorbs step-time noise).
const FIT_MARGIN: f64 = 0.97;

/// The schedule length that fits `budget_s` at `elapsed_s` for the first `done` steps: `steps`
/// when it all fits, else fewer (never fewer than `done`).
pub(super) fn fitted_steps(steps: usize, done: usize, elapsed_s: f64, budget_s: f64) -> usize {
    if done == 0 || elapsed_s <= 0.0 {
        return steps;
    }
    let per_step = elapsed_s / done as f64;
    let fits = (budget_s * FIT_MARGIN / per_step).floor() as usize;
    steps.min(fits.max(done))
}

fn lr_at(args: &TrainArgs, step: usize) -> f64 {
    cosine_lr(args.lr, args.lr_final, args.warmup, args.steps, step)
}

/// Linear warmup to `lr` over `warmup` steps, then cosine decay to `lr * lr_final` at `steps`.
pub(super) fn cosine_lr(lr: f64, lr_final: f64, warmup: usize, steps: usize, step: usize) -> f64 {
    if step < warmup {
        return lr * step as f64 / warmup as f64;
    }
    let span = steps.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    lr * (lr_final + (1.0 - lr_final) * cosine)
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// How training draws timesteps: `t = shift(sigmoid(n))`, `n ~ N(mean, std)`.
#[derive(Debug, Clone, Copy)]
pub struct TimeSampling {
    pub mean: f64,
    pub std: f64,
    pub shift: f64,
}

impl Default for TimeSampling {
    /// The scheduler's shift over a standard logit-normal.
    fn default() -> Self {
        TimeSampling {
            mean: 0.0,
            std: 1.0,
            shift: SHIFT,
        }
    }
}

/// A flow-matching training batch: the clean tokens noised to times `t` (`[B]`, drawn from
/// `time`), and the velocity the model should predict there.
pub struct NoisedBatch {
    pub xt: Tensor,
    pub t: Tensor,
    pub target: Tensor,
}

/// Noise `x0` (`[B, N, C]`) to random times: `xt = (1 - t) x0 + t noise`, target `noise - x0`.
pub fn noised(x0: &Tensor, time: TimeSampling) -> Result<NoisedBatch> {
    let b = x0.size()[0];
    let noise = x0.f_randn_like()?;
    let u = Tensor::f_randn([b], (Kind::Float, x0.device()))?
        .f_mul_scalar(time.std)?
        .f_add_scalar(time.mean)?
        .f_sigmoid()?;
    let s = time.shift;
    let t = (&u * s).f_div(&(u.f_mul_scalar(s - 1.0)?.f_add_scalar(1.0)?))?;
    let tt = t.f_view([b, 1, 1])?;
    let xt = x0
        .f_mul(&tt.f_neg()?.f_add_scalar(1.0)?)?
        .f_add(&noise.f_mul(&tt)?)?;
    let target = noise.f_sub(x0)?;
    Ok(NoisedBatch { xt, t, target })
}

/// One flow-matching loss on a batch (`images` in [-1, 1], `prompts` may contain "").
/// `weights` (`[B, 3, 64, 64]`, like `images`) weights each pixel's squared error; the loss is
/// the weighted mean.
pub fn flow_matching_loss(
    model: &TinyModel,
    images: &Tensor,
    prompts: &[String],
    time: TimeSampling,
    weights: Option<&Tensor>,
) -> Result<Tensor> {
    let x0 = model.images_to_tokens(images)?;
    let NoisedBatch { xt, t, target } = noised(&x0, time)?;
    let ids = model.text_encoder.tokenize(prompts)?;
    let text = model.text_encoder.forward_ids(&ids)?;
    let v = model.velocity(&xt, &text, &t)?;
    let err = v.f_sub(&target)?.f_square()?;
    match weights {
        None => Ok(err.f_mean(Kind::Float)?),
        Some(w) => {
            let w = model.images_to_tokens(w)?;
            Ok(err
                .f_mul(&w)?
                .f_sum(Kind::Float)?
                .f_div(&w.f_sum(Kind::Float)?)?)
        }
    }
}

/// Train (from scratch, or on from `--init-from`) and write the model folder, `train_log.csv`, `train_meta.json` and
/// `loss_curve.png` into `args.out`.
pub fn train(args: &TrainArgs) -> Result<TrainSummary> {
    if args.steps == 0 || args.batch_size == 0 {
        return Err(ModelError::input(
            "steps/batch_size",
            "must both be at least 1",
        ));
    }
    tch::set_num_threads(args.threads);
    if args.object_weight <= 0.0 || args.t_std <= 0.0 || args.t_shift <= 0.0 {
        return Err(ModelError::input(
            "object_weight/t_std/t_shift",
            "must all be positive",
        ));
    }
    tch::manual_seed(args.seed as i64);
    if args.head_dim <= 0 || args.head_dim % 16 != 0 {
        return Err(ModelError::input(
            "head_dim",
            format!("must be a positive multiple of 16, got {}", args.head_dim),
        ));
    }
    let config = flux_config(
        args.heads,
        args.head_dim,
        args.double_blocks,
        args.single_blocks,
    );
    let model = match &args.init_from {
        None => TinyModel::with_flux_config(Device::Cpu, config)?,
        Some(dir) => {
            let model = TinyModel::load(dir, Device::Cpu)?;
            let size = |c: &crate::flux::FluxConfig| {
                (
                    c.num_attention_heads,
                    c.attention_head_dim,
                    c.num_layers,
                    c.num_single_layers,
                )
            };
            if size(&model.flux_config) != size(&config) {
                return Err(ModelError::input(
                    "init_from",
                    format!(
                        "{} holds a transformer of another size than --heads/--head-dim/\
                         --double-blocks/--single-blocks ask for",
                        dir.display()
                    ),
                ));
            }
            eprintln!("starting from the weights in {}", dir.display());
            model
        }
    };
    let bf16 = args.bf16.enabled();
    eprintln!("bf16 autocast: {bf16} (--bf16 {:?})", args.bf16);
    let time = TimeSampling {
        mean: args.t_mean,
        std: args.t_std,
        shift: args.t_shift,
    };
    let (te_params, tr_params) = model.parameter_counts();
    eprintln!("tiny model: text encoder {te_params} params, transformer {tr_params} params");
    let split = Split::new();
    let mut gen = Generator::new(split.train.clone(), args.seed);
    let mut drop_rng = ChaCha8Rng::seed_from_u64(args.seed.wrapping_add(0x00d1_0b0e));
    let opt_cfg = nn::adamw(0.9, 0.99, args.weight_decay);
    let mut opt_tr = opt_cfg.build(&model.transformer_vs, args.lr)?;
    let mut opt_te = opt_cfg.build(&model.text_vs, args.lr)?;
    let mut ema_tr = Ema::new(&model.transformer_vs);
    let mut ema_te = Ema::new(&model.text_vs);

    std::fs::create_dir_all(&args.out).map_err(io_err(&args.out))?;
    let csv_path = args.out.join("train_log.csv");
    let mut csv = std::fs::File::create(&csv_path).map_err(io_err(&csv_path))?;
    writeln!(csv, "step,loss,lr,elapsed_s").map_err(io_err(&csv_path))?;
    let mut curve: Vec<(f64, f64)> = Vec::new();
    let mut losses = LossLog::default();
    let start = Instant::now();
    let mut steps_done = 0;
    let validation = match args.val_every {
        0 => None,
        _ => Some(Validation::new(&model)?),
    };
    let val_path = args.out.join("val_log.csv");
    let mut val_csv = match validation {
        Some(_) => {
            let mut f = std::fs::File::create(&val_path).map_err(io_err(&val_path))?;
            writeln!(f, "step,t_mid,loss,box_loss").map_err(io_err(&val_path))?;
            Some(f)
        }
        None => None,
    };
    let mut val_curve: Vec<(f64, f64)> = Vec::new();
    let save = |ema_te: &Ema, ema_tr: &Ema| {
        model.save(&args.out, Some((&ema_te.named(), &ema_tr.named())))
    };
    // The schedule that runs: `--steps`, unless `--fit-schedule` shortens it.
    let mut schedule = args.clone();
    let mut step = 0;
    while step < schedule.steps {
        step += 1;
        let lr = lr_at(&schedule, step);
        opt_tr.set_lr(lr);
        opt_te.set_lr(lr);
        let mut b = batch_with_boxes(&mut gen, args.batch_size, args.box_margin);
        for p in b.prompts.iter_mut() {
            if drop_rng.random::<f64>() < args.uncond_prob {
                p.clear();
            }
        }
        // 1 outside the object box, object_weight inside.
        let weights = (args.object_weight != 1.0)
            .then(|| {
                b.boxes
                    .f_mul_scalar(args.object_weight - 1.0)?
                    .f_add_scalar(1.0)
            })
            .transpose()?;
        let loss = {
            let _autocast = bf16.then(CpuAutocast::enter).transpose()?;
            flow_matching_loss(&model, &b.images, &b.prompts, time, weights.as_ref())?
        };
        opt_tr.zero_grad();
        opt_te.zero_grad();
        loss.f_backward()?;
        opt_tr.clip_grad_norm(1.0);
        opt_te.clip_grad_norm(1.0);
        opt_tr.step();
        opt_te.step();
        let decay = args
            .ema_decay
            .min((1.0 + step as f64) / (10.0 + step as f64));
        ema_tr.update(decay)?;
        ema_te.update(decay)?;
        losses.record(step, loss.f_double_value(&[])?)?;
        steps_done = step;
        if step == FIT_AFTER_STEPS && args.fit_schedule {
            if let Some(minutes) = args.max_minutes {
                let elapsed = start.elapsed().as_secs_f64();
                let fitted = fitted_steps(schedule.steps, step, elapsed, minutes * 60.0);
                if fitted < schedule.steps {
                    eprintln!(
                        "{:.3} s/step: {} steps would take {:.0} min, over --max-minutes {minutes}; \
                         the schedule now ends at step {fitted} (--fit-schedule)",
                        elapsed / step as f64,
                        schedule.steps,
                        elapsed / step as f64 * schedule.steps as f64 / 60.0
                    );
                    schedule.steps = fitted;
                }
            }
        }
        let stop_now = args
            .max_minutes
            .is_some_and(|m| start.elapsed().as_secs_f64() > m * 60.0)
            || args.stop_after.is_some_and(|k| step >= k);
        if step % args.log_every == 0 || step == schedule.steps || stop_now {
            let mean = losses.take_window_mean();
            let elapsed = start.elapsed().as_secs_f64();
            writeln!(csv, "{step},{mean:.6},{lr:.3e},{elapsed:.1}").map_err(io_err(&csv_path))?;
            csv.flush().map_err(io_err(&csv_path))?;
            curve.push((step as f64, mean));
            eprintln!(
                "step {step}/{} loss {mean:.4} lr {lr:.2e} {:.2}s/step",
                schedule.steps,
                elapsed / step as f64
            );
        }
        let last = step == schedule.steps || stop_now;
        if let (Some(val), Some(f)) = (&validation, val_csv.as_mut()) {
            if step % args.val_every == 0 || last {
                // Score the averaged weights, the ones that are saved.
                ema_tr.swap()?;
                ema_te.swap()?;
                let bands = val.run(&model);
                ema_tr.swap()?;
                ema_te.swap()?;
                let bands = bands?;
                for b in &bands {
                    writeln!(f, "{step},{:.2},{:.6},{:.6}", b.t_mid, b.loss, b.box_loss)
                        .map_err(io_err(&val_path))?;
                }
                f.flush().map_err(io_err(&val_path))?;
                let mean = bands.iter().map(|b| b.loss).sum::<f64>() / bands.len() as f64;
                let box_mean = bands.iter().map(|b| b.box_loss).sum::<f64>() / bands.len() as f64;
                val_curve.push((step as f64, mean));
                eprintln!("step {step} validation loss {mean:.4} (object boxes {box_mean:.4})");
            }
        }
        if args.save_every > 0 && step % args.save_every == 0 && step < schedule.steps {
            save(&ema_te, &ema_tr)?;
        }
        if stop_now {
            eprintln!("stopping after step {step} (--max-minutes or --stop-after)");
            break;
        }
    }
    let wall = start.elapsed().as_secs_f64();
    save(&ema_te, &ema_tr)?;
    let summary = TrainSummary {
        args: args.clone(),
        schedule_steps: schedule.steps,
        steps_done,
        bf16_autocast: bf16,
        wall_time_s: wall,
        mean_step_s: wall / steps_done as f64,
        final_loss: losses.recent_mean(),
        text_encoder_params: te_params,
        transformer_params: tr_params,
        train_tuples: split.train.len(),
        held_out_tuples: split.held_out.len(),
    };
    super::codec::write_json(&args.out.join("train_meta.json"), &summary)?;
    plot::loss_curve(
        &[
            (image::Rgb([30, 90, 200]), curve),
            (image::Rgb([220, 110, 20]), val_curve),
        ],
        &args.out.join("loss_curve.png"),
    )?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_is_fitted_to_the_time_limit() {
        // 0.2 s/step fits 16000 steps in 58 min: unchanged.
        assert_eq!(fitted_steps(16000, 300, 60.0, 58.0 * 60.0), 16000);
        // 0.34 s/step: 58 min x 0.97 / 0.34 s.
        assert_eq!(fitted_steps(16000, 300, 102.0, 58.0 * 60.0), 9928);
        // Never before the steps already run, and nothing timed leaves it alone.
        assert_eq!(fitted_steps(16000, 300, 600.0, 60.0), 300);
        assert_eq!(fitted_steps(16000, 0, 0.0, 60.0), 16000);
    }

    #[test]
    fn warmup_then_cosine_lr() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: TrainArgs,
        }
        let mut args = <Cli as clap::Parser>::parse_from(["test"]).args;
        args.steps = 10 * args.warmup;
        args.lr_final = 0.1;
        assert_eq!(lr_at(&args, 0), 0.0);
        assert!((lr_at(&args, args.warmup / 2) - args.lr / 2.0).abs() < 1e-12);
        assert_eq!(lr_at(&args, args.warmup), args.lr);
        let mid = (args.warmup + args.steps) / 2;
        assert!((lr_at(&args, mid) - 0.55 * args.lr).abs() < 1e-12);
        assert!((lr_at(&args, args.steps) - 0.1 * args.lr).abs() < 1e-12);
        args.lr_final = 1.0;
        assert_eq!(lr_at(&args, args.steps), args.lr);
    }

    #[test]
    fn optimiser_steps_reduce_the_loss_on_a_fixed_draw() {
        tch::manual_seed(0);
        let model = TinyModel::new(Device::Cpu).unwrap();
        let split = Split::new();
        let b = batch_with_boxes(&mut Generator::new(split.train, 1), 2, 2.0);
        let weights = b
            .boxes
            .f_mul_scalar(3.0)
            .unwrap()
            .f_add_scalar(1.0)
            .unwrap();
        let mut opt = nn::adamw(0.9, 0.99, 0.0)
            .build(&model.transformer_vs, 1e-3)
            .unwrap();
        let fixed_loss = |m: &TinyModel| {
            tch::manual_seed(5); // same noise and timesteps every call
            flow_matching_loss(
                m,
                &b.images,
                &b.prompts,
                TimeSampling::default(),
                Some(&weights),
            )
            .unwrap()
        };
        let before = tch::no_grad(|| fixed_loss(&model)).double_value(&[]);
        for _ in 0..10 {
            opt.backward_step(&fixed_loss(&model));
        }
        let after = tch::no_grad(|| fixed_loss(&model)).double_value(&[]);
        assert!(after < 0.9 * before, "loss {before} -> {after}");
    }
    #[test]
    fn init_from_starts_from_the_folder_and_must_match_its_size() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: TrainArgs,
        }
        let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny");
        let out = tempfile::tempdir().unwrap();
        let mut args = <Cli as clap::Parser>::parse_from(["test"]).args;
        (args.out, args.init_from) = (out.path().to_path_buf(), Some(shipped.clone()));
        (args.steps, args.batch_size, args.threads) = (1, 1, 1);

        args.heads += 1;
        let err = train(&args).unwrap_err().to_string();
        assert!(err.contains("init_from"), "{err}");
        args.heads -= 1;

        // One step at the warm-up's (near-)zero learning rate: the weights are the folder's.
        train(&args).unwrap();
        let (a, b) = (
            TinyModel::load(&shipped, Device::Cpu).unwrap(),
            TinyModel::load(out.path(), Device::Cpu).unwrap(),
        );
        let (va, vb) = (a.transformer_vs.variables(), b.transformer_vs.variables());
        assert_eq!(va.len(), vb.len());
        for (name, wa) in &va {
            let diff = (wa - &vb[name]).abs().max().double_value(&[]);
            assert!(diff < 1e-3, "{name} moved by {diff}");
        }
    }
}
