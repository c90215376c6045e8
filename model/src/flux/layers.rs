//! Small building blocks shared by the Flux blocks: linear, RMSNorm, LayerNorm, AdaLN helpers.
//!
//! Every op is a plain fallible tch call (no `no_grad`), so the same code trains and serves.
use crate::error::Result;
use tch::{nn, Tensor};

/// `torch.nn.Linear` with diffusers' key names (`weight`, `bias`) and torch's default init.
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub fn new(vs: nn::Path, in_dim: i64, out_dim: i64, bias: bool) -> Self {
        let l = nn::linear(
            vs,
            in_dim,
            out_dim,
            nn::LinearConfig {
                bias,
                ..Default::default()
            },
        );
        Self {
            weight: l.ws,
            bias: l.bs,
        }
    }

    /// `x @ W^T + b` over the last dim (one addmm for 2-D inputs).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_linear(&self.weight, self.bias.as_ref())?)
    }
}

/// `torch.nn.RMSNorm(dim, eps, elementwise_affine=True)` over the last dim.
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    pub fn new(vs: nn::Path, dim: i64, eps: f64) -> Self {
        Self {
            weight: vs.ones("weight", &[dim]),
            eps,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dim = self.weight.size()[0];
        Ok(x.f_rms_norm([dim], Some(&self.weight), self.eps)?)
    }
}

/// `nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)`, the only LayerNorm Flux uses.
pub fn layer_norm(x: &Tensor, dim: i64) -> Result<Tensor> {
    Ok(x.f_layer_norm([dim], None::<&Tensor>, None::<&Tensor>, 1e-6, true)?)
}

/// `norm(x) * (1 + scale) + shift` with `scale`/`shift` broadcastable to `x`.
/// One fused addcmul for the full-size part; `one_plus_scale` is precomputed by the caller.
pub fn modulate(normed: &Tensor, shift: &Tensor, one_plus_scale: &Tensor) -> Result<Tensor> {
    Ok(shift.f_addcmul(normed, one_plus_scale)?)
}

/// `x + gate * y` (AdaLN-zero gated residual) as one addcmul.
pub fn gated_residual(x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
    Ok(x.f_addcmul(gate, y)?)
}

/// diffusers' `FeedForward(dim, dim_out=dim, activation_fn="gelu-approximate")`:
/// `net.0.proj` (dim -> 4 dim), tanh-GELU, `net.2` (4 dim -> dim).
#[derive(Debug)]
pub struct FeedForward {
    pub proj_in: Linear,
    pub proj_out: Linear,
}

impl FeedForward {
    pub fn new(vs: nn::Path, dim: i64) -> Self {
        let net = &vs / "net";
        Self {
            proj_in: Linear::new(&net / "0" / "proj", dim, 4 * dim, true),
            proj_out: Linear::new(&net / "2", 4 * dim, dim, true),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.proj_in.forward(x)?.f_gelu("tanh")?;
        self.proj_out.forward(&h)
    }
}

/// `AdaLayerNorm*.linear(silu(temb))` split into `n` chunks of width `dim` (shift, scale, gate, ...).
/// Rows of `temb` are either batch elements (full forward) or requests (packed forward).
pub fn ada_chunks(linear: &Linear, temb_silu: &Tensor, n: i64) -> Result<Vec<Tensor>> {
    let emb = linear.forward(temb_silu)?;
    Ok(emb.f_chunk(n, -1)?)
}
