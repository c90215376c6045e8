//! The tiny model as one bundle: text encoder, Flux transformer, pixel codec and scheduler
//! config, with the diffusers-format folder layout it is saved in and loaded from.
//!
//! ```text
//! weights/tiny/
//!   model_index.json
//!   scheduler/scheduler_config.json      FlowMatchEulerDiscreteScheduler, shift 2.0, static
//!   text_encoder/{config.json,model.safetensors}   DiffmeshTinyTextEncoder
//!   tokenizer/{vocab.json,tokenizer_config.json}
//!   transformer/{config.json,diffusion_pytorch_model.safetensors}   FluxTransformer2DModel
//!   vae/config.json                      DiffmeshPixelCodec (no weights)
//! ```
use super::codec::{write_json, DiffmeshPixelCodec, PixelCodecConfig};
use super::text_encoder::{self, DiffmeshTinyTextEncoder, TinyTextEncoderConfig};
use super::tokenizer::WordTokenizer;
use super::IMAGE_SIZE;
use crate::components::{LatentCodec, TextEmbeddings};
use crate::error::{ModelError, Result};
use crate::flux::{FluxConfig, FluxInputs, FluxTransformer};
use crate::packing::{latent_image_ids, pack_latents, unpack_latents};
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

/// Named weights, as a var store lists them (`(name, tensor)`).
type NamedTensors = [(String, Tensor)];

/// Tokens every prompt is padded to (the longest generated prompt has 11 with `<s>`).
pub const MAX_TOKENS: i64 = 16;
/// Static time shift shared by training's timestep sampling and the scheduler.
pub const SHIFT: f64 = 2.0;

/// Attention heads of the shipped transformer.
pub const DEFAULT_HEADS: i64 = 3;
/// Channels per attention head of the shipped transformer.
pub const DEFAULT_HEAD_DIM: i64 = 64;
/// Double-stream blocks of the shipped transformer.
pub const DEFAULT_DOUBLE_BLOCKS: i64 = 2;
/// Single-stream blocks of the shipped transformer.
pub const DEFAULT_SINGLE_BLOCKS: i64 = 2;

/// The transformer config of the shipped model: 2 double + 2 single blocks, width 192 (3 heads of 64).
pub fn default_flux_config() -> FluxConfig {
    flux_config(
        DEFAULT_HEADS,
        DEFAULT_HEAD_DIM,
        DEFAULT_DOUBLE_BLOCKS,
        DEFAULT_SINGLE_BLOCKS,
    )
}

/// The tiny transformer config with `heads` heads of `head_dim` channels (a multiple of 16: RoPE
/// splits a head 1/4 : 3/8 : 3/8 over the (index, row, column) axes, like Flux's 16 : 56 : 56)
/// and the given block counts.
pub fn flux_config(
    heads: i64,
    head_dim: i64,
    double_blocks: i64,
    single_blocks: i64,
) -> FluxConfig {
    FluxConfig {
        patch_size: 1,
        in_channels: 48,
        out_channels: None,
        num_layers: double_blocks,
        num_single_layers: single_blocks,
        attention_head_dim: head_dim,
        num_attention_heads: heads,
        joint_attention_dim: 128,
        pooled_projection_dim: 128,
        guidance_embeds: false,
        axes_dims_rope: vec![head_dim / 4, head_dim * 3 / 8, head_dim * 3 / 8],
    }
}

pub fn default_text_config(tokenizer: &WordTokenizer, flux: &FluxConfig) -> TinyTextEncoderConfig {
    TinyTextEncoderConfig {
        class_name: text_encoder::CLASS_NAME.into(),
        vocab_size: tokenizer.vocab_size(),
        max_tokens: MAX_TOKENS,
        hidden_size: flux.joint_attention_dim,
        num_layers: 2,
        num_heads: 4,
        pooled_projection_dim: flux.pooled_projection_dim,
    }
}

pub struct TinyModel {
    pub text_encoder: DiffmeshTinyTextEncoder,
    pub transformer: FluxTransformer,
    pub codec: DiffmeshPixelCodec,
    pub flux_config: FluxConfig,
    pub text_vs: nn::VarStore,
    pub transformer_vs: nn::VarStore,
    /// `[N, 3]` image position ids of the 16x16 token grid.
    img_ids: Tensor,
    /// `[T, 3]` zeros, as Flux uses for text tokens.
    txt_ids: Tensor,
}

