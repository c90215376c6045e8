//! The building blocks of diffusers' VAE `Encoder`/`Decoder`, with diffusers' parameter names:
//! `ResnetBlock2D`, `Downsample2D`, `Upsample2D`, the mid-block `Attention` (one head over all
//! channels, group-normed, residual) and `UNetMidBlock2D`, `DownEncoderBlock2D`, `UpDecoderBlock2D`.
//!
//! Only the configuration the VAE uses is built: no time embedding, `output_scale_factor = 1`,
//! SiLU activations, eps 1e-6.
use crate::error::Result;
use tch::{nn, Tensor};

const EPS: f64 = 1e-6;

/// `nn.Conv2d` with square kernel, stride and symmetric padding.
#[derive(Debug)]
pub struct Conv2d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    stride: i64,
    padding: i64,
}

impl Conv2d {
    pub fn new(
        vs: nn::Path,
        c_in: i64,
        c_out: i64,
        kernel: i64,
        stride: i64,
        padding: i64,
    ) -> Self {
        let cfg = nn::ConvConfig {
            stride,
            padding,
            ..Default::default()
        };
        let conv = nn::conv2d(vs, c_in, c_out, kernel, cfg);
        Self {
            weight: conv.ws,
            bias: conv.bs,
            stride,
            padding,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (s, p) = (self.stride, self.padding);
        Ok(x.f_conv2d(&self.weight, self.bias.as_ref(), [s, s], [p, p], [1, 1], 1)?)
    }
}

/// `nn.GroupNorm(num_groups, channels, eps=1e-6, affine=True)` (another eps: [`GroupNorm::with_eps`]).
#[derive(Debug)]
pub struct GroupNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    groups: i64,
    eps: f64,
}

impl GroupNorm {
    pub fn new(vs: nn::Path, groups: i64, channels: i64) -> Self {
        Self::with_eps(vs, groups, channels, EPS)
    }

