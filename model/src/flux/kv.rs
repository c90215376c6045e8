//! The mask-aware K/V cache interface: what `forward_capture` hands out and `forward_masked` reads.
//!
//! Three formats, chosen by the capture caller (`KvSink::format`) and carried with the cache
//! (`KvCache::format`). All are `[N, inner]` per block (token-major, heads flattened), so one
//! storage path serves them:
//! - `Raw`: the `to_k`/`to_v` projections before QK RMSNorm and RoPE (what FlashPS caches). The
//!   edit re-applies `norm_k` and RoPE to all N cached keys in every block.
//! - `Prepared`: K after `norm_k` and RoPE, V unchanged. Both are per-token and depend only on the
//!   token's own projection and position, never on the request, so for the unmasked tokens of the
//!   same (template, step) they equal what the edit would compute: caching them is exact and saves
//!   the per-block norm + RoPE over N rows.
//! - `Hidden`: FlashPS's Y cache (paper Fig. 5-Bottom): the block's input hidden stream at the
//!   image tokens, i.e. the previous block's output Y. One tensor instead of two, so half the
//!   bytes; the edit rebuilds the unmasked tokens' K/V from it with its own AdaLN row (LayerNorm,
//!   modulation, `to_k`/`to_v`: about a sixth of a block's per-token compute). Because the
//!   modulation is the edit's own, it is exact against `Prepared` when the conditioning matches
//!   and closer to full compute when it does not (another prompt's pooled embedding).
use crate::error::{ModelError, Result};
use tch::Tensor;

/// What a cache holds per block: keys and values (values are the raw `to_v` rows in both K/V
/// formats), or the block's input hidden stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// Keys are raw `to_k` rows (before `norm_k` and RoPE).
    #[default]
    Raw,
    /// Keys are `rope(norm_k(to_k))` rows at the token's own position.
    Prepared,
    /// The block's input hidden stream (FlashPS's Y); K/V are projected from it at read time.
    Hidden,
}

impl KvFormat {
    /// Tensors stored per block: two (K, V), or one (the hidden stream).
    pub fn parts(self) -> usize {
        match self {
            KvFormat::Raw | KvFormat::Prepared => 2,
            KvFormat::Hidden => 1,
        }
    }

    /// Compute spent per cached token to turn a block's cache into K/V, as a fraction of the
    /// block's compute per computed token: a hidden stream is LayerNorm-modulated and projected
    /// by `to_k` and `to_v`, 2 of the 12 `dim x dim` products a token costs in a Flux block
    /// (double: q, k, v, out and a 4x MLP; single: q, k, v, the 4x MLP in and the 5x out);
    /// K/V formats need at most a norm and RoPE, noise beside that.
    pub fn read_compute_per_token(self) -> f64 {
        match self {
            KvFormat::Raw | KvFormat::Prepared => 0.0,
            KvFormat::Hidden => 2.0 / 12.0,
        }
    }

    /// The name flags, metrics and reports use.
    pub fn as_str(self) -> &'static str {
        match self {
            KvFormat::Raw => "raw",
            KvFormat::Prepared => "prepared",
            KvFormat::Hidden => "hidden",
        }
    }

    /// Parse `raw|prepared|hidden` (`y`, the paper's name, is `hidden`).
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "raw" => KvFormat::Raw,
            "prepared" => KvFormat::Prepared,
            "hidden" | "y" => KvFormat::Hidden,
            other => {
                return Err(ModelError::input(
                    "cache_format",
                    format!("expected raw, prepared or hidden (y), got {other:?}"),
                ))
            }
        })
    }
}

/// Receives the captured image-token K/V of each block (`[N, inner]` each, in `format()`) during
/// `forward_capture`; the caller decides where they go (memory, cachestore, disk). A `Hidden`
/// sink gets the hidden stream as both `k` and `v` (the same tensor) and keeps one.
pub trait KvSink {
    fn put(&mut self, block: usize, k: &Tensor, v: &Tensor) -> Result<()>;

    /// Which key format this sink wants; `Raw` unless overridden.
    fn format(&self) -> KvFormat {
        KvFormat::Raw
    }

    /// Every format this sink keeps of each block, in the order `put_as` gets them: `format()`
    /// alone unless overridden (a sink keeping K/V and the hidden stream for the three-way
    /// planner).
    fn formats(&self) -> Vec<KvFormat> {
        vec![self.format()]
    }

