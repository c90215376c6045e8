//! Evaluation of the tiny UNet through the SD pipeline, as an engine steps it:
//! - held-out accuracy: one image per held-out prompt, read back by the checker (as
//!   [`super::eval`] does for the Flux model);
//! - mask-aware edits (FlashPS on the UNet): a rendered scene is captured as a template, then
//!   edited to another shape inside the object's box, once with the UNet computing only the
//!   masked tokens against the template's cache and once in full; the report compares the two
//!   (SSIM and PSNR over the whole image, the mask's box grown by 8 px, and the masked pixels;
//!   masks in whole 8-pixel tokens, as the mesh applies them)
//!   and checks that the mask-aware edit keeps every unmasked pixel of the template.
use super::check::{detect, judge, Verdict};
use super::data::{
    object_box_mask, render_rgb, rgb_to_tensor, scene_for, Scene, SceneKey, Shape, Split,
};
use super::eval::{accuracy, write_samples, Accuracy};
use super::model::images_to_rgb;
use super::IMAGE_SIZE;
use crate::components::LatentCodec;
use crate::error::{ModelError, Result};
use crate::pipeline::noise::seeded_noise;
use crate::quality::{mask_box, psnr, psnr_masked, ssim, ssim_masked};
use crate::stable_diffusion::inpaint::InpaintInputs;
use crate::stable_diffusion::stepper::SdState;
use crate::stable_diffusion::{SdPipeline, SdRequest};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct UNetEvalArgs {
    /// The tiny UNet pipeline folder.
    #[arg(long, default_value = "weights/tiny-unet")]
    pub model_dir: PathBuf,
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Classifier-free guidance against the empty prompt.
    #[arg(long, default_value_t = 4.0)]
    pub cfg_scale: f64,
    /// Seed of the initial noise (image i uses seed + i).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
    /// Held-out prompts to generate (at most 100).
    #[arg(long, default_value_t = 100)]
    pub prompts: usize,
    /// Mask-aware edits to compare against full compute.
    #[arg(long, default_value_t = 16)]
    pub edits: usize,
    /// Requests stepped together.
    #[arg(long, default_value_t = 20)]
    pub batch_size: usize,
    /// Write `eval.json` and `samples.png` (16 held-out prompts under their reference renders) here.
    #[arg(long)]
    pub report: Option<PathBuf>,
}

/// Mask-aware edits against the same edits computed in full.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EditQuality {
    pub edits: usize,
    /// Share of each edit's pixels its mask repaints, averaged.
    pub mask_ratio_mean: f64,
    pub ssim_mean: f64,
    pub ssim_min: f64,
    pub ssim_box_mean: f64,
    pub ssim_box_min: f64,
    pub ssim_masked_mean: f64,
    pub psnr_mean: f64,
    pub psnr_masked_mean: f64,
    pub psnr_box_mean: f64,
    /// Largest difference (0..1) between a mask-aware edit and its template outside the mask
    /// (0: every unmasked pixel kept).
    pub unmasked_max_abs_diff: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct UNetEval {
    pub model_dir: PathBuf,
    pub accuracy: Accuracy,
    pub edit: EditQuality,
    pub seconds: f64,
}

fn request(prompt: String, args: &UNetEvalArgs) -> SdRequest {
    SdRequest {
        prompt,
        negative_prompt: None,
        height: IMAGE_SIZE,
        width: IMAGE_SIZE,
        steps: args.steps,
        guidance_scale: args.cfg_scale,
        scheduler: None,
    }
}

fn latent_shape(pipe: &SdPipeline) -> [i64; 4] {
    let f = pipe.vae.downscale_factor();
    [
        1,
        pipe.vae.latent_channels(),
        IMAGE_SIZE / f,
        IMAGE_SIZE / f,
    ]
}

/// Step `states` together until all are done (noise, for ancestral schedulers, seeded by
/// request and step).
fn run(pipe: &SdPipeline, states: &mut [SdState], seed: u64) -> Result<()> {
    while states.iter().any(|s| !s.done()) {
        let mut live: Vec<&mut SdState> = states.iter_mut().filter(|s| !s.done()).collect();
        pipe.step_batch(&mut live, &mut |i, step, shape| {
            seeded_noise(
                seed ^ ((i as u64) << 32) ^ step as u64,
                shape,
                Device::Cpu,
                Kind::Float,
            )
        })?;
    }
    Ok(())
}

