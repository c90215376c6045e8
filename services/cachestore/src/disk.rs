//! Local disk tier: one file per key under a directory, least-recently-used eviction by bytes.
//!
//! File names are the hex of the key, so any key maps to a safe name and the index can be
//! rebuilt from the directory after a restart.
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[derive(Debug, Default)]
struct Index {
    /// key -> (recency stamp, size)
    entries: HashMap<String, (u64, u64)>,
    /// recency stamp -> key (oldest first)
    order: BTreeMap<u64, String>,
    bytes: u64,
    clock: u64,
}

impl Index {
    fn touch(&mut self, key: &str) {
        if let Some((stamp, _)) = self.entries.get_mut(key) {
            self.order.remove(stamp);
            self.clock += 1;
            *stamp = self.clock;
            self.order.insert(self.clock, key.to_string());
        }
    }

    fn insert(&mut self, key: String, size: u64) {
        self.remove(&key);
        self.clock += 1;
        self.order.insert(self.clock, key.clone());
        self.entries.insert(key, (self.clock, size));
        self.bytes += size;
    }

    fn remove(&mut self, key: &str) -> Option<u64> {
        let (stamp, size) = self.entries.remove(key)?;
        self.order.remove(&stamp);
        self.bytes -= size;
        Some(size)
    }

    fn oldest(&self) -> Option<String> {
        self.order.values().next().cloned()
    }
}

/// Bytes by key on local disk, bounded by `capacity_bytes`.
#[derive(Debug)]
pub struct DiskTier {
    dir: PathBuf,
    capacity_bytes: u64,
    index: Mutex<Index>,
}

impl DiskTier {
    /// Open (creating) `dir`, indexing the entries already there.
    pub fn open(dir: &Path, capacity_bytes: u64) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut index = Index::default();
        let mut found: Vec<(std::time::SystemTime, String, u64)> = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            let Some(key) = decode_name(&name) else {
                continue; // temp files and foreign files are not entries
            };
            let meta = entry.metadata()?;
            found.push((
                meta.modified().unwrap_or(std::time::UNIX_EPOCH),
                key,
                meta.len(),
            ));
        }
        found.sort();
        for (_, key, size) in found {
            index.insert(key, size);
        }
        let tier = Self {
            dir: dir.to_path_buf(),
            capacity_bytes,
            index: Mutex::new(index),
        };
        tier.evict_to_fit(0)?;
        Ok(tier)
    }

    fn path_of(&self, key: &str) -> PathBuf {
        self.dir.join(encode_name(key))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        // A panic while holding the lock leaves the index consistent enough to go on.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Read a value; `None` when absent.
    pub fn get(&self, key: &str) -> io::Result<Option<Vec<u8>>> {
        if !self.lock().entries.contains_key(key) {
            return Ok(None);
        }
        match std::fs::read(self.path_of(key)) {
            Ok(bytes) => {
                self.lock().touch(key);
                Ok(Some(bytes))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.lock().remove(key);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Write a value (atomically: temp file, then rename), evicting old entries to make room.
    /// Values larger than the whole tier are not stored (returns false).
    pub fn put(&self, key: &str, value: &[u8]) -> io::Result<bool> {
        let size = value.len() as u64;
        if size > self.capacity_bytes {
            return Ok(false);
        }
        self.evict_to_fit(size)?;
        let path = self.path_of(key);
        let tmp = self
            .dir
            .join(format!(".tmp-{}-{}", std::process::id(), encode_name(key)));
        std::fs::write(&tmp, value)?;
        std::fs::rename(&tmp, &path)?;
        self.lock().insert(key.to_string(), size);
        Ok(true)
    }

    /// Remove a value; true when it existed.
    pub fn delete(&self, key: &str) -> io::Result<bool> {
        let existed = self.lock().remove(key).is_some();
        match std::fs::remove_file(self.path_of(key)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(existed),
            Err(e) => Err(e),
        }
    }

    fn evict_to_fit(&self, incoming: u64) -> io::Result<()> {
        loop {
            let victim = {
                let index = self.lock();
                if index.bytes + incoming <= self.capacity_bytes {
                    return Ok(());
                }
                index.oldest()
            };
            let Some(victim) = victim else { return Ok(()) };
            tracing::debug!(key = %victim, "disk tier full; evicting");
            self.delete(&victim)?;
        }
    }

    pub fn entries(&self) -> u64 {
        self.lock().entries.len() as u64
    }

    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    pub fn contains(&self, key: &str) -> bool {
        self.lock().entries.contains_key(key)
    }

    /// Keys held that start with `prefix`.
    pub fn keys_with_prefix(&self, prefix: &str) -> Vec<String> {
        self.lock()
            .entries
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect()
    }

    /// Size of the value under `key`, when held (eviction order unchanged).
    pub fn size_of(&self, key: &str) -> Option<u64> {
        self.lock().entries.get(key).map(|&(_, size)| size)
    }
}

fn encode_name(key: &str) -> String {
    key.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_name(name: &str) -> Option<String> {
    if (name.len() & 1) != 0 || name.is_empty() {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..name.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(name.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_get_delete_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::open(dir.path(), 1000).unwrap();
        assert!(tier.put("tpl/abc/step0", b"hello").unwrap());
        assert_eq!(
            tier.get("tpl/abc/step0").unwrap().as_deref(),
            Some(&b"hello"[..])
        );
        assert_eq!(tier.get("missing").unwrap(), None);
        assert_eq!(tier.bytes(), 5);
        drop(tier);
        let tier = DiskTier::open(dir.path(), 1000).unwrap();
        assert_eq!(tier.entries(), 1);
        assert_eq!(
            tier.get("tpl/abc/step0").unwrap().as_deref(),
            Some(&b"hello"[..])
        );
        assert!(tier.delete("tpl/abc/step0").unwrap());
        assert!(!tier.delete("tpl/abc/step0").unwrap());
        assert_eq!(tier.bytes(), 0);
    }

    #[test]
    fn evicts_least_recently_used_by_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::open(dir.path(), 30).unwrap();
        tier.put("a", &[1; 10]).unwrap();
        tier.put("b", &[2; 10]).unwrap();
        tier.put("c", &[3; 10]).unwrap();
        tier.get("a").unwrap(); // a is now more recent than b
        tier.put("d", &[4; 10]).unwrap();
        assert!(tier.contains("a"));
        assert!(!tier.contains("b"));
        assert!(tier.contains("c") && tier.contains("d"));
        assert_eq!(tier.bytes(), 30);
        assert!(!tier.put("huge", &[0; 31]).unwrap());
        assert_eq!(tier.bytes(), 30);
    }

    #[test]
    fn overwrite_replaces_size() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::open(dir.path(), 100).unwrap();
        tier.put("k", &[0; 40]).unwrap();
        tier.put("k", &[0; 10]).unwrap();
        assert_eq!(tier.bytes(), 10);
        assert_eq!(tier.entries(), 1);
    }

    #[test]
    fn names_round_trip() {
        for key in ["a", "tpl/x=1.y_z-", "ünï"] {
            assert_eq!(decode_name(&encode_name(key)).as_deref(), Some(key));
        }
        assert_eq!(decode_name(".tmp-1-61"), None);
    }
}
