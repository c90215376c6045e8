//! Flux ControlNet (`FluxControlNetModel` of diffusers 0.42.1) and its residuals.
//!
//! A ControlNet is a shortened copy of the transformer's trunk whose image stream also takes the
//! packed latents of a control image (`controlnet_x_embedder`); after every block a zero-initialised
//! linear (`controlnet_blocks`, `controlnet_single_blocks`) turns the image stream into a residual
//! that the transformer adds to its own image stream after the matching block. The ControlNet runs
//! on its own (Katz's ControlNet-as-a-Service): it needs only the step's inputs, never the
//! transformer's activations, so it can run beside the transformer on another worker.
//!
//! Supported: the plain form (`conditioning_embedding_channels` and `num_mode` unset, e.g. the
//! InstantX and Shakker-Labs Flux ControlNets); the union and hint-block forms are refused by name.
use super::blocks::{DoubleBlock, SingleBlock};
use super::config::FluxConfig;
use super::embeddings::{Rope, TimeTextEmbed};
use super::layers::Linear;
use super::{check_inputs, FluxInputs};
use crate::error::{ModelError, Result};
use serde::Deserialize;
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

/// The ControlNet-only keys of a `FluxControlNetModel` `config.json` (the rest is a [`FluxConfig`]).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ControlNetExtras {
    num_mode: Option<i64>,
    conditioning_embedding_channels: Option<i64>,
}

/// The residuals of one ControlNet forward, already multiplied by the conditioning scale, in the
/// ControlNet's own block order: `double[i]` after its double block `i`, `single[j]` after its
/// single block `j`, each `[B, N, inner]` (image tokens only).
#[derive(Debug)]
pub struct ControlResiduals {
    pub double: Vec<Tensor>,
    pub single: Vec<Tensor>,
}

impl ControlResiduals {
    /// The same residuals without copying their storage (tensors are reference-counted).
    pub fn shallow_clone(&self) -> Self {
        Self {
            double: self.double.iter().map(Tensor::shallow_clone).collect(),
            single: self.single.iter().map(Tensor::shallow_clone).collect(),
        }
    }

    /// Which residual diffusers adds after base block `index` of `base_blocks`: with `samples`
    /// residuals, `samples[index / ceil(base_blocks / samples)]` (`FluxTransformer2DModel`'s
    /// `interval_control`, `controlnet_blocks_repeat = false`); none when there are none.
    pub fn index_for(index: usize, base_blocks: usize, samples: usize) -> Option<usize> {
        if samples == 0 || base_blocks == 0 {
            return None;
        }
        let interval = base_blocks.div_ceil(samples);
        Some(index / interval)
    }

    /// The residual for base double block `index` of `base_blocks`.
    pub fn for_double(&self, index: usize, base_blocks: usize) -> Option<&Tensor> {
        Self::index_for(index, base_blocks, self.double.len()).and_then(|i| self.double.get(i))
    }

    /// The residual for base single block `index` of `base_blocks`.
    pub fn for_single(&self, index: usize, base_blocks: usize) -> Option<&Tensor> {
        Self::index_for(index, base_blocks, self.single.len()).and_then(|i| self.single.get(i))
    }

    /// Every residual, double then single (what a ControlNet worker sends back).
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.double.iter().chain(self.single.iter())
    }

    /// The residuals of batch rows `index` (`[R]`, int64).
    pub fn select_rows(&self, index: &Tensor) -> Result<Self> {
        let pick = |v: &[Tensor]| -> Result<Vec<Tensor>> {
            v.iter().map(|t| Ok(t.f_index_select(0, index)?)).collect()
        };
        Ok(Self {
            double: pick(&self.double)?,
            single: pick(&self.single)?,
        })
    }
}

/// The Flux ControlNet.
#[derive(Debug)]
pub struct FluxControlNet {
    pub cfg: FluxConfig,
    pub x_embedder: Linear,
    pub controlnet_x_embedder: Linear,
    pub context_embedder: Linear,
    pub time_text_embed: TimeTextEmbed,
    pub transformer_blocks: Vec<DoubleBlock>,
    pub single_transformer_blocks: Vec<SingleBlock>,
    pub controlnet_blocks: Vec<Linear>,
    pub controlnet_single_blocks: Vec<Linear>,
}

