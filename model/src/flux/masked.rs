//! FlashPS mask-aware forward for Flux (paper §3.1 / §4.2, the K/V-caching variant).
//!
//! A template is registered with a full forward that captures, per block, the K/V of its N image
//! tokens (`FluxTransformer::forward_capture`, in a `KvFormat` the caller picks). An edit then runs
//! only the text tokens and its M masked image tokens through every block. In attention, the
//! computed tokens are the queries; keys/values are the text tokens plus all N image tokens, where
//! masked positions take freshly computed K/V and unmasked positions take the cached K/V (for raw
//! caches, QK RMSNorm and RoPE are applied to the cached keys at their true positions first).
//! Text K/V are never cached.
//!
//! Several requests (different masks, timesteps, prompts, templates) are packed into one token
//! sequence without padding for every token-wise op; each token carries its request index so it
//! gathers its own request's AdaLN rows. Only attention is split per request: one call per request,
//! or on a GPU one padded call for the batch (`padded_attention`).
use super::blocks::{attention, to_heads, DoubleBlock, SingleBlock};
use super::embeddings::Rope;
use super::gather::{cat_rows, check_token_index, gather_rows, merge_rows_, offsets, request_ids};
use super::padded_attention::{MaskedAttention, PaddedLayout, RequestRows};
use super::{check_batch_vector, ids_2d, FluxTransformer};
use crate::error::{ModelError, Result};
use tch::{Device, Kind, Tensor};

pub use super::kv::{CapturedKv, FnSink, KvCache, KvFormat, KvSink};

mod cache_read;
use cache_read::{CacheRead, CachedLayer};

/// Completes a rank's fresh keys and values where an edit's masked tokens are spread over the
/// ranks of a group ([`super::masked_parallel`]).
pub(crate) trait SpreadKeys {
    /// This rank's fresh image keys (rotated) and values `[M_local, H, D]` of request
    /// `request`'s masked tokens -> every rank's, `[M, H, D]` in `token_index` order.
    fn gather(&mut self, request: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)>;
}

/// An edit spread over ranks: this rank's (start, length) share of each request's
/// `token_index`, and the exchange of the other shares' keys.
pub(crate) struct Spread<'a> {
    pub(crate) shards: &'a [(i64, i64)],
    pub(crate) keys: &'a mut dyn SpreadKeys,
}

/// One request of a mask-aware forward, at its own denoising step.
pub struct MaskedRequest<'a> {
    /// `[M, in_channels]` packed latents of the masked image tokens only.
    pub hidden_states: Tensor,
    /// `[M]` distinct indices of those tokens among the N image tokens (int64).
    pub token_index: Tensor,
    /// `[T, joint_attention_dim]` this request's text sequence.
    pub encoder_hidden_states: Tensor,
    /// `[pooled_projection_dim]` (or `[1, P]`).
    pub pooled_projections: Tensor,
    /// Diffusers units (sigma in [0, 1]); multiplied by 1000 inside like the full forward.
    pub timestep: f64,
    /// Required iff the model has `guidance_embeds`.
    pub guidance: Option<f64>,
    /// `[N, 3]` positions of all N image tokens of the template.
    pub img_ids: Tensor,
    /// `[T, 3]`.
    pub txt_ids: Tensor,
    /// K/V of all N image tokens of this request's template at this request's step, each block
    /// in the cache's `block_format()`. Not read when every token is masked (M = N).
    pub cache: &'a dyn KvCache,
    /// `[N, in_channels]` packed latents of all N image tokens: read only when the batch runs a
    /// full prefix of blocks ([`FluxTransformer::forward_masked_prefix`]) and M < N.
    pub full_hidden_states: Option<Tensor>,
}

