//! `ControlNetModel` (diffusers 0.42.1, `models/controlnets/controlnet.py`) for the UNet family:
//! the UNet's time embedding, `conv_in`, down levels and mid block (its own copy of them), with
//! the control image embedded by `controlnet_cond_embedding` and added after `conv_in`; each
//! skip and the mid output go through a 1x1 conv (`controlnet_down_blocks`,
//! `controlnet_mid_block`) and are scaled by the conditioning scale. The UNet adds them to its
//! own skips and mid output ([`super::UNet2DConditionModel::forward_controlled`]); residuals of
//! several ControlNets are summed first, as diffusers' `MultiControlNetModel` does.
use super::config::UNetConfig;
use super::stem::Stem;
use super::{check_inputs, UNetInputs};
use crate::error::{ModelError, Result};
use crate::vae::blocks::Conv2d;
use crate::weights;
use serde::Deserialize;
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

pub const CLASS_NAME: &str = "ControlNetModel";

/// The ControlNet's `config.json`: the UNet's fields (no up blocks) and the control image's.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default)]
pub struct ControlNetConfig {
    #[serde(flatten)]
    pub unet: UNetConfig,
    pub conditioning_embedding_out_channels: Vec<i64>,
    pub conditioning_channels: i64,
    pub controlnet_conditioning_channel_order: String,
    pub global_pool_conditions: bool,
}

impl Default for ControlNetConfig {
    fn default() -> Self {
        Self {
            unet: UNetConfig::default(),
            conditioning_embedding_out_channels: vec![16, 32, 96, 256],
            conditioning_channels: 3,
            controlnet_conditioning_channel_order: "rgb".into(),
            global_pool_conditions: false,
        }
    }
}

impl ControlNetConfig {
    /// Check it, naming the field; the UNet part as a UNet whose up blocks mirror its down
    /// blocks (a ControlNet has none).
    fn validate(&mut self) -> Result<()> {
        self.unet.up_block_types = self
            .unet
            .down_block_types
            .iter()
            .rev()
            .map(|t| match t.as_str() {
                super::config::CROSS_ATTN_DOWN => super::config::CROSS_ATTN_UP.to_string(),
                _ => super::config::UP.to_string(),
            })
            .collect();
        self.unet.validate()?;
        if self.conditioning_embedding_out_channels.is_empty()
            || self
                .conditioning_embedding_out_channels
                .iter()
                .any(|&c| c < 1)
        {
            return Err(ModelError::config(
                "conditioning_embedding_out_channels",
                "must be a non-empty list of positive widths",
            ));
        }
        if self.conditioning_channels < 1 {
            return Err(ModelError::config(
                "conditioning_channels",
                "must be positive",
            ));
        }
        if self.controlnet_conditioning_channel_order != "rgb" {
            return Err(ModelError::config(
                "controlnet_conditioning_channel_order",
                "only rgb is supported",
            ));
        }
        if self.global_pool_conditions {
            return Err(ModelError::config(
                "global_pool_conditions",
                "is not supported",
            ));
        }
        Ok(())
    }
}

/// `ControlNetConditioningEmbedding`: convs with SiLU, halving the side
/// `len(conditioning_embedding_out_channels) - 1` times, to the UNet's first width.
#[derive(Debug)]
struct CondEmbedding {
    conv_in: Conv2d,
    blocks: Vec<Conv2d>,
    conv_out: Conv2d,
}

