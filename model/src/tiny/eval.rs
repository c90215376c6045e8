//! Held-out evaluation: generate one image per held-out tuple (100 prompts the training stream
//! never produced), read each back with the checker in [`super::check`], and report accuracy
//! per attribute and all-correct, for the trained model and for its untrained initialisation.
use super::check::{detect, judge, Detection, Verdict};
use super::data::{render_rgb, Scene, SceneKey, Split};
use super::model::{images_to_rgb, TinyModel};
use super::{plot, IMAGE_SIZE};
use crate::error::{ModelError, Result};
use crate::model_dir::LoadedModel;
use crate::noise_scheduler::FlowMatchEulerDiscreteScheduler;
use crate::pipeline::{text_to_image, FluxPipeline, GenerateOptions, GenerationRequest};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;
use tch::{Device, Kind};

#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct EvalArgs {
    /// Model folder to evaluate.
    #[arg(long, env = "DIFFMESH_TINY_MODEL_DIR", default_value = "weights/tiny")]
    pub model_dir: PathBuf,
    /// Denoising steps per image.
    #[arg(long, env = "DIFFMESH_TINY_EVAL_STEPS", default_value_t = 20)]
    pub steps: usize,
    /// Classifier-free guidance scale against the empty prompt (1.0: off).
    #[arg(long, env = "DIFFMESH_TINY_CFG", default_value_t = 4.0)]
    pub cfg_scale: f64,
    /// Seed of the initial noise (held-out prompt i uses seed + i).
    #[arg(long, env = "DIFFMESH_TINY_EVAL_SEED", default_value_t = 0)]
    pub seed: u64,
    /// libtorch intra-op threads.
    #[arg(long, env = "DIFFMESH_TINY_THREADS", default_value_t = 1)]
    pub threads: i32,
    /// Prompts generated together.
    #[arg(long, env = "DIFFMESH_TINY_EVAL_BATCH", default_value_t = 25)]
    pub batch_size: usize,
    /// Evaluate the first N prompts of the split only (at most 100 held-out, 740 train).
    #[arg(long, env = "DIFFMESH_TINY_EVAL_PROMPTS", default_value_t = 100)]
    pub prompts: usize,
    /// Sample with this static scheduler shift instead of the folder's (for choosing it on the
    /// train split; the shipped value lives in `scheduler/scheduler_config.json`).
    #[arg(long, env = "DIFFMESH_TINY_EVAL_SHIFT")]
    pub shift: Option<f64>,
    /// Which tuples to prompt with: `held-out` (never trained on; the reported accuracy) or
    /// `train` (the first tuples of the training split: a validation set for choosing training
    /// and sampling settings without looking at the held-out prompts).
    #[arg(long, env = "DIFFMESH_TINY_EVAL_SPLIT", value_enum, default_value_t = EvalSplit::HeldOut)]
    pub split: EvalSplit,
    /// Also evaluate the untrained initialisation made with this training seed.
    #[arg(long, env = "DIFFMESH_TINY_BASELINE_SEED")]
    pub untrained_seed: Option<u64>,
    /// Write `eval.json` and `samples.png` (held-out prompts: references above, samples below) here.
    #[arg(long, env = "DIFFMESH_TINY_EVAL_REPORT")]
    pub report: Option<PathBuf>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EvalSplit {
    HeldOut,
    Train,
}

/// The first `n` tuples of the chosen split, in the split's fixed order.
fn eval_keys(split: EvalSplit, n: usize) -> Vec<SceneKey> {
    split_keys(split).into_iter().take(n).collect()
}

fn split_keys(split: EvalSplit) -> Vec<SceneKey> {
    let s = Split::new();
    match split {
        EvalSplit::HeldOut => s.held_out,
        EvalSplit::Train => s.train,
    }
}

