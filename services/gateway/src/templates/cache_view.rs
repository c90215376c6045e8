//! A template's activation cache as the mesh holds it: which cachestore tiers hold each entry
//! (`CacheLocate`), which denoisers hold it in their local tier (their heartbeats'
//! `cached_templates`), and removing it (`CacheDelete` per entry, `EvictTemplate` to denoisers).
use std::collections::HashMap;
use std::time::Duration;

use diffmesh_shared::nats::{publish_msgpack, request_msgpack};
use diffmesh_shared::wire::cachestore::{
    delete_subject, locate_subject, template_keys, CacheDelete, CacheDeleteReply, CacheLocate,
    CacheLocateReply, CacheTier, KeyLocation,
};
use diffmesh_shared::wire::messages::EvictTemplate;
use diffmesh_shared::wire::subjects::TEMPLATES_EVICT;
use diffmesh_shared::MeshError;
use serde::Serialize;
use utoipa::ToSchema;

use crate::error::ApiError;
use diffmesh_shared::wire::messages::Heartbeat;

/// One cachestore entry of a template cache.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CacheEntryView {
    pub key: String,
    /// `memory`, `disk`, `cluster`: the tiers holding it, fastest first (empty: none).
    pub tiers: Vec<String>,
    pub bytes: Option<u64>,
}

/// Where a template's cache is.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct CacheView {
    /// The meta entry and one entry per step.
    pub expected_entries: u32,
    /// Entries some tier holds.
    pub stored_entries: u32,
    /// Entries held by each tier (`memory`, `disk`, `cluster`).
    pub by_tier: HashMap<String, u32>,
    pub entries: Vec<CacheEntryView>,
    /// Denoisers holding the cache in their local tier (from their heartbeats).
    pub denoisers: Vec<String>,
    /// Why the cachestore could not be asked (the entries are then unknown).
    pub error: Option<String>,
}

/// Live denoisers whose local tier holds `cache_key` (from their last heartbeats), sorted.
pub fn holders(denoisers: &[Heartbeat], cache_key: &str) -> Vec<String> {
    let mut workers: Vec<String> = denoisers
        .iter()
        .filter(|hb| hb.cached_templates.iter().any(|k| k == cache_key))
        .map(|hb| hb.worker_id.clone())
        .collect();
    workers.sort();
    workers
}

fn tier_name(t: CacheTier) -> String {
    t.as_str().to_string()
}

/// Build the view from the cachestore's answer (or its failure).
pub fn view_of(
    expected: u32,
    located: Result<Vec<KeyLocation>, String>,
    denoisers: Vec<String>,
) -> CacheView {
    let mut view = CacheView {
        expected_entries: expected,
        denoisers,
        ..Default::default()
    };
    match located {
        Ok(keys) => {
            for t in [CacheTier::Memory, CacheTier::Disk, CacheTier::Cluster] {
                view.by_tier.insert(tier_name(t), 0);
            }
            for loc in keys {
                if !loc.tiers.is_empty() {
                    view.stored_entries += 1;
                }
                for t in &loc.tiers {
                    *view.by_tier.entry(tier_name(*t)).or_default() += 1;
                }
                view.entries.push(CacheEntryView {
                    key: loc.key,
                    tiers: loc.tiers.into_iter().map(tier_name).collect(),
                    bytes: loc.size,
                });
            }
        }
        Err(error) => view.error = Some(error),
    }
    view
}

/// Ask the cachestore where each entry of a `steps`-step cache is.
pub async fn locate(
    client: &async_nats::Client,
    cache_key: &str,
    steps: u32,
    timeout: Duration,
) -> Result<Vec<KeyLocation>, String> {
    let req = CacheLocate {
        keys: template_keys(cache_key, steps),
    };
    match request_msgpack::<_, CacheLocateReply>(client, &locate_subject(), &req, timeout).await {
        Ok(CacheLocateReply::Located { keys }) => Ok(keys),
        Ok(CacheLocateReply::Failed { message }) => {
            Err(format!("the cachestore failed: {message}"))
        }
        Err(MeshError::NoResponders { .. }) => Err("no cachestore is running".into()),
        Err(err) => Err(format!("asking the cachestore failed: {err}")),
    }
}

/// Delete every cachestore entry of a cache and tell the denoisers to drop their local copies.
/// Returns how many entries existed. A cachestore that is not running is a 503: the template's
/// record is then kept, so the delete can be finished later.
pub async fn remove(
    client: &async_nats::Client,
    template_id: &str,
    cache_key: &str,
    steps: u32,
    timeout: Duration,
) -> Result<u32, ApiError> {
    let mut existed = 0;
    for key in template_keys(cache_key, steps) {
        let req = CacheDelete { key: key.clone() };
        match request_msgpack::<_, CacheDeleteReply>(client, &delete_subject(), &req, timeout).await
        {
            Ok(CacheDeleteReply::Deleted { existed: e }) => existed += u32::from(e),
            Ok(CacheDeleteReply::Failed { message }) => {
                return Err(ApiError::Internal(format!(
                    "the cachestore could not delete {key}: {message}"
                )))
            }
            Err(MeshError::NoResponders { .. }) => {
                return Err(ApiError::Unavailable {
                    message: "no cachestore is running, so the template's cache cannot be \
                              deleted; the template stays `deleting` until it can be"
                        .into(),
                    retry_after_s: 5,
                })
            }
            Err(err) => return Err(err.into()),
        }
    }
    let evict = EvictTemplate {
        template_id: template_id.to_string(),
        cache_key: cache_key.to_string(),
    };
    publish_msgpack(client, TEMPLATES_EVICT, None, &evict).await?;
    Ok(existed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn view_counts_tiers_and_reports_failures() {
        let loc = |key: &str, tiers: Vec<CacheTier>| KeyLocation {
            key: key.into(),
            size: (!tiers.is_empty()).then_some(10),
            tiers,
        };
        let v = view_of(
            3,
            Ok(vec![
                loc("k/meta", vec![CacheTier::Memory, CacheTier::Cluster]),
                loc("k/s0", vec![CacheTier::Disk, CacheTier::Cluster]),
                loc("k/s1", vec![]),
            ]),
            vec!["d1".into()],
        );
        assert_eq!((v.expected_entries, v.stored_entries), (3, 2));
        assert_eq!(v.by_tier["memory"], 1);
        assert_eq!(v.by_tier["disk"], 1);
        assert_eq!(v.by_tier["cluster"], 2);
        assert_eq!(v.entries[0].tiers, vec!["memory", "cluster"]);
        assert_eq!(v.denoisers, vec!["d1"]);
        let v = view_of(3, Err("no cachestore is running".into()), vec![]);
        assert_eq!(v.error.as_deref(), Some("no cachestore is running"));
        assert_eq!(v.stored_entries, 0);
    }
}
