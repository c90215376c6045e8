//! The UNet pipelines of diffusers 0.42.1 (issue 48): `StableDiffusionPipeline` (SD 2.1, and
//! 1.x) and `StableDiffusionXLPipeline` text-to-image, and their inpainting pipelines in
//! [`inpaint`]. SD 2.1 conditions on one CLIP encoder's last hidden states; SDXL on the
//! concatenated penultimate hidden states of two, pooled on the second's projection, with its
//! time ids as added conditioning. Both run the UNet with classifier-free guidance, any of the
//! discrete schedulers (the checkpoint's own or one named by `--scheduler`), and the VAE. An SD
//! folder may name diffmesh's tiny text encoder and pixel codec instead of CLIP and the VAE
//! (the tiny UNet's, [`components`]).
//! `cargo xtask generate --model-dir DIR ...` runs them from given latents.
pub mod components;
pub mod control;
pub mod inpaint;
pub mod inputs;
pub mod stepper;
pub mod template;
pub mod text_lora;

use crate::components::LatentCodec;
use crate::error::{read_json, ModelError, Result};
use crate::schedulers::{DiscreteSchedule, DiscreteScheduler, DiscreteSchedulerConfig};
use crate::unet::UNet2DConditionModel;
use components::{SdVae, TextSide};
use std::path::{Path, PathBuf};
use tch::{nn, Device, Kind, Tensor};

pub const SD_PIPELINE_CLASS: &str = "StableDiffusionPipeline";
pub const SD_INPAINT_PIPELINE_CLASS: &str = "StableDiffusionInpaintPipeline";
pub const SDXL_PIPELINE_CLASS: &str = "StableDiffusionXLPipeline";
pub const SDXL_INPAINT_PIPELINE_CLASS: &str = "StableDiffusionXLInpaintPipeline";

/// The pipeline classes this module loads, SD's then SDXL's.
pub const PIPELINE_CLASSES: [&str; 4] = [
    SD_PIPELINE_CLASS,
    SD_INPAINT_PIPELINE_CLASS,
    SDXL_PIPELINE_CLASS,
    SDXL_INPAINT_PIPELINE_CLASS,
];

/// A prompt's conditioning: `[1, T, D]`, and SDXL's pooled `[1, projection_dim]`.
#[derive(Debug)]
pub struct SdPrompt {
    pub embeds: Tensor,
    pub pooled: Option<Tensor>,
}

pub struct SdPipeline {
    /// `model_index.json`'s `_class_name` (one of [`PIPELINE_CLASSES`]).
    pub class: String,
    text: TextSide,
    pub unet: UNet2DConditionModel,
    /// AutoencoderKL, or the tiny model's pixel codec.
    pub vae: SdVae,
    /// The checkpoint's `scheduler/scheduler_config.json`.
    pub scheduler: DiscreteSchedulerConfig,
    /// An absent negative prompt conditions on zeros (SDXL base's `model_index.json`).
    force_zeros_for_empty_prompt: bool,
    /// The text encoders' weights, in the pipeline's order.
    text_stores: Vec<nn::VarStore>,
}

/// What one generation asks for.
#[derive(Debug, Clone)]
pub struct SdRequest {
    pub prompt: String,
    pub negative_prompt: Option<String>,
    pub height: i64,
    pub width: i64,
    pub steps: usize,
    pub guidance_scale: f64,
    /// A [`crate::schedulers::NAMES`] name; None: the checkpoint's own scheduler.
    pub scheduler: Option<String>,
}

