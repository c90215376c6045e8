//! Flux's double-stream (`FluxTransformerBlock`) and single-stream (`FluxSingleTransformerBlock`)
//! blocks, mirroring diffusers 0.42.1.
//!
//! Each block is split into token-wise stages (AdaLN + projections before attention, output
//! projections + MLP after it) and the attention itself. The stages work on any token layout whose
//! modulation rows broadcast against it: `[B, S, C]` with `[B, 1, C]` rows for the full forward,
//! or a packed `[L, C]` with per-token rows `[L, C]` for the mask-aware forward. Only attention
//! differs between the two forwards, so the maths of every other op is shared.
use super::config::FluxConfig;
use super::embeddings::Rope;
use super::layers::{
    ada_chunks, gated_residual, layer_norm, modulate, FeedForward, Linear, RmsNorm,
};
use crate::error::Result;
use tch::{nn, Tensor};

/// QK RMSNorm epsilon inside Flux blocks (diffusers passes eps=1e-6 to `FluxAttention`).
const QK_NORM_EPS: f64 = 1e-6;

/// One AdaLN-zero modulation: `shift`, `1 + scale` and `gate`, broadcastable to the tokens.
#[derive(Debug)]
pub struct Mod {
    pub shift: Tensor,
    pub scale1: Tensor,
    pub gate: Tensor,
}

impl Mod {
    fn from_chunks(shift: &Tensor, scale: &Tensor, gate: &Tensor) -> Result<Self> {
        Ok(Self {
            shift: shift.shallow_clone(),
            scale1: scale.f_add_scalar(1.0)?,
            gate: gate.shallow_clone(),
        })
    }

    /// `norm(x) * (1 + scale) + shift`.
    pub fn apply(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        modulate(&layer_norm(x, dim)?, &self.shift, &self.scale1)
    }
}

/// Expand per-row AdaLN chunks (`[R, C]`) to the token layout: `rows(chunk)` either unsqueezes to
/// `[B, 1, C]` (full forward) or gathers one row per packed token (mask-aware forward).
pub type RowMap<'a> = &'a dyn Fn(&Tensor) -> Result<Tensor>;

/// Split the last dim `inner` into `[heads, head_dim]`.
pub fn to_heads(x: &Tensor, head_dim: i64) -> Result<Tensor> {
    let mut size = x.size();
    let inner = size.pop().unwrap_or(0);
    size.extend([inner / head_dim, head_dim]);
    Ok(x.f_view(size.as_slice())?)
}

/// Query/key/value of one token stream: `q`, `k` RMS-normed and split into heads,
/// `k_raw` the raw `to_k` projection (what the mask-aware cache stores), `v` raw (not split).
#[derive(Debug)]
pub struct Qkv {
    pub q: Tensor,
    pub k: Tensor,
    pub k_raw: Tensor,
    pub v: Tensor,
}

/// The projections + QK norms of one attention stream (`to_q/to_k/to_v/norm_q/norm_k` or the
/// `add_*_proj/norm_added_*` context twins).
#[derive(Debug)]
pub struct QkvProj {
    pub to_q: Linear,
    pub to_k: Linear,
    pub to_v: Linear,
    pub norm_q: RmsNorm,
    pub norm_k: RmsNorm,
    pub head_dim: i64,
}

