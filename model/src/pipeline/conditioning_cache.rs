//! Conditioning that requests can share: a prompt's text embeddings, a template's encoded
//! latents and its seeded noise. Preparing a request runs the text encoder, (for edits) the
//! image encoder and the noise draw on the engine's step loop; on a full-size Flux those are
//! T5-XXL, CLIP and the VAE encoder, tens of milliseconds that every running request waits for.
//! Edits of one template usually repeat its prompt and always its image and noise, so an engine
//! that keeps them pays them once per template.
//!
//! Entries are bounded in bytes and evicted least recently used. Values are shared by shallow
//! clones: nothing downstream writes into them (the stepper only reads them).
use super::{FluxPipeline, Prepared};
use crate::components::TextEmbeddings;
use crate::error::Result;
use crate::packing::pack_latents;
use lru::LruCache;
use std::borrow::Borrow;
use std::hash::Hash;
use tch::{Device, Kind, Tensor};

/// Hits and misses of one kind of entry, and its resident bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReuseCounts {
    pub hits: u64,
    pub misses: u64,
    pub bytes: u64,
}

/// What [`ConditioningCache`] has served, per kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConditioningCounts {
    pub prompts: ReuseCounts,
    pub template_latents: ReuseCounts,
    pub template_noise: ReuseCounts,
}

/// A least-recently-used map whose capacity is a byte budget.
struct ByteLru<K: Hash + Eq, V> {
    entries: LruCache<K, (V, u64)>,
    budget: u64,
    counts: ReuseCounts,
}

impl<K: Hash + Eq, V> ByteLru<K, V> {
    fn new(budget: u64) -> Self {
        Self {
            entries: LruCache::unbounded(),
            budget,
            counts: ReuseCounts::default(),
        }
    }

    fn get<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        let hit = self.entries.get(key).map(|(v, _)| v);
        match hit {
            Some(_) => self.counts.hits += 1,
            None => self.counts.misses += 1,
        }
        hit
    }

    /// Keeps `value` unless it alone exceeds the budget; evicts the least recently used
    /// entries until the rest fits.
    fn put(&mut self, key: K, value: V, bytes: u64) {
        if bytes > self.budget {
            return;
        }
        if let Some((_, old)) = self.entries.put(key, (value, bytes)) {
            self.counts.bytes -= old;
        }
        self.counts.bytes += bytes;
        while self.counts.bytes > self.budget {
            match self.entries.pop_lru() {
                Some((_, (_, b))) => self.counts.bytes -= b,
                None => break,
            }
        }
    }
}

fn tensor_bytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// Text embeddings by prompt, template latents by template content and template noise by seed
/// and shape. Prompts get half the byte budget and the template entries the other half, so a
/// stream of distinct prompts cannot evict the templates.
pub struct ConditioningCache {
    prompts: ByteLru<String, TextEmbeddings>,
    latents: ByteLru<(String, i64, i64), Tensor>,
    noise: ByteLru<(u64, i64, i64, i64), Tensor>,
}

impl ConditioningCache {
    /// A cache of at most `budget_bytes` in all; 0 keeps nothing (every lookup misses).
    pub fn new(budget_bytes: u64) -> Self {
        let templates = budget_bytes - budget_bytes / 2;
        Self {
            prompts: ByteLru::new(budget_bytes / 2),
            latents: ByteLru::new(templates / 2),
            noise: ByteLru::new(templates - templates / 2),
        }
    }

    pub fn counts(&self) -> ConditioningCounts {
        ConditioningCounts {
            prompts: self.prompts.counts,
            template_latents: self.latents.counts,
            template_noise: self.noise.counts,
        }
    }

    /// The embeddings of `prompt` on `device` in `kind`, encoded on a miss. Prompts are
    /// encoded one at a time, as the stepper does: a batch would pad them together.
    pub(crate) fn text(
        &mut self,
        p: &FluxPipeline<'_>,
        prompt: &str,
        device: Device,
        kind: Kind,
    ) -> Result<TextEmbeddings> {
        // One engine serves one model on one device in one dtype, so the prompt is the key.
        if let Some(e) = self.prompts.get(prompt) {
            return Ok(shallow(e));
        }
        let key = prompt.to_string();
        let e = super::embed(p, std::slice::from_ref(&key), device, kind)?;
        let bytes = tensor_bytes(&e.hidden) + tensor_bytes(&e.pooled);
        self.prompts.put(key, shallow(&e), bytes);
        Ok(e)
    }

    /// The packed latents of `template` (`[1, 3, H, W]`), encoded on a miss; `key` names the
    /// template's content (None: not shared, always encoded).
    pub(crate) fn template_latents(
        &mut self,
        p: &FluxPipeline<'_>,
        key: Option<&str>,
        template: &Tensor,
        kind: Kind,
    ) -> Result<Tensor> {
        let encode =
            || -> Result<Tensor> { pack_latents(&p.codec.encode(template)?.f_to_kind(kind)?) };
        let Some(key) = key else {
            return encode();
        };
        let size = template.size();
        let key = (key.to_string(), size[2], size[3]);
        if let Some(t) = self.latents.get(&key) {
            return Ok(t.shallow_clone());
        }
        let t = encode()?;
        let bytes = tensor_bytes(&t);
        self.latents.put(key, t.shallow_clone(), bytes);
        Ok(t)
    }

    /// The packed noise of a template's `seed` at `prep`'s latent size, drawn on a miss. Every
    /// edit of a template blends the template's noise in outside its mask; on a full-size model
    /// drawing it (seeded Box-Muller on the CPU) costs milliseconds per edit.
    pub(crate) fn template_noise(
        &mut self,
        prep: &Prepared,
        seed: u64,
        channels: i64,
    ) -> Result<Tensor> {
        let key = (seed, channels, prep.latent_h, prep.latent_w);
        if let Some(t) = self.noise.get(&key) {
            return Ok(t.shallow_clone());
        }
        let t = prep.noise(&[seed], channels)?;
        let bytes = tensor_bytes(&t);
        self.noise.put(key, t.shallow_clone(), bytes);
        Ok(t)
    }
}

fn shallow(e: &TextEmbeddings) -> TextEmbeddings {
    TextEmbeddings {
        hidden: e.hidden.shallow_clone(),
        pooled: e.pooled.shallow_clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_lru_evicts_least_recently_used_to_fit_the_budget() {
        let mut lru: ByteLru<u32, ()> = ByteLru::new(10);
        lru.put(1, (), 4);
        lru.put(2, (), 4);
        assert!(lru.get(&1).is_some()); // 2 is now the least recently used
        lru.put(3, (), 4);
        assert!(lru.get(&2).is_none());
        assert!(lru.get(&1).is_some() && lru.get(&3).is_some());
        assert_eq!(lru.counts.bytes, 8);
        assert_eq!((lru.counts.hits, lru.counts.misses), (3, 1));
    }

    #[test]
    fn byte_lru_skips_an_entry_larger_than_the_budget_and_replaces_in_place() {
        let mut lru: ByteLru<u32, u8> = ByteLru::new(10);
        lru.put(1, 1, 11);
        assert!(lru.get(&1).is_none());
        assert_eq!(lru.counts.bytes, 0);
        lru.put(1, 1, 6);
        lru.put(1, 2, 7);
        assert_eq!(lru.get(&1), Some(&2));
        assert_eq!(lru.counts.bytes, 7);
    }
}
