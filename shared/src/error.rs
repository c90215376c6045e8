//! The mesh layer's error type: NATS, JetStream, encoding and telemetry failures.
//!
//! Services wrap it in their own error enums (`#[from] MeshError`) and map those to HTTP status
//! or reply messages in one place.
use std::time::Duration;

use async_nats::jetstream::{context, kv, object_store};

/// Anything that can go wrong talking to the mesh.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("connecting to NATS at {url} failed after {attempts} attempts: {source}")]
    Connect {
        url: String,
        attempts: u32,
        #[source]
        source: async_nats::ConnectError,
    },
    /// Nobody answered within the deadline (the subscriber exists but is slow or stuck).
    #[error("request on {subject} timed out after {timeout:?}")]
    Timeout { subject: String, timeout: Duration },
    /// Nobody subscribes to the subject (the service is not running).
    #[error("no service answers on {subject}")]
    NoResponders { subject: String },
    #[error("request on {subject} failed: {source}")]
    Request {
        subject: String,
        #[source]
        source: async_nats::RequestError,
    },
    #[error("publish failed: {0}")]
    Publish(#[from] async_nats::PublishError),
    #[error("subscribe failed: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
    #[error("encoding a message failed: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    #[error("decoding a message failed: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    #[error("job record is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("blob {key} not found in the object store")]
    BlobNotFound { key: String },
    #[error("blob {key} is {size} bytes, above the limit of {limit}")]
    BlobTooLarge {
        key: String,
        size: usize,
        limit: usize,
    },
    /// The object stopped arriving (deleted while being read, or the server is gone).
    #[error("blob {key}: no data for {after:?} after {read} bytes")]
    BlobStalled {
        key: String,
        after: Duration,
        read: usize,
    },
    /// A read of an object's chunks from the stream leader failed (no leader, a chunk gone
    /// because the object was replaced or deleted mid-read, a wrong digest).
    #[error("blob {key}: reading from the stream leader failed: {reason}")]
    BlobRead { key: String, reason: String },
    /// Creating, reading or updating one of the mesh's streams (`jetstream_layout`) failed.
    #[error("JetStream stream {name}: {reason}")]
    JetStreamLayout { name: String, reason: String },
    #[error("object store put failed: {0}")]
    BlobPut(#[from] object_store::PutError),
    /// The bucket is at its byte bound (its share of `JS_MAX_BYTES`) and refuses new objects.
    #[error(
        "storage bucket {bucket} is full: {stored} of its {bound} bytes are taken and {needed} \
         more do not fit (delete templates or LoRAs, or raise JS_MAX_BYTES)"
    )]
    StoreFull {
        bucket: String,
        stored: u64,
        bound: u64,
        needed: u64,
    },
    #[error("object store get failed: {0}")]
    BlobGet(#[from] object_store::GetError),
    #[error("object store delete failed: {0}")]
    BlobDelete(#[from] object_store::DeleteError),
    #[error("opening key-value bucket failed: {0}")]
    KvOpen(#[from] context::KeyValueError),
    #[error("key-value read failed: {0}")]
    KvEntry(#[from] kv::EntryError),
    #[error("key-value put failed: {0}")]
    KvPut(#[from] kv::PutError),
    #[error("key-value create failed: {0}")]
    KvCreate(#[from] kv::CreateError),
    #[error("key-value update failed: {0}")]
    KvUpdate(#[from] kv::UpdateError),
    #[error("key-value watch failed: {0}")]
    KvWatch(#[from] kv::WatchError),
    #[error("key-value watcher failed: {0}")]
    KvWatcher(#[from] kv::WatcherError),
    /// The ordered consumer that follows job records could not be made or read.
    #[error("watching job records failed: {0}")]
    RecordWatch(String),
    #[error("job {job_id} not found")]
    JobNotFound { job_id: String },
    #[error("KV entry {key} changed concurrently {attempts} times; giving up")]
    KvContention { key: String, attempts: u32 },
    #[error("reading a blob failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("telemetry setup failed: {0}")]
    Telemetry(String),
    /// A flag names something that cannot be used (a missing file): no retry helps.
    #[error("configuration: {0}")]
    Config(String),
}

impl MeshError {
    /// A short, stable label for the failure counter (`reason` label).
    pub fn reason(&self) -> &'static str {
        match self {
            MeshError::Connect { .. } => "nats_connect",
            MeshError::Timeout { .. } => "timeout",
            MeshError::NoResponders { .. } => "no_responders",
            MeshError::Request { .. } | MeshError::Publish(_) | MeshError::Subscribe(_) => "nats",
            MeshError::Encode(_) | MeshError::Decode(_) | MeshError::Json(_) => "codec",
            MeshError::BlobNotFound { .. } => "blob_not_found",
            MeshError::BlobTooLarge { .. } => "blob_too_large",
            MeshError::BlobStalled { .. } => "blob_stalled",
            MeshError::BlobPut(_)
            | MeshError::BlobGet(_)
            | MeshError::BlobRead { .. }
            | MeshError::BlobDelete(_)
            | MeshError::Io(_) => "object_store",
            MeshError::JetStreamLayout { .. } => "jetstream_layout",
            MeshError::StoreFull { .. } => "store_full",
            MeshError::KvOpen(_)
            | MeshError::KvEntry(_)
            | MeshError::KvPut(_)
            | MeshError::KvCreate(_)
            | MeshError::KvUpdate(_)
            | MeshError::KvWatch(_)
            | MeshError::KvWatcher(_)
            | MeshError::RecordWatch(_)
            | MeshError::JobNotFound { .. }
            | MeshError::KvContention { .. } => "job_store",
            MeshError::Telemetry(_) => "telemetry",
            MeshError::Config(_) => "config",
        }
    }
}

/// The text of a caught panic (`std::panic::catch_unwind`'s payload).
pub fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}