impl SdPipeline {
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        #[derive(serde::Deserialize)]
        struct Index {
            #[serde(rename = "_class_name")]
            class: String,
            /// SDXL's; SD's pipelines encode the empty negative prompt.
            force_zeros_for_empty_prompt: Option<bool>,
        }
        let index: Index = read_json(&dir.join("model_index.json"))?;
        if !PIPELINE_CLASSES.contains(&index.class.as_str()) {
            return Err(ModelError::config(
                "_class_name",
                format!(
                    "expected one of {PIPELINE_CLASSES:?}, found {}",
                    index.class
                ),
            ));
        }
        let xl = index.class.starts_with("StableDiffusionXL");
        let mut stores = Vec::new();
        let text = TextSide::load(dir, xl, device, kind, &mut stores)?;
        let scheduler = DiscreteSchedulerConfig::from_file(
            &dir.join("scheduler").join("scheduler_config.json"),
        )?;
        Ok(Self {
            class: index.class,
            text,
            unet: UNet2DConditionModel::load(&dir.join("unet"), device, kind)?,
            vae: SdVae::load(dir, device, kind)?,
            scheduler,
            force_zeros_for_empty_prompt: index.force_zeros_for_empty_prompt.unwrap_or(xl),
            text_stores: stores,
        })
    }

    /// Side in pixels of one token as the mesh masks: the pixels one latent pixel of the UNet's
    /// coarsest level covers, so a token mask is exact at every level; at least 8, since SD's
    /// sizes are multiples of 8 whatever the VAE (diffusers checks the same).
    pub fn token_pixels(&self) -> i64 {
        let levels = self.unet.config.block_out_channels.len().clamp(1, 16) as u32;
        (self.vae.downscale_factor().max(1) << (levels - 1)).max(8)
    }

    /// Tokens every prompt is padded or cut to (77 for CLIP).
    pub fn max_tokens(&self) -> i64 {
        self.text.max_tokens()
    }

    /// Per CLIP text encoder, in the pipeline's order, its linear layers as LoRA files name
    /// them (after transformers' `text_model.`); none for the tiny text encoder, which takes no
    /// adapters.
    pub fn text_linear_modules(&self) -> Vec<Vec<String>> {
        self.clip_stores()
            .iter()
            .map(|vs| {
                // Embedding tables are 2-D too; LoRA files adapt them by other keys.
                let mut modules = crate::lora::linear_modules(vs);
                modules.retain(|m| !m.contains("embedding"));
                modules
            })
            .collect()
    }

    /// The CLIP text encoders' weights (none for the tiny text encoder).
    pub(crate) fn clip_stores(&self) -> &[nn::VarStore] {
        match self.text {
            TextSide::Clip(_) => &self.text_stores,
            TextSide::Tiny(_) => &[],
        }
    }

    /// Whether this is an SDXL pipeline (two encoders, added time conditioning).
    pub fn is_xl(&self) -> bool {
        self.text.is_xl()
    }

    /// `encode_prompt` of one prompt padded to each tokenizer's length: SD's last hidden
    /// states; SDXL's penultimate hidden states of both encoders concatenated, and the pooled
    /// output of the second; the tiny encoder's token states.
    pub fn encode_prompt(&self, prompt: &str) -> Result<SdPrompt> {
        self.text.encode(prompt)
    }

    /// The negative conditioning: zeros shaped like `prompt` where no negative prompt is given
    /// and the checkpoint says so, else the encoded negative prompt (empty if none).
    pub fn negative(&self, negative: Option<&str>, prompt: &SdPrompt) -> Result<SdPrompt> {
        match negative {
            None if self.force_zeros_for_empty_prompt => Ok(SdPrompt {
                embeds: prompt.embeds.f_zeros_like()?,
                pooled: prompt.pooled.as_ref().map(Tensor::zeros_like),
            }),
            other => self.encode_prompt(other.unwrap_or("")),
        }
    }

    /// The image `[1, 3, H, W]` in [0, 1] from `latents` `[1, C, H / f, W / f]` (diffusers'
    /// `latents=`, `output_type="pt"`); `noise(step)` gives an ancestral step's noise.
    pub fn generate(
        &self,
        req: &SdRequest,
        latents: &Tensor,
        noise: &mut dyn FnMut(usize, &[i64]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.run_alone(req, latents, None, noise)
    }

    /// Check the request's sizes and guidance against the latents; the error names the field.
    pub(super) fn check_request(&self, req: &SdRequest, latents: &Tensor) -> Result<()> {
        let f = self.vae.downscale_factor();
        for (field, side) in [("height", req.height), ("width", req.width)] {
            if side < 8 || side % 8 != 0 {
                return Err(ModelError::input(
                    field,
                    format!("must be a positive multiple of 8, got {side}"),
                ));
            }
        }
        let want = [1, self.vae.latent_channels(), req.height / f, req.width / f];
        if latents.size() != want {
            return Err(ModelError::input(
                "latents",
                format!("expected {want:?}, got {:?}", latents.size()),
            ));
        }
        if !(req.guidance_scale.is_finite() && req.guidance_scale >= 0.0) {
            return Err(ModelError::input(
                "guidance_scale",
                "must be finite and non-negative",
            ));
        }
        Ok(())
    }

    /// The request's scheduler set to its steps.
    pub(super) fn schedule(&self, req: &SdRequest) -> Result<DiscreteSchedule> {
        let scheduler = match &req.scheduler {
            Some(name) => DiscreteScheduler::named(name, &self.scheduler)?,
            None => DiscreteScheduler::from_config(self.scheduler.clone())?,
        };
        scheduler.set_timesteps(req.steps)
    }
}