impl QkvProj {
    fn new(vs: &nn::Path, names: [&str; 5], dim: i64, head_dim: i64) -> Self {
        Self {
            to_q: Linear::new(vs / names[0], dim, dim, true),
            to_k: Linear::new(vs / names[1], dim, dim, true),
            to_v: Linear::new(vs / names[2], dim, dim, true),
            norm_q: RmsNorm::new(vs / names[3], head_dim, QK_NORM_EPS),
            norm_k: RmsNorm::new(vs / names[4], head_dim, QK_NORM_EPS),
            head_dim,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Qkv> {
        let q = self
            .norm_q
            .forward(&to_heads(&self.to_q.forward(x)?, self.head_dim)?)?;
        let k_raw = self.to_k.forward(x)?;
        let k = self.norm_k(&k_raw)?;
        Ok(Qkv {
            q,
            k,
            k_raw,
            v: self.to_v.forward(x)?,
        })
    }

    /// Raw `to_k` and `to_v` projections of `x` (no norm, no heads split).
    pub fn raw_kv(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((self.to_k.forward(x)?, self.to_v.forward(x)?))
    }

    /// `norm_k` applied to raw keys `[..., inner]` (fresh or cached), giving `[..., H, D]`.
    pub fn norm_k(&self, k_raw: &Tensor) -> Result<Tensor> {
        self.norm_k.forward(&to_heads(k_raw, self.head_dim)?)
    }
}

/// `FluxTransformerBlock`: separate weights for image and text tokens, joint attention.
#[derive(Debug)]
pub struct DoubleBlock {
    pub norm1: Linear,
    pub norm1_context: Linear,
    pub img: QkvProj,
    pub txt: QkvProj,
    pub to_out: Linear,
    pub to_add_out: Linear,
    pub ff: FeedForward,
    pub ff_context: FeedForward,
    pub dim: i64,
}

/// Modulations of one stream in a double block: attention (`msa`) and MLP.
#[derive(Debug)]
pub struct DoubleMods {
    pub msa: Mod,
    pub mlp: Mod,
}

impl DoubleMods {
    pub(crate) fn new(linear: &Linear, temb_silu: &Tensor, rows: RowMap) -> Result<Self> {
        let c = ada_chunks(linear, temb_silu, 6)?;
        let c: Vec<Tensor> = c.iter().map(rows).collect::<Result<_>>()?;
        // diffusers' order: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp.
        Ok(Self {
            msa: Mod::from_chunks(&c[0], &c[1], &c[2])?,
            mlp: Mod::from_chunks(&c[3], &c[4], &c[5])?,
        })
    }
}

impl DoubleBlock {
    pub fn new(vs: nn::Path, cfg: &FluxConfig) -> Self {
        let dim = cfg.inner_dim();
        let hd = cfg.attention_head_dim;
        let attn = &vs / "attn";
        Self {
            norm1: Linear::new(&vs / "norm1" / "linear", dim, 6 * dim, true),
            norm1_context: Linear::new(&vs / "norm1_context" / "linear", dim, 6 * dim, true),
            img: QkvProj::new(&attn, ["to_q", "to_k", "to_v", "norm_q", "norm_k"], dim, hd),
            txt: QkvProj::new(
                &attn,
                [
                    "add_q_proj",
                    "add_k_proj",
                    "add_v_proj",
                    "norm_added_q",
                    "norm_added_k",
                ],
                dim,
                hd,
            ),
            to_out: Linear::new(&attn / "to_out" / "0", dim, dim, true),
            to_add_out: Linear::new(&attn / "to_add_out", dim, dim, true),
            ff: FeedForward::new(&vs / "ff", dim),
            ff_context: FeedForward::new(&vs / "ff_context", dim),
            dim,
        }
    }

    /// AdaLN rows for image (`norm1`) and text (`norm1_context`) tokens.
    pub fn mods(
        &self,
        temb_silu: &Tensor,
        img_rows: RowMap,
        txt_rows: RowMap,
    ) -> Result<(DoubleMods, DoubleMods)> {
        Ok((
            DoubleMods::new(&self.norm1, temb_silu, img_rows)?,
            DoubleMods::new(&self.norm1_context, temb_silu, txt_rows)?,
        ))
    }

    /// Token-wise stage before attention: returns (image qkv, text qkv).
    pub fn pre(
        &self,
        img: &Tensor,
        txt: &Tensor,
        img_mod: &DoubleMods,
        txt_mod: &DoubleMods,
    ) -> Result<(Qkv, Qkv)> {
        let nx = img_mod.msa.apply(img, self.dim)?;
        let nc = txt_mod.msa.apply(txt, self.dim)?;
        Ok((self.img.forward(&nx)?, self.txt.forward(&nc)?))
    }

    /// Token-wise stage after attention: gated residuals, then the gated MLPs.
    /// `attn_img`/`attn_txt` are the attention outputs `[..., inner]` before `to_out`/`to_add_out`.
    pub fn post(
        &self,
        img: &Tensor,
        txt: &Tensor,
        attn_img: &Tensor,
        attn_txt: &Tensor,
        img_mod: &DoubleMods,
        txt_mod: &DoubleMods,
    ) -> Result<(Tensor, Tensor)> {
        let img = gated_residual(img, &img_mod.msa.gate, &self.to_out.forward(attn_img)?)?;
        let ff = self.ff.forward(&img_mod.mlp.apply(&img, self.dim)?)?;
        let img = gated_residual(&img, &img_mod.mlp.gate, &ff)?;
        let txt = gated_residual(txt, &txt_mod.msa.gate, &self.to_add_out.forward(attn_txt)?)?;
        let ff = self
            .ff_context
            .forward(&txt_mod.mlp.apply(&txt, self.dim)?)?;
        let txt = gated_residual(&txt, &txt_mod.mlp.gate, &ff)?;
        Ok((img, txt))
    }
}

/// AdaLN rows of one request, unexpanded (`[1, C]` chunks broadcast over its tokens).
fn one_row(c: &Tensor) -> Result<Tensor> {
    Ok(c.shallow_clone())
}

impl DoubleBlock {
    /// Raw image K and V `[N, inner]` of a cached input hidden stream `h` (`KvFormat::Hidden`)
    /// under one request's conditioning `temb_silu` (`[1, C]`): what `pre` computes for them.
    pub fn hidden_kv(&self, temb_silu: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)> {
        let m = DoubleMods::new(&self.norm1, temb_silu, &one_row)?;
        self.img.raw_kv(&m.msa.apply(h, self.dim)?)
    }
}

impl DoubleBlock {
    /// The whole block over full `[B, S, C]` streams (no capture), as diffusers runs it:
    /// returns the new (image, text) streams. `rope` covers the text then the image tokens.
    pub fn forward_full(
        &self,
        img: &Tensor,
        txt: &Tensor,
        temb_silu: &Tensor,
        rope: &Rope,
        head_dim: i64,
    ) -> Result<(Tensor, Tensor)> {
        let rows = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };
        let (img_mod, txt_mod) = self.mods(temb_silu, &rows, &rows)?;
        let (qi, qt) = self.pre(img, txt, &img_mod, &txt_mod)?;
        let q = rope.apply(&Tensor::f_cat(&[&qt.q, &qi.q], 1)?)?;
        let k = rope.apply(&Tensor::f_cat(&[&qt.k, &qi.k], 1)?)?;
        let v = to_heads(&Tensor::f_cat(&[&qt.v, &qi.v], 1)?, head_dim)?;
        let o = attention(&q, &k, &v)?;
        let t = txt.size()[1];
        let n = img.size()[1];
        let (attn_txt, attn_img) = (o.f_narrow(1, 0, t)?, o.f_narrow(1, t, n)?);
        self.post(img, txt, &attn_img, &attn_txt, &img_mod, &txt_mod)
    }
}

/// `FluxSingleTransformerBlock`: one stream (text then image tokens), attention and MLP in parallel.
#[derive(Debug)]
pub struct SingleBlock {
    pub norm: Linear,
    pub attn: QkvProj,
    pub proj_mlp: Linear,
    pub proj_out: Linear,
    pub dim: i64,
}

/// The output of a single block's token-wise stage before attention.
#[derive(Debug)]
pub struct SinglePre {
    pub qkv: Qkv,
    /// `gelu_tanh(proj_mlp(norm(x)))`.
    pub mlp: Tensor,
}

impl SingleBlock {
    pub fn new(vs: nn::Path, cfg: &FluxConfig) -> Self {
        let dim = cfg.inner_dim();
        let mlp = cfg.mlp_hidden_dim();
        Self {
            norm: Linear::new(&vs / "norm" / "linear", dim, 3 * dim, true),
            attn: QkvProj::new(
                &(&vs / "attn"),
                ["to_q", "to_k", "to_v", "norm_q", "norm_k"],
                dim,
                cfg.attention_head_dim,
            ),
            proj_mlp: Linear::new(&vs / "proj_mlp", dim, mlp, true),
            proj_out: Linear::new(&vs / "proj_out", dim + mlp, dim, true),
            dim,
        }
    }

