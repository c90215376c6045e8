//! Which jobs an API key created, for `GET /v1/jobs`: one empty entry per job in the job
//! bucket itself, under `owners.<owner token>.<created ms>.<job id>`, written with the record.
//! Listing a key's jobs reads the keys under its token alone (a consumer filtered to them,
//! headers only), not every record of the bucket; the entries expire with the records (the
//! bucket's age limit) and are dropped with them when the bucket is full. Empty values keep them
//! out of the record watches (which skip empty payloads) and cost a few dozen bytes each.
use std::time::Duration;

use async_nats::jetstream::{consumer, kv};
use futures::StreamExt;

use crate::error::MeshError;

/// The first token of every index key (job ids are UUIDs: no record key starts so).
pub const PREFIX: &str = "owners";

/// Most index entries one listing reads (the newest are kept).
pub const MAX_LISTED: usize = 10_000;

/// How long a listing waits for the next index entry before it gives up.
const NEXT_ENTRY_TIMEOUT: Duration = Duration::from_secs(5);

/// A subject-safe token of `owner` (an API key id, any characters): FNV-1a of it in hex, or
/// `anonymous` for jobs made with authentication off. Two keys sharing a token would only
/// see each other's job ids in the index: listings check every record's owner.
pub fn owner_token(owner: Option<&str>) -> String {
    match owner {
        None => "anonymous".into(),
        Some(owner) => {
            let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
            for b in owner.bytes() {
                hash ^= u64::from(b);
                hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            }
            format!("{hash:016x}")
        }
    }
}

/// The index key of a job created at `created_ms` by `owner`.
pub fn index_key(owner: Option<&str>, created_ms: u64, job_id: &str) -> String {
    format!("{PREFIX}.{}.{created_ms:016}.{job_id}", owner_token(owner))
}

/// Whether `key` (a key of the job bucket) is an index entry, not a record.
pub fn is_index_key(key: &str) -> bool {
    key.starts_with(PREFIX) && key.as_bytes().get(PREFIX.len()) == Some(&b'.')
}

/// The ids of the jobs `owner` created that the bucket still holds.
#[derive(Debug, Default)]
pub struct OwnedJobs {
    /// Newest first, at most [`MAX_LISTED`].
    pub ids: Vec<String>,
    /// Older ones were left out (beyond [`MAX_LISTED`]).
    pub truncated: bool,
}

/// The job ids `owner` created that the bucket still holds, newest first.
pub async fn owned_job_ids(
    kv: &kv::Store,
    client: &async_nats::Client,
    owner: Option<&str>,
) -> Result<OwnedJobs, MeshError> {
    let failed = |e: &dyn std::fmt::Display| MeshError::RecordWatch(format!("job listing: {e}"));
    let filter = format!("{}{PREFIX}.{}.>", kv.prefix, owner_token(owner));
    let consumer = kv
        .stream
        .create_consumer(consumer::push::OrderedConfig {
            deliver_subject: client.new_inbox(),
            description: Some("a key's jobs".to_string()),
            filter_subject: filter.clone(),
            headers_only: true,
            replay_policy: consumer::ReplayPolicy::Instant,
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .map_err(|e| failed(&e))?;
    let mut found: std::collections::VecDeque<(u64, String)> = Default::default();
    if consumer.cached_info().num_pending == 0 {
        return Ok(OwnedJobs::default());
    }
    let mut truncated = false;
    let mut messages = consumer.messages().await.map_err(|e| failed(&e))?;
    let prefix_len = filter.len() - 1;
    loop {
        let message = match tokio::time::timeout(NEXT_ENTRY_TIMEOUT, messages.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => return Err(failed(&e)),
            Ok(None) => break,
            Err(_) => return Err(failed(&"no answer from the job bucket")),
        };
        let pending = message.info().map(|i| i.pending).unwrap_or(0);
        // `<created ms>.<job id>` after the owner's prefix.
        let rest = message
            .subject
            .as_str()
            .get(prefix_len..)
            .unwrap_or_default();
        if let Some((created, job_id)) = rest.split_once('.') {
            if let Ok(created) = created.parse::<u64>() {
                if found.len() == MAX_LISTED {
                    found.pop_front();
                    truncated = true;
                }
                found.push_back((created, job_id.to_string()));
            }
        }
        if pending == 0 {
            break;
        }
    }
    let mut found: Vec<(u64, String)> = found.into();
    found.sort_by(|a, b| b.cmp(a));
    Ok(OwnedJobs {
        ids: found.into_iter().map(|(_, id)| id).collect(),
        truncated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_keys_are_subject_safe_and_never_record_keys() {
        let key = index_key(Some("key with spaces.and dots*"), 42, "0b5e-uuid");
        assert!(
            key.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
            "{key}"
        );
        assert!(key.ends_with(".0000000000000042.0b5e-uuid"), "{key}");
        assert!(is_index_key(&key));
        assert!(!is_index_key("6f1c2e4a-8d1b-4c1e-9f5e-3b2a1d0c9e8f"));
        assert!(!is_index_key("ownersx"));
        assert_eq!(
            index_key(None, 1, "j"),
            "owners.anonymous.0000000000000001.j"
        );
        assert_ne!(owner_token(Some("a")), owner_token(Some("b")));
    }
}
