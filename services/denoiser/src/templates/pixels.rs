//! Registered templates' model-resolution pixels (what their captures kept in the template
//! bucket), held in memory so a template's edits read them once rather than once per edit.
//!
//! A template's pixels never change under its id (a template is registered once, and its id is
//! a fresh UUID), so a held copy never goes stale; it is dropped when the template is deleted
//! (`EvictTemplate`) or when the cache is over its byte capacity (least recently used first).
use std::sync::Arc;

use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::wire::templates::prepared_image_key;
use diffmesh_shared::MeshError;

/// Whether a read was served from memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Hit,
    Miss,
}

impl Lookup {
    pub fn as_str(self) -> &'static str {
        match self {
            Lookup::Hit => "hit",
            Lookup::Miss => "miss",
        }
    }
}

/// Template pixels by template-bucket key, weighed in bytes.
#[derive(Clone)]
pub struct TemplatePixels {
    images: BlobStore,
    cache: moka::future::Cache<String, Arc<Vec<u8>>>,
    /// Largest object read (`BlobStore::get_limited`).
    max_bytes: usize,
}

impl TemplatePixels {
    /// Read through `images`, holding up to `capacity_bytes` (0 holds nothing).
    pub fn new(images: BlobStore, capacity_bytes: u64, max_bytes: usize) -> Self {
        let cache = moka::future::Cache::builder()
            .max_capacity(capacity_bytes)
            .weigher(|_k: &String, v: &Arc<Vec<u8>>| u32::try_from(v.len()).unwrap_or(u32::MAX))
            .build();
        Self {
            images,
            cache,
            max_bytes,
        }
    }

    /// The pixels under `key`; concurrent misses of one key share a single read.
    pub async fn get(&self, key: &str) -> Result<(Arc<Vec<u8>>, Lookup), Arc<MeshError>> {
        let mut lookup = Lookup::Hit;
        let pixels = self
            .cache
            .try_get_with(key.to_string(), async {
                lookup = Lookup::Miss;
                let bytes = self.images.get_limited(key, self.max_bytes).await?;
                Ok::<_, MeshError>(Arc::new(bytes))
            })
            .await?;
        Ok((pixels, lookup))
    }

    /// Drop what is held of a deleted template.
    pub async fn evict(&self, template_id: &str) {
        self.cache
            .invalidate(&prepared_image_key(template_id))
            .await;
    }

    /// Bytes held now.
    pub async fn bytes(&self) -> u64 {
        self.cache.run_pending_tasks().await;
        self.cache.weighted_size()
    }
}