/// Per-request data fixed for one phase of the forward.
struct Prepared {
    txt: i64,
    /// Computed image tokens (M; N in the full-prefix phase).
    masked: i64,
    img: i64,
    /// `[M]` the computed image tokens among the N (int64, on the model's device).
    index: Tensor,
    /// Rows of the computed tokens in the joint text-then-image sequence: `0..T`, then
    /// `T + token_index` (int64, on the model's device).
    rows: Tensor,
    /// Rows of every fresh key, where they are more than this rank's computed tokens (an
    /// edit spread over ranks, [`super::masked_parallel`]): `0..T`, then `T +` the whole
    /// request's masked index.
    key_rows: Option<Tensor>,
    /// RoPE rows of the computed tokens (text, then masked image tokens), for queries and keys.
    rope: Rope,
    /// RoPE rows of all N image tokens, which a raw block's cached keys need; only when the
    /// cache holds a raw block and is read.
    rope_all: Option<Rope>,
    /// RoPE rows of the unmasked image tokens, which a hidden block's projected keys need;
    /// only when the cache holds a hidden block and is read.
    rope_unmasked: Option<Rope>,
    /// `[N - M]` the unmasked image tokens (of the whole request, every rank's masked tokens
    /// left out): the rows a hidden cache projects back to K/V (the others are computed).
    unmasked: Option<Tensor>,
    /// Set when M = N (nothing is cached, the request is a plain full forward): the fresh
    /// key rows in token order (`key_rows()` inverted), so keys and values are gathered into
    /// token order rather than scattered into an uninitialised buffer.
    token_order: Option<Tensor>,
}

impl Prepared {
    /// Rows of the fresh keys and values in the joint sequence.
    fn key_rows(&self) -> &Tensor {
        self.key_rows.as_ref().unwrap_or(&self.rows)
    }

    /// M = N: every image token is computed and no cache is read.
    fn all_masked(&self) -> bool {
        self.token_order.is_some()
    }
}

/// Offsets of each request's tokens inside one packed stream.
struct Layout {
    txt_off: Vec<i64>,
    img_off: Vec<i64>,
}

/// The packing of one phase: every request's prepared rows, offsets, and per-token request ids
/// (`None` for a single request, whose AdaLN rows broadcast without a gather).
struct Phase {
    prep: Vec<Prepared>,
    layout: Layout,
    total_txt: i64,
    txt_rid: Option<Tensor>,
    img_rid: Option<Tensor>,
    all_rid: Option<Tensor>,
    /// Set where attention runs as one padded call for all requests.
    padded: Option<PaddedLayout>,
}

impl Phase {
    fn new(prep: Vec<Prepared>, device: Device, mode: MaskedAttention) -> Result<Self> {
        let txt_lens: Vec<i64> = prep.iter().map(|p| p.txt).collect();
        let img_lens: Vec<i64> = prep.iter().map(|p| p.masked).collect();
        let (txt_rid, img_rid, all_rid) = if prep.len() == 1 {
            (None, None, None)
        } else {
            let t = request_ids(&txt_lens, device)?;
            let i = request_ids(&img_lens, device)?;
            let a = Tensor::f_cat(&[&t, &i], 0)?;
            (Some(t), Some(i), Some(a))
        };
        let rows: Vec<RequestRows> = prep
            .iter()
            .map(|p| RequestRows {
                txt: p.txt,
                masked: p.masked,
                img: p.img,
                rows: &p.rows,
                rope: &p.rope,
            })
            .collect();
        let padded = PaddedLayout::new(&rows, mode, device)?;
        Ok(Self {
            padded,
            layout: Layout {
                txt_off: offsets(&txt_lens),
                img_off: offsets(&img_lens),
            },
            total_txt: txt_lens.iter().sum(),
            prep,
            txt_rid,
            img_rid,
            all_rid,
        })
    }

    fn single_request(&self) -> bool {
        self.prep.len() == 1
    }

    fn rows(rid: &Option<Tensor>, c: &Tensor) -> Result<Tensor> {
        match rid {
            None => Ok(c.shallow_clone()),
            Some(rid) => gather_rows(c, rid),
        }
    }

    /// Packed image rows of `from` (this phase must compute a superset of `to`'s tokens) at the
    /// positions of `to`'s computed tokens: how the full-prefix phase hands over to the masked one.
    fn select_img(from: &Phase, to: &Phase, img: &Tensor) -> Result<Tensor> {
        let parts: Vec<Tensor> = to
            .prep
            .iter()
            .zip(&from.layout.img_off)
            .map(|(p, &off)| Ok(p.index.f_add_scalar(off)?))
            .collect::<Result<_>>()?;
        gather_rows(img, &cat_rows(&parts)?)
    }
}

