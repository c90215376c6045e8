//! A UNet template step's cache ([`UNetTemplateCache`]) as blocks of the cache tiers' codec
//! (`flux::kv_codec`), so the cachestore, its tiers and the denoiser's loaders carry UNet caches
//! as they carry Flux's. Per `Transformer2DModel`, in forward order: one block per layer (its
//! self-attention keys and values, `[R * H * W, C]` for the template's `R` rows), then one for
//! its output, whose "K" and "V" are the output's first and second channel halves (the codec
//! stores pairs; halving stores each value once). Decoding needs each transformer's layer count
//! ([`super::UNet2DConditionModel::transformer_layers`]) and `R`; tokens and channels come from
//! the blocks' headers.
use super::attention::CapturedTransformer;
use super::masked::UNetTemplateCache;
use crate::error::{ModelError, Result};
use crate::flux::kv_codec::{decode_block, encode_block, CacheDtype};
use crate::flux::KvFormat;
use tch::{Kind, Tensor};

/// The blocks of one step's cache, stored in `dtype`.
pub fn encode_step(cache: &UNetTemplateCache, dtype: CacheDtype) -> Result<Vec<Vec<u8>>> {
    let mut blocks = Vec::new();
    for t in &cache.transformers {
        let flat = |x: &Tensor| -> Result<Tensor> {
            let c = x.size().last().copied().unwrap_or(0);
            Ok(x.f_reshape([-1, c])?)
        };
        for (k, v) in &t.kv {
            blocks.push(encode_block(&flat(k)?, &flat(v)?, KvFormat::Raw, dtype)?);
        }
        let out = flat(&t.out)?;
        let c = out.size()[1];
        if c % 2 != 0 {
            return Err(ModelError::input(
                "cache",
                format!("an output of {c} channels does not halve"),
            ));
        }
        let halves = out.f_split(c / 2, 1)?;
        blocks.push(encode_block(&halves[0], &halves[1], KvFormat::Raw, dtype)?);
    }
    Ok(blocks)
}

/// The cache of one step from its `blocks`, for a UNet whose transformers have `layers` layers
/// each, captured with `rows` rows, as tensors of `kind` on the CPU.
pub fn decode_step(
    blocks: &[&[u8]],
    layers: &[usize],
    rows: i64,
    kind: Kind,
) -> Result<UNetTemplateCache> {
    let expected: usize = layers.iter().map(|l| l + 1).sum();
    if blocks.len() != expected {
        return Err(ModelError::input(
            "cache",
            format!(
                "{} blocks for transformers of {layers:?} layers ({expected} blocks)",
                blocks.len()
            ),
        ));
    }
    if rows < 1 {
        return Err(ModelError::input("cache", format!("{rows} rows")));
    }
    let unflat = |x: Tensor| -> Result<Tensor> {
        let s = x.size();
        if s[0] % rows != 0 {
            return Err(ModelError::input(
                "cache",
                format!("a block of {} tokens for {rows} rows", s[0]),
            ));
        }
        Ok(x.f_reshape([rows, s[0] / rows, s[1]])?)
    };
    let mut next = blocks.iter();
    let mut transformers = Vec::with_capacity(layers.len());
    for &n in layers {
        let mut kv = Vec::with_capacity(n);
        for _ in 0..n {
            let (k, v, _) = decode_block(next.next().copied().unwrap_or_default(), kind)?;
            kv.push((unflat(k)?, unflat(v)?));
        }
        let (first, second, _) = decode_block(next.next().copied().unwrap_or_default(), kind)?;
        let out = unflat(Tensor::f_cat(&[&first, &second], 1)?)?;
        if let Some((k, _)) = kv.first() {
            if k.size() != out.size() {
                return Err(ModelError::input(
                    "cache",
                    format!("keys {:?} beside an output {:?}", k.size(), out.size()),
                ));
            }
        }
        transformers.push(CapturedTransformer { kv, out });
    }
    Ok(UNetTemplateCache { transformers })
}