impl TinyModel {
    /// This model as a pipeline stepping on `scheduler`.
    pub fn pipeline<'a>(
        &'a self,
        scheduler: &'a crate::noise_scheduler::FlowMatchEulerDiscreteScheduler,
    ) -> crate::pipeline::FluxPipeline<'a> {
        crate::pipeline::FluxPipeline {
            transformer: &self.transformer,
            text_encoder: &self.text_encoder,
            codec: &self.codec,
            scheduler,
        }
    }

    /// Freshly initialised model (weights from torch's global RNG: seed it first).
    pub fn new(device: Device) -> Result<Self> {
        Self::with_flux_config(device, default_flux_config())
    }

    /// Freshly initialised model with another transformer size (see [`flux_config`]).
    pub fn with_flux_config(device: Device, flux_config: FluxConfig) -> Result<Self> {
        let tokenizer = WordTokenizer::for_generator(MAX_TOKENS);
        let text_config = default_text_config(&tokenizer, &flux_config);
        let text_vs = nn::VarStore::new(device);
        let transformer_vs = nn::VarStore::new(device);
        let text_encoder = DiffmeshTinyTextEncoder::new(&text_vs.root(), text_config, tokenizer)?;
        let transformer = FluxTransformer::new(&transformer_vs.root(), flux_config.clone())?;
        zero_init_modulation(&transformer_vs)?;
        let codec = DiffmeshPixelCodec::new(PixelCodecConfig::default(), device)?;
        Self::assemble(
            text_encoder,
            transformer,
            codec,
            flux_config,
            text_vs,
            transformer_vs,
        )
    }

    /// A model whose transformer weights are all random (normal, std 0.05) and non-zero, seeded
    /// from `seed`. The trained-from-scratch init zeroes the modulation, which makes the output
    /// independent of the inputs; tests that compare outputs (batch vs alone, seeds, cancellation)
    /// need a model whose output depends on prompt, timestep and noise.
    pub fn random_for_tests(seed: i64, device: Device) -> Result<Self> {
        tch::manual_seed(seed);
        let m = Self::new(device)?;
        tch::no_grad(|| -> Result<()> {
            // In name order: `variables()` is a HashMap, whose order changes from one call to
            // the next, and with it which variable gets which draw.
            let mut variables: Vec<_> = m.transformer_vs.variables().into_iter().collect();
            variables.sort_by(|a, b| a.0.cmp(&b.0));
            for (_, mut v) in variables {
                let r = Tensor::f_randn(v.size(), (Kind::Float, device))?.f_mul_scalar(0.05)?;
                v.f_copy_(&r)?;
            }
            Ok(())
        })?;
        Ok(m)
    }

    /// Load a folder written by [`TinyModel::save`] (strict: every weight must be present).
    pub fn load(dir: &Path, device: Device) -> Result<Self> {
        let (text_encoder, text_vs) =
            DiffmeshTinyTextEncoder::load(&dir.join("text_encoder"), device)?;
        let flux_config = FluxConfig::from_dir(&dir.join("transformer"))?;
        let mut transformer_vs = nn::VarStore::new(device);
        let transformer = FluxTransformer::new(&transformer_vs.root(), flux_config.clone())?;
        crate::weights::load_strict(&mut transformer_vs, &dir.join("transformer"))?;
        let codec = DiffmeshPixelCodec::load(&dir.join("vae"), device)?;
        Self::assemble(
            text_encoder,
            transformer,
            codec,
            flux_config,
            text_vs,
            transformer_vs,
        )
    }

    fn assemble(
        text_encoder: DiffmeshTinyTextEncoder,
        transformer: FluxTransformer,
        codec: DiffmeshPixelCodec,
        flux_config: FluxConfig,
        text_vs: nn::VarStore,
        transformer_vs: nn::VarStore,
    ) -> Result<Self> {
        if flux_config.in_channels != codec.latent_channels() * 4 {
            return Err(ModelError::config(
                "transformer.in_channels",
                format!(
                    "{} != 4 x codec latent channels {}",
                    flux_config.in_channels,
                    codec.latent_channels()
                ),
            ));
        }
        let device = text_vs.device();
        let grid = IMAGE_SIZE / codec.downscale_factor() / 2;
        let img_ids = latent_image_ids(grid, grid, Kind::Float)?.f_to_device(device)?;
        let txt_ids =
            Tensor::f_zeros([text_encoder.config().max_tokens, 3], (Kind::Float, device))?;
        Ok(TinyModel {
            text_encoder,
            transformer,
            codec,
            flux_config,
            text_vs,
            transformer_vs,
            img_ids,
            txt_ids,
        })
    }

    pub fn device(&self) -> Device {
        self.text_vs.device()
    }

    pub fn parameter_counts(&self) -> (i64, i64) {
        let count = |vs: &nn::VarStore| {
            vs.variables()
                .values()
                .map(|t| t.numel() as i64)
                .sum::<i64>()
        };
        (count(&self.text_vs), count(&self.transformer_vs))
    }

    /// Images `[B, 3, 64, 64]` -> packed tokens `[B, 256, 48]`.
    pub fn images_to_tokens(&self, images: &Tensor) -> Result<Tensor> {
        pack_latents(&self.codec.encode(images)?)
    }

    /// Packed tokens -> images `[B, 3, 64, 64]` (unclamped).
    pub fn tokens_to_images(&self, tokens: &Tensor) -> Result<Tensor> {
        let side = IMAGE_SIZE / self.codec.downscale_factor();
        self.codec.decode(&unpack_latents(tokens, side, side)?)
    }

    /// Velocity prediction for packed noisy tokens `x` at flow time `t` (`[B]`, in 0..1).
    pub fn velocity(&self, x: &Tensor, text: &TextEmbeddings, t: &Tensor) -> Result<Tensor> {
        self.transformer.forward(&self.flux_inputs(x, text, t))
    }

    /// The transformer inputs of [`Self::velocity`] (ControlNet training runs them twice).
    pub fn flux_inputs(&self, x: &Tensor, text: &TextEmbeddings, t: &Tensor) -> FluxInputs {
        FluxInputs {
            hidden_states: x.shallow_clone(),
            encoder_hidden_states: text.hidden.shallow_clone(),
            pooled_projections: text.pooled.shallow_clone(),
            timestep: t.shallow_clone(),
            img_ids: self.img_ids.shallow_clone(),
            txt_ids: self.txt_ids.shallow_clone(),
            guidance: None,
        }
    }

    /// Write the full folder; `weights` replaces the live weights of the named store when given
    /// (training saves its EMA copies this way).
    pub fn save(&self, dir: &Path, weights: Option<(&NamedTensors, &NamedTensors)>) -> Result<()> {
        let te = dir.join("text_encoder");
        let tr = dir.join("transformer");
        text_encoder::save_configs(
            dir,
            self.text_encoder.config(),
            self.text_encoder.tokenizer(),
        )?;
        let mut flux_json =
            serde_json::to_value(&self.flux_config).map_err(|source| ModelError::Json {
                path: tr.join("config.json"),
                source,
            })?;
        flux_json["_class_name"] = "FluxTransformer2DModel".into();
        flux_json["_diffusers_version"] = "0.42.1".into();
        write_json(&tr.join("config.json"), &flux_json)?;
        self.codec.save(&dir.join("vae"))?;
        write_json(
            &dir.join("scheduler").join("scheduler_config.json"),
            &scheduler_config_json(),
        )?;
        write_json(&dir.join("model_index.json"), &model_index_json())?;
        match weights {
            Some((text, transformer)) => {
                write_sorted(text, &te.join("model.safetensors"))?;
                write_sorted(transformer, &tr.join("diffusion_pytorch_model.safetensors"))
            }
            None => {
                crate::weights::save(&self.text_vs, &te.join("model.safetensors"))?;
                crate::weights::save(
                    &self.transformer_vs,
                    &tr.join("diffusion_pytorch_model.safetensors"),
                )
            }
        }
    }
}

