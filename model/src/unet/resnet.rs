//! The UNet's convolutional parts with diffusers' key names: `ResnetBlock2D` with its time
//! embedding, `Downsample2D` and `Upsample2D` (the VAE's building blocks, `crate::vae::blocks`,
//! without the time embedding).
use crate::error::Result;
use crate::flux::layers::Linear;
use crate::vae::blocks::{Conv2d, GroupNorm};
use tch::{nn, Tensor};

/// `ResnetBlock2D(time_embedding_norm="default")`: `shortcut(x) + conv2(silu(norm2(conv1(
/// silu(norm1(x))) + time_emb_proj(silu(temb)))))`.
#[derive(Debug)]
pub struct ResnetBlock2D {
    norm1: GroupNorm,
    conv1: Conv2d,
    time_emb_proj: Linear,
    norm2: GroupNorm,
    conv2: Conv2d,
    conv_shortcut: Option<Conv2d>,
}

/// What every resnet of a UNet shares: group count, eps and time-embedding width.
#[derive(Debug, Clone, Copy)]
pub struct ResnetShape {
    pub groups: i64,
    pub eps: f64,
    pub temb: i64,
}

impl ResnetBlock2D {
    pub fn new(vs: nn::Path, c_in: i64, c_out: i64, shape: ResnetShape) -> Self {
        let norm = |name: &str, c: i64| GroupNorm::with_eps(&vs / name, shape.groups, c, shape.eps);
        Self {
            norm1: norm("norm1", c_in),
            conv1: Conv2d::new(&vs / "conv1", c_in, c_out, 3, 1, 1),
            time_emb_proj: Linear::new(&vs / "time_emb_proj", shape.temb, c_out, true),
            norm2: norm("norm2", c_out),
            conv2: Conv2d::new(&vs / "conv2", c_out, c_out, 3, 1, 1),
            conv_shortcut: (c_in != c_out)
                .then(|| Conv2d::new(&vs / "conv_shortcut", c_in, c_out, 1, 1, 0)),
        }
    }

    /// `temb_silu`: SiLU of the time embedding `[B, temb]`, shared by every resnet of a step.
    pub fn forward(&self, x: &Tensor, temb_silu: &Tensor) -> Result<Tensor> {
        let h = self.conv1.forward(&self.norm1.forward(x)?.f_silu()?)?;
        let t = self
            .time_emb_proj
            .forward(temb_silu)?
            .f_unsqueeze(-1)?
            .f_unsqueeze(-1)?;
        let h = self.norm2.forward(&h.f_add(&t)?)?.f_silu()?;
        let h = self.conv2.forward(&h)?;
        let shortcut = match &self.conv_shortcut {
            Some(c) => c.forward(x)?,
            None => x.shallow_clone(),
        };
        Ok(shortcut.f_add(&h)?)
    }
}

/// `Downsample2D(use_conv=True, padding=p)`: a 3x3 conv with stride 2 (with `p = 0`, after
/// padding right and bottom by one, as diffusers does).
#[derive(Debug)]
pub struct Downsample2D {
    conv: Conv2d,
    pad_right_bottom: bool,
}

impl Downsample2D {
    pub fn new(vs: nn::Path, channels: i64, padding: i64) -> Self {
        Self {
            conv: Conv2d::new(&vs / "conv", channels, channels, 3, 2, padding),
            pad_right_bottom: padding == 0,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.pad_right_bottom {
            return self.conv.forward(&x.f_constant_pad_nd([0, 1, 0, 1])?);
        }
        self.conv.forward(x)
    }
}

/// `Upsample2D(use_conv=True)`: nearest upsampling to twice the size, or to `size` (the skip
/// connection's, where the input side did not divide), then a 3x3 conv.
#[derive(Debug)]
pub struct Upsample2D {
    conv: Conv2d,
}

impl Upsample2D {
    pub fn new(vs: nn::Path, channels: i64) -> Self {
        Self {
            conv: Conv2d::new(&vs / "conv", channels, channels, 3, 1, 1),
        }
    }

    pub fn forward(&self, x: &Tensor, size: Option<[i64; 2]>) -> Result<Tensor> {
        let s = x.size();
        let (h, w) = (s[s.len() - 2], s[s.len() - 1]);
        let up = match size {
            None => x.f_upsample_nearest2d([2 * h, 2 * w], 2.0, 2.0)?,
            Some(size) => x.f_upsample_nearest2d(size, None, None)?,
        };
        self.conv.forward(&up)
    }
}
