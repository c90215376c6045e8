//! The UNet's levels with diffusers' key names: `DownBlock2D` / `CrossAttnDownBlock2D` (resnets,
//! each followed by a `Transformer2DModel` where the level has attention, then a downsampler),
//! `UNetMidBlock2DCrossAttn`, and the mirrored `UpBlock2D` / `CrossAttnUpBlock2D`, whose
//! resnets take the down path's skip connections concatenated on channels.
use super::attention::{Transformer2D, Transformer2DShape};
use super::config::Level;
use super::masked::AttentionPass;
use super::resnet::{Downsample2D, ResnetBlock2D, ResnetShape, Upsample2D};
use crate::error::Result;
use tch::{nn, Tensor};

/// How the transformers of a UNet are built, besides each level's own settings.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub groups: i64,
    pub linear_projection: bool,
}

fn transformer(vs: nn::Path, level: &Level, layers: i64, a: AttentionShape) -> Transformer2D {
    Transformer2D::new(
        vs,
        Transformer2DShape {
            channels: level.channels,
            heads: level.heads,
            layers,
            context_dim: level.cross_attention_dim,
            groups: a.groups,
            linear_projection: a.linear_projection,
        },
    )
}

/// One down level: `layers` resnets (each followed by a transformer if the level has
/// attention), then a downsampler unless it is the last level.
#[derive(Debug)]
pub struct DownBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2D>,
    downsampler: Option<Downsample2D>,
}

impl DownBlock {
    /// Layers of each of its transformers, in forward order.
    pub fn transformer_layers(&self) -> Vec<usize> {
        self.attentions.iter().map(|t| t.layers()).collect()
    }

    pub fn new(
        vs: nn::Path,
        c_in: i64,
        level: &Level,
        downsample: Option<i64>,
        r: ResnetShape,
        a: AttentionShape,
    ) -> Self {
        let c = level.channels;
        Self {
            resnets: (0..level.layers)
                .map(|i| {
                    let c_in = if i == 0 { c_in } else { c };
                    ResnetBlock2D::new(&vs / "resnets" / i, c_in, c, r)
                })
                .collect(),
            attentions: (0..level.layers)
                .filter(|_| level.transformer_layers > 0)
                .map(|i| transformer(&vs / "attentions" / i, level, level.transformer_layers, a))
                .collect(),
            downsampler: downsample
                .map(|padding| Downsample2D::new(&vs / "downsamplers" / 0, c, padding)),
        }
    }

    /// The level's output; every resnet's (or transformer's) output and the downsampled one
    /// are pushed to `skips` for the up path.
    pub fn forward(
        &self,
        x: &Tensor,
        temb_silu: &Tensor,
        context: &Tensor,
        skips: &mut Vec<Tensor>,
        pass: &mut dyn AttentionPass,
    ) -> Result<Tensor> {
        let mut h = x.shallow_clone();
        for (i, resnet) in self.resnets.iter().enumerate() {
            h = resnet.forward(&h, temb_silu)?;
            if let Some(attn) = self.attentions.get(i) {
                h = pass.run(attn, &h, context)?;
            }
            skips.push(h.shallow_clone());
        }
        if let Some(down) = &self.downsampler {
            h = down.forward(&h)?;
            skips.push(h.shallow_clone());
        }
        Ok(h)
    }
}

/// `UNetMidBlock2DCrossAttn` with one layer: resnet, transformer, resnet.
#[derive(Debug)]
pub struct MidBlock {
    first: ResnetBlock2D,
    attention: Transformer2D,
    second: ResnetBlock2D,
}

impl MidBlock {
    /// Layers of each of its transformers, in forward order.
    pub fn transformer_layers(&self) -> Vec<usize> {
        vec![self.attention.layers()]
    }

    pub fn new(
        vs: nn::Path,
        level: &Level,
        transformer_layers: i64,
        r: ResnetShape,
        a: AttentionShape,
    ) -> Self {
        let c = level.channels;
        Self {
            first: ResnetBlock2D::new(&vs / "resnets" / 0, c, c, r),
            attention: transformer(&vs / "attentions" / 0, level, transformer_layers, a),
            second: ResnetBlock2D::new(&vs / "resnets" / 1, c, c, r),
        }
    }

    pub fn forward(
        &self,
        x: &Tensor,
        temb_silu: &Tensor,
        context: &Tensor,
        pass: &mut dyn AttentionPass,
    ) -> Result<Tensor> {
        let h = self.first.forward(x, temb_silu)?;
        let h = pass.run(&self.attention, &h, context)?;
        self.second.forward(&h, temb_silu)
    }
}

/// One up level: `layers + 1` resnets, each on the previous output concatenated with a skip
/// connection (and followed by a transformer if the level has attention), then an upsampler
/// unless it is the last level.
#[derive(Debug)]
pub struct UpBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2D>,
    upsampler: Option<Upsample2D>,
}

/// The channels an up level joins: the previous up level's output, its own output, and the
/// skips of the mirrored down level's input (for its last resnet).
#[derive(Debug, Clone, Copy)]
pub struct UpChannels {
    pub prev_output: i64,
    pub skip_input: i64,
}

impl UpBlock {
    /// Layers of each of its transformers, in forward order.
    pub fn transformer_layers(&self) -> Vec<usize> {
        self.attentions.iter().map(|t| t.layers()).collect()
    }

    pub fn new(
        vs: nn::Path,
        level: &Level,
        channels: UpChannels,
        upsample: bool,
        r: ResnetShape,
        a: AttentionShape,
    ) -> Self {
        let (c, n) = (level.channels, level.layers + 1);
        Self {
            resnets: (0..n)
                .map(|i| {
                    let from = if i == 0 { channels.prev_output } else { c };
                    let skip = if i == n - 1 { channels.skip_input } else { c };
                    ResnetBlock2D::new(&vs / "resnets" / i, from + skip, c, r)
                })
                .collect(),
            attentions: (0..n)
                .filter(|_| level.transformer_layers > 0)
                .map(|i| transformer(&vs / "attentions" / i, level, level.transformer_layers, a))
                .collect(),
            upsampler: upsample.then(|| Upsample2D::new(&vs / "upsamplers" / 0, c)),
        }
    }

    /// Resnets this level has (the skips it consumes).
    pub fn skips(&self) -> usize {
        self.resnets.len()
    }

    /// `skips`: this level's skip connections, in the order the down path pushed them (the
    /// last is consumed first); `upsample_size`: the next level's skip size where the input's
    /// side did not divide.
    pub fn forward(
        &self,
        x: &Tensor,
        temb_silu: &Tensor,
        context: &Tensor,
        mut skips: Vec<Tensor>,
        upsample_size: Option<[i64; 2]>,
        pass: &mut dyn AttentionPass,
    ) -> Result<Tensor> {
        let mut h = x.shallow_clone();
        for (i, resnet) in self.resnets.iter().enumerate() {
            let skip = skips.pop().ok_or_else(|| {
                crate::error::ModelError::input("sample", "the up path ran out of skip connections")
            })?;
            h = resnet.forward(&Tensor::f_cat(&[&h, &skip], 1)?, temb_silu)?;
            if let Some(attn) = self.attentions.get(i) {
                h = pass.run(attn, &h, context)?;
            }
        }
        match &self.upsampler {
            Some(up) => up.forward(&h, upsample_size),
            None => Ok(h),
        }
    }
}