    pub fn with_eps(vs: nn::Path, groups: i64, channels: i64, eps: f64) -> Self {
        Self {
            weight: vs.ones("weight", &[channels]),
            bias: vs.zeros("bias", &[channels]),
            groups,
            eps,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (w, b) = (Some(&self.weight), Some(&self.bias));
        Ok(x.f_group_norm(self.groups, w, b, self.eps, true)?)
    }
}

fn silu(x: &Tensor) -> Result<Tensor> {
    Ok(x.f_silu()?)
}

/// `ResnetBlock2D` without time embedding: `shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))`.
#[derive(Debug)]
pub struct ResnetBlock2D {
    norm1: GroupNorm,
    conv1: Conv2d,
    norm2: GroupNorm,
    conv2: Conv2d,
    conv_shortcut: Option<Conv2d>,
}

impl ResnetBlock2D {
    pub fn new(vs: nn::Path, c_in: i64, c_out: i64, groups: i64) -> Self {
        Self {
            norm1: GroupNorm::new(&vs / "norm1", groups, c_in),
            conv1: Conv2d::new(&vs / "conv1", c_in, c_out, 3, 1, 1),
            norm2: GroupNorm::new(&vs / "norm2", groups, c_out),
            conv2: Conv2d::new(&vs / "conv2", c_out, c_out, 3, 1, 1),
            conv_shortcut: (c_in != c_out)
                .then(|| Conv2d::new(&vs / "conv_shortcut", c_in, c_out, 1, 1, 0)),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv1.forward(&silu(&self.norm1.forward(x)?)?)?;
        let h = self.conv2.forward(&silu(&self.norm2.forward(&h)?)?)?;
        let shortcut = match &self.conv_shortcut {
            Some(c) => c.forward(x)?,
            None => x.shallow_clone(),
        };
        Ok(shortcut.f_add(&h)?)
    }
}

/// `Downsample2D(use_conv=True, padding=0)`: pad right/bottom by one, 3x3 conv with stride 2.
#[derive(Debug)]
pub struct Downsample2D {
    conv: Conv2d,
}

impl Downsample2D {
    pub fn new(vs: nn::Path, channels: i64) -> Self {
        Self {
            conv: Conv2d::new(&vs / "conv", channels, channels, 3, 2, 0),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv.forward(&x.f_constant_pad_nd([0, 1, 0, 1])?)
    }
}

/// `Upsample2D(use_conv=True)`: nearest 2x upsampling, then a 3x3 conv.
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

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let s = x.size();
        let (h, w) = (s[s.len() - 2], s[s.len() - 1]);
        let up = x.f_upsample_nearest2d([2 * h, 2 * w], 2.0, 2.0)?;
        self.conv.forward(&up)
    }
}

/// The VAE mid-block `Attention`: single-head self-attention over the `H*W` positions with a
/// group norm in front and a residual connection (`AttnProcessor2_0` path, via SDPA).
#[derive(Debug)]
pub struct VaeAttention {
    group_norm: GroupNorm,
    to_q: nn::Linear,
    to_k: nn::Linear,
    to_v: nn::Linear,
    to_out: nn::Linear,
    heads: i64,
}

impl VaeAttention {
    pub fn new(vs: nn::Path, channels: i64, groups: i64, head_dim: i64) -> Self {
        let lin = |name: &str| nn::linear(&vs / name, channels, channels, Default::default());
        Self {
            group_norm: GroupNorm::new(&vs / "group_norm", groups, channels),
            to_q: lin("to_q"),
            to_k: lin("to_k"),
            to_v: lin("to_v"),
            to_out: nn::linear(&vs / "to_out" / "0", channels, channels, Default::default()),
            heads: channels / head_dim,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let s = x.size();
        let (b, c, h, w) = (s[0], s[1], s[2], s[3]);
        // GroupNorm on [B, C, HW] equals GroupNorm on the 4-D input; then tokens-major.
        let tokens = self
            .group_norm
            .forward(&x.f_view([b, c, h * w])?)?
            .f_transpose(1, 2)?;
        let lin = |l: &nn::Linear, t: &Tensor| -> Result<Tensor> {
            Ok(t.f_linear(&l.ws, l.bs.as_ref())?)
        };
        let head_dim = c / self.heads;
        let split = |t: Tensor| -> Result<Tensor> {
            Ok(t.f_view([b, -1, self.heads, head_dim])?.f_transpose(1, 2)?)
        };
        let q = split(lin(&self.to_q, &tokens)?)?;
        let k = split(lin(&self.to_k, &tokens)?)?;
        let v = split(lin(&self.to_v, &tokens)?)?;
        let attn = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<&Tensor>,
            0.0,
            false,
            None,
            false,
        )?;
        let attn = attn
            .f_transpose(1, 2)?
            .f_reshape([b, -1, self.heads * head_dim])?;
        let out = lin(&self.to_out, &attn)?
            .f_transpose(-1, -2)?
            .f_reshape([b, c, h, w])?;
        Ok(out.f_add(x)?)
    }
}

/// `UNetMidBlock2D` with one layer: resnet, optional attention, resnet.
#[derive(Debug)]
pub struct MidBlock2D {
    resnets: Vec<ResnetBlock2D>,
    attention: Option<VaeAttention>,
}

impl MidBlock2D {
    pub fn new(vs: nn::Path, channels: i64, groups: i64, add_attention: bool) -> Self {
        let resnets = (0..2)
            .map(|i| ResnetBlock2D::new(&vs / "resnets" / i, channels, channels, groups))
            .collect();
        let attention = add_attention
            .then(|| VaeAttention::new(&vs / "attentions" / 0, channels, groups, channels));
        Self { resnets, attention }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.resnets[0].forward(x)?;
        if let Some(attn) = &self.attention {
            h = attn.forward(&h)?;
        }
        self.resnets[1].forward(&h)
    }
}

/// `DownEncoderBlock2D`: `num_layers` resnets, then an optional downsampler.
#[derive(Debug)]
pub struct DownEncoderBlock2D {
    resnets: Vec<ResnetBlock2D>,
    downsampler: Option<Downsample2D>,
}

impl DownEncoderBlock2D {
    pub fn new(
        vs: nn::Path,
        c_in: i64,
        c_out: i64,
        layers: i64,
        groups: i64,
        downsample: bool,
    ) -> Self {
        let resnets = (0..layers)
            .map(|i| {
                ResnetBlock2D::new(
                    &vs / "resnets" / i,
                    if i == 0 { c_in } else { c_out },
                    c_out,
                    groups,
                )
            })
            .collect();
        let downsampler = downsample.then(|| Downsample2D::new(&vs / "downsamplers" / 0, c_out));
        Self {
            resnets,
            downsampler,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.shallow_clone();
        for r in &self.resnets {
            h = r.forward(&h)?;
        }
        match &self.downsampler {
            Some(d) => d.forward(&h),
            None => Ok(h),
        }
    }
}

/// `UpDecoderBlock2D`: `num_layers` resnets, then an optional upsampler.
#[derive(Debug)]
pub struct UpDecoderBlock2D {
    resnets: Vec<ResnetBlock2D>,
    upsampler: Option<Upsample2D>,
}

impl UpDecoderBlock2D {
    pub fn new(
        vs: nn::Path,
        c_in: i64,
        c_out: i64,
        layers: i64,
        groups: i64,
        upsample: bool,
    ) -> Self {
        let resnets = (0..layers)
            .map(|i| {
                ResnetBlock2D::new(
                    &vs / "resnets" / i,
                    if i == 0 { c_in } else { c_out },
                    c_out,
                    groups,
                )
            })
            .collect();
        let upsampler = upsample.then(|| Upsample2D::new(&vs / "upsamplers" / 0, c_out));
        Self { resnets, upsampler }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.shallow_clone();
        for r in &self.resnets {
            h = r.forward(&h)?;
        }
        match &self.upsampler {
            Some(u) => u.forward(&h),
            None => Ok(h),
        }
    }
}
