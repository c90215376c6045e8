//! What `UNet2DConditionModel` and `ControlNetModel` share: the time embedding (with SDXL's
//! added `text_time` conditioning), `conv_in`, the down levels and the mid block, under the
//! same key names in both.
use super::blocks::{AttentionShape, DownBlock, MidBlock};
use super::config::UNetConfig;
use super::masked::AttentionPass;
use super::resnet::ResnetShape;
use super::{sinusoidal, UNetInputs};
use crate::error::{ModelError, Result};
use crate::flux::embeddings::TimestepEmbedding;
use crate::vae::blocks::Conv2d;
use tch::{nn, Device, Kind, Tensor};

#[derive(Debug)]
pub(crate) struct Stem {
    pub conv_in: Conv2d,
    time_embedding: TimestepEmbedding,
    add_embedding: Option<TimestepEmbedding>,
    down: Vec<DownBlock>,
    mid: MidBlock,
    pub resnet_shape: ResnetShape,
    pub attention_shape: AttentionShape,
}

impl Stem {
    /// Under `vs` (the model's root), from a validated configuration.
    pub fn new(vs: &nn::Path, config: &UNetConfig) -> Result<Self> {
        let levels = config.levels()?;
        let groups = config.norm_num_groups.unwrap_or(32);
        let c0 = config.block_out_channels[0];
        let temb = config.time_embed_dim();
        let r = ResnetShape {
            groups,
            eps: config.norm_eps,
            temb,
        };
        let a = AttentionShape {
            groups,
            linear_projection: config.use_linear_projection,
        };
        let n = levels.len();
        let down = (0..n)
            .map(|i| {
                let c_in = if i == 0 { c0 } else { levels[i - 1].channels };
                let downsample = (i + 1 < n).then_some(config.downsample_padding);
                DownBlock::new(vs / "down_blocks" / i, c_in, &levels[i], downsample, r, a)
            })
            .collect();
        let mid_layers = config.mid_transformer_layers();
        let mid = MidBlock::new(vs / "mid_block", &levels[n - 1], mid_layers, r, a);
        let k_in = config.conv_in_kernel;
        Ok(Self {
            conv_in: Conv2d::new(vs / "conv_in", config.in_channels, c0, k_in, 1, k_in / 2),
            time_embedding: TimestepEmbedding::new(vs / "time_embedding", c0, temb),
            add_embedding: config
                .text_time()
                .map(|(_, input)| TimestepEmbedding::new(vs / "add_embedding", input, temb)),
            down,
            mid,
            resnet_shape: r,
            attention_shape: a,
        })
    }

    pub fn device_kind(&self) -> (Device, Kind) {
        (self.conv_in.weight.device(), self.conv_in.weight.kind())
    }

    /// Layers of each transformer of the down levels and the mid block, in forward order.
    pub fn transformer_layers(&self) -> Vec<usize> {
        let mut layers: Vec<usize> = self
            .down
            .iter()
            .flat_map(|d| d.transformer_layers())
            .collect();
        layers.extend(self.mid.transformer_layers());
        layers
    }

    /// SiLU of the time embedding (plus the added conditioning), `[B, temb]`: what every
    /// resnet projects.
    pub fn time_embedding(&self, cfg: &UNetConfig, x: &UNetInputs, batch: i64) -> Result<Tensor> {
        let (device, kind) = self.device_kind();
        let t = x.timestep.f_to_device(device)?.f_reshape([-1])?;
        let t = if t.size()[0] == 1 {
            t.f_expand([batch], false)?
        } else {
            t
        };
        let c0 = cfg.block_out_channels[0];
        let t_emb = sinusoidal(&t, c0, cfg.flip_sin_to_cos, cfg.freq_shift)?.f_to_kind(kind)?;
        let mut emb = self.time_embedding.forward(&t_emb)?;
        if let (Some(add), Some((time_dim, _))) = (&self.add_embedding, cfg.text_time()) {
            let (Some(text), Some(ids)) = (&x.text_embeds, &x.time_ids) else {
                let field = if x.text_embeds.is_none() {
                    "text_embeds"
                } else {
                    "time_ids"
                };
                return Err(ModelError::input(
                    field,
                    "this model (addition_embed_type text_time) needs text_embeds and time_ids",
                ));
            };
            let ids = ids.f_to_device(device)?.f_reshape([-1])?;
            let time = sinusoidal(&ids, time_dim, cfg.flip_sin_to_cos, cfg.freq_shift)?
                .f_reshape([batch, -1])?
                .f_to_kind(kind)?;
            let text = text.f_to_device(device)?.f_to_kind(kind)?;
            emb = emb.f_add(&add.forward(&Tensor::f_cat(&[&text, &time], -1)?)?)?;
        }
        Ok(emb.f_silu()?)
    }

    /// The down levels and the mid block from `h` (after `conv_in`): the mid block's output,
    /// and every skip in the order the levels pushed them (`h` first).
    pub fn down_mid(
        &self,
        h: Tensor,
        temb_silu: &Tensor,
        context: &Tensor,
        pass: &mut dyn AttentionPass,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let mut skips = vec![h.shallow_clone()];
        let mut h = h;
        for block in &self.down {
            h = block.forward(&h, temb_silu, context, &mut skips, pass)?;
        }
        Ok((self.mid.forward(&h, temb_silu, context, pass)?, skips))
    }
}
