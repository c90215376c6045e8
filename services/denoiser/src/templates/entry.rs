//! One template's cache as the denoiser holds it (encoded step entries, shared read-only between
//! the NATS side and the loader thread), and the local tier: a byte-weighed LRU of such caches.
use super::gpu_copy::GpuCopy;
use super::layout::CacheLayout;
use diffmesh_model::flux::kv_codec::{read_header, BlobHeader};
use diffmesh_model::flux::KvFormat;
use diffmesh_shared::wire::templates::{step_block_ranges, CacheMeta};
use std::ops::Range;
use std::sync::Arc;

/// A whole template cache: one encoded entry per step, each holding every block (every block
/// once per format of its layout: all blocks in the first format, then all in the second).
#[derive(Debug)]
pub struct TemplateEntry {
    pub meta: CacheMeta,
    pub layout: CacheLayout,
    steps: Vec<bytes::Bytes>,
    ranges: Vec<Vec<Range<usize>>>,
}

impl TemplateEntry {
    /// Check the entries against the metadata: step and block counts, every block's header, one
    /// shape and format throughout each layer. A damaged cache is refused here, not mid-step.
    pub fn new(meta: CacheMeta, steps: Vec<bytes::Bytes>) -> Result<Self, String> {
        if steps.len() != meta.steps as usize {
            return Err(format!(
                "cache {} has {} step entries, its metadata says {}",
                meta.cache_key,
                steps.len(),
                meta.steps
            ));
        }
        let mut ranges = Vec::with_capacity(steps.len());
        // Block `b` of every step has the first step's block `b` shape; each layer's blocks
        // share one format and dtype (a UNet's blocks differ in shape level by level, a Flux
        // model's do not).
        let blocks = meta.blocks as usize;
        let mut first_step: Vec<BlobHeader> = Vec::new();
        for (s, entry) in steps.iter().enumerate() {
            let r = step_block_ranges(entry).map_err(|e| format!("step {s}: {e}"))?;
            if r.is_empty() || r.len() % blocks.max(1) != 0 || r.len() > 2 * blocks {
                return Err(format!(
                    "step {s} has {} blocks, the metadata says {}",
                    r.len(),
                    meta.blocks
                ));
            }
            if s > 0 && r.len() != first_step.len() {
                return Err(format!(
                    "step {s} has {} blocks, step 0 has {}",
                    r.len(),
                    first_step.len()
                ));
            }
            for (b, range) in r.iter().enumerate() {
                let h = read_header(&entry[range.clone()])
                    .map_err(|e| format!("step {s} block {b}: {e}"))?;
                let like = if s == 0 {
                    first_step.push(h);
                    first_step.get(b - b % blocks.max(1))
                } else {
                    first_step.get(b)
                };
                if let Some(f) = like.filter(|&&f| {
                    if s == 0 {
                        (f.format, f.dtype) != (h.format, h.dtype)
                    } else {
                        f != h
                    }
                }) {
                    return Err(format!(
                        "step {s} block {b}: {h:?} does not match the first step's {f:?}"
                    ));
                }
            }
            ranges.push(r);
        }
        let layers: Vec<KvFormat> = first_step
            .iter()
            .step_by(blocks.max(1))
            .map(|h| h.format)
            .collect();
        let layout = match layers.is_empty() {
            true => CacheLayout::default(),
            false => CacheLayout::of_layers(&layers)?,
        };
        Ok(Self {
            meta,
            layout,
            steps,
            ranges,
        })
    }

    /// Encoded cache of one (step, block) in the layout's first format.
    pub fn block(&self, step: usize, block: usize) -> Option<&[u8]> {
        self.block_as(step, block, self.layout.kv())
    }

    /// Encoded cache of one (step, block) in `format`, if the layout holds it.
    pub fn block_as(&self, step: usize, block: usize, format: KvFormat) -> Option<&[u8]> {
        let layer = self.layout.formats().iter().position(|&f| f == format)?;
        if block >= self.blocks() {
            return None;
        }
        let range = self.ranges.get(step)?.get(layer * self.blocks() + block)?;
        Some(&self.steps[step][range.clone()])
    }

