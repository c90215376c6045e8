//! Conditioning embeddings (timestep, guidance, pooled text) and Flux's 3-axis rotary embedding.
use super::config::FluxConfig;
use super::layers::Linear;
use crate::error::{ModelError, Result};
use tch::{nn, Device, Kind, Tensor};

/// Width of the sinusoidal timestep projection (`Timesteps(num_channels=256)` in diffusers).
const TIME_PROJ_DIM: i64 = 256;
/// RoPE base (`FluxPosEmbed(theta=10000)`).
const ROPE_THETA: f64 = 10000.0;

/// diffusers' `get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)`:
/// `[cos(t f), sin(t f)]` with `f_i = exp(-ln(10000) i / 128)`, computed in fp32 like diffusers.
pub fn timestep_proj(t: &Tensor) -> Result<Tensor> {
    let half = TIME_PROJ_DIM / 2;
    let exponent = Tensor::f_arange(half, (Kind::Float, t.device()))?
        .f_mul_scalar(-(10000f64.ln()))?
        .f_div_scalar(half as f64)?;
    let freqs = exponent.f_exp()?;
    let args = t
        .f_to_kind(Kind::Float)?
        .f_unsqueeze(1)?
        .f_mul(&freqs.f_unsqueeze(0)?)?;
    Ok(Tensor::f_cat(&[args.f_cos()?, args.f_sin()?], -1)?)
}

/// `TimestepEmbedding(256, dim)`: linear_1 -> SiLU -> linear_2.
#[derive(Debug)]
pub struct TimestepEmbedding {
    pub linear_1: Linear,
    pub linear_2: Linear,
}

impl TimestepEmbedding {
    pub fn new(vs: nn::Path, in_dim: i64, dim: i64) -> Self {
        Self {
            linear_1: Linear::new(&vs / "linear_1", in_dim, dim, true),
            linear_2: Linear::new(&vs / "linear_2", dim, dim, true),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear_2.forward(&self.linear_1.forward(x)?.f_silu()?)
    }
}

/// `CombinedTimestep[Guidance]TextProjEmbeddings`: temb = time_emb (+ guidance_emb) + text_emb(pooled).
#[derive(Debug)]
pub struct TimeTextEmbed {
    pub timestep_embedder: TimestepEmbedding,
    pub guidance_embedder: Option<TimestepEmbedding>,
    /// `PixArtAlphaTextProjection(pooled, dim, act_fn="silu")`: same shape as a TimestepEmbedding.
    pub text_embedder: TimestepEmbedding,
}

impl TimeTextEmbed {
    pub fn new(vs: nn::Path, cfg: &FluxConfig) -> Self {
        let dim = cfg.inner_dim();
        Self {
            timestep_embedder: TimestepEmbedding::new(
                &vs / "timestep_embedder",
                TIME_PROJ_DIM,
                dim,
            ),
            guidance_embedder: cfg
                .guidance_embeds
                .then(|| TimestepEmbedding::new(&vs / "guidance_embedder", TIME_PROJ_DIM, dim)),
            text_embedder: TimestepEmbedding::new(
                &vs / "text_embedder",
                cfg.pooled_projection_dim,
                dim,
            ),
        }
    }

    /// `timestep` and `guidance` are already scaled by 1000 (as the transformer's forward does).
    /// Rows of the result follow the rows of `pooled`.
    pub fn forward(
        &self,
        timestep: &Tensor,
        guidance: Option<&Tensor>,
        pooled: &Tensor,
    ) -> Result<Tensor> {
        let kind = pooled.kind();
        let mut temb = self
            .timestep_embedder
            .forward(&timestep_proj(timestep)?.f_to_kind(kind)?)?;
        match (&self.guidance_embedder, guidance) {
            (Some(emb), Some(g)) => {
                temb = temb.f_add(&emb.forward(&timestep_proj(g)?.f_to_kind(kind)?)?)?
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(ModelError::input(
                    "guidance",
                    "required: the model has guidance_embeds = true",
                ))
            }
            (None, Some(_)) => {
                return Err(ModelError::input(
                    "guidance",
                    "must be absent: the model has guidance_embeds = false",
                ))
            }
        }
        Ok(temb.f_add(&self.text_embedder.forward(pooled)?)?)
    }
}

/// Rotary tables for a sequence of positions: `freqs[s, i] = cos + i sin` of the angle of
/// pair `i` at position `s`, as one complex64 tensor `[S, head_dim/2]` so applying RoPE is one
/// complex multiply (same maths as diffusers' interleaved real form).
#[derive(Debug)]
pub struct Rope {
    pub freqs: Tensor,
}

impl Rope {
    /// diffusers' `FluxPosEmbed(theta=10000, axes_dim).forward(ids)`; `ids` is `[S, n_axes]`.
    /// Angles are computed in float64 like diffusers on CPU, then rounded to float32.
    pub fn new(ids: &Tensor, axes_dims: &[i64]) -> Result<Self> {
        let size = ids.size();
        if size.len() != 2 || size[1] != axes_dims.len() as i64 {
            return Err(ModelError::input(
                "ids",
                format!("expected [S, {}], got {size:?}", axes_dims.len()),
            ));
        }
        let pos = ids.f_to_kind(Kind::Float)?.f_to_kind(Kind::Double)?;
        let mut angles = Vec::with_capacity(axes_dims.len());
        for (axis, &dim) in axes_dims.iter().enumerate() {
            let exps = Tensor::f_arange_start_step(0, dim, 2, (Kind::Double, ids.device()))?
                .f_div_scalar(dim as f64)?;
            let inv = Tensor::f_pow_scalar(ROPE_THETA, &exps)?.f_reciprocal()?;
            angles.push(pos.f_select(1, axis as i64)?.f_outer(&inv)?);
        }
        let angles = Tensor::f_cat(&angles, 1)?;
        let cos = angles.f_cos()?.f_to_kind(Kind::Float)?;
        let sin = angles.f_sin()?.f_to_kind(Kind::Float)?;
        Ok(Self {
            freqs: Tensor::f_complex(&cos, &sin)?,
        })
    }

    /// Rows `index` of the tables (positions of a token subset).
    pub fn select(&self, index: &Tensor) -> Result<Self> {
        Ok(Self {
            freqs: self.freqs.f_index_select(0, index)?,
        })
    }

    pub fn narrow(&self, start: i64, len: i64) -> Result<Self> {
        Ok(Self {
            freqs: self.freqs.f_narrow(0, start, len)?,
        })
    }

    pub fn device(&self) -> Device {
        self.freqs.device()
    }

    /// Rotate `x` of shape `[..., S, H, D]` (sequence dim third from the end) pairwise:
    /// `(x0 + i x1) * (cos + i sin)` per pair, computed in fp32 and cast back (diffusers' `apply_rotary_emb`).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let kind = x.kind();
        let mut size = x.size();
        let d = size.pop().unwrap_or(0);
        let xf = x.f_to_kind(Kind::Float)?;
        let xf = if xf.is_contiguous() {
            xf
        } else {
            xf.f_contiguous()?
        };
        let mut pairs = size.clone();
        pairs.extend([d / 2, 2]);
        let xc = xf.f_view(pairs.as_slice())?.f_view_as_complex()?;
        // freqs [S, D/2] -> [S, 1, D/2] broadcasts over heads (and any leading batch dims).
        let rotated = xc.f_mul(&self.freqs.f_unsqueeze(1)?)?.f_view_as_real()?;
        size.push(d);
        Ok(rotated.f_view(size.as_slice())?.f_to_kind(kind)?)
    }
}
