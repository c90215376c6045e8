//! FlashPS's mask-aware forward for UNets (paper §3, issue 48 point 5). The resnets compute in
//! full (convolutions need every neighbour; they are about a fifth of SDXL's FLOPs); each
//! `Transformer2DModel` computes only the masked tokens of its resolution level, their
//! self-attention reading the template's cached keys and values for the other tokens, and
//! hands on the template's cached output at those tokens.
//!
//! A template's forward ([`UNet2DConditionModel::forward_capture`]) records, for every
//! `Transformer2DModel` in the order the forward meets them (down levels, mid block, up levels),
//! each block's self-attention keys and values and the output ([`CapturedTransformer`]), of
//! every row (a guided template has two: negative and prompt). An edit
//! ([`UNet2DConditionModel::forward_masked`]) gives the latent mask, one for every row or one
//! per row, and each of its rows reads a row of a template's cache
//! ([`UNet2DConditionModel::forward_masked_rows`]: edits of different templates in one batch); a level's mask is a token masked where any latent pixel under it is
//! (max-pooled by 2 per level, as the downsamplers halve the side rounding up). Rows with
//! different masks run as one batch: each row's masked tokens are padded to the level's largest
//! count by repeating its first one (a repeated query gives the same output, and every row's
//! keys are the whole map, so the repeats change nothing). With every token of every row masked
//! no cache is read and the result is the full forward's.
use super::attention::{CapturedTransformer, Transformer2D};
use super::{UNet2DConditionModel, UNetInputs};
use crate::error::{ModelError, Result};
use tch::{Kind, Tensor};

/// How the forward runs each `Transformer2DModel` (in full, capturing, mask-aware).
pub trait AttentionPass {
    fn run(&mut self, t: &Transformer2D, x: &Tensor, context: &Tensor) -> Result<Tensor>;
}

/// In full (the plain forward).
pub struct Plain;

impl AttentionPass for Plain {
    fn run(&mut self, t: &Transformer2D, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        t.forward(x, context)
    }
}

/// In full, recording each transformer's cache.
struct Capture {
    captured: Vec<CapturedTransformer>,
}

impl AttentionPass for Capture {
    fn run(&mut self, t: &Transformer2D, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let (out, captured) = t.forward_capture(x, context)?;
        self.captured.push(captured);
        Ok(out)
    }
}

/// One resolution level's masked tokens.
struct LevelMask {
    side: [i64; 2],
    /// `[B, M]`: each row's masked token indices, padded to the level's largest count.
    index: Tensor,
    /// Every token of every row masked: the transformer runs in full.
    all_masked: bool,
}

/// Mask-aware, reading the templates' caches in order.
struct Masked<'a> {
    levels: Vec<LevelMask>,
    /// Per batch row: the cache it reads and the row of it.
    rows: &'a [(&'a UNetTemplateCache, i64)],
    /// The transformers of every cache (checked before the forward).
    transformers: usize,
    next: usize,
}

impl AttentionPass for Masked<'_> {
    fn run(&mut self, t: &Transformer2D, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let s = x.size();
        let side = [s[2], s[3]];
        let level = self.levels.iter().find(|l| l.side == side).ok_or_else(|| {
            ModelError::input(
                "mask",
                format!("no level of the mask has the side {side:?}"),
            )
        })?;
        if self.next >= self.transformers {
            return Err(ModelError::input(
                "cache",
                format!(
                    "holds {} transformers; this UNet has more",
                    self.transformers
                ),
            ));
        }
        let j = self.next;
        self.next += 1;
        if level.all_masked {
            // Every token masked: the transformer in full, no cache read.
            return t.forward(x, context);
        }
        let cached: Vec<_> = self
            .rows
            .iter()
            .map(|(cache, row)| (&cache.transformers[j], *row))
            .collect();
        t.forward_masked(x, context, &level.index, &cached)
    }
}

/// A template's step: what every `Transformer2DModel` of the UNet left its edits.
#[derive(Debug)]
pub struct UNetTemplateCache {
    pub transformers: Vec<CapturedTransformer>,
}

// SAFETY: a step's cache is written once, when captured or decoded, before it is shared;
// afterwards every use through `&UNetTemplateCache` is a read-only torch op (narrow, cat,
// conversion), which libtorch allows from several threads at once on one tensor (reference
// counts are atomic). `Tensor` is not `Sync` only because it wraps a raw pointer.
unsafe impl Sync for UNetTemplateCache {}

impl UNetTemplateCache {
    /// The template's rows (2 for a guided template: negative, then prompt).
    pub fn rows(&self) -> i64 {
        self.transformers.first().map_or(0, |t| t.rows())
    }

    /// Rows `start..start + len` alone (one request's rows of a batch's capture).
    pub fn narrow_rows(&self, start: i64, len: i64) -> Result<Self> {
        self.map(|t| Ok(t.f_narrow(0, start, len)?.f_contiguous()?))
    }

    /// The cache on `device` (a decoded cache comes to the host first).
    pub fn to_device(&self, device: tch::Device) -> Result<Self> {
        self.map(|t| Ok(t.f_to_device(device)?))
    }

    /// Every cached tensor through `f`.
    fn map(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            transformers: self
                .transformers
                .iter()
                .map(|c| {
                    Ok(CapturedTransformer {
                        kv: c
                            .kv
                            .iter()
                            .map(|(k, v)| Ok((f(k)?, f(v)?)))
                            .collect::<Result<_>>()?,
                        out: f(&c.out)?,
                    })
                })
                .collect::<Result<_>>()?,
        })
    }

    /// Bytes the cached tensors hold.
    pub fn bytes(&self) -> u64 {
        let of = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        self.transformers
            .iter()
            .map(|c| of(&c.out) + c.kv.iter().map(|(k, v)| of(k) + of(v)).sum::<u64>())
            .sum()
    }
}