impl CondEmbedding {
    fn new(vs: nn::Path, c: &ControlNetConfig) -> Self {
        let widths = &c.conditioning_embedding_out_channels;
        let mut blocks = Vec::new();
        for i in 0..widths.len() - 1 {
            let (w_in, w_out) = (widths[i], widths[i + 1]);
            let at = |k: usize| &vs / "blocks" / k;
            blocks.push(Conv2d::new(at(blocks.len()), w_in, w_in, 3, 1, 1));
            blocks.push(Conv2d::new(at(blocks.len()), w_in, w_out, 3, 2, 1));
        }
        let last = widths[widths.len() - 1];
        Self {
            conv_in: Conv2d::new(&vs / "conv_in", c.conditioning_channels, widths[0], 3, 1, 1),
            blocks,
            conv_out: Conv2d::new(
                &vs / "conv_out",
                last,
                c.unet.block_out_channels[0],
                3,
                1,
                1,
            ),
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.conv_in.forward(x)?.f_silu()?;
        for b in &self.blocks {
            h = b.forward(&h)?.f_silu()?;
        }
        self.conv_out.forward(&h)
    }
}

/// A ControlNet's residuals for a UNet: one per skip connection (in the order the down path
/// pushes them) and one for the mid block's output.
#[derive(Debug)]
pub struct UNetResiduals {
    pub down: Vec<Tensor>,
    pub mid: Tensor,
}

impl UNetResiduals {
    /// `self + other`, residual by residual (two ControlNets steering one request).
    pub fn sum(&self, other: &UNetResiduals) -> Result<UNetResiduals> {
        if self.down.len() != other.down.len() {
            return Err(ModelError::input(
                "controlnet",
                format!(
                    "{} and {} down residuals: the ControlNets do not fit one UNet",
                    self.down.len(),
                    other.down.len()
                ),
            ));
        }
        Ok(UNetResiduals {
            down: self
                .down
                .iter()
                .zip(&other.down)
                .map(|(a, b)| Ok(a.f_add(b)?))
                .collect::<Result<_>>()?,
            mid: self.mid.f_add(&other.mid)?,
        })
    }
}

#[derive(Debug)]
pub struct ControlNetModel {
    pub config: ControlNetConfig,
    stem: Stem,
    cond_embedding: CondEmbedding,
    down_convs: Vec<Conv2d>,
    mid_conv: Conv2d,
    vs: Option<nn::VarStore>,
}

impl ControlNetModel {
    pub fn new(vs: &nn::Path, mut config: ControlNetConfig) -> Result<Self> {
        config.validate()?;
        let levels = config.unet.levels()?;
        let c0 = config.unet.block_out_channels[0];
        // One 1x1 conv per skip: conv_in's, each resnet's, each downsampler's.
        let mut widths = vec![c0];
        for (i, l) in levels.iter().enumerate() {
            widths.extend(std::iter::repeat_n(l.channels, l.layers as usize));
            if i + 1 < levels.len() {
                widths.push(l.channels);
            }
        }
        let down_convs = widths
            .iter()
            .enumerate()
            .map(|(i, &w)| Conv2d::new(vs / "controlnet_down_blocks" / i, w, w, 1, 1, 0))
            .collect();
        let last = levels[levels.len() - 1].channels;
        Ok(Self {
            stem: Stem::new(vs, &config.unet)?,
            cond_embedding: CondEmbedding::new(vs / "controlnet_cond_embedding", &config),
            down_convs,
            mid_conv: Conv2d::new(vs / "controlnet_mid_block", last, last, 1, 1, 0),
            config,
            vs: None,
        })
    }

    /// Load from a diffusers `controlnet/` folder, strictly by key.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let config: ControlNetConfig = weights::component_config(dir, CLASS_NAME)?;
        let mut vs = weights::new_store(device, kind);
        let mut model = Self::new(&vs.root(), config)?;
        weights::load_frozen(&mut vs, dir, kind, "ControlNet")?;
        model.vs = Some(vs);
        Ok(model)
    }

    /// Where its weights live and their dtype.
    pub fn device_kind(&self) -> (Device, Kind) {
        self.stem.device_kind()
    }

    /// Whether its residuals fit the UNet of `base`: the same levels (widths, layers, text
    /// width), block kinds and added conditioning (its down path is a copy of that UNet's).
    pub fn check_compatible(&self, base: &UNetConfig) -> Result<()> {
        let own = &self.config.unet;
        let level = |l: &super::config::Level| (l.channels, l.layers, l.cross_attention_dim);
        let shape = |c: &UNetConfig| -> Result<Vec<(i64, i64, i64)>> {
            Ok(c.levels()?.iter().map(level).collect())
        };
        let checks = [
            (
                "block_out_channels, layers_per_block, cross_attention_dim",
                format!("{:?}", shape(own)?),
                format!("{:?}", shape(base)?),
            ),
            (
                "down_block_types",
                format!("{:?}", own.down_block_types),
                format!("{:?}", base.down_block_types),
            ),
            (
                "addition_embed_type",
                format!("{:?}", own.addition_embed_type),
                format!("{:?}", base.addition_embed_type),
            ),
            (
                "addition_time_embed_dim",
                format!("{:?}", own.addition_time_embed_dim),
                format!("{:?}", base.addition_time_embed_dim),
            ),
            (
                "projection_class_embeddings_input_dim",
                format!("{:?}", own.projection_class_embeddings_input_dim),
                format!("{:?}", base.projection_class_embeddings_input_dim),
            ),
        ];
        for (field, ours, theirs) in checks {
            if ours != theirs {
                return Err(ModelError::config(
                    field,
                    format!("the ControlNet has {ours}, the UNet {theirs}"),
                ));
            }
        }
        Ok(())
    }

