//! `UNet2DConditionModel` as in diffusers 0.42.1 (`models/unets/unet_2d_condition.py`), for
//! the SD1.x/SD2.x and SDXL configurations (issue 48): loadable from a diffusers `unet/` folder
//! by key name, its configuration checked by [`UNetConfig::validate`].
//!
//! The forward: a sinusoidal timestep projection and `TimestepEmbedding` (plus, for SDXL's
//! `text_time` conditioning, the pooled text embeds and six time ids through `add_time_proj`
//! and `add_embedding`), `conv_in`, the down levels (each pushing its outputs as skips), the
//! mid block, the up levels (each taking its skips back, last first), then group norm, SiLU
//! and `conv_out`. Whether the checkpoint predicts noise (`epsilon`) or velocity
//! (`v_prediction`) is the scheduler's business, not the UNet's.
pub mod attention;
pub mod blocks;
pub mod cache_codec;
pub mod config;
pub mod controlnet;
pub mod lora;
pub mod masked;
pub mod resnet;
mod stem;

use crate::error::{ModelError, Result};
use crate::vae::blocks::{Conv2d, GroupNorm};
use crate::weights;
use blocks::{UpBlock, UpChannels};
pub use config::UNetConfig;
pub use controlnet::{ControlNetModel, UNetResiduals};
use std::path::{Path, PathBuf};
use stem::Stem;
use tch::{nn, Device, Kind, Tensor};

pub const CLASS_NAME: &str = "UNet2DConditionModel";

/// The forward's inputs, under diffusers' argument names.
#[derive(Debug)]
pub struct UNetInputs {
    /// `[B, in_channels, H, W]` latents.
    pub sample: Tensor,
    /// `[B]` or `[]` (one for every row): the scheduler's timestep, fractional allowed.
    pub timestep: Tensor,
    /// `[B, T, cross_attention_dim]`.
    pub encoder_hidden_states: Tensor,
    /// SDXL (`text_time`): `[B, pooled width]` pooled text embeds.
    pub text_embeds: Option<Tensor>,
    /// SDXL (`text_time`): `[B, 6]` original size, crop corner, target size.
    pub time_ids: Option<Tensor>,
}

#[derive(Debug)]
pub struct UNet2DConditionModel {
    pub config: UNetConfig,
    stem: Stem,
    up: Vec<UpBlock>,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
    /// Owns the parameters when built by [`UNet2DConditionModel::load`].
    vs: Option<nn::VarStore>,
}

impl UNet2DConditionModel {
    /// Build under `vs` with diffusers' key names.
    pub fn new(vs: &nn::Path, config: UNetConfig) -> Result<Self> {
        config.validate()?;
        let levels = config.levels()?;
        let stem = Stem::new(vs, &config)?;
        let (r, a) = (stem.resnet_shape, stem.attention_shape);
        let (groups, c0, n) = (r.groups, config.block_out_channels[0], levels.len());
        let mut prev_output = levels[n - 1].channels;
        let up = (0..n)
            .map(|i| {
                let level = &levels[n - 1 - i];
                let channels = UpChannels {
                    prev_output,
                    skip_input: levels[(n - 1 - i).saturating_sub(1)].channels,
                };
                prev_output = level.channels;
                UpBlock::new(vs / "up_blocks" / i, level, channels, i + 1 < n, r, a)
            })
            .collect();
        let k_out = config.conv_out_kernel;
        Ok(Self {
            stem,
            up,
            conv_norm_out: GroupNorm::with_eps(vs / "conv_norm_out", groups, c0, config.norm_eps),
            conv_out: Conv2d::new(
                vs / "conv_out",
                c0,
                config.out_channels,
                k_out,
                1,
                k_out / 2,
            ),
            config,
            vs: None,
        })
    }