/// Whether `dir` holds one of [`PIPELINE_CLASSES`] (its `model_index.json` says so).
pub fn is_unet_pipeline_dir(dir: &Path) -> bool {
    #[derive(serde::Deserialize)]
    struct Index {
        #[serde(rename = "_class_name")]
        class: String,
    }
    read_json::<Index>(&dir.join("model_index.json"))
        .is_ok_and(|i| PIPELINE_CLASSES.contains(&i.class.as_str()))
}

/// What `diffmesh-pipeline generate` passes for an SD or SDXL directory.
pub struct SdFileArgs {
    pub model_dir: PathBuf,
    pub request: SdRequest,
    /// Safetensors holding `latents` `[1, C, H / f, W / f]`.
    pub latents: PathBuf,
    /// Seeds the noise of ancestral steps.
    pub seed: i64,
    /// An inpainting pipeline's image and mask (PNG or any format `image` reads) and strength.
    pub inpaint: Option<(PathBuf, PathBuf, f64)>,
    pub out: PathBuf,
    pub device: Device,
    pub kind: Kind,
}

/// `cargo xtask generate` on an SD or SDXL directory: writes `image` `[1, 3, H, W]` in [0, 1].
pub fn generate_file(args: &SdFileArgs) -> Result<()> {
    let pipe = SdPipeline::load(&args.model_dir, args.device, args.kind)?;
    let latents = Tensor::read_safetensors(&args.latents)?
        .into_iter()
        .find(|(name, _)| name == "latents")
        .map(|(_, t)| t)
        .ok_or_else(|| {
            ModelError::input(
                "latents",
                format!("no `latents` in {}", args.latents.display()),
            )
        })?;
    tch::manual_seed(args.seed);
    let mut noise = |_: usize, shape: &[i64]| -> Result<Tensor> {
        Ok(Tensor::f_randn(shape, (Kind::Float, Device::Cpu))?)
    };
    let image = match &args.inpaint {
        Some((image, mask, strength)) => {
            let image = crate::pipeline::cli::read_image(image)?;
            let mask = crate::pipeline::cli::read_mask(mask)?;
            let inputs = inpaint::InpaintInputs {
                image: &image,
                mask: &mask,
                strength: *strength,
            };
            pipe.inpaint(&args.request, &inputs, &latents, &mut noise)?
        }
        None => pipe.generate(&args.request, &latents, &mut noise)?,
    };
    Tensor::write_safetensors(&[("image", image.f_contiguous()?)], &args.out)?;
    Ok(())
}
