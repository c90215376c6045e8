//! Webhook deliveries due, as a JetStream work queue (`DIFFMESH_WEBHOOKS`) shared by every
//! gateway, and the two durable consumers that move them:
//! - the relay (`diffmesh-webhook-relay`) reads every write of a job record (the job bucket's
//!   own stream) and, for a record whose webhook became due ([`JobRecord::webhook_due`]),
//!   appends the job's id here. Every writer of an ending (a gateway, the router that placed
//!   an async job) is covered without any of them knowing of webhooks, and a relay that dies
//!   before its ack leaves the record's message to another.
//! - the senders (`diffmesh-webhook-senders`) post each due webhook. A message stays until a
//!   sender acks it (delivered or given up): a failed post is retried by a negative ack with a
//!   delay, and a sender that dies holding one leaves it to another after the ack wait.
//!
//! The job id is the message id too, so a relay's repeat within [`DUPLICATE_WINDOW`] is
//! stored once; a later one is dropped by the record's claim ([`super::job::Webhook::claim`]).
//!
//! [`JobRecord::webhook_due`]: super::job::JobRecord::webhook_due
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use async_nats::HeaderMap;

use crate::error::MeshError;
use crate::stores::async_queue;
use crate::wire::subjects::JOB_BUCKET;

/// The stream's name.
pub const STREAM: &str = "DIFFMESH_WEBHOOKS";
/// The one subject deliveries due are appended on.
pub const SUBJECT: &str = "diffmesh.webhooks.due";
/// The gateways' shared consumer of [`STREAM`].
pub const SENDERS: &str = "diffmesh-webhook-senders";
/// The gateways' shared consumer of the job bucket's stream.
pub const RELAY: &str = "diffmesh-webhook-relay";
/// Deliveries due at most; beyond it the relay waits and tries again (the records keep them).
pub const MAX_DUE: i64 = 100_000;
/// A repeated announcement of one job within this window is stored once.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(600);
/// Longest a due delivery is kept, whatever its retries (gateways give up sooner:
/// `--webhook-max-age` is at most [`MAX_WEBHOOK_AGE`]).
const MAX_AGE: Duration = Duration::from_secs(4 * 24 * 3600);
/// The longest `--webhook-max-age` a gateway takes.
pub const MAX_WEBHOOK_AGE: Duration = Duration::from_secs(3 * 24 * 3600);
/// A sender holding a message past this without a word loses it to another sender; senders
/// send a progress ack every [`PROGRESS_EVERY`] while they work on one, however long a post or
/// the record's writes take.
pub const ACK_WAIT: Duration = Duration::from_secs(30);
/// How often a sender working on a message tells the server so.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// A message is a job id (a UUID); anything longer is not one of ours.
const MAX_MESSAGE_BYTES: i32 = 1024;

fn stream_config(replicas: usize) -> stream::Config {
    stream::Config {
        name: STREAM.to_string(),
        subjects: vec![SUBJECT.to_string()],
        retention: stream::RetentionPolicy::WorkQueue,
        max_messages: MAX_DUE,
        max_bytes: MAX_DUE * i64::from(MAX_MESSAGE_BYTES),
        max_message_size: MAX_MESSAGE_BYTES,
        discard: stream::DiscardPolicy::New,
        max_age: MAX_AGE,
        duplicate_window: DUPLICATE_WINDOW,
        num_replicas: replicas.max(1),
        ..Default::default()
    }
}

/// The queue of webhook deliveries due.
#[derive(Clone)]
pub struct WebhookQueue {
    js: jetstream::Context,
}

impl WebhookQueue {
    /// Open the stream, creating it when missing, raising its replicas to `replicas`.
    pub async fn open(js: &jetstream::Context, replicas: usize) -> Result<Self, MeshError> {
        let wanted = stream_config(replicas);
        match js.get_stream(STREAM).await {
            Ok(existing) => {
                let mut config = existing.cached_info().config.clone();
                if config.num_replicas < wanted.num_replicas {
                    config.num_replicas = wanted.num_replicas;
                    js.update_stream(config)
                        .await
                        .map_err(|e| layout_error(format!("update: {e}")))?;
                }
            }
            Err(_) => async_queue::create_or_find(js, wanted)
                .await
                .map_err(layout_error)?,
        }
        Ok(Self { js: js.clone() })
    }

    /// Append `job_id`'s delivery (stored once within [`DUPLICATE_WINDOW`]).
    pub async fn announce(&self, job_id: &str) -> Result<(), MeshError> {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", job_id);
        let ack = self
            .js
            .publish_with_headers(SUBJECT, headers, job_id.to_string().into())
            .await
            .map_err(|e| layout_error(format!("publish: {e}")))?;
        ack.await
            .map(drop)
            .map_err(|e| layout_error(format!("publish: {e}")))
    }

    /// The senders' consumer (created on first use).
    pub async fn senders(&self) -> Result<consumer::Consumer<consumer::pull::Config>, MeshError> {
        let stream = self
            .js
            .get_stream(STREAM)
            .await
            .map_err(|e| layout_error(format!("get: {e}")))?;
        stream
            .get_or_create_consumer(
                SENDERS,
                consumer::pull::Config {
                    durable_name: Some(SENDERS.to_string()),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: ACK_WAIT,
                    // Deliveries waiting for their retry are pending too: room for all of them.
                    max_ack_pending: MAX_DUE,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| layout_error(format!("senders' consumer: {e}")))
    }

    /// The relay's consumer of the job bucket's stream (created on first use): job records
    /// only (single-token keys; the owner index's `owners.…` entries are not). Made, it starts
    /// [`MAX_WEBHOOK_AGE`] back, so records that ended before any gateway made it are relayed
    /// too (a record already claimed or without a webhook is passed over).
    pub async fn relay(&self) -> Result<consumer::Consumer<consumer::pull::Config>, MeshError> {
        // The bucket's stream, as `jetstream_layout::JOBS` names it (`KV_<bucket>`).
        let stream = self
            .js
            .get_stream(format!("KV_{JOB_BUCKET}"))
            .await
            .map_err(|e| layout_error(format!("job bucket: {e}")))?;
        stream
            .get_or_create_consumer(
                RELAY,
                consumer::pull::Config {
                    durable_name: Some(RELAY.to_string()),
                    filter_subject: format!("$KV.{JOB_BUCKET}.*"),
                    deliver_policy: consumer::DeliverPolicy::ByStartTime {
                        start_time: time::OffsetDateTime::now_utc() - MAX_WEBHOOK_AGE,
                    },
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: Duration::from_secs(30),
                    max_ack_pending: 1_000,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| layout_error(format!("relay's consumer: {e}")))
    }
}

fn layout_error(reason: String) -> MeshError {
    MeshError::JetStreamLayout {
        name: STREAM.to_string(),
        reason,
    }
}
