//! The cluster tier's own bound: when the template caches in the object store pass their
//! budget (`--cluster-bytes`), the caches least recently used are deleted from it, whole (a
//! cache is every key under one cache key: `<cache key>/meta`, `<cache key>/s<step>`), so a
//! new capture is not refused for room while caches nobody edits sit there. A denoiser whose
//! edit then finds its template's cache gone computes the edit in full and captures the
//! template again (`services/denoiser/src/recapture.rs`).
//!
//! A use is any get or prefetch of a key, whichever tier answers it. Uses are counted per
//! cachestore instance (with several replicas each sees its share; a cache only one replica
//! reads may be deleted by another that never saw it used, which costs one re-capture). At
//! start the order is seeded from the objects' write times.
use std::collections::HashMap;
use std::sync::Mutex;

/// One template cache in the cluster tier.
#[derive(Debug, Default)]
struct Group {
    /// Size of each of its keys.
    keys: HashMap<String, u64>,
    bytes: u64,
    /// Logical time of its last use or write (larger is more recent).
    last_use: u64,
}

#[derive(Debug, Default)]
struct State {
    groups: HashMap<String, Group>,
    bytes: u64,
    clock: u64,
}

/// Least-recently-used order and sizes of the caches in the cluster tier.
#[derive(Debug)]
pub struct ClusterLru {
    budget: u64,
    state: Mutex<State>,
}

/// The cache a key belongs to: everything before its last `/` (a key without one is its own).
pub fn group_of(key: &str) -> &str {
    key.rsplit_once('/').map_or(key, |(group, _)| group)
}

impl ClusterLru {
    /// Keep at most `budget` bytes (0: no bound of its own; the bucket's bound still refuses).
    pub fn new(budget: u64) -> Self {
        Self {
            budget,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Objects found in the bucket at start, `(key, size, written at)` in any order: the
    /// earliest written count as the least recently used.
    pub fn seed(&self, mut objects: Vec<(String, u64, i128)>) {
        objects.sort_by_key(|(_, _, written)| *written);
        for (key, size, _) in objects {
            self.record(&key, size);
        }
    }

    /// A key was read (from any tier): its cache becomes the most recently used.
    pub fn touch(&self, key: &str) {
        let mut s = self.lock();
        s.clock += 1;
        let now = s.clock;
        if let Some(group) = s.groups.get_mut(group_of(key)) {
            group.last_use = now;
        }
    }

    fn record(&self, key: &str, size: u64) {
        let mut s = self.lock();
        s.clock += 1;
        let now = s.clock;
        let group = s.groups.entry(group_of(key).to_string()).or_default();
        let old = group.keys.insert(key.to_string(), size).unwrap_or(0);
        group.bytes = group.bytes - old + size;
        group.last_use = now;
        s.bytes = s.bytes - old + size;
    }

    /// A key was written to the cluster tier. Returns the keys of the caches to delete from
    /// it (least recently used first, never the cache `key` belongs to) so the tier is back
    /// within its budget; they are already forgotten here.
    pub fn stored(&self, key: &str, size: u64) -> Vec<String> {
        self.record(key, size);
        if self.budget == 0 {
            return Vec::new();
        }
        let mut s = self.lock();
        let keep = group_of(key);
        let mut victims = Vec::new();
        while s.bytes > self.budget {
            let oldest = s
                .groups
                .iter()
                .filter(|(name, _)| name.as_str() != keep)
                .min_by_key(|(_, g)| g.last_use)
                .map(|(name, _)| name.clone());
            let Some(name) = oldest else { break };
            let group = s.groups.remove(&name).expect("just found");
            s.bytes -= group.bytes;
            let mut keys: Vec<String> = group.keys.into_keys().collect();
            // The metadata goes first: a reader that finds it finds every step (or none).
            keys.sort_by_key(|k| !k.ends_with("/meta"));
            victims.extend(keys);
        }
        victims
    }

    /// A key was deleted from the cluster tier.
    pub fn forget(&self, key: &str) {
        let mut s = self.lock();
        let name = group_of(key);
        let Some(group) = s.groups.get_mut(name) else {
            return;
        };
        let size = group.keys.remove(key).unwrap_or(0);
        group.bytes -= size;
        let empty = group.keys.is_empty();
        s.bytes -= size;
        if empty {
            s.groups.remove(name);
        }
    }

    /// (caches, keys, bytes) this instance knows in the cluster tier.
    pub fn size(&self) -> (u64, u64, u64) {
        let s = self.lock();
        let keys = s.groups.values().map(|g| g.keys.len() as u64).sum();
        (s.groups.len() as u64, keys, s.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(lru: &ClusterLru, name: &str, steps: u32, step_bytes: u64) -> Vec<String> {
        let mut victims = Vec::new();
        for s in 0..steps {
            victims.extend(lru.stored(&format!("{name}/s{s}"), step_bytes));
        }
        victims.extend(lru.stored(&format!("{name}/meta"), 10));
        victims
    }

    #[test]
    fn the_least_recently_used_cache_goes_whole_and_meta_first() {
        let lru = ClusterLru::new(1000);
        assert!(cache(&lru, "a", 2, 200).is_empty());
        assert!(cache(&lru, "b", 2, 200).is_empty());
        lru.touch("a/s0"); // a is now the more recent
        let victims = cache(&lru, "c", 2, 200);
        assert_eq!(victims[0], "b/meta");
        let mut rest = victims[1..].to_vec();
        rest.sort();
        assert_eq!(rest, ["b/s0", "b/s1"]);
        assert_eq!(lru.size(), (2, 6, 820));
    }

    #[test]
    fn the_cache_being_written_is_never_its_own_victim() {
        let lru = ClusterLru::new(100);
        assert!(cache(&lru, "a", 1, 50).is_empty());
        // Larger than the whole budget: everything else goes, it stays.
        let victims = cache(&lru, "big", 3, 100);
        let mut sorted = victims.clone();
        sorted.sort();
        assert_eq!(sorted, ["a/meta", "a/s0"]);
        assert_eq!(lru.size(), (1, 4, 310));
    }

    #[test]
    fn deletes_and_rewrites_keep_the_sizes_right() {
        let lru = ClusterLru::new(0);
        cache(&lru, "a", 2, 100);
        lru.stored("a/s0", 40); // rewritten smaller
        assert_eq!(lru.size(), (1, 3, 150));
        lru.forget("a/s1");
        lru.forget("a/s0");
        lru.forget("a/unknown");
        assert_eq!(lru.size(), (1, 1, 10));
        lru.forget("a/meta");
        assert_eq!(lru.size(), (0, 0, 0));
        assert!(
            cache(&lru, "b", 100, 1 << 30).is_empty(),
            "no budget: nothing evicted"
        );
    }

    #[test]
    fn seeding_orders_by_write_time() {
        let lru = ClusterLru::new(300);
        lru.seed(vec![
            ("new/s0".into(), 100, 30),
            ("old/s0".into(), 100, 10),
            ("mid/s0".into(), 100, 20),
        ]);
        assert_eq!(lru.stored("next/s0", 100), ["old/s0"]);
        lru.touch("mid/s0");
        assert_eq!(lru.stored("last/s0", 100), ["new/s0"]);
    }
}
