//! The UNet's attention with diffusers' key names: `Transformer2DModel` over a feature map
//! (group norm, projection in, `BasicTransformerBlock`s, projection out, residual) and its
//! blocks (self-attention, cross-attention on the text, GEGLU feed-forward, each behind a
//! LayerNorm with a residual).
use crate::error::Result;
use crate::flux::layers::Linear;
use crate::vae::blocks::{Conv2d, GroupNorm};
use tch::{nn, Tensor};

/// `nn.LayerNorm(dim, eps=1e-5, elementwise_affine=True)`.
#[derive(Debug)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    fn new(vs: nn::Path, dim: i64) -> Self {
        Self {
            weight: vs.ones("weight", &[dim]),
            bias: vs.zeros("bias", &[dim]),
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dim = self.weight.size()[0];
        Ok(x.f_layer_norm([dim], Some(&self.weight), Some(&self.bias), 1e-5, true)?)
    }
}

/// `Attention(bias=False, out_bias=True)`: queries from the image tokens, keys and values from
/// them (self) or from the text (cross).
#[derive(Debug)]
pub struct Attention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    heads: i64,
}

impl Attention {
    fn new(vs: nn::Path, dim: i64, context_dim: i64, heads: i64) -> Self {
        Self {
            to_q: Linear::new(&vs / "to_q", dim, dim, false),
            to_k: Linear::new(&vs / "to_k", context_dim, dim, false),
            to_v: Linear::new(&vs / "to_v", context_dim, dim, false),
            to_out: Linear::new(&vs / "to_out" / "0", dim, dim, true),
            heads,
        }
    }

    /// `x` `[B, S, dim]`, `context` `[B, T, context_dim]` -> `[B, S, dim]`.
    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let (k, v) = self.keys_values(context)?;
        self.attend(x, &k, &v)
    }

    /// The keys and values of `context`, `[B, T, dim]` each.
    fn keys_values(&self, context: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((self.to_k.forward(context)?, self.to_v.forward(context)?))
    }

    /// `x`'s queries over given keys and values `[B, T, dim]`, then `to_out`.
    fn attend(&self, x: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let split = |t: Tensor| -> Result<Tensor> {
            let s = t.size();
            Ok(t.f_view([s[0], s[1], self.heads, s[2] / self.heads])?
                .f_transpose(1, 2)?)
        };
        let q = split(self.to_q.forward(x)?)?;
        let k = split(k.shallow_clone())?;
        let v = split(v.shallow_clone())?;
        let o = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<&Tensor>,
            0.0,
            false,
            None,
            false,
        )?;
        let s = o.size();
        let o = o.f_transpose(1, 2)?.f_reshape([s[0], s[2], s[1] * s[3]])?;
        self.to_out.forward(&o)
    }
}

/// `BasicTransformerBlock(norm_type="layer_norm", activation_fn="geglu")`.
#[derive(Debug)]
pub struct BasicTransformerBlock {
    norm1: LayerNorm,
    attn1: Attention,
    norm2: LayerNorm,
    attn2: Attention,
    norm3: LayerNorm,
    /// GEGLU's projection to twice the inner width, then the projection back.
    ff_in: Linear,
    ff_out: Linear,
}

impl BasicTransformerBlock {
    fn new(vs: nn::Path, dim: i64, context_dim: i64, heads: i64) -> Self {
        let inner = 4 * dim;
        Self {
            norm1: LayerNorm::new(&vs / "norm1", dim),
            attn1: Attention::new(&vs / "attn1", dim, dim, heads),
            norm2: LayerNorm::new(&vs / "norm2", dim),
            attn2: Attention::new(&vs / "attn2", dim, context_dim, heads),
            norm3: LayerNorm::new(&vs / "norm3", dim),
            ff_in: Linear::new(&vs / "ff" / "net" / "0" / "proj", dim, 2 * inner, true),
            ff_out: Linear::new(&vs / "ff" / "net" / "2", inner, dim, true),
        }
    }

    fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        self.forward_with(x, context, &mut |k, v| Ok((k, v)))
    }

    /// The block with `self_kv` shown the self-attention's keys and values of `x`'s tokens
    /// (`[B, S, dim]` each) and returning the ones attention reads: the same (the plain and
    /// capture passes), or every token's with cached rows for the tokens `x` leaves out (the
    /// mask-aware pass).
    fn forward_with(
        &self,
        x: &Tensor,
        context: &Tensor,
        self_kv: &mut dyn FnMut(Tensor, Tensor) -> Result<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let n = self.norm1.forward(x)?;
        let (k, v) = self.attn1.keys_values(&n)?;
        let (k, v) = self_kv(k, v)?;
        let x = x.f_add(&self.attn1.attend(&n, &k, &v)?)?;
        let n = self.norm2.forward(&x)?;
        let x = x.f_add(&self.attn2.forward(&n, context)?)?;
        let h = self.ff_in.forward(&self.norm3.forward(&x)?)?;
        let half = h.size()[2] / 2;
        let (hidden, gate) = (h.f_narrow(2, 0, half)?, h.f_narrow(2, half, half)?);
        let h = hidden.f_mul(&gate.f_gelu("none")?)?;
        Ok(x.f_add(&self.ff_out.forward(&h)?)?)
    }
}

