//! What `cargo xtask encode-prompt` and `cargo xtask generate` run: a FLUX.1 directory's prompt
//! encoding and whole pipelines on files, with the outputs diffusers' pipelines return, so a
//! checkpoint can be compared with diffusers outside the mesh.
use super::fill::{fill, FillInputs};
use super::{text_to_image_from, GenerateOptions, GenerationRequest};
use crate::error::{ModelError, Result};
use crate::model_dir::{load_flux_prompt_encoder, LoadedModel, FILL_PIPELINE};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// One prompt a line; every line counts (an empty line is the empty prompt), a final newline
/// does not start another.
pub fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ModelError::input("prompts", format!("{}: {e}", path.display())))?;
    if text.is_empty() {
        return Err(ModelError::input(
            "prompts",
            format!("{} holds no line", path.display()),
        ));
    }
    let body = text.strip_suffix('\n').unwrap_or(&text);
    Ok(body
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l).to_string())
        .collect())
}

/// `FluxPipeline.encode_prompt` over a prompts file: writes `prompt_embeds` `[P, N, D]` and
/// `pooled_prompt_embeds` `[P, D']` in the file's order.
pub fn encode_prompt_file(
    model_dir: &Path,
    prompts: &Path,
    max_sequence_length: i64,
    out: &Path,
    device: Device,
    kind: Kind,
) -> Result<()> {
    let prompts = read_prompts(prompts)?;
    let (encoder, _stores) = load_flux_prompt_encoder(model_dir, device, kind)?;
    let e = encoder.encode_with_length(&prompts, max_sequence_length)?;
    Tensor::write_safetensors(
        &[
            ("prompt_embeds", e.hidden.f_contiguous()?),
            ("pooled_prompt_embeds", e.pooled.f_contiguous()?),
        ],
        out,
    )?;
    Ok(())
}

/// A `generate` run's inputs.
#[derive(Debug, Clone)]
pub struct GenerateFileArgs {
    pub model_dir: PathBuf,
    pub prompt: String,
    pub height: i64,
    pub width: i64,
    pub steps: usize,
    pub guidance_scale: f64,
    pub max_sequence_length: i64,
    /// Safetensors holding `latents` in diffusers' packed layout `[1, N, 4C]`.
    pub latents: PathBuf,
    /// FLUX.1-Fill: the image to repaint and its mask (PNG or any format `image` reads).
    pub image: Option<PathBuf>,
    pub mask: Option<PathBuf>,
    pub out: PathBuf,
    pub device: Device,
    pub kind: Kind,
}

/// The whole pipeline from given latents: writes `image` `[1, 3, H, W]` in [0, 1], as
/// `FluxPipeline(..., latents=L, output_type="pt")` (or `FluxFillPipeline`) returns it.
pub fn generate_file(args: &GenerateFileArgs) -> Result<()> {
    let mut model = LoadedModel::load(&args.model_dir, args.device, args.kind)?;
    model
        .text_encoder
        .set_max_tokens(args.max_sequence_length)?;
    let latents = read_latents(&args.latents)?;
    let requests = [GenerationRequest {
        prompt: args.prompt.clone(),
        seed: 0,
    }];
    let opts = GenerateOptions {
        height: args.height,
        width: args.width,
        steps: args.steps,
        guidance_scale: args.guidance_scale,
        ..GenerateOptions::default()
    };
    let pipeline = model.pipeline();
    let is_fill = model.index.pipeline_class == FILL_PIPELINE;
    let output = match (is_fill, &args.image, &args.mask) {
        (false, None, None) => {
            text_to_image_from(&pipeline, &requests, &opts, Some(&latents), None)?
        }
        (true, Some(image), Some(mask)) => {
            let images = read_image(image)?;
            let masks = read_mask(mask)?;
            let inputs = FillInputs {
                requests: &requests,
                images: &images,
                masks: &masks,
            };
            fill(&pipeline, &inputs, &opts, Some(&latents), None)?
        }
        (true, _, _) => {
            return Err(ModelError::input(
                "image",
                format!("{FILL_PIPELINE} needs --image and --mask"),
            ))
        }
        (false, _, _) => {
            return Err(ModelError::input(
                "image",
                format!(
                    "{} is a {}: --image and --mask are for {FILL_PIPELINE}",
                    args.model_dir.display(),
                    model.index.pipeline_class
                ),
            ))
        }
    };
    // diffusers' postprocess: (x / 2 + 0.5).clamp(0, 1), in f32.
    let image = output
        .images
        .f_to_kind(Kind::Float)?
        .f_div_scalar(2.0)?
        .f_add_scalar(0.5)?
        .f_clamp(0.0, 1.0)?
        .f_to_device(Device::Cpu)?;
    Tensor::write_safetensors(&[("image", image.f_contiguous()?)], &args.out)?;
    Ok(())
}

fn read_latents(path: &Path) -> Result<Tensor> {
    let tensors = Tensor::read_safetensors(path)
        .map_err(|e| ModelError::input("latents", format!("{}: {e}", path.display())))?;
    tensors
        .into_iter()
        .find_map(|(name, t)| (name == "latents").then_some(t))
        .ok_or_else(|| {
            ModelError::input(
                "latents",
                format!("{} holds no tensor named `latents`", path.display()),
            )
        })
}

fn open_image(path: &Path, field: &str) -> Result<image::DynamicImage> {
    image::open(path).map_err(|e| ModelError::input(field, format!("{}: {e}", path.display())))
}

/// An RGB image as `[1, 3, H, W]` in [-1, 1] (diffusers' `VaeImageProcessor.preprocess`).
pub fn read_image(path: &Path) -> Result<Tensor> {
    let rgb = open_image(path, "image")?.to_rgb8();
    let (w, h) = rgb.dimensions();
    let t = Tensor::from_slice(rgb.as_raw())
        .f_view([h as i64, w as i64, 3])?
        .f_permute([2, 0, 1])?
        .f_unsqueeze(0)?
        .f_to_kind(Kind::Float)?
        .f_div_scalar(255.0)?;
    Ok(t.f_mul_scalar(2.0)?.f_sub_scalar(1.0)?)
}

/// A mask as `[1, 1, H, W]` in [0, 1]; colour is made grey with PIL's `convert("L")` weights, as
/// diffusers' mask processor does.
pub fn read_mask(path: &Path) -> Result<Tensor> {
    let rgb = open_image(path, "mask")?.to_rgb8();
    let (w, h) = rgb.dimensions();
    let grey: Vec<u8> = rgb
        .pixels()
        .map(|p| {
            let [r, g, b] = p.0.map(u32::from);
            // PIL's ITU-R 601-2 luma in 16-bit fixed point, rounded.
            ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16) as u8
        })
        .collect();
    Ok(Tensor::from_slice(&grey)
        .f_view([1, 1, h as i64, w as i64])?
        .f_to_kind(Kind::Float)?
        .f_div_scalar(255.0)?)
}
