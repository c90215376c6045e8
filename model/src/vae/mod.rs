//! `AutoencoderKL` as in diffusers 0.42.1 (`models/autoencoders/autoencoder_kl.py`), loadable from
//! a diffusers `vae/` folder by key name, and usable by pipelines as a [`LatentCodec`].
//!
//! Only the configuration space real checkpoints use is supported (`DownEncoderBlock2D` /
//! `UpDecoderBlock2D`, SiLU, group norm); anything else is rejected by [`AutoencoderKLConfig::validate`]
//! with the offending field named. Tiling and slicing are not implemented.
pub(crate) mod blocks;
mod coder;

pub use coder::{Decoder, Encoder};

use crate::components::LatentCodec;
use crate::error::{ModelError, Result};
use crate::weights;
use serde::Deserialize;
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

pub const CLASS_NAME: &str = "AutoencoderKL";

/// Mirrors the VAE's `config.json`; defaults are diffusers' constructor defaults.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default)]
pub struct AutoencoderKLConfig {
    pub in_channels: i64,
    pub out_channels: i64,
    pub down_block_types: Vec<String>,
    pub up_block_types: Vec<String>,
    pub block_out_channels: Vec<i64>,
    pub layers_per_block: i64,
    pub act_fn: String,
    pub latent_channels: i64,
    pub norm_num_groups: i64,
    /// Only used by diffusers' tiling (an int or a pair); kept for completeness.
    pub sample_size: serde_json::Value,
    pub scaling_factor: f64,
    pub shift_factor: Option<f64>,
    pub latents_mean: Option<Vec<f64>>,
    pub latents_std: Option<Vec<f64>>,
    pub force_upcast: bool,
    pub use_quant_conv: bool,
    pub use_post_quant_conv: bool,
    pub mid_block_add_attention: bool,
}

impl Default for AutoencoderKLConfig {
    fn default() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            down_block_types: vec!["DownEncoderBlock2D".into()],
            up_block_types: vec!["UpDecoderBlock2D".into()],
            block_out_channels: vec![64],
            layers_per_block: 1,
            act_fn: "silu".into(),
            latent_channels: 4,
            norm_num_groups: 32,
            sample_size: serde_json::Value::from(32),
            scaling_factor: 0.18215,
            shift_factor: None,
            latents_mean: None,
            latents_std: None,
            force_upcast: true,
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
        }
    }
}

impl AutoencoderKLConfig {
    pub fn validate(&self) -> Result<()> {
        let n = self.block_out_channels.len();
        if n == 0 {
            return Err(ModelError::config(
                "block_out_channels",
                "must not be empty",
            ));
        }
        if self.down_block_types.len() != n || self.up_block_types.len() != n {
            return Err(ModelError::config(
                "down_block_types",
                "down/up block lists must match block_out_channels",
            ));
        }
        if let Some(t) = self
            .down_block_types
            .iter()
            .find(|t| *t != "DownEncoderBlock2D")
        {
            return Err(ModelError::config(
                "down_block_types",
                format!("block type {t} is not supported"),
            ));
        }
        if let Some(t) = self
            .up_block_types
            .iter()
            .find(|t| *t != "UpDecoderBlock2D")
        {
            return Err(ModelError::config(
                "up_block_types",
                format!("block type {t} is not supported"),
            ));
        }
        if self.act_fn != "silu" && self.act_fn != "swish" {
            return Err(ModelError::config(
                "act_fn",
                format!("{} is not supported (only silu)", self.act_fn),
            ));
        }
        if self.layers_per_block < 1 {
            return Err(ModelError::config("layers_per_block", "must be at least 1"));
        }
        for (field, v) in [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("latent_channels", self.latent_channels),
            ("norm_num_groups", self.norm_num_groups),
        ] {
            if v < 1 {
                return Err(ModelError::config(field, "must be positive"));
            }
        }
        if let Some(c) = self
            .block_out_channels
            .iter()
            .find(|&&c| c < 1 || c % self.norm_num_groups != 0)
        {
            return Err(ModelError::config(
                "block_out_channels",
                format!(
                    "{c} is not a positive multiple of norm_num_groups {}",
                    self.norm_num_groups
                ),
            ));
        }
        if !(self.scaling_factor.is_finite() && self.scaling_factor != 0.0) {
            return Err(ModelError::config(
                "scaling_factor",
                "must be finite and non-zero",
            ));
        }
        Ok(())
    }

