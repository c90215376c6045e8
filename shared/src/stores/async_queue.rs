//! The durable queue of accepted async jobs: a JetStream work-queue stream
//! (`DIFFMESH_ASYNC_JOBS`) that a gateway appends a prepared job to before it answers 202, and
//! that routers consume from as denoisers have room. A job leaves it only when a router acked it
//! after placing it (or found it ended), so a gateway, router or denoiser crash loses none: an
//! unacked message goes to another router after the consumer's ack wait.
//!
//! Bounds, kept by the server so every gateway replica sees the same ones: the stream holds at
//! most `max_jobs` messages, and at most `max_per_key` on one key's subject
//! (`diffmesh.queue.async.<key token>`, `discard_new_per_subject`). A publish beyond either is
//! refused, which the gateway answers 429 at submit time ([`QueueRefusal`]).
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use async_nats::HeaderMap;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::MeshError;
use crate::wire::messages::DenoiseJob;

/// The stream's name.
pub const STREAM: &str = "DIFFMESH_ASYNC_JOBS";
/// Subject prefix; one subject per API key below it.
pub const SUBJECT_PREFIX: &str = "diffmesh.queue.async";
/// The routers' shared durable consumer: each message goes to one router at a time.
pub const CONSUMER: &str = "diffmesh-routers";
/// A message a router holds unacked for this long goes to another router; holders send a
/// progress ack well within it.
pub const ACK_WAIT: Duration = Duration::from_secs(10);
/// How often a router holding a job tells the server it is still working on it.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(3);
/// Largest message (a prepared job is a few KiB: prompts, keys, parameters).
const MAX_MESSAGE_BYTES: i32 = 256 * 1024;
/// A job older than this is dropped by the server even if no router saw it (every job's own
/// deadline is far shorter: [`QueuedJob::place_by_ms`]).
const MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// One queued job, as a gateway appends it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueuedJob {
    pub job: DenoiseJob,
    /// Unix ms after which the job is not placed any more but failed (its `deadline_ms`, or the
    /// gateway's longest queue time).
    pub place_by_ms: u64,
}

/// The queue's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueBounds {
    pub max_jobs: u32,
    pub max_per_key: u32,
}

impl Default for QueueBounds {
    fn default() -> Self {
        Self {
            max_jobs: 10_000,
            max_per_key: 1_000,
        }
    }
}

/// Why the queue refused a job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueRefusal {
    #[error("the mesh's queue of async jobs is full ({0} jobs)")]
    Full(u32),
    #[error("this API key's queue of async jobs is full ({0} jobs)")]
    KeyFull(u32),
}

/// The subject token of an API key: a hash, so a key id never appears in a subject and any
/// string makes a valid token. `None` (authentication off) shares one subject.
pub fn key_token(owner: Option<&str>) -> String {
    match owner {
        None => "anonymous".to_string(),
        Some(owner) => {
            let digest = Sha256::digest(owner.as_bytes());
            digest[..12].iter().map(|b| format!("{b:02x}")).collect()
        }
    }
}

/// The subject a key's jobs are queued on.
pub fn key_subject(owner: Option<&str>) -> String {
    format!("{SUBJECT_PREFIX}.{}", key_token(owner))
}

fn stream_config(bounds: QueueBounds, replicas: usize) -> stream::Config {
    stream::Config {
        name: STREAM.to_string(),
        subjects: vec![format!("{SUBJECT_PREFIX}.>")],
        retention: stream::RetentionPolicy::WorkQueue,
        max_messages: i64::from(bounds.max_jobs),
        max_messages_per_subject: i64::from(bounds.max_per_key),
        max_bytes: i64::from(bounds.max_jobs) * i64::from(MAX_MESSAGE_BYTES),
        max_message_size: MAX_MESSAGE_BYTES,
        discard: stream::DiscardPolicy::New,
        discard_new_per_subject: true,
        max_age: MAX_AGE,
        // A retried publish of the same job (its id as `Nats-Msg-Id`) is stored once.
        duplicate_window: Duration::from_secs(120),
        num_replicas: replicas.max(1),
        ..Default::default()
    }
}

/// The queue stream, as a gateway (which sets the bounds) or a router (which takes them as they
/// are) opens it.
#[derive(Clone)]
pub struct AsyncQueue {
    js: jetstream::Context,
}

impl AsyncQueue {
    /// Open the stream, creating it with `bounds` when missing, or setting `bounds` on it when
    /// given and different (gateways own the bounds; give every replica the same ones).
    pub async fn open(
        js: &jetstream::Context,
        bounds: Option<QueueBounds>,
        replicas: usize,
    ) -> Result<Self, MeshError> {
        let wanted = stream_config(bounds.unwrap_or_default(), replicas);
        match js.get_stream(STREAM).await {
            Ok(existing) => {
                let mut config = existing.cached_info().config.clone();
                let stale = bounds.is_some()
                    && (config.max_messages != wanted.max_messages
                        || config.max_messages_per_subject != wanted.max_messages_per_subject
                        || config.max_bytes != wanted.max_bytes);
                let fewer_replicas = config.num_replicas < wanted.num_replicas;
                if stale || fewer_replicas {
                    // A router (no bounds) raises replicas only: the gateways' bounds stay.
                    if bounds.is_some() {
                        config.max_messages = wanted.max_messages;
                        config.max_messages_per_subject = wanted.max_messages_per_subject;
                        config.max_bytes = wanted.max_bytes;
                    }
                    config.num_replicas = config.num_replicas.max(wanted.num_replicas);
                    js.update_stream(config)
                        .await
                        .map_err(|e| layout_error(format!("update: {e}")))?;
                }
            }
            Err(_) => create_or_find(js, wanted).await.map_err(layout_error)?,
        }
        Ok(Self { js: js.clone() })
    }