/// adaLN-Zero (DiT): zero every modulation linear and the final projection, so each block starts
/// as the identity and the initial velocity prediction is 0 (loss starts near 2 instead of ~10).
fn zero_init_modulation(vs: &nn::VarStore) -> Result<()> {
    let is_modulation = |name: &str| {
        [".norm1.linear.", ".norm1_context.linear.", ".norm.linear."]
            .iter()
            .any(|m| name.contains(m))
            || name.starts_with("norm_out.linear.")
            || name.starts_with("proj_out.")
    };
    tch::no_grad(|| {
        for (name, mut var) in vs.variables() {
            if is_modulation(&name) {
                let _ = var.f_zero_()?;
            }
        }
        Ok(())
    })
}

fn write_sorted(vars: &[(String, Tensor)], path: &Path) -> Result<()> {
    let mut vars: Vec<(String, Tensor)> = vars
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&vars, path)?;
    Ok(())
}

pub fn scheduler_config_json() -> serde_json::Value {
    serde_json::json!({
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "_diffusers_version": "0.42.1",
        "num_train_timesteps": 1000,
        "shift": SHIFT,
        "use_dynamic_shifting": false,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "invert_sigmas": false,
        "shift_terminal": null,
        "use_karras_sigmas": false,
        "use_exponential_sigmas": false,
        "use_beta_sigmas": false,
        "time_shift_type": "exponential",
        "stochastic_sampling": false
    })
}

