//! Reading one block's cache in the mask-aware forward: cached rows to the model's device and
//! dtype, keys normed and rotated where the format stores them raw, and a hidden-stream cache
//! (FlashPS's Y) projected back to K/V under each request's own conditioning.
use super::{KvCache, KvFormat, Prepared};
use crate::error::{ModelError, Result};
use crate::flux::blocks::{to_heads, DoubleBlock, QkvProj, SingleBlock};
use crate::flux::{Conditioning, FluxTransformer};
use tch::{Device, Kind, Tensor};

/// The block whose cache a mask-aware forward reads, with what a hidden cache needs to become K/V.
pub(super) struct CacheRead<'a> {
    /// In cache order (double blocks, then single).
    pub(super) block: usize,
    pub(super) layer: CachedLayer<'a>,
    /// Every request's conditioning (`temb_silu` row `r` is request `r`'s).
    pub(super) cond: &'a Conditioning,
}

#[derive(Clone, Copy)]
pub(super) enum CachedLayer<'a> {
    Double(&'a DoubleBlock),
    Single(&'a SingleBlock),
}

impl CachedLayer<'_> {
    /// The image tokens' projections.
    fn proj(&self) -> &QkvProj {
        match self {
            CachedLayer::Double(b) => &b.img,
            CachedLayer::Single(b) => &b.attn,
        }
    }

    /// Raw K/V of a cached hidden stream under one request's conditioning row.
    fn hidden_kv(&self, temb_silu: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)> {
        match self {
            CachedLayer::Double(b) => b.hidden_kv(temb_silu, h),
            CachedLayer::Single(b) => b.hidden_kv(temb_silu, h),
        }
    }
}

impl FluxTransformer {
    /// [`Self::cached_kv`] of a request that reads its cache; `None` when it computes every token.
    pub(super) fn cached_kv_of(
        &self,
        read: &CacheRead,
        request: usize,
        p: &Prepared,
        cache: &dyn KvCache,
    ) -> Result<Option<(Tensor, Tensor)>> {
        if p.all_masked() {
            return Ok(None);
        }
        self.cached_kv(read, request, p, cache).map(Some)
    }

    /// One block's cached image K/V of request `request` as `[N, H, D]`, keys normed and
    /// rotated (by us for a raw cache; projected from the hidden stream first for a hidden one,
    /// at the unmasked tokens only: the masked rows are left zero, the caller writes the
    /// computed ones over them).
    pub(super) fn cached_kv(
        &self,
        read: &CacheRead,
        request: usize,
        p: &Prepared,
        cache: &dyn KvCache,
    ) -> Result<(Tensor, Tensor)> {
        let (device, kind) = self.device_kind();
        let (inner, head_dim) = (self.cfg.inner_dim(), self.cfg.attention_head_dim);
        let block = read.block;
        let (k, v) = cache.block_kv(block)?;
        let format = cache.block_format(block);
        let k = cached_rows("cache.k", block, k, p.img, inner, device, kind)?;
        let (k, v) = match (format, &p.unmasked) {
            (KvFormat::Hidden, Some(rows)) => {
                let temb_silu = read.cond.temb_silu.f_narrow(0, request as i64, 1)?;
                read.layer
                    .hidden_kv(&temb_silu, &k.f_index_select(0, rows)?)?
            }
            (KvFormat::Hidden, None) => {
                return Err(ModelError::input(
                    "cache",
                    "hidden cache read without its unmasked rows (internal error)",
                ))
            }
            _ => (
                k,
                cached_rows("cache.v", block, v, p.img, inner, device, kind)?,
            ),
        };
        let rope = match format {
            KvFormat::Raw => p.rope_all.as_ref(),
            KvFormat::Hidden => p.rope_unmasked.as_ref(),
            KvFormat::Prepared => None,
        };
        let k = match (format, rope) {
            (KvFormat::Prepared, _) => to_heads(&k, head_dim)?,
            (KvFormat::Raw | KvFormat::Hidden, Some(rope)) => {
                rope.apply(&read.layer.proj().norm_k(&k)?)?
            }
            (KvFormat::Raw | KvFormat::Hidden, None) => {
                return Err(ModelError::input(
                    "cache",
                    "raw cache read without image RoPE tables (internal error)",
                ))
            }
        };
        let v = to_heads(&v, head_dim)?;
        match (format, &p.unmasked) {
            (KvFormat::Hidden, Some(rows)) => {
                Ok((spread_rows(&k, rows, p.img)?, spread_rows(&v, rows, p.img)?))
            }
            _ => Ok((k, v)),
        }
    }
}

/// `x`'s rows at `rows` of an `[n, ...]` zero tensor.
fn spread_rows(x: &Tensor, rows: &Tensor, n: i64) -> Result<Tensor> {
    let mut size = x.size();
    size[0] = n;
    Ok(Tensor::f_zeros(size.as_slice(), (x.kind(), x.device()))?.f_index_copy(0, rows, x)?)
}

/// A cached `[N, inner]` tensor on the model's device and dtype; errors name block and field.
fn cached_rows(
    field: &str,
    block: usize,
    t: Tensor,
    n: i64,
    inner: i64,
    device: Device,
    kind: Kind,
) -> Result<Tensor> {
    let s = t.size();
    if s != [n, inner] {
        return Err(ModelError::input(
            field,
            format!("block {block}: expected [{n}, {inner}], got {s:?}"),
        ));
    }
    Ok(t.f_to_device(device)?.f_to_kind(kind)?)
}