    /// AdaLN rows (`norm.linear`: shift, scale, gate).
    pub fn mods(&self, temb_silu: &Tensor, rows: RowMap) -> Result<Mod> {
        let c = ada_chunks(&self.norm, temb_silu, 3)?;
        Mod::from_chunks(&rows(&c[0])?, &rows(&c[1])?, &rows(&c[2])?)
    }

    pub fn pre(&self, x: &Tensor, m: &Mod) -> Result<SinglePre> {
        let nx = m.apply(x, self.dim)?;
        let mlp = self.proj_mlp.forward(&nx)?.f_gelu("tanh")?;
        Ok(SinglePre {
            qkv: self.attn.forward(&nx)?,
            mlp,
        })
    }

    /// Raw K and V `[N, inner]` of a cached input hidden stream `h` (`KvFormat::Hidden`)
    /// under one request's conditioning `temb_silu` (`[1, C]`): what `pre` computes for them.
    pub fn hidden_kv(&self, temb_silu: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)> {
        let m = self.mods(temb_silu, &one_row)?;
        self.attn.raw_kv(&m.apply(h, self.dim)?)
    }

    /// `x + gate * proj_out(cat[attn, mlp])`.
    pub fn post(&self, x: &Tensor, attn: &Tensor, mlp: &Tensor, m: &Mod) -> Result<Tensor> {
        let last = attn.dim() as i64 - 1;
        let h = Tensor::f_cat(&[attn, mlp], last)?;
        gated_residual(x, &m.gate, &self.proj_out.forward(&h)?)
    }
}

impl SingleBlock {
    /// The whole block over a full `[B, T + N, C]` stream (text then image tokens, no capture).
    pub fn forward_full(
        &self,
        x: &Tensor,
        temb_silu: &Tensor,
        rope: &Rope,
        head_dim: i64,
    ) -> Result<Tensor> {
        let rows = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };
        let m = self.mods(temb_silu, &rows)?;
        let pre = self.pre(x, &m)?;
        let q = rope.apply(&pre.qkv.q)?;
        let k = rope.apply(&pre.qkv.k)?;
        let v = to_heads(&pre.qkv.v, head_dim)?;
        let o = attention(&q, &k, &v)?;
        self.post(x, &o, &pre.mlp, &m)
    }
}

/// Batched scaled-dot-product attention over `[B, S, H, D]` inputs, returning `[B, Sq, H*D]`.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let out = Tensor::f_scaled_dot_product_attention(
        &q.f_transpose(1, 2)?,
        &k.f_transpose(1, 2)?,
        &v.f_transpose(1, 2)?,
        None::<&Tensor>,
        0.0,
        false,
        None,
        false,
    )?;
    let size = out.size();
    Ok(out
        .f_transpose(1, 2)?
        .f_reshape([size[0], size[2], size[1] * size[3]])?)
}