    /// Load from a diffusers `unet/` folder (`config.json` + safetensors), strictly by key.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let config: UNetConfig = weights::component_config(dir, CLASS_NAME)?;
        let mut vs = weights::new_store(device, kind);
        let mut unet = Self::new(&vs.root(), config)?;
        weights::load_frozen(&mut vs, dir, kind, "UNet")?;
        unet.vs = Some(vs);
        Ok(unet)
    }

    /// The weights' device and dtype.
    pub fn device_kind(&self) -> (Device, Kind) {
        self.stem.device_kind()
    }

    /// Layers of each `Transformer2DModel`, in the order the forward meets them (and a
    /// template's cache holds them): what [`cache_codec::decode_step`] needs.
    pub fn transformer_layers(&self) -> Vec<usize> {
        let mut layers = self.stem.transformer_layers();
        layers.extend(self.up.iter().flat_map(|u| u.transformer_layers()));
        layers
    }

    /// The predicted noise or velocity, `[B, out_channels, H, W]`.
    pub fn forward(&self, x: &UNetInputs) -> Result<Tensor> {
        self.forward_controlled(x, None)
    }

    /// [`Self::forward`] steered by ControlNet residuals (summed over the ControlNets of a
    /// request): each added to its skip connection, the last to the mid block's output.
    pub fn forward_controlled(
        &self,
        x: &UNetInputs,
        residuals: Option<&UNetResiduals>,
    ) -> Result<Tensor> {
        self.forward_with(x, residuals, &mut masked::Plain)
    }

    /// The forward with each `Transformer2DModel` run by `pass` (in full, capturing, or
    /// mask-aware: [`masked`]).
    pub(crate) fn forward_with(
        &self,
        x: &UNetInputs,
        residuals: Option<&UNetResiduals>,
        pass: &mut dyn masked::AttentionPass,
    ) -> Result<Tensor> {
        let (batch, side) = check_inputs(&self.config, x)?;
        let (device, kind) = self.device_kind();
        let on = |t: &Tensor| -> Result<Tensor> { Ok(t.f_to_device(device)?.f_to_kind(kind)?) };
        let context = on(&x.encoder_hidden_states)?;
        let temb_silu = self.stem.time_embedding(&self.config, x, batch)?;
        let h = self.stem.conv_in.forward(&on(&x.sample)?)?;
        let (mut h, mut skips) = self.stem.down_mid(h, &temb_silu, &context, pass)?;
        if let Some(r) = residuals {
            let add = |a: &Tensor, b: &Tensor, what: &str| -> Result<Tensor> {
                if a.size() != b.size() {
                    return Err(ModelError::input(
                        "controlnet",
                        format!("{what}: residual {:?} for {:?}", b.size(), a.size()),
                    ));
                }
                Ok(a.f_add(&b.f_to_device(device)?.f_to_kind(kind)?)?)
            };
            if r.down.len() != skips.len() {
                return Err(ModelError::input(
                    "controlnet",
                    format!("{} down residuals for {} skips", r.down.len(), skips.len()),
                ));
            }
            for (i, (skip, residual)) in skips.iter_mut().zip(&r.down).enumerate() {
                *skip = add(skip, residual, &format!("down residual {i}"))?;
            }
            h = add(&h, &r.mid, "mid residual")?;
        }
        // Sides that do not divide by the downsampling: each upsampler takes its size from
        // the skip it meets next, as diffusers does.
        let factor = 1i64 << (self.up.len() - 1);
        let odd = side.iter().any(|s| s % factor != 0);
        for (i, block) in self.up.iter().enumerate() {
            let mine = skips.split_off(skips.len().saturating_sub(block.skips()));
            let size = match (odd && i + 1 < self.up.len(), skips.last()) {
                (true, Some(next)) => {
                    let s = next.size();
                    Some([s[2], s[3]])
                }
                _ => None,
            };
            h = block.forward(&h, &temb_silu, &context, mine, size, pass)?;
        }
        let h = self.conv_norm_out.forward(&h)?.f_silu()?;
        self.conv_out.forward(&h)
    }

    /// The text width the cross-attention reads (every level's: [`UNetConfig::validate`]).
    pub fn context_dim(&self) -> i64 {
        self.config.context_dim()
    }

    /// The parameters, when [`Self::load`] built it (what a LoRA patcher patches).
    pub fn var_store(&self) -> Option<&nn::VarStore> {
        self.vs.as_ref()
    }

    /// The paths of its linear layers (2-D weights), as LoRA files name them.
    pub fn linear_modules(&self) -> Vec<String> {
        self.vs
            .as_ref()
            .map(crate::lora::linear_modules)
            .unwrap_or_default()
    }
}

