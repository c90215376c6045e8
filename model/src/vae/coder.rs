//! diffusers' VAE `Encoder` and `Decoder` (models/autoencoders/vae.py), group-norm variant.
use super::blocks::{Conv2d, DownEncoderBlock2D, GroupNorm, MidBlock2D, UpDecoderBlock2D};
use super::AutoencoderKLConfig;
use crate::error::Result;
use tch::{nn, Tensor};

/// Image `[B, in, H, W]` -> moments `[B, 2 * latent, H / 2^(L-1), W / 2^(L-1)]` (mean, logvar).
#[derive(Debug)]
pub struct Encoder {
    conv_in: Conv2d,
    down_blocks: Vec<DownEncoderBlock2D>,
    mid_block: MidBlock2D,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Encoder {
    pub fn new(vs: nn::Path, cfg: &AutoencoderKLConfig) -> Self {
        let ch = &cfg.block_out_channels;
        let g = cfg.norm_num_groups;
        let last = *ch
            .last()
            .expect("validated: block_out_channels is non-empty");
        let mut c_prev = ch[0];
        let down_blocks = ch
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let block = DownEncoderBlock2D::new(
                    &vs / "down_blocks" / i,
                    c_prev,
                    c,
                    cfg.layers_per_block,
                    g,
                    i + 1 != ch.len(),
                );
                c_prev = c;
                block
            })
            .collect();
        Self {
            conv_in: Conv2d::new(&vs / "conv_in", cfg.in_channels, ch[0], 3, 1, 1),
            down_blocks,
            mid_block: MidBlock2D::new(&vs / "mid_block", last, g, cfg.mid_block_add_attention),
            conv_norm_out: GroupNorm::new(&vs / "conv_norm_out", g, last),
            conv_out: Conv2d::new(&vs / "conv_out", last, 2 * cfg.latent_channels, 3, 1, 1),
        }
    }

    /// The first convolution's weight (its device and dtype are the model's).
    pub fn weight(&self) -> &Tensor {
        &self.conv_in.weight
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.conv_in.forward(x)?;
        for block in &self.down_blocks {
            h = block.forward(&h)?;
        }
        h = self.mid_block.forward(&h)?;
        h = self.conv_norm_out.forward(&h)?.f_silu()?;
        self.conv_out.forward(&h)
    }
}

/// Latent `[B, latent, h, w]` -> image `[B, out, h * 2^(L-1), w * 2^(L-1)]`.
#[derive(Debug)]
pub struct Decoder {
    conv_in: Conv2d,
    mid_block: MidBlock2D,
    up_blocks: Vec<UpDecoderBlock2D>,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Decoder {
    pub fn new(vs: nn::Path, cfg: &AutoencoderKLConfig) -> Self {
        let ch = &cfg.block_out_channels;
        let g = cfg.norm_num_groups;
        let last = *ch
            .last()
            .expect("validated: block_out_channels is non-empty");
        let reversed: Vec<i64> = ch.iter().rev().copied().collect();
        let mut c_prev = reversed[0];
        let up_blocks = reversed
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let block = UpDecoderBlock2D::new(
                    &vs / "up_blocks" / i,
                    c_prev,
                    c,
                    cfg.layers_per_block + 1,
                    g,
                    i + 1 != ch.len(),
                );
                c_prev = c;
                block
            })
            .collect();
        Self {
            conv_in: Conv2d::new(&vs / "conv_in", cfg.latent_channels, last, 3, 1, 1),
            mid_block: MidBlock2D::new(&vs / "mid_block", last, g, cfg.mid_block_add_attention),
            up_blocks,
            conv_norm_out: GroupNorm::new(&vs / "conv_norm_out", g, ch[0]),
            conv_out: Conv2d::new(&vs / "conv_out", ch[0], cfg.out_channels, 3, 1, 1),
        }
    }

    pub fn forward(&self, z: &Tensor) -> Result<Tensor> {
        let mut h = self.conv_in.forward(z)?;
        h = self.mid_block.forward(&h)?;
        for block in &self.up_blocks {
            h = block.forward(&h)?;
        }
        h = self.conv_norm_out.forward(&h)?.f_silu()?;
        self.conv_out.forward(&h)
    }
}