/// Generate and judge the first `args.prompts` held-out prompts; returns the images too.
pub fn held_out_accuracy(
    pipe: &SdPipeline,
    args: &UNetEvalArgs,
) -> Result<(Accuracy, Vec<Vec<u8>>)> {
    let keys: Vec<SceneKey> = Split::new()
        .held_out
        .into_iter()
        .take(args.prompts)
        .collect();
    let shape = latent_shape(pipe);
    let mut verdicts: Vec<Verdict> = Vec::with_capacity(keys.len());
    let mut images = Vec::with_capacity(keys.len());
    for (c, chunk) in keys.chunks(args.batch_size.max(1)).enumerate() {
        let mut states = chunk
            .iter()
            .enumerate()
            .map(|(j, k)| {
                let seed = args.seed + (c * args.batch_size.max(1) + j) as u64;
                let latents = seeded_noise(seed, &shape, Device::Cpu, Kind::Float)?;
                pipe.prepare(&request(k.prompt(), args), &latents, None)
            })
            .collect::<Result<Vec<_>>>()?;
        run(pipe, &mut states, args.seed)?;
        for (state, key) in states.iter().zip(chunk) {
            let image = pipe.decode(state)?.f_mul_scalar(2.0)?.f_sub_scalar(1.0)?;
            let rgb = images_to_rgb(&image)?.remove(0);
            verdicts.push(judge(&detect(&rgb)?, key));
            images.push(rgb);
        }
    }
    Ok((accuracy(&verdicts), images))
}

/// One edit: its template scene's image `[1, 3, 64, 64]` in [-1, 1] and prompt, the edit's
/// prompt (another shape at the same place) and mask `[1, 1, 64, 64]`: the object's box + 4 px,
/// widened to whole `token`-pixel tokens as the mesh masks (so the mask every level of the UNet
/// sees is this one).
struct EditCase {
    template_image: Tensor,
    template_prompt: String,
    prompt: String,
    mask: Tensor,
}

/// The shape an edit turns `shape` into (the next of [`Shape::ALL`]).
pub fn next_shape(shape: Shape) -> Shape {
    let at = Shape::ALL.iter().position(|s| *s == shape).unwrap_or(0);
    Shape::ALL[(at + 1) % Shape::ALL.len()]
}

/// The pixel rectangle `(x0, y0, x1, y1)` (ends exclusive) of the scene's object box grown by
/// `margin`, widened to whole `token`-pixel tokens.
pub fn object_box_in_tokens(
    scene: &Scene,
    margin: f64,
    token: usize,
) -> (usize, usize, usize, usize) {
    let n = IMAGE_SIZE as usize;
    let (mut x0, mut y0, mut x1, mut y1) = (n, n, 0, 0);
    for (i, v) in object_box_mask(scene, margin).iter().enumerate() {
        if *v > 0.5 {
            let (x, y) = (i % n, i / n);
            (x0, y0, x1, y1) = (x0.min(x), y0.min(y), x1.max(x + 1), y1.max(y + 1));
        }
    }
    let t = token.max(1);
    (
        x0 / t * t,
        y0 / t * t,
        x1.div_ceil(t) * t,
        y1.div_ceil(t) * t,
    )
}