/// The loaded model's scheduler, with `--shift` applied when given.
fn eval_scheduler(
    loaded: &FlowMatchEulerDiscreteScheduler,
    shift: Option<f64>,
) -> Result<FlowMatchEulerDiscreteScheduler> {
    match shift {
        None => Ok(loaded.clone()),
        Some(shift) => FlowMatchEulerDiscreteScheduler::new(
            crate::noise_scheduler::FlowMatchEulerDiscreteSchedulerConfig {
                shift,
                use_dynamic_shifting: false,
                ..loaded.config.clone()
            },
        ),
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Accuracy {
    pub background: f64,
    pub colour: f64,
    pub position: f64,
    pub shape: f64,
    pub all: f64,
    /// Shape and all-correct with the first shape criterion (bounding-box fill ratio).
    pub shape_by_fill: f64,
    pub all_by_fill: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ImageResult {
    pub prompt: String,
    pub verdict: Verdict,
    pub all_correct: bool,
    pub detected: Detection,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelEval {
    pub accuracy: Accuracy,
    pub seconds: f64,
    pub images: Vec<ImageResult>,
}

pub(super) fn accuracy(verdicts: &[Verdict]) -> Accuracy {
    let n = verdicts.len().max(1) as f64;
    let frac = |f: &dyn Fn(&Verdict) -> bool| verdicts.iter().filter(|v| f(v)).count() as f64 / n;
    Accuracy {
        background: frac(&|v| v.background),
        colour: frac(&|v| v.colour),
        position: frac(&|v| v.position),
        shape: frac(&|v| v.shape),
        shape_by_fill: frac(&|v| v.shape_by_fill),
        all_by_fill: frac(&|v| v.all_by_fill()),
        all: frac(&|v| v.all()),
    }
}

/// Generate and judge the held-out prompts through the project's Flux pipeline; returns the
/// results and the RGB images.
pub fn evaluate(pipeline: &FluxPipeline<'_>, args: &EvalArgs) -> Result<(ModelEval, Vec<Vec<u8>>)> {
    let keys = eval_keys(args.split, args.prompts);
    let guided = args.cfg_scale > 1.0;
    let opts = GenerateOptions {
        height: IMAGE_SIZE,
        width: IMAGE_SIZE,
        steps: args.steps,
        guidance_scale: 1.0,
        true_cfg_scale: args.cfg_scale,
        negative_prompt: guided.then(String::new),
    };
    let start = Instant::now();
    let mut images = Vec::new();
    let mut results = Vec::new();
    let batch = args.batch_size.max(1);
    for (c, chunk) in keys.chunks(batch).enumerate() {
        let requests: Vec<GenerationRequest> = chunk
            .iter()
            .enumerate()
            .map(|(j, k)| GenerationRequest {
                prompt: k.prompt(),
                seed: args.seed + (c * batch + j) as u64,
            })
            .collect();
        let out = text_to_image(pipeline, &requests, &opts, None)?;
        for ((key, req), img) in chunk.iter().zip(requests).zip(images_to_rgb(&out.images)?) {
            let detected = detect(&img)?;
            let verdict = judge(&detected, key);
            results.push(ImageResult {
                prompt: req.prompt,
                verdict,
                all_correct: verdict.all(),
                detected,
            });
            images.push(img);
        }
    }
    let verdicts: Vec<Verdict> = results.iter().map(|r| r.verdict).collect();
    Ok((
        ModelEval {
            accuracy: accuracy(&verdicts),
            seconds: start.elapsed().as_secs_f64(),
            images: results,
        },
        images,
    ))
}

/// Full evaluation as `diffmesh-train-tiny eval` runs it; prints a summary and returns the JSON.
pub fn run(args: &EvalArgs) -> Result<serde_json::Value> {
    let available = split_keys(args.split).len();
    if args.prompts == 0 || args.prompts > available {
        return Err(ModelError::input(
            "prompts",
            format!("must be in 1..={available} for this split"),
        ));
    }
    tch::set_num_threads(args.threads);
    let model = LoadedModel::load(&args.model_dir, Device::Cpu, Kind::Float)?;
    let scheduler = eval_scheduler(&model.scheduler, args.shift)?;
    let pipeline = FluxPipeline {
        scheduler: &scheduler,
        ..model.pipeline()
    };
    let (trained, images) = evaluate(&pipeline, args)?;
    eprintln!(
        "trained:   {:?} ({:.0}s)",
        trained.accuracy, trained.seconds
    );
    let untrained = match args.untrained_seed {
        Some(seed) => {
            tch::manual_seed(seed as i64);
            // Same transformer size as the evaluated model, same init as its training run.
            let init = TinyModel::with_flux_config(Device::Cpu, model.transformer.cfg.clone())?;
            let (e, _) = evaluate(&init.pipeline(&scheduler), args)?;
            eprintln!("untrained: {:?} ({:.0}s)", e.accuracy, e.seconds);
            Some(e)
        }
        None => None,
    };
    let summary = serde_json::json!({
        "model_dir": args.model_dir,
        "prompts": args.prompts,
        "steps": args.steps,
        "cfg_scale": args.cfg_scale,
        "shift": scheduler.config.shift,
        "seed": args.seed,
        "split": args.split,
        "trained": trained.accuracy,
        "untrained": untrained.as_ref().map(|u| &u.accuracy),
    });
    if let Some(dir) = &args.report {
        let full = serde_json::json!({
            "summary": summary,
            "args": args,
            "trained_images": trained.images,
            "untrained_images": untrained.as_ref().map(|u| &u.images),
        });
        super::codec::write_json(&dir.join("eval.json"), &full)?;
        write_samples(
            &images,
            &eval_keys(args.split, args.prompts),
            &dir.join("samples.png"),
        )?;
    }
    Ok(summary)
}

/// 16 prompts (`keys`, in `images` order) in 8 columns: a row of reference renders above each
/// row of samples.
pub(super) fn write_samples(
    images: &[Vec<u8>],
    keys: &[SceneKey],
    path: &std::path::Path,
) -> Result<()> {
    let n = images.len().min(16).min(keys.len());
    let cols = n.min(8);
    if n == 0 {
        return Ok(());
    }
    // Whole rows only, so reference and sample rows stay paired.
    let n = n - n % cols;
    let mut tiles = Vec::new();
    for row in (0..n).step_by(cols) {
        let end = (row + cols).min(n);
        for key in &keys[row..end] {
            let scene = Scene {
                key: *key,
                half_size: 11.0,
                jitter: (0.0, 0.0),
            };
            tiles.push(render_rgb(&scene));
        }
        tiles.extend(images[row..end].iter().cloned());
    }
    plot::grid(&tiles, IMAGE_SIZE as u32, cols as u32, path)
}
