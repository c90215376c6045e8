//! API keys: Bearer tokens from a file (`--api-keys-file`) and/or the environment
//! (`GATEWAY_API_KEYS`), kept only as SHA-256 hashes. With no key configured authentication
//! is off and every caller is the one anonymous caller.
use std::collections::HashMap;
use std::path::Path;

use actix_web::http::header::HeaderValue;
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// Who is calling: an API key (by its id) or, with authentication off, anyone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    Anonymous,
    Key(String),
}

impl Caller {
    /// The id stored as a job's owner (`None` when authentication is off).
    pub fn owner(&self) -> Option<&str> {
        match self {
            Caller::Anonymous => None,
            Caller::Key(id) => Some(id),
        }
    }

    /// The name per-key limits are kept under.
    pub fn limit_key(&self) -> &str {
        self.owner().unwrap_or("anonymous")
    }

    /// A job, template or LoRA is visible to the key that created it only. With
    /// authentication off there is no identity to scope by, so every one is visible.
    pub fn may_access(&self, owner: Option<&str>) -> bool {
        match self {
            Caller::Anonymous => true,
            Caller::Key(id) => owner == Some(id.as_str()),
        }
    }

    /// Whether the caller may see `record`.
    pub fn sees<R: Owned>(&self, record: &R) -> bool {
        self.may_access(record.owner())
    }

    /// The one owner-checked lookup of jobs, templates and LoRAs: `found` when it exists and
    /// the caller may see it, else `not_found()`, the same answer for another key's record as
    /// for none (so ids of other keys cannot even be confirmed).
    pub fn owned<R: Owned>(
        &self,
        found: Option<R>,
        not_found: impl FnOnce() -> ApiError,
    ) -> Result<R, ApiError> {
        found.filter(|r| self.sees(r)).ok_or_else(not_found)
    }
}

/// A record that belongs to the API key that created it.
pub trait Owned {
    /// The creating key's id (`None`: created with authentication off).
    fn owner(&self) -> Option<&str>;
}

impl Owned for diffmesh_shared::stores::job::JobRecord {
    fn owner(&self) -> Option<&str> {
        self.owner.as_deref()
    }
}

impl Owned for diffmesh_shared::wire::lora::LoraRecord {
    fn owner(&self) -> Option<&str> {
        self.owner.as_deref()
    }
}

/// The configured keys, by the SHA-256 of the key (the key itself is not kept).
#[derive(Debug, Default)]
pub struct ApiKeys {
    by_hash: HashMap<[u8; 32], String>,
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl ApiKeys {
    /// Keys from `file` (one per line) and `list` (comma- or newline-separated); each entry is
    /// `key` or `name:key`; blank lines and lines starting with `#` are skipped. An unnamed
    /// key's id is `key-` and the first 12 hex digits of its hash.
    pub fn load(file: Option<&Path>, list: Option<&str>) -> Result<Self, String> {
        let mut keys = ApiKeys::default();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--api-keys-file {}: {e}", path.display()))?;
            for (i, line) in text.lines().enumerate() {
                keys.add_entry(line).map_err(|e| {
                    format!("--api-keys-file {} line {}: {e}", path.display(), i + 1)
                })?;
            }
        }
        if let Some(list) = list {
            for (i, entry) in list.split([',', '\n']).enumerate() {
                keys.add_entry(entry)
                    .map_err(|e| format!("GATEWAY_API_KEYS entry {}: {e}", i + 1))?;
            }
        }
        Ok(keys)
    }