/// Check the inputs' shapes against the configuration: the batch and the latent sides.
pub(crate) fn check_inputs(cfg: &UNetConfig, x: &UNetInputs) -> Result<(i64, [i64; 2])> {
    let s = x.sample.size();
    if s.len() != 4 || s[1] != cfg.in_channels || s[0] < 1 || s[2] < 1 || s[3] < 1 {
        return Err(ModelError::input(
            "sample",
            format!("expected [B, {}, H, W], got {s:?}", cfg.in_channels),
        ));
    }
    let batch = s[0];
    let context_dim = cfg.context_dim();
    let e = x.encoder_hidden_states.size();
    if e.len() != 3 || e[0] != batch || e[2] != context_dim || e[1] < 1 {
        return Err(ModelError::input(
            "encoder_hidden_states",
            format!("expected [{batch}, T, {context_dim}], got {e:?}"),
        ));
    }
    let t = x.timestep.numel() as i64;
    if t != 1 && !(x.timestep.dim() == 1 && t == batch) {
        return Err(ModelError::input(
            "timestep",
            format!(
                "expected one value or [{batch}], got {:?}",
                x.timestep.size()
            ),
        ));
    }
    if let Some((_, input)) = cfg.text_time() {
        let time_ids = x.time_ids.as_ref().map(|t| t.size());
        let text = x.text_embeds.as_ref().map(|t| t.size());
        let (Some(time_ids), Some(text)) = (time_ids, text) else {
            return Err(ModelError::input(
                "text_embeds",
                "this UNet (addition_embed_type text_time) needs text_embeds and time_ids",
            ));
        };
        let time_dim = cfg.addition_time_embed_dim.unwrap_or(0);
        let ids = input - time_dim * time_ids.get(1).copied().unwrap_or(0);
        if time_ids.len() != 2 || time_ids[0] != batch {
            return Err(ModelError::input(
                "time_ids",
                format!("expected [{batch}, N], got {time_ids:?}"),
            ));
        }
        if text != [batch, ids] {
            return Err(ModelError::input(
                "text_embeds",
                format!(
                    "expected [{batch}, {ids}] (with {} time ids), got {text:?}",
                    time_ids[1]
                ),
            ));
        }
    }
    Ok((batch, [s[2], s[3]]))
}

/// diffusers' `get_timestep_embedding(t, dim, flip_sin_to_cos, downscale_freq_shift=shift)`,
/// in fp32: `[sin(t f), cos(t f)]` (flipped: cos first), `f_i = exp(-ln(10000) i / (dim/2 - shift))`.
pub fn sinusoidal(t: &Tensor, dim: i64, flip_sin_to_cos: bool, shift: f64) -> Result<Tensor> {
    let half = dim / 2;
    let exponent = Tensor::f_arange(half, (Kind::Float, t.device()))?
        .f_mul_scalar(-(10000f64.ln()))?
        .f_div_scalar(half as f64 - shift)?;
    let args = t
        .f_to_kind(Kind::Float)?
        .f_unsqueeze(1)?
        .f_mul(&exponent.f_exp()?.f_unsqueeze(0)?)?;
    let (sin, cos) = (args.f_sin()?, args.f_cos()?);
    let emb = if flip_sin_to_cos {
        Tensor::f_cat(&[cos, sin], -1)?
    } else {
        Tensor::f_cat(&[sin, cos], -1)?
    };
    if dim % 2 == 1 {
        return Ok(emb.f_constant_pad_nd([0, 1])?);
    }
    Ok(emb)
}

/// The UNet's folder: `model_dir/unet` when there is one, else `model_dir`.
pub fn component_dir(model_dir: &Path) -> PathBuf {
    if model_dir.join("unet").join("config.json").is_file() {
        model_dir.join("unet")
    } else {
        model_dir.into()
    }
}

/// `cargo xtask forward --component unet`: inputs under diffusers' `UNet2DConditionModel.forward`
/// argument names (`sample`, `timestep`, `encoder_hidden_states`, and for SDXL `text_embeds`,
/// `time_ids`); writes `sample`. fp32 on the CPU.
pub fn cli_forward_unet(model_dir: &Path, inputs: &Path, out: &Path) -> Result<()> {
    let unet = UNet2DConditionModel::load(&component_dir(model_dir), Device::Cpu, Kind::Float)?;
    let (x, mut rest) = cli_inputs(inputs)?;
    // diffusers' names for a ControlNet's residuals, where given.
    let mut down = Vec::new();
    while let Some(t) = rest.remove(&format!("down_block_additional_residuals.{}", down.len())) {
        down.push(t);
    }
    let residuals = rest
        .remove("mid_block_additional_residual")
        .map(|mid| UNetResiduals { down, mid });
    let sample = tch::no_grad(|| unet.forward_controlled(&x, residuals.as_ref()))?;
    Tensor::write_safetensors(&[("sample", sample.f_contiguous()?)], out)?;
    Ok(())
}

/// The UNet's inputs from a safetensors file under diffusers' argument names, and the rest.
pub(crate) fn cli_inputs(
    inputs: &Path,
) -> Result<(UNetInputs, std::collections::HashMap<String, Tensor>)> {
    let mut named: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(inputs)?.into_iter().collect();
    let mut take = |name: &str| {
        named.remove(name).ok_or_else(|| {
            ModelError::input(name, format!("no tensor `{name}` in {}", inputs.display()))
        })
    };
    let x = UNetInputs {
        sample: take("sample")?,
        timestep: take("timestep")?,
        encoder_hidden_states: take("encoder_hidden_states")?,
        text_embeds: take("text_embeds").ok(),
        time_ids: take("time_ids").ok(),
    };
    Ok((x, named))
}
