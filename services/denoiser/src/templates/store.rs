//! The denoiser's cachestore client for template caches: store a fresh capture (every step entry,
//! then the metadata, so a reader that finds the metadata finds every step), and fetch a whole
//! cache into a [`TemplateEntry`]. Values above the inline limit are written through the cache
//! bucket of the object store, and read in ranges from the cachestore that holds them
//! (`shared::stores::cache_read`), as the cachestore contract says.
use super::entry::TemplateEntry;
use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::cache_read::CacheReader;
use diffmesh_shared::wire::cachestore::{
    put_subject, CachePut, CachePutReply, DEFAULT_INLINE_LIMIT,
};
use diffmesh_shared::wire::templates::{meta_key, step_key, CacheMeta};
use futures::StreamExt;
use std::time::Duration;

/// Talks to the cachestore service (and its object-store bucket for large values).
#[derive(Clone)]
pub struct CacheClient {
    /// The connection, bucket and timeout both reads and writes use.
    reader: CacheReader,
}

/// Step entries of one cache read at once by [`CacheClient::fetch`].
const FETCH_CONCURRENCY: usize = 8;

/// Largest step entry this client reads (a full-size Flux step in bf16 is ~1.4 GB; refuse more).
const MAX_ENTRY_BYTES: usize = 2 << 30;

impl CacheClient {
    /// `bucket`: the cachestore's (`shared::wire::cachestore::CACHE_BUCKET`); `timeout`: per request.
    pub fn new(client: async_nats::Client, bucket: BlobStore, timeout: Duration) -> Self {
        Self {
            reader: CacheReader {
                client,
                bucket,
                timeout,
                max_bytes: MAX_ENTRY_BYTES,
            },
        }
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<(), String> {
        let inline = value.len() <= DEFAULT_INLINE_LIMIT;
        let r = &self.reader;
        if !inline {
            r.bucket
                .put(key, value)
                .await
                .map_err(|e| format!("writing {key} to the cache bucket: {e}"))?;
        }
        let req = CachePut {
            key: key.to_string(),
            value: inline.then(|| value.to_vec()),
        };
        match request_msgpack(&r.client, &put_subject(), &req, r.timeout).await {
            Ok(CachePutReply::Stored { .. }) => Ok(()),
            Ok(CachePutReply::Failed { message }) => {
                Err(format!("cachestore refused {key}: {message}"))
            }
            Err(e) => Err(format!("cachestore put {key}: {e}")),
        }
    }

    async fn get_owned(&self, key: String) -> Result<Option<Vec<u8>>, String> {
        self.get(&key).await
    }

    /// `Ok(None)` when the cachestore has no such key.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        Ok(self.reader.read(key).await?.map(|(value, _)| value))
    }

    /// Store a whole cache: steps first, metadata last.
    pub async fn store(&self, entry: &TemplateEntry) -> Result<(), String> {
        let key = &entry.meta.cache_key;
        for (s, step) in entry.step_entries().iter().enumerate() {
            self.put(&step_key(key, s as u32), step).await?;
        }
        let meta = serde_json::to_vec(&entry.meta).map_err(|e| e.to_string())?;
        self.put(&meta_key(key), &meta).await
    }

    /// Fetch a whole cache; `Ok(None)` when it is not stored (never captured, or evicted).
    pub async fn fetch(&self, cache_key: &str) -> Result<Option<TemplateEntry>, String> {
        let Some(meta) = self.get(&meta_key(cache_key)).await? else {
            return Ok(None);
        };
        let meta: CacheMeta = serde_json::from_slice(&meta)
            .map_err(|e| format!("metadata of {cache_key} is not valid JSON: {e}"))?;
        if meta.cache_key != cache_key {
            return Err(format!(
                "metadata under {cache_key} names {}",
                meta.cache_key
            ));
        }
        // Several steps in flight at once: each is a round trip to the cachestore (and, above
        // the inline limit, to the object store), which one after another made the first edit
        // of a template on this denoiser wait for `steps` round trips.
        let mut reads = futures::stream::iter(0..meta.steps)
            .map(|s| self.get_owned(step_key(cache_key, s)))
            .buffered(FETCH_CONCURRENCY);
        let mut steps = Vec::with_capacity(meta.steps as usize);
        while let Some(read) = reads.next().await {
            match read? {
                Some(bytes) => steps.push(bytes::Bytes::from(bytes)),
                // A step evicted from every tier: the cache is unusable as a whole.
                None => return Ok(None),
            }
        }
        drop(reads);
        TemplateEntry::new(meta, steps).map(Some)
    }
}