    /// The residuals for `x` steered by `control` (`[B, conditioning_channels, H * f, W * f]`
    /// in [0, 1], `f` the embedding's downscale), times `scale`.
    pub fn forward(&self, x: &UNetInputs, control: &Tensor, scale: f64) -> Result<UNetResiduals> {
        let cfg = &self.config.unet;
        let (batch, side) = check_inputs(cfg, x)?;
        let (device, kind) = self.stem.device_kind();
        let on = |t: &Tensor| -> Result<Tensor> { Ok(t.f_to_device(device)?.f_to_kind(kind)?) };
        let factor = 1i64 << (self.config.conditioning_embedding_out_channels.len() - 1);
        let want = [
            batch,
            self.config.conditioning_channels,
            side[0] * factor,
            side[1] * factor,
        ];
        if control.size() != want {
            return Err(ModelError::input(
                "controlnet_cond",
                format!("expected {want:?}, got {:?}", control.size()),
            ));
        }
        if !scale.is_finite() {
            return Err(ModelError::input("conditioning_scale", "must be finite"));
        }
        let context = on(&x.encoder_hidden_states)?;
        let temb_silu = self.stem.time_embedding(cfg, x, batch)?;
        let h = self.stem.conv_in.forward(&on(&x.sample)?)?;
        let h = h.f_add(&self.cond_embedding.forward(&on(control)?)?)?;
        let (mid, skips) =
            self.stem
                .down_mid(h, &temb_silu, &context, &mut super::masked::Plain)?;
        let down = skips
            .iter()
            .zip(&self.down_convs)
            .map(|(s, conv)| Ok(conv.forward(s)?.f_mul_scalar(scale)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(UNetResiduals {
            down,
            mid: self.mid_conv.forward(&mid)?.f_mul_scalar(scale)?,
        })
    }
}

/// `cargo xtask forward --component controlnet`: the UNet's inputs plus `controlnet_cond` (and
/// optionally a one-element `conditioning_scale`); writes `down_block_res_samples.{i}` and
/// `mid_block_res_sample`. fp32 on the CPU.
pub fn cli_forward_controlnet(model_dir: &Path, inputs: &Path, out: &Path) -> Result<()> {
    let dir = if model_dir.join("controlnet").join("config.json").is_file() {
        model_dir.join("controlnet")
    } else {
        model_dir.into()
    };
    let model = ControlNetModel::load(&dir, Device::Cpu, Kind::Float)?;
    let (x, mut rest) = super::cli_inputs(inputs)?;
    let control = rest.remove("controlnet_cond").ok_or_else(|| {
        ModelError::input(
            "controlnet_cond",
            format!("no tensor `controlnet_cond` in {}", inputs.display()),
        )
    })?;
    let scale = match rest.remove("conditioning_scale") {
        Some(s) => s.f_double_value(&[0])?,
        None => 1.0,
    };
    let r = tch::no_grad(|| model.forward(&x, &control, scale))?;
    let mut named: Vec<(String, Tensor)> = r
        .down
        .into_iter()
        .enumerate()
        .map(|(i, t)| Ok((format!("down_block_res_samples.{i}"), t.f_contiguous()?)))
        .collect::<Result<_>>()?;
    named.push(("mid_block_res_sample".into(), r.mid.f_contiguous()?));
    Tensor::write_safetensors(&named, out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shapes the denoiser checks a worker's residuals against are the ones a ControlNet
    /// gives, odd latent sides (rounded up by each downsampler) included.
    #[test]
    fn residual_shapes_from_the_config_are_the_forwards() {
        let config: ControlNetConfig = serde_json::from_value(serde_json::json!({
            "block_out_channels": [8, 16, 16],
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
            "layers_per_block": 2,
            "cross_attention_dim": 8,
            "attention_head_dim": 2,
            "norm_num_groups": 4,
            "conditioning_embedding_out_channels": [4, 8],
        }))
        .unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = ControlNetModel::new(&vs.root(), config).unwrap();
        let (rows, h, w) = (2, 9, 6);
        let opts = (Kind::Float, Device::Cpu);
        let inputs = UNetInputs {
            sample: Tensor::randn([rows, 4, h, w], opts),
            timestep: Tensor::from_slice(&[10.0f32, 10.0]),
            encoder_hidden_states: Tensor::randn([rows, 3, 8], opts),
            text_embeds: None,
            time_ids: None,
        };
        let control = Tensor::rand([rows, 3, 2 * h, 2 * w], opts);
        let r = tch::no_grad(|| net.forward(&inputs, &control, 1.0)).unwrap();
        let (down, mid) = net
            .config
            .unet
            .control_residual_shapes(rows, [h, w])
            .unwrap();
        let got: Vec<Vec<i64>> = r.down.iter().map(Tensor::size).collect();
        let want: Vec<Vec<i64>> = down.iter().map(|s| s.to_vec()).collect();
        assert_eq!(got, want);
        assert_eq!(r.mid.size(), mid.to_vec());
    }
}
