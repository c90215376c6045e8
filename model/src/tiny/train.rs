//! Flow-matching training of the tiny model on the procedural data (rectified flow, as Flux):
//! `x_t = (1 - t) x0 + t noise`, the transformer predicts `noise - x0`, `t` is logit-normal
//! pushed through the scheduler's static shift, so training spends its effort where sampling does.
//! The text encoder trains jointly; prompts are dropped (replaced by "") with a small probability
//! so classifier-free guidance has an unconditional branch. Weights are saved as an EMA.
use super::data::{batch, Generator, Split};
use super::model::{TinyModel, SHIFT};
use super::plot;
use crate::error::{ModelError, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};

/// Flags of `diffmesh-train-tiny` (train); the defaults reproduce the shipped `models/tiny`.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct TrainArgs {
    /// Output model folder (diffusers layout); overwritten.
    #[arg(long, env = "DIFFMESH_TINY_OUT", default_value = "models/tiny")]
    pub out: PathBuf,
    /// Optimiser steps.
    #[arg(long, env = "DIFFMESH_TINY_STEPS", default_value_t = 2919)]
    pub steps: usize,
    /// Seed of weight init, noise, timesteps and the data stream.
    #[arg(long, env = "DIFFMESH_TINY_SEED", default_value_t = 0)]
    pub seed: u64,
    /// libtorch intra-op threads (1 is fastest on a shared 2-core machine: OpenMP barriers stall
    /// when another process takes a core; results differ from other counts only by float rounding).
    #[arg(long, env = "DIFFMESH_TINY_THREADS", default_value_t = 1)]
    pub threads: i32,
    /// Images per step.
    #[arg(long, env = "DIFFMESH_TINY_BATCH", default_value_t = 12)]
    pub batch_size: usize,
    /// Learning rate (AdamW, linear warmup then constant: stopping early at step k gives exactly
    /// the model `--steps k` gives, which `--max-minutes` relies on).
    #[arg(long, env = "DIFFMESH_TINY_LR", default_value_t = 1e-3)]
    pub lr: f64,
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
    /// Steps per row of `train_log.csv` (mean loss over the window).
    #[arg(long, env = "DIFFMESH_TINY_LOG_EVERY", default_value_t = 10)]
    pub log_every: usize,
    /// Stop after the first step that ends past this wall time (minutes); `train_meta.json`
    /// records `steps_done`, and `--steps <steps_done>` reproduces the result.
    #[arg(long, env = "DIFFMESH_TINY_MAX_MINUTES")]
    pub max_minutes: Option<f64>,
    /// Save the EMA model every this many steps (0: only at the end).
    #[arg(long, env = "DIFFMESH_TINY_SAVE_EVERY", default_value_t = 250)]
    pub save_every: usize,
}

/// What `train_meta.json` records.
#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    pub args: TrainArgs,
    pub steps_done: usize,
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
struct Ema {
    names: Vec<String>,
    live: Vec<Tensor>,
    shadow: Vec<Tensor>,
}

