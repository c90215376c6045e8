//! Job records in JetStream KV (`subjects::JOB_BUCKET`): the durable state of every accepted
//! job, so a restarted service can see what was in flight. Stored as JSON so operators can read
//! them with `nats kv get`.
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, kv, stream};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::MeshError;
use crate::messages::{DenoiseJob, JobKind};
use crate::subjects::JOB_BUCKET;

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Accepted by the gateway, not yet running on a denoiser.
    Queued,
    Running,
    Done,
    Failed,
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Done | JobState::Failed)
    }
}

/// Why a job failed, as shown to the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobFailure {
    pub message: String,
    /// One of `messages::error_types`.
    pub error_type: String,
}

/// The KV record of one job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub job_id: String,
    pub kind: JobKind,
    pub state: JobState,
    /// Unix milliseconds.
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    /// Denoiser running (or that last ran) the job.
    #[serde(default)]
    pub worker_id: Option<String>,
    /// Placements so far (retries after a lost worker increase it).
    #[serde(default)]
    pub attempt: u32,
    /// Object-store keys of the final PNGs once done.
    #[serde(default)]
    pub result_keys: Vec<String>,
    #[serde(default)]
    pub error: Option<JobFailure>,
    /// The prepared job as submitted, so it can be placed again after a restart.
    #[serde(default)]
    pub submitted: Option<DenoiseJob>,
}

/// Current time in Unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl JobRecord {
    /// A fresh record in state `Queued`.
    pub fn new(job_id: impl Into<String>, kind: JobKind) -> Self {
        let now = now_ms();
        Self {
            job_id: job_id.into(),
            kind,
            state: JobState::Queued,
            created_at_ms: now,
            updated_at_ms: now,
            worker_id: None,
            attempt: 0,
            result_keys: Vec::new(),
            error: None,
            submitted: None,
        }
    }

    pub fn mark_running(&mut self, worker_id: &str) {
        self.state = JobState::Running;
        self.worker_id = Some(worker_id.to_string());
        self.updated_at_ms = now_ms();
    }

    pub fn mark_done(&mut self, result_keys: Vec<String>) {
        self.state = JobState::Done;
        self.result_keys = result_keys;
        self.error = None;
        self.updated_at_ms = now_ms();
    }

    pub fn mark_failed(&mut self, message: impl Into<String>, error_type: impl Into<String>) {
        self.state = JobState::Failed;
        self.error = Some(JobFailure {
            message: message.into(),
            error_type: error_type.into(),
        });
        self.updated_at_ms = now_ms();
    }
}

/// Job records by job id in the KV bucket.
#[derive(Clone)]
pub struct JobStore {
    kv: kv::Store,
}

/// Compare-and-set attempts before an update gives up under contention.
const MAX_UPDATE_ATTEMPTS: u32 = 16;

impl JobStore {
    /// Open `subjects::JOB_BUCKET`, creating it when missing (records expire after a week).
    ///
    /// The bucket's stream is created directly (the layout async-nats' `create_key_value` would
    /// make) because that call needs account-info fields older servers (2.9) do not send.
    pub async fn open(js: &jetstream::Context) -> Result<Self, MeshError> {
        if let Ok(kv) = js.get_key_value(JOB_BUCKET).await {
            return Ok(Self { kv });
        }
        let created = js
            .create_stream(stream::Config {
                name: format!("KV_{JOB_BUCKET}"),
                subjects: vec![format!("$KV.{JOB_BUCKET}.>")],
                max_messages_per_subject: 1,
                max_age: Duration::from_secs(7 * 24 * 3600),
                allow_rollup: true,
                deny_delete: true,
                allow_direct: true,
                discard: stream::DiscardPolicy::New,
                ..Default::default()
            })
            .await;
        match js.get_key_value(JOB_BUCKET).await {
            Ok(kv) => Ok(Self { kv }),
            // Report the creation error when there was one (a lost race is not an error).
            Err(err) => match created {
                Err(create_err) => Err(MeshError::StreamCreate(create_err)),
                Ok(_) => Err(MeshError::KvOpen(err)),
            },
        }
    }

    /// Store a new record; fails if the job id already exists.
    pub async fn create(&self, record: &JobRecord) -> Result<(), MeshError> {
        let value = Bytes::from(serde_json::to_vec(record)?);
        self.kv.create(&record.job_id, value).await?;
        Ok(())
    }

    /// Overwrite the record unconditionally.
    pub async fn put(&self, record: &JobRecord) -> Result<(), MeshError> {
        let value = Bytes::from(serde_json::to_vec(record)?);
        self.kv.put(&record.job_id, value).await?;
        Ok(())
    }

    pub async fn get(&self, job_id: &str) -> Result<Option<JobRecord>, MeshError> {
        Ok(self.get_with_revision(job_id).await?.map(|(r, _)| r))
    }

    async fn get_with_revision(&self, job_id: &str) -> Result<Option<(JobRecord, u64)>, MeshError> {
        match self.kv.entry(job_id).await? {
            Some(entry) if entry.operation == kv::Operation::Put => Ok(Some((
                serde_json::from_slice(&entry.value)?,
                entry.revision,
            ))),
            _ => Ok(None),
        }
    }

    /// Read-modify-write with compare-and-set, retrying when another writer got in between.
    /// Returns the record as written.
    pub async fn update<F>(&self, job_id: &str, mut change: F) -> Result<JobRecord, MeshError>
    where
        F: FnMut(&mut JobRecord),
    {
        for _ in 0..MAX_UPDATE_ATTEMPTS {
            let (mut record, revision) =
                self.get_with_revision(job_id)
                    .await?
                    .ok_or_else(|| MeshError::JobNotFound {
                        job_id: job_id.to_string(),
                    })?;
            change(&mut record);
            record.updated_at_ms = now_ms();
            let value = Bytes::from(serde_json::to_vec(&record)?);
            match self.kv.update(job_id, value, revision).await {
                Ok(_) => return Ok(record),
                Err(err) if err.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(err) => return Err(err.into()),
            }
        }
        Err(MeshError::JobContention {
            job_id: job_id.to_string(),
            attempts: MAX_UPDATE_ATTEMPTS,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_transitions_and_json_round_trip() {
        let mut r = JobRecord::new("j1", JobKind::Edit);
        assert_eq!(r.state, JobState::Queued);
        r.mark_running("w1");
        assert_eq!(r.worker_id.as_deref(), Some("w1"));
        r.mark_failed("lost", "worker_lost");
        assert!(r.state.is_terminal());
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"state\":\"failed\""));
        let back: JobRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
    }
}