pub fn model_index_json() -> serde_json::Value {
    serde_json::json!({
        "_class_name": "FluxPipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["diffmesh", text_encoder::CLASS_NAME],
        "tokenizer": ["diffmesh", "DiffmeshWordTokenizer"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffmesh", super::codec::CLASS_NAME]
    })
}

/// `[B, 3, H, W]` in [-1, 1] -> one row-major RGB byte vector per image.
pub fn images_to_rgb(images: &Tensor) -> Result<Vec<Vec<u8>>> {
    let imgs = images
        .f_clamp(-1.0, 1.0)?
        .f_add_scalar(1.0)?
        .f_mul_scalar(127.5)?
        .f_round()?
        .f_to_kind(Kind::Uint8)?
        .f_permute([0, 2, 3, 1])?
        .f_contiguous()?
        .f_to_device(Device::Cpu)?;
    let b = imgs.size()[0];
    let mut out = Vec::with_capacity(b as usize);
    for i in 0..b {
        let img = imgs.f_get(i)?.f_flatten(0, -1)?;
        out.push(Vec::<u8>::try_from(&img).map_err(ModelError::Torch)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_load_round_trip_and_zero_init() {
        tch::manual_seed(1);
        let model = TinyModel::new(Device::Cpu).unwrap();
        let dir = std::env::temp_dir().join(format!("diffmesh-tiny-model-{}", std::process::id()));
        model.save(&dir, None).unwrap();
        let back = TinyModel::load(&dir, Device::Cpu).unwrap();
        // The folder also loads through the generic model-directory loader.
        let generic = crate::model_dir::LoadedModel::load(&dir, Device::Cpu, Kind::Float).unwrap();
        assert_eq!(generic.transformer.cfg, model.flux_config);

        let images = Tensor::rand([2, 3, 64, 64], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
        let tokens = model.images_to_tokens(&images).unwrap();
        assert_eq!(tokens.size(), vec![2, 256, 48]);
        assert!(model.tokens_to_images(&tokens).unwrap().equal(&images));

        let prompts = vec![
            "a red circle on the left on a blue background".to_string(),
            String::new(),
        ];
        let t = Tensor::from_slice(&[0.3f32, 0.9]);
        let run = |m: &TinyModel| {
            tch::no_grad(|| {
                let text = m
                    .text_encoder
                    .forward_ids(&m.text_encoder.tokenize(&prompts).unwrap())
                    .unwrap();
                m.velocity(&tokens, &text, &t).unwrap()
            })
        };
        let (a, b) = (run(&model), run(&back));
        assert!(a.allclose(&b, 1e-6, 1e-6, false));
        // adaLN-Zero: a fresh model predicts exactly zero velocity.
        assert_eq!(a.abs().max().double_value(&[]), 0.0);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn images_to_rgb_maps_range() {
        let x = Tensor::from_slice(&[-1.0f32, 0.0, 1.0, 2.0])
            .view([1, 1, 2, 2])
            .repeat([1, 3, 1, 1]);
        let rgb = images_to_rgb(&x).unwrap();
        assert_eq!(rgb[0][..3], [0, 0, 0]);
        assert_eq!(rgb[0][3..6], [128, 128, 128]);
        assert_eq!(rgb[0][9..12], [255, 255, 255]);
    }
}