/// How `Transformer2DModel` projects in and out: a linear over tokens (SD2.x, SDXL) or a 1x1
/// conv over the map (SD1.x).
#[derive(Debug)]
enum Projection {
    Linear(Linear),
    Conv(Conv2d),
}

/// `Transformer2DModel` on a continuous feature map `[B, C, H, W]`.
#[derive(Debug)]
pub struct Transformer2D {
    norm: GroupNorm,
    proj_in: Projection,
    blocks: Vec<BasicTransformerBlock>,
    proj_out: Projection,
}

/// What one `Transformer2DModel` is built from.
#[derive(Debug, Clone, Copy)]
pub struct Transformer2DShape {
    pub channels: i64,
    pub heads: i64,
    pub layers: i64,
    pub context_dim: i64,
    pub groups: i64,
    pub linear_projection: bool,
}

impl Transformer2D {
    pub fn new(vs: nn::Path, s: Transformer2DShape) -> Self {
        let c = s.channels;
        let projection = |name: &str| {
            if s.linear_projection {
                Projection::Linear(Linear::new(&vs / name, c, c, true))
            } else {
                Projection::Conv(Conv2d::new(&vs / name, c, c, 1, 1, 0))
            }
        };
        Self {
            norm: GroupNorm::with_eps(&vs / "norm", s.groups, c, 1e-6),
            proj_in: projection("proj_in"),
            blocks: (0..s.layers)
                .map(|i| {
                    BasicTransformerBlock::new(
                        &vs / "transformer_blocks" / i,
                        c,
                        s.context_dim,
                        s.heads,
                    )
                })
                .collect(),
            proj_out: projection("proj_out"),
        }
    }