impl FluxTransformer {
    /// Mask-aware forward over a batch of requests; returns each request's predicted velocity for
    /// its masked tokens, `[M_i, patch^2 * out_channels]`, in `token_index` order.
    pub fn forward_masked(&self, requests: &[MaskedRequest]) -> Result<Vec<Tensor>> {
        self.forward_masked_prefix(requests, 0)
    }

    /// [`Self::forward_masked`] with the first `full_prefix` blocks (double blocks first, then
    /// single blocks) computed over every image token, as the full forward does, and only the
    /// rest in cached mode. The prefix reads no cache (its blocks need no loading) at the price of
    /// computing all N tokens; a planner picks `full_prefix` to balance that against cache
    /// loading (FlashPS Algorithm 1 restricted to prefixes: once the unmasked tokens are dropped
    /// they cannot come back). Requests with M < N need `full_hidden_states` when it is > 0.
    pub fn forward_masked_prefix(
        &self,
        requests: &[MaskedRequest],
        full_prefix: usize,
    ) -> Result<Vec<Tensor>> {
        self.forward_masked_spread(requests, full_prefix, None)
    }

    /// [`Self::forward_masked_prefix`] that also returns each request's residual at its masked
    /// tokens, `[M_i, inner]`: what the blocks added to the image stream, which a later step of
    /// the same request may reuse (step caching, [`super::step_cache`]).
    pub fn forward_masked_with_residuals(
        &self,
        requests: &[MaskedRequest],
        full_prefix: usize,
    ) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let (out, residuals) = self.forward_masked_run(requests, full_prefix, None, true)?;
        Ok((out, residuals.unwrap_or_default()))
    }

    /// [`Self::forward_masked_prefix`], computing only this rank's share of each request's
    /// masked tokens where `spread` is set (and then no full prefix).
    pub(crate) fn forward_masked_spread(
        &self,
        requests: &[MaskedRequest],
        full_prefix: usize,
        spread: Option<Spread>,
    ) -> Result<Vec<Tensor>> {
        Ok(self
            .forward_masked_run(requests, full_prefix, spread, false)?
            .0)
    }

    /// The mask-aware forward, with the masked tokens' residuals where `residuals` is set.
    fn forward_masked_run(
        &self,
        requests: &[MaskedRequest],
        full_prefix: usize,
        spread: Option<Spread>,
        residuals: bool,
    ) -> Result<(Vec<Tensor>, Option<Vec<Tensor>>)> {
        if requests.is_empty() {
            return Ok((Vec::new(), residuals.then(Vec::new)));
        }
        let (device, kind) = self.device_kind();
        let n_double = self.transformer_blocks.len();
        let n_blocks = n_double + self.single_transformer_blocks.len();
        let prefix = full_prefix.min(n_blocks);
        let (shards, mut keys) = match spread {
            Some(s) if prefix == 0 && s.shards.len() == requests.len() => (s.shards, Some(s.keys)),
            Some(_) => {
                return Err(ModelError::input(
                    "ranks",
                    "a spread edit needs one shard per request and no full prefix",
                ))
            }
            None => (&[][..], None),
        };
        // Attention runs per request where keys are exchanged, in the same order on every rank.
        let mode = if keys.is_some() {
            MaskedAttention::PerRequest
        } else {
            self.masked_attention
        };
        let masked = Phase::new(
            requests
                .iter()
                .enumerate()
                .map(|(r, q)| self.prepare(r, q, device, false, shards.get(r).copied()))
                .collect::<Result<_>>()?,
            device,
            mode,
        )?;
        let full = if prefix > 0 {
            Some(Phase::new(
                requests
                    .iter()
                    .enumerate()
                    .map(|(r, q)| self.prepare(r, q, device, true, None))
                    .collect::<Result<_>>()?,
                device,
                mode,
            )?)
        } else {
            None
        };

        // Token-wise inputs, packed without padding.
        let on_dev = |t: &Tensor| -> Result<Tensor> { Ok(t.f_to_device(device)?.f_to_kind(kind)?) };
        let hs: Vec<Tensor> = requests
            .iter()
            .enumerate()
            .map(|(r, q)| match (&full, &q.full_hidden_states) {
                (Some(f), _) if f.prep[r].masked == masked.prep[r].masked => {
                    on_dev(&q.hidden_states)
                }
                (Some(_), Some(h)) => on_dev(h),
                (Some(_), None) => Err(ModelError::input(
                    format!("requests[{r}].full_hidden_states"),
                    "required when blocks run over every token (full_prefix > 0)",
                )),
                (None, _) => match shards.get(r) {
                    Some(&(start, len)) => on_dev(&q.hidden_states.f_narrow(0, start, len)?),
                    None => on_dev(&q.hidden_states),
                },
            })
            .collect::<Result<_>>()?;
        let es: Vec<Tensor> = requests
            .iter()
            .map(|q| on_dev(&q.encoder_hidden_states))
            .collect::<Result<_>>()?;
        let pooled: Vec<Tensor> = requests
            .iter()
            .map(|q| on_dev(&q.pooled_projections.f_reshape([1, -1])?))
            .collect::<Result<_>>()?;
        let mut img = self.x_embedder.forward(&cat_rows(&hs)?)?;
        let img_in = match (residuals, &full) {
            (false, _) => None,
            (true, Some(f)) => Some(Phase::select_img(f, &masked, &img)?),
            (true, None) => Some(img.shallow_clone()),
        };
        let mut txt = self.context_embedder.forward(&cat_rows(&es)?)?;

        // Per-request conditioning rows, gathered per token below.
        let steps: Vec<f32> = requests.iter().map(|q| q.timestep as f32).collect();
        let timestep = Tensor::f_from_slice(&steps)?.f_to_device(device)?;
        let guidance = guidance_tensor(requests, device)?;
        let cond = self.conditioning(&timestep, guidance.as_ref(), &cat_rows(&pooled)?)?;

        let mut phase = full.as_ref().unwrap_or(&masked);
        for (i, block) in self.transformer_blocks.iter().enumerate() {
            if i == prefix {
                if let Some(f) = &full {
                    img = Phase::select_img(f, &masked, &img)?;
                    phase = &masked;
                }
            }
            (img, txt) = self.masked_double_block(
                i,
                block,
                phase,
                requests,
                (&img, &txt),
                &cond,
                keys.as_deref_mut(),
            )?;
        }

        // Single blocks: one packed stream, all text tokens first, then all computed image tokens.
        // With one request that stream is exactly its text-then-image sequence: no copies.
        let mut x = Tensor::f_cat(&[&txt, &img], 0)?;
        for (j, block) in self.single_transformer_blocks.iter().enumerate() {
            if n_double + j == prefix {
                if let Some(f) = &full {
                    x = switch_joint(f, &masked, &x)?;
                    phase = &masked;
                }
            }
            let keys = keys.as_deref_mut();
            x = self.masked_single_block(n_double + j, block, phase, requests, &x, &cond, keys)?;
        }
        let total_txt = masked.total_txt;
        let mut img = x.f_narrow(0, total_txt, x.size()[0] - total_txt)?;
        if let (Some(f), true) = (&full, prefix == n_blocks) {
            // Every block ran in full: the final layer is token-wise, so select first.
            img = Phase::select_img(f, &masked, &img)?;
        }
        let img_rows = |c: &Tensor| Phase::rows(&masked.img_rid, c);
        let out = self.final_layer(&img, &cond.temb_silu, &img_rows)?;
        let per_request = |t: &Tensor| -> Result<Vec<Tensor>> {
            masked
                .prep
                .iter()
                .zip(&masked.layout.img_off)
                .map(|(p, &o)| Ok(t.f_narrow(0, o, p.masked)?))
                .collect()
        };
        let residuals = match img_in {
            Some(start) => Some(per_request(&img.f_sub(&start)?)?),
            None => None,
        };
        Ok((per_request(&out)?, residuals))
    }

    /// One double-stream block of the packed mask-aware forward.
    #[allow(clippy::too_many_arguments)]
    fn masked_double_block(
        &self,
        i: usize,
        block: &DoubleBlock,
        phase: &Phase,
        requests: &[MaskedRequest],
        (img, txt): (&Tensor, &Tensor),
        cond: &super::Conditioning,
        mut keys: Option<&mut (dyn SpreadKeys + '_)>,
    ) -> Result<(Tensor, Tensor)> {
        let img_rows = |c: &Tensor| Phase::rows(&phase.img_rid, c);
        let txt_rows = |c: &Tensor| Phase::rows(&phase.txt_rid, c);
        let (img_mod, txt_mod) = block.mods(&cond.temb_silu, &img_rows, &txt_rows)?;
        let read = CacheRead {
            block: i,
            layer: CachedLayer::Double(block),
            cond,
        };
        let (qi, qt) = block.pre(img, txt, &img_mod, &txt_mod)?;
        if let Some(padded) = &phase.padded {
            let cat = |t: &Tensor, i: &Tensor| Tensor::f_cat(&[t, i], 0);
            let attn = padded.attend(
                &cat(&qt.q, &qi.q)?,
                &cat(&qt.k, &qi.k)?,
                &cat(&qt.v, &qi.v)?,
                self.cfg.attention_head_dim,
                |r| self.cached_kv_of(&read, r, &phase.prep[r], requests[r].cache),
            )?;
            let t = phase.total_txt;
            let attn_txt = attn.f_narrow(0, 0, t)?;
            let attn_img = attn.f_narrow(0, t, attn.size()[0] - t)?;
            return block.post(img, txt, &attn_img, &attn_txt, &img_mod, &txt_mod);
        }
        let mut out_txt = Vec::with_capacity(phase.prep.len());
        let mut out_img = Vec::with_capacity(phase.prep.len());
        for (r, (p, q)) in phase.prep.iter().zip(requests).enumerate() {
            let (to, mo) = (phase.layout.txt_off[r], phase.layout.img_off[r]);
            // Text then computed image rows of this request (small: T + M rows).
            let join = |t: &Tensor, m: &Tensor| -> Result<Tensor> {
                Ok(Tensor::f_cat(
                    &[t.f_narrow(0, to, p.txt)?, m.f_narrow(0, mo, p.masked)?],
                    0,
                )?)
            };
            let o = self.request_attention(
                &read,
                r,
                p,
                q.cache,
                Streams {
                    q: join(&qt.q, &qi.q)?,
                    k: join(&qt.k, &qi.k)?,
                    v: join(&qt.v, &qi.v)?,
                },
                keys.as_deref_mut(),
            )?;
            out_txt.push(o.f_narrow(0, 0, p.txt)?);
            out_img.push(o.f_narrow(0, p.txt, p.masked)?);
        }
        let (attn_img, attn_txt) = (cat_rows(&out_img)?, cat_rows(&out_txt)?);
        block.post(img, txt, &attn_img, &attn_txt, &img_mod, &txt_mod)
    }

    /// One single-stream block of the packed mask-aware forward (`x` = all text, then all image).
    #[allow(clippy::too_many_arguments)]
    fn masked_single_block(
        &self,
        b: usize,
        block: &SingleBlock,
        phase: &Phase,
        requests: &[MaskedRequest],
        x: &Tensor,
        cond: &super::Conditioning,
        mut keys: Option<&mut (dyn SpreadKeys + '_)>,
    ) -> Result<Tensor> {
        let all_rows = |c: &Tensor| Phase::rows(&phase.all_rid, c);
        let m = block.mods(&cond.temb_silu, &all_rows)?;
        let pre = block.pre(x, &m)?;
        let qkv = &pre.qkv;
        let read = CacheRead {
            block: b,
            layer: CachedLayer::Single(block),
            cond,
        };
        let attn = if phase.single_request() {
            self.request_attention(
                &read,
                0,
                &phase.prep[0],
                requests[0].cache,
                Streams {
                    q: qkv.q.shallow_clone(),
                    k: qkv.k.shallow_clone(),
                    v: qkv.v.shallow_clone(),
                },
                keys,
            )?
        } else if let Some(padded) = &phase.padded {
            padded.attend(&qkv.q, &qkv.k, &qkv.v, self.cfg.attention_head_dim, |r| {
                self.cached_kv_of(&read, r, &phase.prep[r], requests[r].cache)
            })?
        } else {
            let mut out_txt = Vec::with_capacity(phase.prep.len());
            let mut out_img = Vec::with_capacity(phase.prep.len());
            for (r, (p, q)) in phase.prep.iter().zip(requests).enumerate() {
                let (to, mo) = (
                    phase.layout.txt_off[r],
                    phase.total_txt + phase.layout.img_off[r],
                );
                let join = |t: &Tensor| -> Result<Tensor> {
                    Ok(Tensor::f_cat(
                        &[t.f_narrow(0, to, p.txt)?, t.f_narrow(0, mo, p.masked)?],
                        0,
                    )?)
                };
                let o = self.request_attention(
                    &read,
                    r,
                    p,
                    q.cache,
                    Streams {
                        q: join(&qkv.q)?,
                        k: join(&qkv.k)?,
                        v: join(&qkv.v)?,
                    },
                    keys.as_deref_mut(),
                )?;
                out_txt.push(o.f_narrow(0, 0, p.txt)?);
                out_img.push(o.f_narrow(0, p.txt, p.masked)?);
            }
            out_txt.extend(out_img);
            Tensor::f_cat(&out_txt, 0)?
        };
        block.post(x, &attn, &pre.mlp, &m)
    }

    /// Attention of one request: queries are its text + masked tokens; keys/values are its text
    /// tokens plus all N image tokens, fresh K/V at masked positions and cached K/V elsewhere.
    ///
    /// Requests are looped rather than packed into one block-diagonal call: SDPA on CPU (and the
    /// fused kernels on GPU) only skip work for a missing mask, so a block-diagonal mask would cost
    /// (sum of lengths)^2 and use the slow masked path, while a loop does exactly the per-request
    /// FLOPs. A varlen kernel (cumulative offsets) can replace this loop on GPU.
    ///
    /// Where the masked tokens are spread over ranks, `keys` completes this rank's fresh image
    /// keys and values with the other ranks' before they join the cached ones.
    fn request_attention(
        &self,
        read: &CacheRead,
        request: usize,
        p: &Prepared,
        cache: &dyn KvCache,
        s: Streams,
        keys: Option<&mut (dyn SpreadKeys + '_)>,
    ) -> Result<Tensor> {
        let head_dim = self.cfg.attention_head_dim;
        let q = p.rope.apply(&s.q)?;
        let k = p.rope.apply(&s.k)?;
        let v = to_heads(&s.v, head_dim)?;
        let (k, v) = match keys {
            Some(keys) => {
                let image = |x: &Tensor| x.f_narrow(0, p.txt, p.masked);
                let (ik, iv) = keys.gather(request, &image(&k)?, &image(&v)?)?;
                let text = |x: &Tensor| x.f_narrow(0, 0, p.txt);
                (
                    Tensor::f_cat(&[&text(&k)?, &ik], 0)?,
                    Tensor::f_cat(&[&text(&v)?, &iv], 0)?,
                )
            }
            None => (k, v),
        };
        let (k, v) = if let Some(order) = &p.token_order {
            // The computed rows are the whole key set. Put them in token order anyway: key order
            // does not change the math but does change float rounding, and in token order the
            // result matches the full forward's.
            (gather_rows(&k, order)?, gather_rows(&v, order)?)
        } else {
            let (ck, cv) = self.cached_kv(read, request, p, cache)?;
            // Cached rows at `T..T + N`, then the fresh rows written over their positions; text
            // rows are among the fresh ones, so every row of the buffer is written.
            let size = [p.txt + p.img, k.size()[1], head_dim];
            let opts = (k.kind(), k.device());
            let mut kb = Tensor::f_empty(size, opts)?;
            let mut vb = Tensor::f_empty(size, opts)?;
            merge_rows_(&mut kb, p.txt, &ck, p.key_rows(), &k)?;
            merge_rows_(&mut vb, p.txt, &cv, p.key_rows(), &v)?;
            (kb, vb)
        };
        let o = attention(&q.f_unsqueeze(0)?, &k.f_unsqueeze(0)?, &v.f_unsqueeze(0)?)?;
        Ok(o.f_squeeze_dim(0)?)
    }

    /// Validate one request and precompute its positions and RoPE rows; `full` prepares the
    /// full-prefix phase (every image token computed, no cache read); `shard` (start, length)
    /// computes only those of the request's masked tokens, the others' keys coming from ranks.
    fn prepare(
        &self,
        r: usize,
        q: &MaskedRequest,
        device: Device,
        full: bool,
        shard: Option<(i64, i64)>,
    ) -> Result<Prepared> {
        let cfg = &self.cfg;
        let field = |name: &str| format!("requests[{r}].{name}");
        let hs = q.hidden_states.size();
        if hs.len() != 2 || hs[1] != cfg.in_channels {
            return Err(ModelError::input(
                field("hidden_states"),
                format!("expected [M, {}], got {hs:?}", cfg.in_channels),
            ));
        }
        let es = q.encoder_hidden_states.size();
        if es.len() != 2 || es[1] != cfg.joint_attention_dim {
            return Err(ModelError::input(
                field("encoder_hidden_states"),
                format!("expected [T, {}], got {es:?}", cfg.joint_attention_dim),
            ));
        }
        let ps = q.pooled_projections.size();
        if ps.iter().product::<i64>() != cfg.pooled_projection_dim || ps.len() > 2 {
            return Err(ModelError::input(
                field("pooled_projections"),
                format!("expected [{}], got {ps:?}", cfg.pooled_projection_dim),
            ));
        }
        let (m, t) = (hs[0], es[0]);
        let axes = cfg.axes_dims_rope.len() as i64;
        let img_ids = ids_2d(
            &field("img_ids"),
            &q.img_ids,
            q.img_ids.size().first().copied().unwrap_or(0),
            axes,
        )?;
        let n = img_ids.size()[0];
        let txt_ids = ids_2d(&field("txt_ids"), &q.txt_ids, t, axes)?;
        let index = check_token_index(&field("token_index"), &q.token_index, n, device)?;
        if let (true, Some(h)) = (full && m < n, &q.full_hidden_states) {
            if h.size() != [n, cfg.in_channels] {
                return Err(ModelError::input(
                    field("full_hidden_states"),
                    format!("expected [{n}, {}], got {:?}", cfg.in_channels, h.size()),
                ));
            }
        }
        if index.size()[0] != m {
            return Err(ModelError::input(
                field("token_index"),
                format!(
                    "has {} entries but hidden_states has {m} tokens",
                    index.size()[0]
                ),
            ));
        }
        for (name, v) in [("timestep", Some(q.timestep)), ("guidance", q.guidance)] {
            if let Some(v) = v {
                if !v.is_finite() {
                    return Err(ModelError::input(
                        field(name),
                        format!("must be finite, got {v}"),
                    ));
                }
            }
        }
        // A cache may mix formats block by block (the three-way planner's plans): prepare
        // what every format it holds needs.
        let formats = q.cache.formats();
        let reads = |f: KvFormat| formats.contains(&f);
        let all_masked = full || m == n;
        let (index, m, key_index) = match (full, shard) {
            (true, _) => (Tensor::f_arange(n, (Kind::Int64, device))?, n, None),
            (false, Some((start, len))) if start >= 0 && len >= 0 && start + len <= m => {
                (index.f_narrow(0, start, len)?, len, Some(index))
            }
            (false, Some(bad)) => {
                return Err(ModelError::input(
                    field("token_index"),
                    format!("shard {bad:?} outside the {m} masked tokens"),
                ))
            }
            (false, None) => (index, m, None),
        };
        // RoPE tables only for the rows that need them: the computed tokens always, all N image
        // tokens only when a raw cache is read.
        let img_ids = img_ids.f_to_device(device)?;
        let q_ids = Tensor::f_cat(
            &[
                &txt_ids.f_to_device(device)?.f_to_kind(img_ids.kind())?,
                &img_ids.f_index_select(0, &index)?,
            ],
            0,
        )?;
        let rope = Rope::new(&q_ids, &cfg.axes_dims_rope)?;
        let unmasked = match reads(KvFormat::Hidden) {
            // The whole request's masked tokens (every rank's), complemented on the host: no
            // device sync in `nonzero`.
            true if !all_masked => {
                let masked = Vec::<i64>::try_from(
                    q.token_index
                        .f_to_device(Device::Cpu)?
                        .f_to_kind(Kind::Int64)?
                        .f_reshape([-1])?,
                )?;
                let mut keep = vec![true; n as usize];
                for &i in &masked {
                    // `check_token_index` has checked the range.
                    if let Some(k) = keep.get_mut(i as usize) {
                        *k = false;
                    }
                }
                let rows: Vec<i64> = (0..n).filter(|&i| keep[i as usize]).collect();
                Some(Tensor::f_from_slice(&rows)?.f_to_device(device)?)
            }
            _ => None,
        };
        let rope_all = match reads(KvFormat::Raw) && !all_masked {
            true => Some(Rope::new(&img_ids, &cfg.axes_dims_rope)?),
            false => None,
        };
        let rope_unmasked = match &unmasked {
            Some(rows) => Some(Rope::new(
                &img_ids.f_index_select(0, rows)?,
                &cfg.axes_dims_rope,
            )?),
            None => None,
        };
        let joint_rows = |index: &Tensor| -> Result<Tensor> {
            Ok(Tensor::f_cat(
                &[
                    &Tensor::f_arange(t, (Kind::Int64, device))?,
                    &index.f_add_scalar(t)?,
                ],
                0,
            )?)
        };
        let rows = joint_rows(&index)?;
        let key_rows = key_index.as_ref().map(joint_rows).transpose()?;
        // The fresh key rows are a permutation of `0..T + N` when every token is computed; its
        // inverse puts them back in token order.
        let token_order = if all_masked {
            Some(key_rows.as_ref().unwrap_or(&rows).f_argsort(0, false)?)
        } else {
            None
        };
        Ok(Prepared {
            token_order,
            key_rows,
            txt: t,
            masked: m,
            img: n,
            index,
            rows,
            rope,
            rope_all,
            rope_unmasked,
            unmasked,
        })
    }
}

/// The joint stream `x` (all text rows, then the packed image rows of phase `from`) with its image
/// rows narrowed to phase `to`'s computed tokens.
fn switch_joint(from: &Phase, to: &Phase, x: &Tensor) -> Result<Tensor> {
    let t = from.total_txt;
    let img = x.f_narrow(0, t, x.size()[0] - t)?;
    Ok(Tensor::f_cat(
        &[&x.f_narrow(0, 0, t)?, &Phase::select_img(from, to, &img)?],
        0,
    )?)
}

/// One request's rows of the projections in a block: text, then masked image tokens.
struct Streams {
    /// `[T + M, H, D]` after `norm_q`/`norm_added_q`, before RoPE.
    q: Tensor,
    /// `[T + M, H, D]` after `norm_k`/`norm_added_k`, before RoPE.
    k: Tensor,
    /// `[T + M, inner]` raw.
    v: Tensor,
}

/// Guidance of every request as `[R]`, or `None` when no request has one; a mix is an error.
fn guidance_tensor(requests: &[MaskedRequest], device: Device) -> Result<Option<Tensor>> {
    let given: Vec<f32> = requests
        .iter()
        .filter_map(|q| q.guidance.map(|g| g as f32))
        .collect();
    if given.is_empty() {
        return Ok(None);
    }
    if given.len() != requests.len() {
        return Err(ModelError::input(
            "guidance",
            "either every request or none must carry guidance",
        ));
    }
    let g = Tensor::f_from_slice(&given)?.f_to_device(device)?;
    check_batch_vector("guidance", &g, requests.len() as i64)?;
    Ok(Some(g))
}
