//! Whole template caches fetched from the cachestore into the local tier, one fetch per cache
//! key at a time: edits of one template arriving together, or an edit arriving while a capture
//! broadcast's warm-up is loading the same cache, share a single read of every step instead of
//! each pulling the whole cache.
use super::entry::{LocalTier, TemplateEntry};
use super::store::CacheClient;
use futures::future::{BoxFuture, FutureExt, Shared};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What a fetch found.
#[derive(Clone, Debug)]
pub enum Fetched {
    /// Loaded and held in the local tier (what the tier holds: pinned on a GPU denoiser).
    Entry(Arc<TemplateEntry>),
    /// Not in the cachestore (never captured, or evicted from every tier).
    Missing,
    Failed(String),
}

type SharedFetch = Shared<BoxFuture<'static, Fetched>>;

/// Fetches caches into `local`, coalescing concurrent fetches of one key.
#[derive(Clone)]
pub struct CacheFetcher {
    store: CacheClient,
    local: LocalTier,
    in_flight: Arc<Mutex<HashMap<String, SharedFetch>>>,
    /// Seconds each whole-cache read took (`diffmesh_denoiser_template_fetch_duration_seconds`).
    seconds: Option<prometheus::Histogram>,
}

impl CacheFetcher {
    pub fn new(
        store: CacheClient,
        local: LocalTier,
        seconds: Option<prometheus::Histogram>,
    ) -> Self {
        Self {
            store,
            local,
            in_flight: Arc::default(),
            seconds,
        }
    }

    /// Fetch `cache_key` into the local tier, or join the fetch of it already running, or find
    /// it held already. The second element says whether this call started no read of its own.
    pub async fn fetch(&self, cache_key: &str) -> (Fetched, bool) {
        let (fetch, joined) = self.fetch_of(cache_key);
        (fetch.await, joined)
    }

    /// Keys being fetched now.
    pub fn in_flight(&self) -> usize {
        lock(&self.in_flight).len()
    }

    fn fetch_of(&self, cache_key: &str) -> (SharedFetch, bool) {
        let mut in_flight = lock(&self.in_flight);
        if let Some(fetch) = in_flight.get(cache_key) {
            return (fetch.clone(), true);
        }
        // Callers look in the tier before they fetch, but a read that ended between that look
        // and this lock has admitted the entry and left the map: hand out what it held instead
        // of reading the whole cache again. (A read admits before it leaves the map, so under
        // this lock the key is either in flight or held, unless evicted since.)
        if let Some(entry) = self.local.get(cache_key) {
            let held = futures::future::ready(Fetched::Entry(entry));
            return (held.boxed().shared(), true);
        }
        let (store, local, map, key, seconds) = (
            self.store.clone(),
            self.local.clone(),
            self.in_flight.clone(),
            cache_key.to_string(),
            self.seconds.clone(),
        );
        let fetch = async move {
            // Out of the map when the read ends, also by a panic (which every waiter sees):
            // the next fetch of the key then starts afresh instead of joining a dead one.
            let _leave = LeaveInFlight { map, key: key.clone() };
            let started = std::time::Instant::now();
            let read = store.fetch(&key).await;
            let took = started.elapsed().as_secs_f64();
            if let Ok(Some(entry)) = &read {
                seconds.inspect(|h| h.observe(took));
                tracing::info!(%key, bytes = entry.bytes(), seconds = took, "template cache fetched");
            }
            let fetched = match read {
                Ok(Some(entry)) => Fetched::Entry(local.admit_off_runtime(Arc::new(entry)).await),
                Ok(None) => Fetched::Missing,
                Err(err) => Fetched::Failed(err),
            };
            // Held in the tier now (or known absent): a fetch of this key after `_leave` drops
            // finds it there, and reads afresh only once the tier has let it go.
            fetched
        }
        .boxed()
        .shared();
        in_flight.insert(cache_key.to_string(), fetch.clone());
        (fetch, false)
    }
}

/// Removes a fetch from the in-flight map when dropped.
struct LeaveInFlight {
    map: Arc<Mutex<HashMap<String, SharedFetch>>>,
    key: String,
}

impl Drop for LeaveInFlight {
    fn drop(&mut self) {
        lock(&self.map).remove(&self.key);
    }
}

/// The map holds futures only; a panic elsewhere while it was locked leaves it usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
