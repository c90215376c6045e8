//! Attention of a packed mask-aware batch in one fused call.
//!
//! The per-request loop of the mask-aware forward does exactly each request's FLOPs, but on a GPU
//! it launches a dozen small kernels per request per block; measured on an H100 (docs/BENCHMARKS.md,
//! "FlashPS engine on a GPU") a packed batch of 8 medium-config requests ran 2.6x slower than the
//! full forward of the same 8. Requests of one resolution and text length share the key length
//! (text + all N image tokens), so their attention can be one batched call: queries padded to the
//! longest request (the padded rows are computed and dropped), keys and values assembled for every
//! request in one buffer by one copy of each cached block and one indexed write of all fresh rows.
//! RoPE runs once over the packed rows. The price is the padded query rows' attention FLOPs, which
//! a CPU pays in full: there the loop stays the default.
use super::blocks::{attention, to_heads};
use super::embeddings::Rope;
use crate::error::Result;
use tch::{Device, Kind, Tensor};

/// How the mask-aware forward runs attention when a batch holds several requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MaskedAttention {
    /// One padded call on a CUDA device, the per-request loop elsewhere.
    #[default]
    Auto,
    /// One attention call per request (no padding).
    PerRequest,
    /// One padded call wherever the requests share their key length.
    Padded,
}

impl MaskedAttention {
    pub fn parse(s: &str) -> std::result::Result<Self, &'static str> {
        match s {
            "auto" => Ok(Self::Auto),
            "per-request" => Ok(Self::PerRequest),
            "padded" => Ok(Self::Padded),
            _ => Err("auto, per-request or padded"),
        }
    }

    fn pads_on(self, device: Device) -> bool {
        match self {
            Self::Auto => device.is_cuda(),
            Self::PerRequest => false,
            Self::Padded => true,
        }
    }
}

/// What the padded call needs of one request: its text and computed image token counts, N, the
/// computed tokens' rows in its text-then-image key sequence, and their RoPE rows.
pub(super) struct RequestRows<'a> {
    pub txt: i64,
    pub masked: i64,
    pub img: i64,
    pub rows: &'a Tensor,
    pub rope: &'a Rope,
}

/// Where every packed row (all requests' text rows, then all their computed image rows, the
/// order of the mask-aware forward's streams) goes in the padded query and key buffers.
pub(super) struct PaddedLayout {
    requests: i64,
    /// Longest query sequence (text + computed image tokens) of the batch.
    longest: i64,
    txt: i64,
    img: i64,
    /// RoPE rows in packed order.
    rope: Rope,
    /// Row of each packed row in the `[requests * longest]` query buffer.
    q_slot: Tensor,
    /// Row of each packed row in the `[requests * (txt + img)]` key/value buffer.
    kv_slot: Tensor,
}

impl PaddedLayout {
    /// The layout of a batch, or `None` where the loop runs: one request, a mode that does not
    /// pad on this device, or requests whose key sequences differ in length.
    pub fn new(
        reqs: &[RequestRows],
        mode: MaskedAttention,
        device: Device,
    ) -> Result<Option<Self>> {
        let Some(first) = reqs.first() else {
            return Ok(None);
        };
        let (txt, img) = (first.txt, first.img);
        if reqs.len() < 2
            || !mode.pads_on(device)
            || reqs.iter().any(|r| r.txt != txt || r.img != img)
        {
            return Ok(None);
        }
        let longest = reqs.iter().map(|r| r.txt + r.masked).max().unwrap_or(0);
        let seq = txt + img;
        let (mut q_slot, mut kv_slot, mut freqs) = (vec![], vec![], vec![]);
        // Text rows of every request, then image rows of every request.
        for image in [false, true] {
            for (r, req) in reqs.iter().enumerate() {
                let (start, len) = if image {
                    (req.txt, req.masked)
                } else {
                    (0, req.txt)
                };
                let r = r as i64;
                let at = Tensor::f_arange_start(start, start + len, (Kind::Int64, device))?;
                q_slot.push(at.f_add_scalar(r * longest)?);
                kv_slot.push(req.rows.f_narrow(0, start, len)?.f_add_scalar(r * seq)?);
                freqs.push(req.rope.freqs.f_narrow(0, start, len)?);
            }
        }
        Ok(Some(Self {
            requests: reqs.len() as i64,
            longest,
            txt,
            img,
            rope: Rope {
                freqs: Tensor::f_cat(&freqs, 0)?,
            },
            q_slot: Tensor::f_cat(&q_slot, 0)?,
            kv_slot: Tensor::f_cat(&kv_slot, 0)?,
        }))
    }

    /// Attention of every packed row: `q`, `k` are `[rows, H, D]` normed and not yet rotated, `v`
    /// is `[rows, inner]`; `cached(r)` gives request `r`'s cached image K/V as `[N, H, D]` (keys
    /// ready to use), or `None` when every one of its image tokens is computed. Returns
    /// `[rows, inner]` in packed order.
    pub fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        head_dim: i64,
        mut cached: impl FnMut(usize) -> Result<Option<(Tensor, Tensor)>>,
    ) -> Result<Tensor> {
        let q = self.rope.apply(q)?;
        let k = self.rope.apply(k)?;
        let v = to_heads(v, head_dim)?;
        let (heads, opts) = (q.size()[1], (q.kind(), q.device()));
        let (b, seq) = (self.requests, self.txt + self.img);
        let mut qb = Tensor::f_zeros([b * self.longest, heads, head_dim], opts)?;
        let _ = qb.f_index_copy_(0, &self.q_slot, &q)?;
        let kb = Tensor::f_empty([b, seq, heads, head_dim], opts)?;
        let vb = Tensor::f_empty([b, seq, heads, head_dim], opts)?;
        for r in 0..b {
            // Cached rows first: the fresh rows written below replace those at masked positions.
            if let Some((ck, cv)) = cached(r as usize)? {
                kb.f_get(r)?.f_narrow(0, self.txt, self.img)?.f_copy_(&ck)?;
                vb.f_get(r)?.f_narrow(0, self.txt, self.img)?.f_copy_(&cv)?;
            }
        }
        let _ = kb
            .f_view([b * seq, heads, head_dim])?
            .f_index_copy_(0, &self.kv_slot, &k)?;
        let _ = vb
            .f_view([b * seq, heads, head_dim])?
            .f_index_copy_(0, &self.kv_slot, &v)?;
        let o = attention(&qb.f_view([b, self.longest, heads, head_dim])?, &kb, &vb)?;
        Ok(o.f_reshape([b * self.longest, heads * head_dim])?
            .f_index_select(0, &self.q_slot)?)
    }
}
