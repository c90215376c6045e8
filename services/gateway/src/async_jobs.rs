//! Async jobs (`Prefer: respond-async`) go into the mesh's durable queue
//! (`shared::stores::async_queue`) before their 202: from there a router places each as a
//! denoiser has room, for as long as the job's deadline allows, and records its ending. No
//! gateway drives them, so a gateway crash costs none, and a burst waits in the queue instead of
//! failing. A full queue (all keys, or the caller's key) is a 429 at submit time.
use diffmesh_shared::stores::async_queue::{QueueRefusal, QueuedJob};
use diffmesh_shared::stores::job::{now_ms, JobRecord};
use diffmesh_shared::wire::messages::DenoiseJob;

use crate::error::ApiError;
use crate::job_driver::{Mesh, PreparedJob};

/// Retry hint of a request refused because the queue is full: a denoiser drains a few jobs a
/// second at best, so a queue of hundreds frees room in seconds, not milliseconds.
const QUEUE_FULL_RETRY_S: u64 = 5;

impl Mesh {
    /// Append a prepared async job to the durable queue and record it there (detached: from
    /// then on its webhook, if any, is due at its ending); answers the record as the 202 shows
    /// it. A refused job's record ends `failed` (`rate_limited`), with no webhook: its 429 said
    /// so.
    pub async fn enqueue_detached(
        &self,
        mut prepared: PreparedJob,
        owner: Option<&str>,
    ) -> Result<JobRecord, ApiError> {
        let job = prepared.job.clone();
        let queued = QueuedJob {
            place_by_ms: self.queue_deadline(job.params.deadline_unix_ms),
            job: job.clone(),
        };
        let refused = match self.queue.enqueue(owner, &queued).await {
            Ok(Ok(sequence)) => {
                // From here the queue holds the job: the client's connection no longer matters.
                prepared.release();
                return Ok(self.record_queued(&job, sequence).await);
            }
            Ok(Err(refusal)) => {
                let quota = match refusal {
                    QueueRefusal::Full(_) => "async_queue_max",
                    QueueRefusal::KeyFull(_) => "async_queue_per_key",
                };
                self.metrics.failures.inc(quota);
                ApiError::Overloaded {
                    message: format!("{refusal} (quota {quota}); retry later"),
                    retry_after_s: QUEUE_FULL_RETRY_S,
                }
            }
            Err(err) => ApiError::from(err),
        };
        self.refuse(prepared, &refused).await;
        Err(refused)
    }

    /// Unix ms by which a queued job must be placed: its deadline, at most the longest queue
    /// time from now.
    fn queue_deadline(&self, deadline_unix_ms: Option<u64>) -> u64 {
        let longest = now_ms() + self.max_queue_time.as_millis() as u64;
        deadline_unix_ms.map_or(longest, |d| d.min(longest))
    }

    async fn record_queued(&self, job: &DenoiseJob, sequence: u64) -> JobRecord {
        match self
            .jobs
            .update(&job.job_id, |r| r.record_queued(job, sequence))
            .await
        {
            Ok(record) => record,
            Err(err) => {
                // The job is queued all the same; a router places it and writes its ending.
                tracing::warn!(job_id = %job.job_id, error = %err, "could not record the queued job");
                let mut record = JobRecord::new(job.job_id.clone(), job.kind);
                record.record_queued(job, sequence);
                record
            }
        }
    }

    /// Where a job waiting in the durable queue is in it (None once a router took it).
    pub async fn queue_position(&self, record: &JobRecord) -> Option<u32> {
        let sequence = record.queue_seq?;
        if record.worker_id.is_some() || record.state.is_terminal() {
            return None;
        }
        match self.queue.position(sequence).await {
            Ok(position) => position,
            Err(err) => {
                tracing::debug!(error = %err, "could not read the queue's position");
                None
            }
        }
    }

    /// A cancelled job still in the durable queue leaves it (its room is freed at once; a
    /// router that took it meanwhile finds the record cancelled and drops it).
    pub async fn unqueue(&self, record: &JobRecord) {
        if let Some(sequence) = record.queue_seq.filter(|_| record.worker_id.is_none()) {
            self.queue.remove(sequence).await;
        }
    }
}