fn edit_case(key: SceneKey, rng: &mut ChaCha8Rng, token: usize) -> EditCase {
    let scene = scene_for(key, rng);
    let next = next_shape(key.shape);
    let n = IMAGE_SIZE as usize;
    let (x0, y0, x1, y1) = object_box_in_tokens(&scene, 4.0, token);
    let mask: Vec<f32> = (0..n * n)
        .map(|i| {
            let (x, y) = (i % n, i / n);
            if (x0..x1).contains(&x) && (y0..y1).contains(&y) {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    EditCase {
        template_image: rgb_to_tensor(&render_rgb(&scene), IMAGE_SIZE).unsqueeze(0),
        template_prompt: key.prompt(),
        prompt: SceneKey { shape: next, ..key }.prompt(),
        mask: Tensor::from_slice(&mask).view([1, 1, IMAGE_SIZE, IMAGE_SIZE]),
    }
}

/// Capture each case's template, then run its edit mask-aware and in full; compare.
pub fn edit_quality(pipe: &SdPipeline, args: &UNetEvalArgs) -> Result<EditQuality> {
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed.wrapping_add(0xed17));
    let token = pipe.token_pixels() as usize;
    let cases: Vec<EditCase> = Split::new()
        .held_out
        .into_iter()
        .take(args.edits)
        .map(|k| edit_case(k, &mut rng, token))
        .collect();
    if cases.is_empty() {
        return Ok(EditQuality::default());
    }
    let shape = latent_shape(pipe);
    let mut q = EditQuality {
        edits: cases.len(),
        ssim_min: f64::INFINITY,
        ssim_box_min: f64::INFINITY,
        ..EditQuality::default()
    };
    let (mut masked_n, mut box_psnr_n) = (0usize, 0usize);
    for (i, case) in cases.iter().enumerate() {
        let template_seed = args.seed + 1000 + i as u64;
        let noise = seeded_noise(template_seed, &shape, Device::Cpu, Kind::Float)?;
        let mut capture = vec![pipe.prepare_capture(
            &request(case.template_prompt.clone(), args),
            &noise,
            &case.template_image,
            1.0,
        )?];
        run(pipe, &mut capture, template_seed)?;
        let template = capture
            .pop()
            .and_then(SdState::into_template)
            .ok_or_else(|| ModelError::input("template", "the capture did not finish"))?;
        let own = seeded_noise(
            args.seed + 2000 + i as u64,
            &shape,
            Device::Cpu,
            Kind::Float,
        )?;
        let latent_mask = case
            .mask
            .f_upsample_nearest2d([shape[2], shape[3]], None, None)?;
        let latents = noise.f_add(&own.f_sub(&noise)?.f_mul(&latent_mask)?)?;
        let inputs = InpaintInputs {
            image: &case.template_image,
            mask: &case.mask,
            strength: 1.0,
        };
        let req = request(case.prompt.clone(), args);
        let mut states = vec![
            pipe.prepare_edit(&req, &latents, &inputs, Arc::new(template))?,
            pipe.prepare(&req, &latents, Some(&inputs))?,
        ];
        run(pipe, &mut states, args.seed + 3000 + i as u64)?;
        let (aware, full) = (pipe.decode(&states[0])?, pipe.decode(&states[1])?);
        let mask = case.mask.f_view([IMAGE_SIZE, IMAGE_SIZE])?;
        q.mask_ratio_mean += mask.f_mean(Kind::Double)?.double_value(&[]);
        let whole = ssim(&aware, &full)?;
        q.ssim_mean += whole;
        q.ssim_min = q.ssim_min.min(whole);
        q.psnr_mean += psnr(&aware, &full)?.min(100.0);
        if let Some(b) = mask_box(&mask, 8)? {
            let in_box = ssim(&b.crop(&aware)?, &b.crop(&full)?)?;
            q.ssim_box_mean += in_box;
            q.ssim_box_min = q.ssim_box_min.min(in_box);
            q.psnr_box_mean += psnr(&b.crop(&aware)?, &b.crop(&full)?)?.min(100.0);
            box_psnr_n += 1;
        }
        if let (Some(s), Some(db)) = (
            ssim_masked(&aware, &full, &mask)?,
            psnr_masked(&aware, &full, &mask)?,
        ) {
            q.ssim_masked_mean += s;
            q.psnr_masked_mean += db.min(100.0);
            masked_n += 1;
        }
        let keep = mask.f_lt(0.5)?.f_to_kind(Kind::Float)?;
        let template01 = case.template_image.f_div_scalar(2.0)?.f_add_scalar(0.5)?;
        let diff = aware.f_sub(&template01)?.f_abs()?.f_mul(&keep)?;
        q.unmasked_max_abs_diff = q.unmasked_max_abs_diff.max(diff.f_max()?.double_value(&[]));
    }
    let n = cases.len() as f64;
    q.mask_ratio_mean /= n;
    q.ssim_mean /= n;
    q.psnr_mean /= n;
    q.ssim_box_mean /= box_psnr_n.max(1) as f64;
    q.psnr_box_mean /= box_psnr_n.max(1) as f64;
    q.ssim_masked_mean /= masked_n.max(1) as f64;
    q.psnr_masked_mean /= masked_n.max(1) as f64;
    Ok(q)
}

/// `diffmesh-train-tiny unet-eval`.
pub fn run_eval(args: &UNetEvalArgs) -> Result<UNetEval> {
    tch::set_num_threads(args.threads);
    let start = Instant::now();
    let pipe = SdPipeline::load(&args.model_dir, Device::Cpu, Kind::Float)?;
    let (accuracy, images) = held_out_accuracy(&pipe, args)?;
    let edit = edit_quality(&pipe, args)?;
    let eval = UNetEval {
        model_dir: args.model_dir.clone(),
        accuracy,
        edit,
        seconds: start.elapsed().as_secs_f64(),
    };
    if let Some(dir) = &args.report {
        super::codec::write_json(&dir.join("eval.json"), &eval)?;
        let keys: Vec<SceneKey> = Split::new()
            .held_out
            .into_iter()
            .take(args.prompts)
            .collect();
        write_samples(&images, &keys, &dir.join("samples.png"))?;
    }
    Ok(eval)
}
