//! FlashPS's mask-aware forward for UNets (paper §3, issue 48 point 5). The resnets compute in
//! full (convolutions need every neighbour; they are about a fifth of SDXL's FLOPs); each
//! `Transformer2DModel` computes only the masked tokens of its resolution level, their
//! self-attention reading the template's cached keys and values for the other tokens, and
//! hands on the template's cached output at those tokens.
//!
//! A template's forward ([`UNet2DConditionModel::forward_capture`]) records, for every
//! `Transformer2DModel` in the order the forward meets them (down levels, mid block, up levels),
//! each block's self-attention keys and values and the output ([`CapturedTransformer`]). An
//! edit ([`UNet2DConditionModel::forward_masked`]) gives the latent mask; a level's mask is a
//! token masked where any latent pixel under it is (max-pooled by 2 per level, as the
//! downsamplers halve the side rounding up). With every token masked no cache is read and the
//! result is the full forward's.
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

/// Mask-aware, reading the template's caches in order.
struct Masked<'a> {
    /// `(side, index of the masked tokens)` per resolution level.
    levels: Vec<([i64; 2], Tensor)>,
    cache: &'a UNetTemplateCache,
    next: usize,
}

impl AttentionPass for Masked<'_> {
    fn run(&mut self, t: &Transformer2D, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let s = x.size();
        let side = [s[2], s[3]];
        let index = self
            .levels
            .iter()
            .find(|(l, _)| *l == side)
            .map(|(_, i)| i)
            .ok_or_else(|| {
                ModelError::input(
                    "mask",
                    format!("no level of the mask has the side {side:?}"),
                )
            })?;
        let cache = self.cache.transformers.get(self.next).ok_or_else(|| {
            ModelError::input(
                "cache",
                format!(
                    "holds {} transformers; this UNet has more",
                    self.cache.transformers.len()
                ),
            )
        })?;
        self.next += 1;
        if index.size()[0] == s[2] * s[3] {
            // Every token masked: the transformer in full, no cache read.
            return t.forward(x, context);
        }
        t.forward_masked(x, context, index, cache)
    }
}

/// A template's step: what every `Transformer2DModel` of the UNet left its edits.
#[derive(Debug)]
pub struct UNetTemplateCache {
    pub transformers: Vec<CapturedTransformer>,
}

impl UNetTemplateCache {
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
    /// The forward of a template (row 0 is recorded), and its cache.
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

    /// The mask-aware forward of an edit of the template `cache` was captured from, at the same
    /// step: `mask` `[H, W]` over the latents (true or 1: repainted), the same for every row.
    pub fn forward_masked(
        &self,
        x: &UNetInputs,
        mask: &Tensor,
        cache: &UNetTemplateCache,
    ) -> Result<Tensor> {
        let s = x.sample.size();
        let side = [
            s.get(2).copied().unwrap_or(0),
            s.get(3).copied().unwrap_or(0),
        ];
        if mask.size() != side {
            return Err(ModelError::input(
                "mask",
                format!("expected the latents' side {side:?}, got {:?}", mask.size()),
            ));
        }
        let (device, _) = self.device_kind();
        let mut m = mask
            .f_to_device(device)?
            .f_to_kind(Kind::Float)?
            .f_gt(0.5)?
            .f_to_kind(Kind::Float)?
            .f_view([1, 1, side[0], side[1]])?;
        if i64::try_from(m.f_sum(Kind::Int64)?)? == 0 {
            return Err(ModelError::input("mask", "masks no token"));
        }
        let mut levels = Vec::new();
        for _ in 0..self.config.block_out_channels.len() {
            let ms = m.size();
            let index = m.f_view([-1])?.f_nonzero()?.f_view([-1])?;
            levels.push(([ms[2], ms[3]], index));
            m = m.f_max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], true)?;
        }
        let mut pass = Masked {
            levels,
            cache,
            next: 0,
        };
        let out = self.forward_with(x, None, &mut pass)?;
        if pass.next != cache.transformers.len() {
            return Err(ModelError::input(
                "cache",
                format!(
                    "holds {} transformers, this UNet has {}",
                    cache.transformers.len(),
                    pass.next
                ),
            ));
        }
        Ok(out)
    }
}
