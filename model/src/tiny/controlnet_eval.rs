//! What the silhouette ControlNet does, measured: for held-out scenes (prompts the model never
//! trained on, each with its own size and offset), generate with and without the ControlNet at
//! the same seed through the serving stepper, and report how well the drawn object covers the
//! silhouette (intersection over union of the object's pixels with it).
use super::controlnet_train::render_silhouette;
use super::data::{rgb_to_tensor, scene_for, Scene, Split, COLOURS};
use super::model::images_to_rgb;
use super::{plot, IMAGE_SIZE};
use crate::error::{ModelError, Result};
use crate::flux::{ControlResiduals, FluxControlNet};
use crate::model_dir::LoadedModel;
use crate::pipeline::control::ControlInput;
use crate::pipeline::stepper::{
    step_batch_controlled, DenoiseState, StepMode, StepRequest, TrueCfg,
};
use crate::pipeline::FluxPipeline;
use rand::SeedableRng;
use std::path::PathBuf;
use std::time::Instant;
use tch::{Device, Kind};

#[derive(clap::Args, Debug, Clone)]
pub struct ControlNetEvalArgs {
    #[arg(long, default_value = "weights/tiny")]
    pub model_dir: PathBuf,
    #[arg(long, default_value = "weights/tiny-controlnets/silhouette")]
    pub controlnet_dir: PathBuf,
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Held-out scenes to generate (at most 100).
    #[arg(long, default_value_t = 40)]
    pub prompts: usize,
    /// `controlnet_conditioning_scale`.
    #[arg(long, default_value_t = 1.0)]
    pub scale: f64,
    /// Scene `i` uses noise seed `seed + i` (and its size and offset come from `seed`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
    /// Write `samples.png` here (rows of silhouette, without, with).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Steer as a `pipelined` denoiser does (ControlNet-as-a-Service): each step adds the
    /// residuals of the previous step's inputs (the first two steps those of the first).
    #[arg(long)]
    pub pipelined: bool,
    /// True classifier-free guidance scale for both generations (1 = off; the served default
    /// of `cargo xtask up` is 4); the negative prompt is the empty prompt.
    #[arg(long, default_value_t = 1.0)]
    pub cfg_scale: f64,
}

#[derive(Debug, serde::Serialize)]
pub struct ControlNetEvalSummary {
    pub prompts: usize,
    pub steps: usize,
    pub scale: f64,
    pub pipelined: bool,
    pub cfg_scale: f64,
    /// Mean IoU of the drawn object with the silhouette, without the ControlNet and with it.
    pub iou_without: f64,
    pub iou_with: f64,
    /// Scenes whose IoU the ControlNet raised.
    pub improved: usize,
    pub seconds: f64,
}

/// Pixels nearer the scene's object colour than its background colour.
fn object_pixels(rgb: &[u8], scene: &Scene) -> Vec<bool> {
    let (bg, fg) = (COLOURS[scene.key.background].1, COLOURS[scene.key.colour].1);
    let dist =
        |p: &[u8], c: [u8; 3]| -> i32 { (0..3).map(|i| (p[i] as i32 - c[i] as i32).pow(2)).sum() };
    rgb.chunks(3).map(|p| dist(p, fg) < dist(p, bg)).collect()
}

/// Intersection over union of the drawn object with the silhouette.
pub fn silhouette_iou(rgb: &[u8], scene: &Scene) -> f64 {
    let drawn = object_pixels(rgb, scene);
    let sil: Vec<bool> = render_silhouette(scene)
        .chunks(3)
        .map(|p| p[0] > 127)
        .collect();
    let inter = drawn.iter().zip(&sil).filter(|(a, b)| **a && **b).count();
    let union = drawn.iter().zip(&sil).filter(|(a, b)| **a || **b).count();
    if union == 0 {
        return 0.0;
    }
    inter as f64 / union as f64
}

