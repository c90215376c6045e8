//! The mask-aware K/V cache interface: what `forward_capture` hands out and `forward_masked` reads.
//!
//! Two formats, chosen by the capture caller (`KvSink::format`) and carried with the cache
//! (`KvCache::format`). Both are `[N, inner]` per block (token-major, heads flattened), so one
//! storage path serves both:
//! - `Raw`: the `to_k`/`to_v` projections before QK RMSNorm and RoPE (what FlashPS caches). The
//!   edit re-applies `norm_k` and RoPE to all N cached keys in every block.
//! - `Prepared`: K after `norm_k` and RoPE, V unchanged. Both are per-token and depend only on the
//!   token's own projection and position, never on the request, so for the unmasked tokens of the
//!   same (template, step) they equal what the edit would compute: caching them is exact and saves
//!   the per-block norm + RoPE over N rows.
use crate::error::{ModelError, Result};
use tch::Tensor;

/// Layout of cached keys; values are the raw `to_v` rows in both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// Keys are raw `to_k` rows (before `norm_k` and RoPE).
    #[default]
    Raw,
    /// Keys are `rope(norm_k(to_k))` rows at the token's own position.
    Prepared,
}

/// Receives the captured image-token K/V of each block (`[N, inner]` each, in `format()`) during
/// `forward_capture`; the caller decides where they go (memory, cachestore, disk).
pub trait KvSink {
    fn put(&mut self, block: usize, k: &Tensor, v: &Tensor) -> Result<()>;

    /// Which key format this sink wants; `Raw` unless overridden.
    fn format(&self) -> KvFormat {
        KvFormat::Raw
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
pub trait KvCache {
    fn block_kv(&self, block: usize) -> Result<(Tensor, Tensor)>;

    /// The key format of the tensors `block_kv` returns; `Raw` unless overridden.
    fn format(&self) -> KvFormat {
        KvFormat::Raw
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
}