impl UNet2DConditionModel {
    /// The forward of a template, and its cache (of every row).
    pub fn forward_capture(&self, x: &UNetInputs) -> Result<(Tensor, UNetTemplateCache)> {
        let mut pass = Capture {
            captured: Vec::new(),
        };
        let out = self.forward_with(x, None, &mut pass)?;
        Ok((
            out,
            UNetTemplateCache {
                transformers: pass.captured,
            },
        ))
    }

    /// The mask-aware forward of edits of the template `cache` was captured from, at the same
    /// step: `mask` over the latents (true or 1: repainted), `[H, W]` for every row or
    /// `[B, H, W]`, one per row. A cache of one row serves every row; a cache of `B` rows
    /// serves row for row (a guided step's negative and prompt rows).
    pub fn forward_masked(
        &self,
        x: &UNetInputs,
        mask: &Tensor,
        cache: &UNetTemplateCache,
    ) -> Result<Tensor> {
        let batch = x.sample.size().first().copied().unwrap_or(0);
        let rows: Vec<(&UNetTemplateCache, i64)> = match cache.rows() {
            1 => (0..batch).map(|_| (cache, 0)).collect(),
            r if r == batch => (0..batch).map(|row| (cache, row)).collect(),
            r => {
                return Err(ModelError::input(
                    "cache",
                    format!("a cache of {r} rows for a batch of {batch}"),
                ))
            }
        };
        self.forward_masked_rows(x, mask, &rows)
    }

    /// [`Self::forward_masked`] with batch row `r` reading row `rows[r].1` of the cache
    /// `rows[r].0`: edits of several templates, or of a template's rows, in one batch. A row
    /// whose mask covers every latent pixel computes in full and reads no cache.
    pub fn forward_masked_rows(
        &self,
        x: &UNetInputs,
        mask: &Tensor,
        rows: &[(&UNetTemplateCache, i64)],
    ) -> Result<Tensor> {
        let s = x.sample.size();
        let batch = s.first().copied().unwrap_or(0);
        let side = [
            s.get(2).copied().unwrap_or(0),
            s.get(3).copied().unwrap_or(0),
        ];
        let m = mask.size();
        let per_row = match m.len() {
            2 => false,
            3 if m[0] == batch => true,
            _ => {
                return Err(ModelError::input(
                    "mask",
                    format!(
                        "expected [{}, {}] or [{batch}, {}, {}], got {m:?}",
                        side[0], side[1], side[0], side[1]
                    ),
                ))
            }
        };
        if m[m.len() - 2..] != side {
            return Err(ModelError::input(
                "mask",
                format!("expected the latents' side {side:?}, got {m:?}"),
            ));
        }
        let (device, _) = self.device_kind();
        let mut m = mask
            .f_to_device(device)?
            .f_to_kind(Kind::Float)?
            .f_gt(0.5)?
            .f_to_kind(Kind::Float)?
            .f_view([-1, 1, side[0], side[1]])?;
        if !per_row {
            m = m.f_expand([batch, 1, side[0], side[1]], false)?;
        }
        let mut levels = Vec::new();
        for _ in 0..self.config.block_out_channels.len() {
            levels.push(level_mask(&m)?);
            m = m.f_max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], true)?;
        }
        if rows.len() as i64 != batch {
            return Err(ModelError::input(
                "cache",
                format!("{} cache rows for a batch of {batch}", rows.len()),
            ));
        }
        let transformers = rows.first().map_or(0, |(c, _)| c.transformers.len());
        if let Some((c, r)) = rows
            .iter()
            .find(|(c, r)| c.transformers.len() != transformers || !(0..c.rows()).contains(r))
        {
            return Err(ModelError::input(
                "cache",
                format!(
                    "row {r} of a cache of {} rows and {} transformers beside caches of {transformers}",
                    c.rows(),
                    c.transformers.len()
                ),
            ));
        }
        let mut pass = Masked {
            levels,
            rows,
            transformers,
            next: 0,
        };
        let out = self.forward_with(x, None, &mut pass)?;
        if pass.next != transformers {
            return Err(ModelError::input(
                "cache",
                format!(
                    "holds {transformers} transformers, this UNet has {}",
                    pass.next
                ),
            ));
        }
        Ok(out)
    }
}

/// The masked tokens of one level's mask `[B, 1, H, W]` (0 or 1), each row's padded to the
/// largest count by repeating its first.
fn level_mask(m: &Tensor) -> Result<LevelMask> {
    let s = m.size();
    let (rows, tokens) = (s[0], s[2] * s[3]);
    let flat = m.f_reshape([rows, tokens])?;
    let counts = flat.f_sum_dim_intlist(1, false, Kind::Int64)?;
    let fewest = i64::try_from(counts.f_min()?)?;
    if fewest == 0 {
        let row = i64::try_from(counts.f_argmin(None, false)?)?;
        return Err(ModelError::input(
            "mask",
            format!("row {row} masks no token"),
        ));
    }
    let most = i64::try_from(counts.f_max()?)?;
    // A stable descending sort puts each row's masked tokens first, in token order.
    let order = flat.f_argsort_stable(true, 1, true)?.f_narrow(1, 0, most)?;
    let filled = Tensor::f_arange(most, (Kind::Int64, m.device()))?
        .f_unsqueeze(0)?
        .f_lt_tensor(&counts.f_unsqueeze(1)?)?;
    let first = order.f_narrow(1, 0, 1)?.f_expand([rows, most], false)?;
    Ok(LevelMask {
        side: [s[2], s[3]],
        index: order.f_where_self(&filled, &first)?,
        all_masked: fewest == tokens,
    })
}
