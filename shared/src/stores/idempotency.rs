//! `Idempotency-Key` -> job: a client that repeats a submission with the same key gets the
//! job the first one created, not a second job (the gateway's `POST /v1/...` routes).
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use serde::{Deserialize, Serialize};

use crate::error::MeshError;
use crate::stores::jetstream_layout;
use crate::stores::record::{Record, RecordStore};

/// What an `Idempotency-Key` points at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    pub job_id: String,
    /// Hash of the request that created the job: a repeat with another request is refused.
    pub fingerprint: String,
    pub created_at_ms: u64,
}

impl Record for IdempotencyRecord {
    const KIND: &'static str = "idempotency";
}

/// The first claim of a key wins; later claims learn the winner's job.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    Created,
    Existing(IdempotencyRecord),
}

/// `Idempotency-Key` -> job, per API key, in `subjects::IDEMPOTENCY_BUCKET` (a day's memory).
#[derive(Clone)]
pub struct IdempotencyStore {
    records: RecordStore<IdempotencyRecord>,
}

/// How long a repeated key returns the same job.
pub const IDEMPOTENCY_TTL: Duration = jetstream_layout::IDEMPOTENCY_TTL;

impl IdempotencyStore {
    pub async fn open(js: &jetstream::Context) -> Result<Self, MeshError> {
        let records = RecordStore::open(js, &jetstream_layout::IDEMPOTENCY).await?;
        Ok(Self { records })
    }

    /// Try failing calls again for `window` instead of the default election window.
    pub fn with_retry_window(self, window: Duration) -> Self {
        Self {
            records: self.records.with_retry_window(window),
        }
    }

    /// `key` must be a valid KV key (callers hash the client's key and scope into hex).
    pub async fn get(&self, key: &str) -> Result<Option<IdempotencyRecord>, MeshError> {
        self.records.get(key).await
    }

    /// Atomically map `key` to `record` unless it is mapped already. Tried again while the
    /// bucket has no leader; a claim that landed but whose reply was lost finds `record`
    /// itself stored, which counts as created.
    pub async fn claim(&self, key: &str, record: &IdempotencyRecord) -> Result<Claim, MeshError> {
        match self.records.create(key, record).await {
            Ok(_) => Ok(Claim::Created),
            Err(MeshError::KvCreate(err)) if err.kind() == kv::CreateErrorKind::AlreadyExists => {
                match self.get(key).await? {
                    Some(existing) => Ok(Claim::Existing(existing)),
                    // Expired between the two calls: the next claim will create it.
                    None => Err(MeshError::KvCreate(err)),
                }
            }
            Err(err) => Err(err),
        }
    }
}