/// Generate one image through the stepper, steered by `net` when given (`pipelined`: with the
/// residuals one step behind).
fn generate(
    p: &FluxPipeline<'_>,
    scene: &Scene,
    seed: u64,
    steps: usize,
    net: Option<(&FluxControlNet, f64)>,
    pipelined: bool,
    cfg_scale: f64,
) -> Result<Vec<u8>> {
    let control = net.map(|(_, scale)| ControlInput {
        image: rgb_to_tensor(&render_silhouette(scene), IMAGE_SIZE).unsqueeze(0),
        scale,
    });
    let req = StepRequest {
        true_cfg: (cfg_scale > 1.0).then(|| TrueCfg {
            negative_prompt: String::new(),
            scale: cfg_scale,
        }),
        prompt: scene.key.prompt(),
        seed,
        height: IMAGE_SIZE,
        width: IMAGE_SIZE,
        steps,
        guidance_scale: 1.0,
        edit: None,
        control,
        cache_threshold: None,
        cache_method: Default::default(),
    };
    let mut state = DenoiseState::new(p, &req)?;
    let mut previous: Option<ControlResiduals> = None;
    while !state.is_done() {
        let fresh: Option<ControlResiduals> = match (state.control_step()?, net) {
            (Some(step), Some((net, _))) => Some(step.residuals(net)?),
            _ => None,
        };
        let residuals = match (pipelined, previous.take()) {
            (true, Some(stale)) => {
                previous = fresh;
                Some(stale)
            }
            (true, None) => {
                previous = fresh.as_ref().map(ControlResiduals::shallow_clone);
                fresh
            }
            (false, _) => fresh,
        };
        step_batch_controlled(p, &mut [&mut state], &[StepMode::Full], 0, &[residuals])?;
    }
    let image = state.decode(p)?;
    Ok(images_to_rgb(&image)?.remove(0))
}

pub fn run(args: &ControlNetEvalArgs) -> Result<ControlNetEvalSummary> {
    let held_out = Split::new().held_out;
    if args.prompts == 0 || args.prompts > held_out.len() {
        return Err(ModelError::input(
            "prompts",
            format!("must be in 1..={}", held_out.len()),
        ));
    }
    tch::set_num_threads(args.threads);
    let model = LoadedModel::load(&args.model_dir, Device::Cpu, Kind::Float)?;
    let (net, _vs) = FluxControlNet::load(&args.controlnet_dir, Device::Cpu, Kind::Float)?;
    net.check_compatible(&model.transformer.cfg)?;
    let p = model.pipeline();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    let start = Instant::now();
    let (mut without, mut with, mut improved) = (0.0, 0.0, 0);
    let mut tiles = Vec::new();
    for (i, key) in held_out.into_iter().take(args.prompts).enumerate() {
        let scene = scene_for(key, &mut rng);
        let seed = args.seed + i as u64;
        let plain = generate(&p, &scene, seed, args.steps, None, false, args.cfg_scale)?;
        let steered = generate(
            &p,
            &scene,
            seed,
            args.steps,
            Some((&net, args.scale)),
            args.pipelined,
            args.cfg_scale,
        )?;
        let (a, b) = (
            silhouette_iou(&plain, &scene),
            silhouette_iou(&steered, &scene),
        );
        without += a;
        with += b;
        improved += usize::from(b > a);
        if i < 12 {
            tiles.push((render_silhouette(&scene), plain, steered));
        }
    }
    if let Some(dir) = &args.report {
        std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
            path: dir.clone(),
            source,
        })?;
        let cols = tiles.len() as u32;
        let mut grid: Vec<Vec<u8>> = tiles.iter().map(|t| t.0.clone()).collect();
        grid.extend(tiles.iter().map(|t| t.1.clone()));
        grid.extend(tiles.iter().map(|t| t.2.clone()));
        plot::grid(&grid, IMAGE_SIZE as u32, cols, &dir.join("samples.png"))?;
    }
    let n = args.prompts as f64;
    Ok(ControlNetEvalSummary {
        prompts: args.prompts,
        steps: args.steps,
        scale: args.scale,
        pipelined: args.pipelined,
        cfg_scale: args.cfg_scale,
        iou_without: without / n,
        iou_with: with / n,
        improved,
        seconds: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::data::render_rgb;

    #[test]
    fn iou_is_one_for_the_scene_itself_and_low_for_a_shifted_one() {
        let split = Split::new();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let scene = scene_for(split.held_out[0], &mut rng);
        assert_eq!(silhouette_iou(&render_rgb(&scene), &scene), 1.0);
        let moved = Scene {
            jitter: (scene.jitter.0 + 8.0, scene.jitter.1),
            ..scene
        };
        let iou = silhouette_iou(&render_rgb(&moved), &scene);
        assert!(iou > 0.0 && iou < 0.7, "{iou}");
    }
}