    /// Encoded bytes of block `block` in `format` (the same at every step), 0 if not held.
    pub fn block_len(&self, block: usize, format: KvFormat) -> usize {
        self.block_as(0, block, format).map_or(0, <[u8]>::len)
    }

    pub fn steps(&self) -> usize {
        self.steps.len()
    }

    pub fn blocks(&self) -> usize {
        self.meta.blocks as usize
    }

    /// Bytes held (what the local tier weighs).
    pub fn bytes(&self) -> u64 {
        self.steps.iter().map(|s| s.len() as u64).sum()
    }

    /// The encoded step entries (for storing a fresh capture).
    pub fn step_entries(&self) -> &[bytes::Bytes] {
        &self.steps
    }
}

/// Whole template caches in host memory, least recently used out first, weighed in bytes.
#[derive(Clone)]
pub struct LocalTier {
    cache: moka::sync::Cache<String, Arc<TemplateEntry>>,
    capacity_bytes: u64,
    /// A GPU denoiser's copy stream: entries are held in pinned memory.
    pin: Option<Arc<GpuCopy>>,
}

impl LocalTier {
    /// A tier of `capacity_bytes`; with `pin` (a GPU denoiser) entries are held in pinned host
    /// memory, so the loader's copies to the device overlap the compute.
    pub fn new(capacity_bytes: u64, pin: Option<Arc<GpuCopy>>) -> Self {
        let cache = moka::sync::Cache::builder()
            .max_capacity(capacity_bytes)
            .weigher(|_k: &String, v: &Arc<TemplateEntry>| {
                u32::try_from(v.bytes()).unwrap_or(u32::MAX)
            })
            .build();
        Self {
            cache,
            capacity_bytes,
            pin,
        }
    }

    /// Hold `entry` (a pinned copy of it on a GPU denoiser) and return what is held. Pinning
    /// copies the whole cache on the caller's thread; if it fails the entry is held as it is
    /// (its loads are then synchronous copies).
    pub fn admit(&self, entry: Arc<TemplateEntry>) -> Arc<TemplateEntry> {
        let held = match &self.pin {
            Some(gpu) => match gpu.pin(&entry) {
                Ok(pinned) => Arc::new(pinned),
                Err(error) => {
                    tracing::warn!(cache_key = %entry.meta.cache_key, %error, "cache not pinned");
                    entry
                }
            },
            None => entry,
        };
        self.insert(held.clone());
        held
    }

    /// [`LocalTier::admit`] from async code: pinning copies a whole cache (and evicting a
    /// pinned one waits for the copy stream), so where this tier pins it runs on a blocking
    /// thread; should that thread fail, the entry is held unpinned.
    pub async fn admit_off_runtime(&self, entry: Arc<TemplateEntry>) -> Arc<TemplateEntry> {
        if self.pin.is_none() {
            return self.admit(entry);
        }
        let (tier, given) = (self.clone(), entry.clone());
        match tokio::task::spawn_blocking(move || tier.admit(given)).await {
            Ok(held) => held,
            Err(error) => {
                tracing::warn!(%error, "pinning thread failed; cache held unpinned");
                self.insert(entry.clone());
                entry
            }
        }
    }

    pub fn get(&self, cache_key: &str) -> Option<Arc<TemplateEntry>> {
        self.cache.get(cache_key)
    }

    /// Whether `cache_key` is held, without counting as a use (the LRU order stays).
    pub fn contains(&self, cache_key: &str) -> bool {
        self.cache.contains_key(cache_key)
    }

    pub fn insert(&self, entry: Arc<TemplateEntry>) {
        self.cache.insert(entry.meta.cache_key.clone(), entry);
    }

    pub fn remove(&self, cache_key: &str) {
        self.cache.invalidate(cache_key);
    }

    /// Cache keys resident now (for heartbeats).
    pub fn keys(&self) -> Vec<String> {
        self.cache.run_pending_tasks();
        self.cache.iter().map(|(k, _)| (*k).clone()).collect()
    }

    pub fn bytes(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.weighted_size()
    }