    /// Block `block` in `format` (one of `formats()`); `put` unless overridden.
    fn put_as(&mut self, block: usize, _format: KvFormat, k: &Tensor, v: &Tensor) -> Result<()> {
        self.put(block, k, v)
    }
}

/// Adapts a closure into a `KvSink` (raw format).
pub struct FnSink<F>(pub F);

impl<F: FnMut(usize, &Tensor, &Tensor) -> Result<()>> KvSink for FnSink<F> {
    fn put(&mut self, block: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        (self.0)(block, k, v)
    }
}

/// Supplies one request's cached K/V per block (`[N, inner]` each, any dtype/device; they are
/// converted to the model's). Called once per block in order, so an implementation may load lazily.
/// A `Hidden` cache returns the hidden stream as `k` (and `v` is not read).
pub trait KvCache {
    fn block_kv(&self, block: usize) -> Result<(Tensor, Tensor)>;

    /// The key format of the tensors `block_kv` returns; `Raw` unless overridden.
    fn format(&self) -> KvFormat {
        KvFormat::Raw
    }

    /// The format of block `block`'s tensors: `format()`, unless the cache mixes formats
    /// block by block (a plan of K/V and hidden blocks).
    fn block_format(&self, _block: usize) -> KvFormat {
        self.format()
    }

    /// Every format `block_format` may answer (what a reader prepares for).
    fn formats(&self) -> Vec<KvFormat> {
        vec![self.format()]
    }
}

/// An in-memory cache of one (template, step): entry `i` is block `i` (double blocks, then single).
#[derive(Debug, Default)]
pub struct CapturedKv {
    pub blocks: Vec<(Tensor, Tensor)>,
    /// Asked for at capture, reported when read.
    pub format: KvFormat,
}

impl CapturedKv {
    /// An empty cache that captures (and later serves) keys in `format`.
    pub fn new(format: KvFormat) -> Self {
        Self {
            blocks: Vec::new(),
            format,
        }
    }
}

impl KvSink for CapturedKv {
    fn put(&mut self, block: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        if block != self.blocks.len() {
            return Err(ModelError::input(
                "cache",
                format!(
                    "blocks must arrive in order: expected {}, got {block}",
                    self.blocks.len()
                ),
            ));
        }
        // detach: a cache must not keep an autograd graph alive.
        self.blocks.push((k.f_detach()?, v.f_detach()?));
        Ok(())
    }

    fn format(&self) -> KvFormat {
        self.format
    }
}

impl KvCache for CapturedKv {
    fn block_kv(&self, block: usize) -> Result<(Tensor, Tensor)> {
        let (k, v) = self.blocks.get(block).ok_or_else(|| {
            ModelError::input(
                "cache",
                format!("block {block} missing (cache holds {})", self.blocks.len()),
            )
        })?;
        Ok((k.shallow_clone(), v.shallow_clone()))
    }

    fn format(&self) -> KvFormat {
        self.format
    }
}

/// One cache read by several requests of a forward (the two rows of a guided request): the
/// cache underneath still sees each block once, in order, as [`KvCache`] promises it; the
/// rows after the first get the block just read.
pub struct SharedBlockReads<'c> {
    inner: &'c dyn KvCache,
    last: std::cell::RefCell<Option<(usize, Tensor, Tensor)>>,
}

impl<'c> SharedBlockReads<'c> {
    pub fn new(inner: &'c dyn KvCache) -> Self {
        Self {
            inner,
            last: std::cell::RefCell::new(None),
        }
    }
}

impl KvCache for SharedBlockReads<'_> {
    fn block_kv(&self, block: usize) -> Result<(Tensor, Tensor)> {
        let mut last = self.last.borrow_mut();
        if let Some((b, k, v)) = last.as_ref() {
            if *b == block {
                return Ok((k.shallow_clone(), v.shallow_clone()));
            }
        }
        let (k, v) = self.inner.block_kv(block)?;
        *last = Some((block, k.shallow_clone(), v.shallow_clone()));
        Ok((k, v))
    }

    fn format(&self) -> KvFormat {
        self.inner.format()
    }

    fn block_format(&self, block: usize) -> KvFormat {
        self.inner.block_format(block)
    }

    fn formats(&self) -> Vec<KvFormat> {
        self.inner.formats()
    }
}