    /// Append a job for `owner`; answers its sequence in the stream. A job published again
    /// (same id within two minutes) is stored once and answers the first sequence.
    pub async fn enqueue(
        &self,
        owner: Option<&str>,
        queued: &QueuedJob,
    ) -> Result<Result<u64, QueueRefusal>, MeshError> {
        let payload = rmp_serde::to_vec_named(queued)?;
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", queued.job.job_id.as_str());
        let sent = self
            .js
            .publish_with_headers(key_subject(owner), headers, payload.into())
            .await;
        let acked = match sent {
            Ok(ack) => ack.await,
            Err(err) => Err(err),
        };
        match acked {
            Ok(ack) => Ok(Ok(ack.sequence)),
            Err(err) => {
                let text = format!("{err} {:?}", std::error::Error::source(&err));
                match refusal_of(&text) {
                    Some(Limit::PerKey) => Ok(Err(QueueRefusal::KeyFull(self.bound(true).await))),
                    Some(Limit::Total) => Ok(Err(QueueRefusal::Full(self.bound(false).await))),
                    None => Err(layout_error(format!("publish: {text}"))),
                }
            }
        }
    }

    /// The configured bound (for the refusal's message).
    async fn bound(&self, per_key: bool) -> u32 {
        match self.stream().await {
            Ok(s) => {
                let c = &s.cached_info().config;
                let v = if per_key {
                    c.max_messages_per_subject
                } else {
                    c.max_messages
                };
                u32::try_from(v).unwrap_or(u32::MAX)
            }
            Err(_) => 0,
        }
    }

    /// Jobs ahead of the one at `sequence`: the messages still queued below it, counted from the
    /// stream's first sequence (a job cancelled out of the middle may make it overstate by one
    /// per such job until the queue moves past it). None when it is no longer queued.
    pub async fn position(&self, sequence: u64) -> Result<Option<u32>, MeshError> {
        // `get_stream` reads the stream's info afresh: its state is current.
        let stream = self.stream().await?;
        let state = &stream.cached_info().state;
        if state.messages == 0 || sequence < state.first_sequence {
            return Ok(None);
        }
        let ahead = (sequence - state.first_sequence).min(state.messages.saturating_sub(1));
        Ok(Some(u32::try_from(ahead).unwrap_or(u32::MAX)))
    }

    /// Take a cancelled job out of the queue (false: a router had taken it already).
    pub async fn remove(&self, sequence: u64) -> bool {
        match self.stream().await {
            Ok(stream) => stream.delete_message(sequence).await.unwrap_or(false),
            Err(_) => false,
        }
    }

    /// The routers' shared consumer (created on first use).
    pub async fn consumer(&self) -> Result<consumer::Consumer<consumer::pull::Config>, MeshError> {
        self.stream()
            .await?
            .get_or_create_consumer(
                CONSUMER,
                consumer::pull::Config {
                    durable_name: Some(CONSUMER.to_string()),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: ACK_WAIT,
                    // Held jobs are bounded by the routers (a few each), not by the server.
                    max_ack_pending: 10_000,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| layout_error(format!("consumer: {e}")))
    }

    /// The stream, with its info as of now.
    async fn stream(&self) -> Result<stream::Stream, MeshError> {
        self.js
            .get_stream(STREAM)
            .await
            .map_err(|e| layout_error(format!("get: {e}")))
    }
}

/// Create the stream `wanted`, or find it when another service created it meanwhile; the
/// reason it is neither, for the caller's error.
pub(crate) async fn create_or_find(
    js: &jetstream::Context,
    wanted: stream::Config,
) -> Result<(), String> {
    let name = wanted.name.clone();
    if let Err(err) = js.create_stream(wanted).await {
        js.get_stream(&name)
            .await
            .map_err(|_| format!("create: {err}"))?;
    }
    Ok(())
}

fn layout_error(reason: String) -> MeshError {
    MeshError::JetStreamLayout {
        name: STREAM.to_string(),
        reason,
    }
}

enum Limit {
    Total,
    PerKey,
}

/// Which bound a refused publish hit, from the server's description (10077 "maximum messages
/// exceeded", 10078 "maximum messages per subject exceeded", "maximum bytes exceeded").
fn refusal_of(text: &str) -> Option<Limit> {
    let text = text.to_ascii_lowercase();
    if text.contains("per subject") {
        Some(Limit::PerKey)
    } else if text.contains("maximum messages") || text.contains("maximum bytes") {
        Some(Limit::Total)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_tokens_are_subject_safe_and_distinct() {
        let a = key_token(Some("key.with dots>*"));
        assert_eq!(a.len(), 24);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, key_token(Some("other")));
        assert_eq!(key_token(None), "anonymous");
        assert_eq!(key_subject(None), "diffmesh.queue.async.anonymous");
    }

    #[test]
    fn refusals_name_their_bound() {
        assert!(matches!(
            refusal_of("publish failed: maximum messages per subject exceeded"),
            Some(Limit::PerKey)
        ));
        assert!(matches!(
            refusal_of("Some(maximum messages exceeded)"),
            Some(Limit::Total)
        ));
        assert!(refusal_of("timed out").is_none());
    }
}