    /// Whether `bytes` more fit without evicting anything held.
    pub fn has_room_for(&self, bytes: u64) -> bool {
        self.bytes().saturating_add(bytes) <= self.capacity_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffmesh_model::flux::kv_codec::{encode_block, CacheDtype};
    use diffmesh_model::tch::{Device, Kind, Tensor};
    use diffmesh_shared::wire::templates::pack_step;

    pub fn entry(key: &str, steps: u32, blocks: u32) -> TemplateEntry {
        let t = Tensor::ones([4, 8], (Kind::Float, Device::Cpu));
        let block = encode_block(&t, &t, KvFormat::Prepared, CacheDtype::Bf16).unwrap();
        let step = pack_step(&vec![block; blocks as usize]);
        let meta = CacheMeta {
            cache_key: key.into(),
            steps,
            blocks,
            bytes: step.len() as u64 * steps as u64,
            format: "prepared".into(),
            dtype: "bf16".into(),
        };
        TemplateEntry::new(meta, vec![bytes::Bytes::from(step); steps as usize]).unwrap()
    }

    #[test]
    fn entries_check_counts_and_serve_blocks() {
        let e = entry("k", 3, 2);
        assert_eq!(
            (e.steps(), e.blocks(), e.layout),
            (3, 2, CacheLayout::One(KvFormat::Prepared))
        );
        assert!(e.block(2, 1).is_some() && e.block(3, 0).is_none() && e.block(0, 2).is_none());
        let mut meta = e.meta.clone();
        meta.blocks = 3;
        let err = TemplateEntry::new(meta, e.step_entries().to_vec()).unwrap_err();
        assert!(err.contains("metadata says 3"), "{err}");
        let mut meta = e.meta.clone();
        meta.steps = 4;
        assert!(TemplateEntry::new(meta, e.step_entries().to_vec()).is_err());
        let damaged = vec![bytes::Bytes::from_static(b"DMST\x01\x00\x00\x00"); 3];
        assert!(TemplateEntry::new(e.meta.clone(), damaged).is_err());
    }

    #[test]
    fn blocks_differ_in_shape_by_index_never_by_step() {
        let block = |rows: i64, dtype| {
            let t = Tensor::ones([rows, 8], (Kind::Float, Device::Cpu));
            encode_block(&t, &t, KvFormat::Raw, dtype).unwrap()
        };
        let step = |a, b, dtype| bytes::Bytes::from(pack_step(&[block(a, dtype), block(b, dtype)]));
        let meta = CacheMeta {
            cache_key: "unet".into(),
            steps: 2,
            blocks: 2,
            bytes: 0,
            format: "raw".into(),
            dtype: "f32".into(),
        };
        let f32 = CacheDtype::F32;
        // A UNet's levels: blocks of different shapes within a step.
        assert!(TemplateEntry::new(meta.clone(), vec![step(4, 2, f32), step(4, 2, f32)]).is_ok());
        let err =
            TemplateEntry::new(meta.clone(), vec![step(4, 2, f32), step(4, 3, f32)]).unwrap_err();
        assert!(err.contains("step 1 block 1"), "{err}");
        let mixed = bytes::Bytes::from(pack_step(&[block(4, f32), block(2, CacheDtype::Bf16)]));
        let err = TemplateEntry::new(meta, vec![mixed.clone(), mixed]).unwrap_err();
        assert!(err.contains("step 0 block 1"), "{err}");
    }

    #[test]
    fn local_tier_evicts_by_bytes() {
        let one = entry("a", 2, 2).bytes();
        let tier = LocalTier::new(one * 2 + one / 2, None);
        for k in ["a", "b", "c"] {
            tier.insert(Arc::new(entry(k, 2, 2)));
        }
        let keys = tier.keys();
        assert_eq!(keys.len(), 2, "{keys:?}");
        assert!(tier.bytes() <= one * 2 + one / 2);
        assert!(!tier.has_room_for(one), "two held, half of one free");
        tier.remove(&keys[0]);
        assert_eq!(tier.keys().len(), 1);
        assert!(tier.has_room_for(one) && !tier.has_room_for(one * 2));
        assert!(tier.contains(&keys[1]) && !tier.contains(&keys[0]));
    }
}
