//! The cachestore's request/reply contract (subjects under `subjects::CACHESTORE_PREFIX`).
//!
//! Small values ride inline as MessagePack `bin`. A value above the inline limit is read in
//! ranges straight from the instance that answered (`CacheGetReply::Ranged`, when the get asked
//! for it), or else through the JetStream object store bucket [`CACHE_BUCKET`] under the cache
//! key itself, and the messages only say so (`in_object_store`). `crate::stores::cache_read` is the
//! client side.
use crate::wire::subjects::CACHESTORE_PREFIX;
use serde::{Deserialize, Serialize};

/// JetStream object store bucket of the cluster cache tier (also the transport for large values).
pub const CACHE_BUCKET: &str = "diffmesh-cache";
/// Values up to this size may ride inline in a message; larger ones must use the object store.
pub const DEFAULT_INLINE_LIMIT: usize = 256 * 1024;

pub fn get_subject() -> String {
    format!("{CACHESTORE_PREFIX}.get")
}
pub fn put_subject() -> String {
    format!("{CACHESTORE_PREFIX}.put")
}
pub fn delete_subject() -> String {
    format!("{CACHESTORE_PREFIX}.delete")
}
pub fn stats_subject() -> String {
    format!("{CACHESTORE_PREFIX}.stats")
}
/// Request/reply: which tiers hold each of some keys ([`CacheLocate`]).
pub fn locate_subject() -> String {
    format!("{CACHESTORE_PREFIX}.locate")
}
/// Publish (fire and forget) or request: promote keys into the memory tier ([`CachePrefetch`]).
pub fn prefetch_subject() -> String {
    format!("{CACHESTORE_PREFIX}.prefetch")
}
/// Queue group of cachestore instances.
pub const CACHESTORE_QUEUE: &str = "cachestore";

/// Which tier answered a get.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CacheTier {
    Memory,
    Disk,
    Cluster,
}

impl CacheTier {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheTier::Memory => "memory",
            CacheTier::Disk => "disk",
            CacheTier::Cluster => "cluster",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheGet {
    pub key: String,
    /// The caller can read a large value in ranges ([`CacheGetReply::Ranged`]); without it a
    /// large value comes through the object store.
    #[serde(default)]
    pub ranged: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CacheGetReply {
    /// The value, inline (small values).
    Inline {
        tier: CacheTier,
        #[serde(with = "bin")]
        value: Vec<u8>,
    },
    /// The value is in [`CACHE_BUCKET`] under the same key; read it from there.
    InObjectStore {
        tier: CacheTier,
        size: u64,
    },
    /// The answering instance holds the value for a while as `transfer`: read it with
    /// [`CacheRange`] requests to `subject` (that instance's own), each answered with the raw
    /// bytes of its range as the payload, or with [`RANGE_STATUS_HEADER`] set and no payload.
    Ranged {
        tier: CacheTier,
        size: u64,
        subject: String,
        transfer: String,
    },
    Missing,
    Failed {
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachePut {
    pub key: String,
    /// Inline value; `None` when the caller already wrote it to [`CACHE_BUCKET`] under `key`.
    #[serde(with = "opt_bin", default)]
    pub value: Option<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CachePutReply {
    Stored { size: u64 },
    Failed { message: String },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheDelete {
    pub key: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CacheDeleteReply {
    Deleted { existed: bool },
    Failed { message: String },
}

/// Which tiers hold each key. Answered from one cachestore instance: its own memory and disk
/// tiers and the shared cluster tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheLocate {
    pub keys: Vec<String>,
}

/// Where one key is, fastest tier first (empty: nowhere).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyLocation {
    pub key: String,
    pub tiers: Vec<CacheTier>,
    /// Size of the value in bytes, when any tier holds it.
    pub size: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CacheLocateReply {
    /// One location per requested key, in request order.
    Located {
        keys: Vec<KeyLocation>,
    },
    Failed {
        message: String,
    },
}

/// Promote keys into the memory tier in the background, so a later get is a memory hit.
/// Keys already in memory, and keys no tier holds, are skipped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachePrefetch {
    pub keys: Vec<String>,
}

/// Sent only when the prefetch was a request (it is usually published without a reply subject).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CachePrefetchReply {
    /// How many keys were queued for promotion (the promotion itself runs after this reply).
    Scheduled {
        keys: u32,
    },
    Failed {
        message: String,
    },
}

/// Bytes `offset .. offset + len` of a ranged transfer ([`CacheGetReply::Ranged`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheRange {
    pub transfer: String,
    pub offset: u64,
    pub len: u64,
}

/// Set on a range reply that carries no bytes: `gone` (the transfer expired: get the value
/// again) or `failed: <why>` (a bad range).
pub const RANGE_STATUS_HEADER: &str = "Diffmesh-Range-Status";
pub const RANGE_GONE: &str = "gone";

/// Subject of one cachestore instance's range requests (no queue group: only the instance
/// holding the transfer can answer).
pub fn range_subject(instance: &str) -> String {
    format!("{CACHESTORE_PREFIX}.range.{instance}")
}

/// Most keys one locate or prefetch request may name (a template cache is `steps + 1` keys).
pub const MAX_KEYS_PER_REQUEST: usize = 1024;

/// Every cachestore key of a template cache of `steps` steps: its meta entry, then the step
/// entries `s0 .. s<steps-1>` (`shared::wire::templates` names them).
pub fn template_keys(cache_key: &str, steps: u32) -> Vec<String> {
    std::iter::once(crate::wire::templates::meta_key(cache_key))
        .chain((0..steps).map(|s| crate::wire::templates::step_key(cache_key, s)))
        .collect()
}

/// Per-tier counters of one cachestore instance.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TierStats {
    pub entries: u64,
    pub bytes: u64,
    pub hits: u64,
    pub misses: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheStatsReply {
    pub memory: TierStats,
    pub disk: TierStats,
    /// Entries/bytes of the cluster tier are not counted (shared bucket); hits/misses are this
    /// instance's.
    pub cluster: TierStats,
}

/// Serialize `Vec<u8>` as MessagePack `bin` (serde's default would be an array of integers).
mod bin {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        d.deserialize_byte_buf(BytesVisitor)
    }

    pub(super) struct BytesVisitor;

    impl<'de> serde::de::Visitor<'de> for BytesVisitor {
        type Value = Vec<u8>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a byte string")
        }
        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }
        fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            // The hint is the length the message claims: a few bytes may claim 4 GiB. Reserve at
            // most what a real value's first chunk needs; the loop grows it as bytes arrive.
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64 * 1024));
            while let Some(b) = seq.next_element::<u8>()? {
                out.push(b);
            }
            Ok(out)
        }
    }
}