    /// Pixel-to-latent downscale factor, `2^(len(block_out_channels) - 1)` (8 for real VAEs).
    pub fn downscale_factor(&self) -> i64 {
        1 << (self.block_out_channels.len().max(1) - 1)
    }
}

/// The encoder's posterior `DiagonalGaussianDistribution` (logvar clamped to [-30, 20]).
#[derive(Debug)]
pub struct LatentDist {
    pub mean: Tensor,
    pub logvar: Tensor,
}

impl LatentDist {
    /// `mean + exp(0.5 * logvar) * noise`, with caller-supplied standard normal noise.
    pub fn sample(&self, noise: &Tensor) -> Result<Tensor> {
        if noise.size() != self.mean.size() {
            return Err(ModelError::input(
                "noise",
                format!("shape {:?} != latent {:?}", noise.size(), self.mean.size()),
            ));
        }
        let std = self.logvar.f_mul_scalar(0.5)?.f_exp()?;
        Ok(self.mean.f_add(&std.f_mul(noise)?)?)
    }
}

#[derive(Debug)]
pub struct AutoencoderKL {
    pub config: AutoencoderKLConfig,
    pub encoder: Encoder,
    pub decoder: Decoder,
    quant_conv: Option<blocks::Conv2d>,
    post_quant_conv: Option<blocks::Conv2d>,
    /// Owns the parameters when built by [`AutoencoderKL::load`].
    vs: Option<nn::VarStore>,
}

impl AutoencoderKL {
    /// Build under `vs` with diffusers' key names (`encoder.*`, `decoder.*`, `quant_conv.*`, ...).
    pub fn new(vs: &nn::Path, config: AutoencoderKLConfig) -> Result<Self> {
        config.validate()?;
        let l = config.latent_channels;
        Ok(Self {
            encoder: Encoder::new(vs / "encoder", &config),
            decoder: Decoder::new(vs / "decoder", &config),
            quant_conv: config
                .use_quant_conv
                .then(|| blocks::Conv2d::new(vs / "quant_conv", 2 * l, 2 * l, 1, 1, 0)),
            post_quant_conv: config
                .use_post_quant_conv
                .then(|| blocks::Conv2d::new(vs / "post_quant_conv", l, l, 1, 1, 0)),
            config,
            vs: None,
        })
    }