impl Ema {
    fn new(vs: &nn::VarStore) -> Self {
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

    fn update(&mut self, decay: f64) -> Result<()> {
        tch::no_grad(|| {
            for (s, v) in self.shadow.iter_mut().zip(&self.live) {
                let _ = s.f_mul_scalar_(decay)?;
                let _ = s.f_add_(&v.f_mul_scalar(1.0 - decay)?)?;
            }
            Ok(())
        })
    }

    fn named(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .cloned()
            .zip(self.shadow.iter().map(|t| t.shallow_clone()))
            .collect()
    }
}

fn lr_at(args: &TrainArgs, step: usize) -> f64 {
    args.lr * (step as f64 / args.warmup.max(1) as f64).min(1.0)
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One flow-matching loss on a batch (`images` in [-1, 1], `prompts` may contain "").
pub fn flow_matching_loss(
    model: &TinyModel,
    images: &Tensor,
    prompts: &[String],
) -> Result<Tensor> {
    let x0 = model.images_to_tokens(images)?;
    let b = x0.size()[0];
    let noise = x0.f_randn_like()?;
    let u = Tensor::f_randn([b], (Kind::Float, x0.device()))?.f_sigmoid()?;
    let t = (&u * SHIFT).f_div(&(u.f_mul_scalar(SHIFT - 1.0)?.f_add_scalar(1.0)?))?;
    let tt = t.f_view([b, 1, 1])?;
    let xt = x0
        .f_mul(&tt.f_neg()?.f_add_scalar(1.0)?)?
        .f_add(&noise.f_mul(&tt)?)?;
    let target = noise.f_sub(&x0)?;
    let ids = model.text_encoder.tokenize(prompts)?;
    let text = model.text_encoder.forward_ids(&ids)?;
    let v = model.velocity(&xt, &text, &t)?;
    Ok(v.f_sub(&target)?.f_square()?.f_mean(Kind::Float)?)
}

/// Train from scratch and write the model folder, `train_log.csv`, `train_meta.json` and
/// `loss_curve.png` into `args.out`.
pub fn train(args: &TrainArgs) -> Result<TrainSummary> {
    if args.steps == 0 || args.batch_size == 0 {
        return Err(ModelError::input(
            "steps/batch_size",
            "must both be at least 1",
        ));
    }
    tch::set_num_threads(args.threads);
    tch::manual_seed(args.seed as i64);
    let model = TinyModel::new(Device::Cpu)?;
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
    let mut window = Vec::new();
    let mut recent = std::collections::VecDeque::new();
    let start = Instant::now();
    let mut steps_done = 0;
    let save = |ema_te: &Ema, ema_tr: &Ema| {
        model.save(&args.out, Some((&ema_te.named(), &ema_tr.named())))
    };
    for step in 1..=args.steps {
        let lr = lr_at(args, step);
        opt_tr.set_lr(lr);
        opt_te.set_lr(lr);
        let (images, mut prompts) = batch(&mut gen, args.batch_size);
        for p in prompts.iter_mut() {
            if drop_rng.random::<f64>() < args.uncond_prob {
                p.clear();
            }
        }
        let loss = flow_matching_loss(&model, &images, &prompts)?;
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
        let value = loss.f_double_value(&[])?;
        if !value.is_finite() {
            return Err(ModelError::input(
                "loss",
                format!("became {value} at step {step}; lower --lr"),
            ));
        }
        window.push(value);
        recent.push_back(value);
        if recent.len() > 100 {
            recent.pop_front();
        }
        steps_done = step;
        let out_of_time = args
            .max_minutes
            .is_some_and(|m| start.elapsed().as_secs_f64() > m * 60.0);
        if step % args.log_every == 0 || step == args.steps || out_of_time {
            let mean = window.iter().sum::<f64>() / window.len() as f64;
            window.clear();
            let elapsed = start.elapsed().as_secs_f64();
            writeln!(csv, "{step},{mean:.6},{lr:.3e},{elapsed:.1}").map_err(io_err(&csv_path))?;
            csv.flush().map_err(io_err(&csv_path))?;
            curve.push((step as f64, mean));
            eprintln!(
                "step {step}/{} loss {mean:.4} lr {lr:.2e} {:.2}s/step",
                args.steps,
                elapsed / step as f64
            );
        }
        if args.save_every > 0 && step % args.save_every == 0 && step < args.steps {
            save(&ema_te, &ema_tr)?;
        }
        if out_of_time {
            eprintln!("stopping after step {step}: --max-minutes reached");
            break;
        }
    }
    let wall = start.elapsed().as_secs_f64();
    save(&ema_te, &ema_tr)?;
    let summary = TrainSummary {
        args: args.clone(),
        steps_done,
        wall_time_s: wall,
        mean_step_s: wall / steps_done as f64,
        final_loss: recent.iter().sum::<f64>() / recent.len().max(1) as f64,
        text_encoder_params: te_params,
        transformer_params: tr_params,
        train_tuples: split.train.len(),
        held_out_tuples: split.held_out.len(),
    };
    super::codec::write_json(&args.out.join("train_meta.json"), &summary)?;
    plot::loss_curve(
        &[(image::Rgb([30, 90, 200]), curve)],
        &args.out.join("loss_curve.png"),
    )?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_constant_lr() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: TrainArgs,
        }
        let args = <Cli as clap::Parser>::parse_from(["test"]).args;
        assert_eq!(lr_at(&args, 0), 0.0);
        assert!((lr_at(&args, args.warmup / 2) - args.lr / 2.0).abs() < 1e-12);
        assert_eq!(lr_at(&args, args.warmup), args.lr);
        assert_eq!(lr_at(&args, 10 * args.warmup), args.lr);
    }

    #[test]
    fn optimiser_steps_reduce_the_loss_on_a_fixed_draw() {
        tch::manual_seed(0);
        let model = TinyModel::new(Device::Cpu).unwrap();
        let split = Split::new();
        let (images, prompts) = batch(&mut Generator::new(split.train, 1), 2);
        let mut opt = nn::adamw(0.9, 0.99, 0.0)
            .build(&model.transformer_vs, 1e-3)
            .unwrap();
        let fixed_loss = |m: &TinyModel| {
            tch::manual_seed(5); // same noise and timesteps every call
            flow_matching_loss(m, &images, &prompts).unwrap()
        };
        let before = tch::no_grad(|| fixed_loss(&model)).double_value(&[]);
        for _ in 0..10 {
            opt.backward_step(&fixed_loss(&model));
        }
        let after = tch::no_grad(|| fixed_loss(&model)).double_value(&[]);
        assert!(after < 0.9 * before, "loss {before} -> {after}");
    }
}