    fn add_entry(&mut self, entry: &str) -> Result<(), String> {
        let entry = entry.trim();
        if entry.is_empty() || entry.starts_with('#') {
            return Ok(());
        }
        let (name, key) = match entry.split_once(':') {
            Some((name, key)) => (Some(name.trim()), key.trim()),
            None => (None, entry),
        };
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_graphic()) {
            return Err("the key must be non-empty printable ASCII without spaces".into());
        }
        let hash = sha256(key.as_bytes());
        let id = match name {
            Some(n)
                if !n.is_empty()
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) =>
            {
                n.to_string()
            }
            Some(n) => return Err(format!("key name {n:?} must be letters, digits, - _ .")),
            None => format!("key-{}", &hex(&hash)[..12]),
        };
        if self.by_hash.contains_key(&hash) {
            return Err(format!("the key of {id} is listed twice"));
        }
        if self.by_hash.values().any(|existing| *existing == id) {
            return Err(format!("key name {id} is used twice"));
        }
        self.by_hash.insert(hash, id);
        Ok(())
    }

    pub fn is_enabled(&self) -> bool {
        !self.by_hash.is_empty()
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The caller of a request with this `Authorization` header: 401 when keys are configured
    /// and the header is missing, not `Bearer <key>`, or names no configured key.
    pub fn authenticate(&self, header: Option<&HeaderValue>) -> Result<Caller, ApiError> {
        if !self.is_enabled() {
            return Ok(Caller::Anonymous);
        }
        let unauthorized = |message: &str| ApiError::Unauthorized {
            message: message.to_string(),
        };
        let value = header
            .ok_or_else(|| unauthorized("missing API key: send `Authorization: Bearer <key>`"))?
            .to_str()
            .map_err(|_| unauthorized("the Authorization header is not ASCII"))?;
        let token = value
            .split_once(' ')
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|t| !t.is_empty())
            .ok_or_else(|| unauthorized("the Authorization header must be `Bearer <key>`"))?;
        self.by_hash
            .get(&sha256(token.as_bytes()))
            .map(|id| Caller::Key(id.clone()))
            .ok_or_else(|| unauthorized("invalid API key"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(v: &str) -> HeaderValue {
        HeaderValue::from_str(v).unwrap()
    }

    #[test]
    fn no_keys_means_anonymous() {
        let keys = ApiKeys::load(None, Some(" , # nothing")).unwrap();
        assert!(!keys.is_enabled());
        assert_eq!(keys.authenticate(None).unwrap(), Caller::Anonymous);
        assert!(Caller::Anonymous.may_access(Some("alice")));
    }

    #[test]
    fn keys_from_file_and_list_authenticate() {
        let dir = std::env::temp_dir().join(format!("gw-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "# team keys\nalice:sk-alice-1\n\nsk-anon-2\n").unwrap();
        let keys = ApiKeys::load(Some(&file), Some("bob:sk-bob-3")).unwrap();
        assert_eq!(keys.len(), 3);
        let alice = keys
            .authenticate(Some(&header("Bearer sk-alice-1")))
            .unwrap();
        assert_eq!(alice, Caller::Key("alice".into()));
        assert_eq!(
            keys.authenticate(Some(&header("bearer sk-bob-3"))).unwrap(),
            Caller::Key("bob".into())
        );
        let anon = keys
            .authenticate(Some(&header("Bearer sk-anon-2")))
            .unwrap();
        assert!(anon.limit_key().starts_with("key-"), "{anon:?}");
        // Only hashes are kept.
        assert!(!format!("{keys:?}").contains("sk-alice-1"));
        // Ownership: a key sees its own jobs only.
        assert!(alice.may_access(Some("alice")));
        assert!(!alice.may_access(Some("bob")));
        assert!(!alice.may_access(None));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_headers_are_401() {
        let keys = ApiKeys::load(None, Some("alice:sk-alice-1")).unwrap();
        for h in [
            None,
            Some("sk-alice-1"),
            Some("Basic sk-alice-1"),
            Some("Bearer "),
            Some("Bearer wrong"),
        ] {
            let hv = h.map(header);
            let err = keys.authenticate(hv.as_ref()).unwrap_err();
            assert!(matches!(err, ApiError::Unauthorized { .. }), "{h:?}: {err}");
        }
    }

    #[test]
    fn bad_key_lists_are_refused() {
        assert!(
            ApiKeys::load(None, Some("a:k1,a:k2")).is_err(),
            "duplicate name"
        );
        assert!(
            ApiKeys::load(None, Some("a:k1,b:k1")).is_err(),
            "duplicate key"
        );
        assert!(ApiKeys::load(None, Some("a b:k1")).is_err(), "bad name");
        assert!(ApiKeys::load(None, Some("a:")).is_err(), "empty key");
        assert!(ApiKeys::load(Some(Path::new("/nonexistent/keys")), None).is_err());
    }
}