    /// Load a diffusers `vae/` folder (`config.json` + safetensors) strictly, frozen for inference.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let config: AutoencoderKLConfig = weights::component_config(dir, CLASS_NAME)?;
        let mut vs = weights::new_store(device, kind);
        let mut vae = Self::new(&vs.root(), config)?;
        weights::load_frozen(&mut vs, dir, kind, "VAE")?;
        vae.vs = Some(vs);
        Ok(vae)
    }

    /// Check `[B, channels, H >= min_side, W >= min_side]` and move `x` to the weights' device
    /// and dtype.
    fn prepare_input(
        &self,
        x: &Tensor,
        field: &str,
        channels: i64,
        min_side: i64,
    ) -> Result<Tensor> {
        let s = x.size();
        if s.len() != 4 || s[0] < 1 || s[1] != channels || s[2] < min_side || s[3] < min_side {
            return Err(ModelError::input(
                field,
                format!("expected [B, {channels}, H>={min_side}, W>={min_side}], got {s:?}"),
            ));
        }
        let (device, kind) = self.device_kind();
        Ok(x.f_to_device(device)?.f_to_kind(kind)?)
    }

    /// Device and dtype of the parameters.
    pub fn device_kind(&self) -> (Device, Kind) {
        let w = self.encoder.weight();
        (w.device(), w.kind())
    }

    /// `vae.encode(x).latent_dist` for images in [-1, 1] (unscaled; the scaled latent is
    /// [`LatentCodec::encode`]).
    pub fn posterior(&self, images: &Tensor) -> Result<LatentDist> {
        // Each stride-2 downsampler needs at least 2 rows and columns.
        let images =
            self.prepare_input(images, "images", self.config.in_channels, self.downscale())?;
        let mut h = self.encoder.forward(&images)?;
        if let Some(q) = &self.quant_conv {
            h = q.forward(&h)?;
        }
        let parts = h.f_chunk(2, 1)?;
        let logvar = parts[1].f_clamp(-30.0, 20.0)?;
        Ok(LatentDist {
            mean: parts[0].shallow_clone(),
            logvar,
        })
    }

    /// `vae.decode(z).sample` for unscaled latents (scaled ones go through [`LatentCodec::decode`]).
    pub fn decode_unscaled(&self, z: &Tensor) -> Result<Tensor> {
        let z = self.prepare_input(z, "latents", self.config.latent_channels, 1)?;
        let z = match &self.post_quant_conv {
            Some(p) => p.forward(&z)?,
            None => z,
        };
        self.decoder.forward(&z)
    }

    /// `vae(sample, sample_posterior=False).sample`: decode of the posterior mean.
    pub fn forward(&self, images: &Tensor) -> Result<Tensor> {
        self.decode_unscaled(&self.posterior(images)?.mean)
    }

    fn downscale(&self) -> i64 {
        self.config.downscale_factor()
    }

    fn shift(&self) -> f64 {
        self.config.shift_factor.unwrap_or(0.0)
    }
}

impl LatentCodec for AutoencoderKL {
    /// `(mean - shift_factor) * scaling_factor`, as the Flux pipelines scale image latents (they
    /// sample the posterior; serving uses the mean so a template always maps to one latent).
    fn encode(&self, images: &Tensor) -> Result<Tensor> {
        let mean = self.posterior(images)?.mean;
        Ok(mean
            .f_sub_scalar(self.shift())?
            .f_mul_scalar(self.config.scaling_factor)?)
    }

    /// `decode(latents / scaling_factor + shift_factor)`.
    fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        let z = latents
            .f_div_scalar(self.config.scaling_factor)?
            .f_add_scalar(self.shift())?;
        self.decode_unscaled(&z)
    }

    fn latent_channels(&self) -> i64 {
        self.config.latent_channels
    }

    fn downscale_factor(&self) -> i64 {
        self.config.downscale_factor()
    }

    fn resident_bytes(&self) -> u64 {
        self.vs.as_ref().map_or(0, weights::store_bytes)
    }
}

/// `diffmesh-forward --component vae`: reads `sample` from `inputs`, writes `latent_mean`
/// (`encode(sample).latent_dist.mean`, unscaled) and `decoded` (`vae(sample).sample` with
/// `sample_posterior=False`, i.e. decode of that mean) to `out`. fp32 on CPU. `model_dir` is a
/// `vae/` folder or a model directory containing one.
pub fn cli_forward_vae(model_dir: &Path, inputs: &Path, out: &Path) -> Result<()> {
    let dir = if model_dir.join("vae").join("config.json").is_file() {
        model_dir.join("vae")
    } else {
        model_dir.into()
    };
    let vae = AutoencoderKL::load(&dir, Device::Cpu, Kind::Float)?;
    let sample = Tensor::read_safetensors(inputs)?
        .into_iter()
        .find(|(name, _)| name == "sample")
        .map(|(_, t)| t)
        .ok_or_else(|| {
            ModelError::input(
                "sample",
                format!("no tensor `sample` in {}", inputs.display()),
            )
        })?
        .f_to_kind(Kind::Float)?;
    let (mean, decoded) = tch::no_grad(|| -> Result<(Tensor, Tensor)> {
        let mean = vae.posterior(&sample)?.mean;
        let decoded = vae.decode_unscaled(&mean)?;
        Ok((mean, decoded))
    })?;
    Tensor::write_safetensors(
        &[
            ("latent_mean", mean.f_contiguous()?),
            ("decoded", decoded.f_contiguous()?),
        ],
        out,
    )?;
    Ok(())
}