impl FluxControlNet {
    /// Create the parameters under `vs` (torch's default init). Validates `cfg`.
    pub fn new(vs: &nn::Path, cfg: FluxConfig) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let linears = |name: &str, count: i64| -> Vec<Linear> {
            (0..count)
                .map(|i| Linear::new(vs / name / i, dim, dim, true))
                .collect()
        };
        Ok(Self {
            x_embedder: Linear::new(vs / "x_embedder", cfg.in_channels, dim, true),
            controlnet_x_embedder: Linear::new(
                vs / "controlnet_x_embedder",
                cfg.in_channels,
                dim,
                true,
            ),
            context_embedder: Linear::new(
                vs / "context_embedder",
                cfg.joint_attention_dim,
                dim,
                true,
            ),
            time_text_embed: TimeTextEmbed::new(vs / "time_text_embed", &cfg),
            transformer_blocks: (0..cfg.num_layers)
                .map(|i| DoubleBlock::new(vs / "transformer_blocks" / i, &cfg))
                .collect(),
            single_transformer_blocks: (0..cfg.num_single_layers)
                .map(|i| SingleBlock::new(vs / "single_transformer_blocks" / i, &cfg))
                .collect(),
            controlnet_blocks: linears("controlnet_blocks", cfg.num_layers),
            controlnet_single_blocks: linears("controlnet_single_blocks", cfg.num_single_layers),
            cfg,
        })
    }

    /// Load a diffusers `FluxControlNetModel` folder strictly, convert to `kind`, freeze.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<(Self, nn::VarStore)> {
        let cfg = FluxConfig::from_dir(dir)?;
        let extras: ControlNetExtras = crate::error::read_json(&dir.join("config.json"))?;
        if extras.num_mode.is_some() {
            return Err(ModelError::config(
                "num_mode",
                "union ControlNets (num_mode) are not supported",
            ));
        }
        if extras.conditioning_embedding_channels.is_some() {
            return Err(ModelError::config(
                "conditioning_embedding_channels",
                "ControlNets with an input hint block are not supported",
            ));
        }
        let mut vs = crate::weights::new_store(device, kind);
        let model = Self::new(&vs.root(), cfg)?;
        crate::weights::load_frozen(&mut vs, dir, kind, "Flux ControlNet")?;
        Ok((model, vs))
    }

    /// Device and dtype of the parameters.
    pub fn device_kind(&self) -> (Device, Kind) {
        let w = &self.x_embedder.weight;
        (w.device(), w.kind())
    }

    /// Whether this ControlNet's inputs fit a transformer of `base` (same token widths, so it can
    /// read the transformer's latents, prompt embeddings and ids).
    pub fn check_compatible(&self, base: &FluxConfig) -> Result<()> {
        let fields = [
            ("in_channels", self.cfg.in_channels, base.in_channels),
            (
                "num_attention_heads x attention_head_dim",
                self.cfg.inner_dim(),
                base.inner_dim(),
            ),
            (
                "joint_attention_dim",
                self.cfg.joint_attention_dim,
                base.joint_attention_dim,
            ),
            (
                "pooled_projection_dim",
                self.cfg.pooled_projection_dim,
                base.pooled_projection_dim,
            ),
        ];
        for (field, own, theirs) in fields {
            if own != theirs {
                return Err(ModelError::config(
                    field,
                    format!("ControlNet has {own}, the transformer {theirs}"),
                ));
            }
        }
        if self.cfg.axes_dims_rope != base.axes_dims_rope {
            return Err(ModelError::config(
                "axes_dims_rope",
                format!(
                    "ControlNet has {:?}, the transformer {:?}",
                    self.cfg.axes_dims_rope, base.axes_dims_rope
                ),
            ));
        }
        Ok(())
    }

    /// diffusers' forward: the residuals of every block, times `conditioning_scale`.
    /// `control` is `[B, N, in_channels]`, the control image's packed latents. `inputs.guidance`
    /// must be given iff this ControlNet embeds guidance (diffusers' pipeline decides by the
    /// ControlNet's own `guidance_embeds`).
    pub fn forward(
        &self,
        inputs: &FluxInputs,
        control: &Tensor,
        conditioning_scale: f64,
    ) -> Result<ControlResiduals> {
        let cfg = &self.cfg;
        let shapes = check_inputs(cfg, inputs)?;
        let n = shapes.img_tokens;
        if control.size() != inputs.hidden_states.size() {
            return Err(ModelError::input(
                "control",
                format!(
                    "expected {:?} like hidden_states, got {:?}",
                    inputs.hidden_states.size(),
                    control.size()
                ),
            ));
        }
        if inputs.guidance.is_some() != cfg.guidance_embeds {
            return Err(ModelError::input(
                "guidance",
                format!(
                    "the ControlNet {} guidance, got {}",
                    if cfg.guidance_embeds {
                        "embeds"
                    } else {
                        "does not embed"
                    },
                    if inputs.guidance.is_some() {
                        "some"
                    } else {
                        "none"
                    }
                ),
            ));
        }
        let (img_ids, txt_ids) = (shapes.img_ids, shapes.txt_ids);

        let (_, kind) = self.device_kind();
        let mut img = self
            .x_embedder
            .forward(&inputs.hidden_states)?
            .f_add(&self.controlnet_x_embedder.forward(control)?)?;
        let t = inputs
            .timestep
            .f_reshape([-1])?
            .f_to_kind(kind)?
            .f_mul_scalar(1000.0)?;
        let g = inputs
            .guidance
            .as_ref()
            .map(|g| g.f_reshape([-1])?.f_to_kind(kind)?.f_mul_scalar(1000.0))
            .transpose()?;
        let temb_silu = self
            .time_text_embed
            .forward(&t, g.as_ref(), &inputs.pooled_projections)?
            .f_silu()?;
        let mut txt = self
            .context_embedder
            .forward(&inputs.encoder_hidden_states)?;
        let ids = Tensor::f_cat(&[&txt_ids, &img_ids], 0)?.f_to_device(img.device())?;
        let rope = Rope::new(&ids, &cfg.axes_dims_rope)?;
        let head_dim = cfg.attention_head_dim;

        let mut double = Vec::with_capacity(self.transformer_blocks.len());
        for (block, out) in self.transformer_blocks.iter().zip(&self.controlnet_blocks) {
            (img, txt) = block.forward_full(&img, &txt, &temb_silu, &rope, head_dim)?;
            double.push(out.forward(&img)?.f_mul_scalar(conditioning_scale)?);
        }
        let t_len = txt.size()[1];
        let mut x = Tensor::f_cat(&[&txt, &img], 1)?;
        let mut single = Vec::with_capacity(self.single_transformer_blocks.len());
        for (block, out) in self
            .single_transformer_blocks
            .iter()
            .zip(&self.controlnet_single_blocks)
        {
            x = block.forward_full(&x, &temb_silu, &rope, head_dim)?;
            let img = x.f_narrow(1, t_len, n)?;
            single.push(out.forward(&img)?.f_mul_scalar(conditioning_scale)?);
        }
        Ok(ControlResiduals { double, single })
    }
}

#[cfg(test)]
mod tests {
    use super::ControlResiduals;

    #[test]
    fn residual_index_follows_diffusers_interval_rule() {
        // 19 base blocks, 5 residuals: interval ceil(19 / 5) = 4.
        let got: Vec<_> = (0..19)
            .map(|i| ControlResiduals::index_for(i, 19, 5).unwrap())
            .collect();
        assert_eq!(
            got,
            [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4]
        );
        // As many residuals as blocks: one each.
        assert_eq!(ControlResiduals::index_for(7, 38, 38), Some(7));
        // More residuals than blocks: interval 1, the extra ones unused.
        assert_eq!(ControlResiduals::index_for(2, 3, 10), Some(2));
        assert_eq!(ControlResiduals::index_for(0, 3, 0), None);
    }
}