mod opt_bin {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_some(&Wrapper(b)),
            None => s.serialize_none(),
        }
    }

    struct Wrapper<'a>(&'a [u8]);
    impl serde::Serialize for Wrapper<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }

    struct Owned(Vec<u8>);
    impl<'de> Deserialize<'de> for Owned {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_byte_buf(super::bin::BytesVisitor).map(Owned)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        Ok(Option::<Owned>::deserialize(d)?.map(|o| o.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::messages::{decode, encode};

    #[test]
    fn template_keys_are_meta_then_every_step() {
        assert_eq!(
            template_keys("tpl-x", 3),
            vec!["tpl-x/meta", "tpl-x/s0", "tpl-x/s1", "tpl-x/s2"]
        );
        let locate = CacheLocateReply::Located {
            keys: vec![KeyLocation {
                key: "k".into(),
                tiers: vec![CacheTier::Memory, CacheTier::Cluster],
                size: Some(3),
            }],
        };
        assert_eq!(
            decode::<CacheLocateReply>(&encode(&locate).unwrap()).unwrap(),
            locate
        );
    }

    #[test]
    fn values_travel_as_compact_bin() {
        let value: Vec<u8> = (0..=255).collect();
        let reply = CacheGetReply::Inline {
            tier: CacheTier::Disk,
            value: value.clone(),
        };
        let bytes = encode(&reply).unwrap();
        // bin8/16 header + 256 raw bytes + small envelope; an int array would be ~384+ bytes.
        assert!(bytes.len() < 256 + 40, "encoded {} bytes", bytes.len());
        assert_eq!(decode::<CacheGetReply>(&bytes).unwrap(), reply);
        for put in [
            CachePut {
                key: "k".into(),
                value: Some(value),
            },
            CachePut {
                key: "k".into(),
                value: None,
            },
        ] {
            assert_eq!(decode::<CachePut>(&encode(&put).unwrap()).unwrap(), put);
        }
    }
}