    /// `x` `[B, C, H, W]`, `context` the text `[B, T, context_dim]`.
    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let s = x.size();
        let (b, c, h, w) = (s[0], s[1], s[2], s[3]);
        let to_tokens = |m: &Tensor| -> Result<Tensor> {
            Ok(m.f_permute([0, 2, 3, 1])?.f_reshape([b, h * w, c])?)
        };
        let to_map = |t: &Tensor| -> Result<Tensor> {
            Ok(t.f_reshape([b, h, w, c])?.f_permute([0, 3, 1, 2])?)
        };
        let n = self.norm.forward(x)?;
        let mut t = match &self.proj_in {
            Projection::Linear(l) => l.forward(&to_tokens(&n)?)?,
            Projection::Conv(conv) => to_tokens(&conv.forward(&n)?)?,
        };
        for block in &self.blocks {
            t = block.forward(&t, context)?;
        }
        let out = match &self.proj_out {
            Projection::Linear(l) => to_map(&l.forward(&t)?)?,
            Projection::Conv(conv) => conv.forward(&to_map(&t)?.f_contiguous()?)?,
        };
        Ok(out.f_add(x)?)
    }

    /// [`Self::forward`] of a template, recording what its edits read: each block's
    /// self-attention keys and values and the output, as tokens `[B, H * W, C]` of every row
    /// (a guided template's negative and prompt rows alike).
    pub fn forward_capture(
        &self,
        x: &Tensor,
        context: &Tensor,
    ) -> Result<(Tensor, CapturedTransformer)> {
        let mut kv = Vec::with_capacity(self.blocks.len());
        let s = x.size();
        let (b, c, h, w) = (s[0], s[1], s[2], s[3]);
        let tokens = |m: &Tensor| -> Result<Tensor> {
            Ok(m.f_permute([0, 2, 3, 1])?.f_reshape([b, h * w, c])?)
        };
        let mut t = self.project_in(&tokens(&self.norm.forward(x)?)?)?;
        for block in &self.blocks {
            t = block.forward_with(&t, context, &mut |k, v| {
                kv.push((k.f_contiguous()?, v.f_contiguous()?));
                Ok((k, v))
            })?;
        }
        let out = self.project_out(&t)?.f_add(&tokens(x)?)?;
        let captured = CapturedTransformer {
            kv,
            out: out.f_contiguous()?,
        };
        Ok((
            out.f_reshape([b, h, w, c])?.f_permute([0, 3, 1, 2])?,
            captured,
        ))
    }

    /// FlashPS for a UNet's attention: only the tokens at `index` (`[B, M]` of the `H * W`, a
    /// row's repeats allowed) go through the blocks, their self-attention reading every token's
    /// keys and values (theirs fresh, the others' from the template's cache); the output is the
    /// template's at the other tokens. Batch row `r` reads row `cached[r].1` of the cache
    /// `cached[r].0`. The group norm sees the whole map (the resnets computed it in full).
    pub fn forward_masked(
        &self,
        x: &Tensor,
        context: &Tensor,
        index: &Tensor,
        cached: &[(&CapturedTransformer, i64)],
    ) -> Result<Tensor> {
        let s = x.size();
        let (b, c, h, w) = (s[0], s[1], s[2], s[3]);
        if cached.len() as i64 != b {
            return Err(crate::error::ModelError::input(
                "cache",
                format!("{} cache rows for a batch of {b}", cached.len()),
            ));
        }
        for (cache, row) in cached {
            let rows = cache.rows();
            if cache.kv.len() != self.blocks.len()
                || cache.out.size() != [rows, h * w, c]
                || !(0..rows).contains(row)
            {
                return Err(crate::error::ModelError::input(
                    "cache",
                    format!(
                        "row {row} of a cache of {} blocks and {:?} for a transformer of {} blocks on [{}, {c}]",
                        cache.kv.len(),
                        cache.out.size(),
                        self.blocks.len(),
                        h * w
                    ),
                ));
            }
        }
        let m = index.size().get(1).copied().unwrap_or(0);
        if index.size() != [b, m] {
            return Err(crate::error::ModelError::input(
                "mask",
                format!("token index {:?} for {b} rows", index.size()),
            ));
        }
        let gather_index = index.f_unsqueeze(2)?.f_expand([b, m, c], false)?;
        let masked = |x: &Tensor| -> Result<Tensor> {
            Ok(x.f_permute([0, 2, 3, 1])?
                .f_reshape([b, h * w, c])?
                .f_gather(1, &gather_index, false)?)
        };
        // Every token of each batch row's cache row, `fresh` written at `index` (a repeated
        // index writes the same values twice).
        let merge = |part: &dyn Fn(&CapturedTransformer) -> &Tensor, fresh: &Tensor| {
            let (first, row) = cached[0];
            let shared = cached
                .iter()
                .all(|(c, r)| std::ptr::eq(*c, first) && *r == row);
            let all = if shared {
                part(first)
                    .f_narrow(0, row, 1)?
                    .f_expand([b, h * w, c], false)?
            } else {
                let rows: Vec<Tensor> = cached
                    .iter()
                    .map(|(c, r)| part(c).f_narrow(0, *r, 1))
                    .collect::<std::result::Result<_, _>>()?;
                Tensor::f_cat(&rows, 0)?
            };
            let all = all.f_to_kind(fresh.kind())?.f_contiguous()?;
            Ok::<_, crate::error::ModelError>(all.f_scatter(1, &gather_index, fresh)?)
        };
        let mut t = self.project_in(&masked(&self.norm.forward(x)?)?)?;
        for (j, block) in self.blocks.iter().enumerate() {
            t = block.forward_with(&t, context, &mut |k, v| {
                Ok((merge(&|c| &c.kv[j].0, &k)?, merge(&|c| &c.kv[j].1, &v)?))
            })?;
        }
        let out = self.project_out(&t)?.f_add(&masked(x)?)?;
        Ok(merge(&|c| &c.out, &out)?
            .f_reshape([b, h, w, c])?
            .f_permute([0, 3, 1, 2])?)
    }

    /// Its `BasicTransformerBlock`s.
    pub fn layers(&self) -> usize {
        self.blocks.len()
    }

    /// `proj_in` on tokens `[B, S, C]` (a 1x1 conv is a linear over channels).
    fn project_in(&self, t: &Tensor) -> Result<Tensor> {
        project(&self.proj_in, t)
    }

    fn project_out(&self, t: &Tensor) -> Result<Tensor> {
        project(&self.proj_out, t)
    }
}

fn project(p: &Projection, t: &Tensor) -> Result<Tensor> {
    match p {
        Projection::Linear(l) => l.forward(t),
        Projection::Conv(conv) => {
            let s = conv.weight.size();
            let w = conv.weight.f_view([s[0], s[1]])?;
            Ok(t.f_linear(&w, conv.bias.as_ref())?)
        }
    }
}

/// What a template's `Transformer2DModel` leaves its edits: per block, the self-attention keys
/// and values of every token, and the output, each `[R, H * W, C]` for the template's `R` rows.
#[derive(Debug)]
pub struct CapturedTransformer {
    pub kv: Vec<(Tensor, Tensor)>,
    pub out: Tensor,
}

impl CapturedTransformer {
    /// The template's rows (2 for a guided template: negative, then prompt).
    pub fn rows(&self) -> i64 {
        self.out.size().first().copied().unwrap_or(0)
    }
}
