//! Job records in JetStream KV (`subjects::JOB_BUCKET`): the durable state of every accepted
//! job, so a restarted service can see what was in flight. Stored as JSON so operators can read
//! them with `nats kv get`.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, consumer, kv};
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use crate::error::MeshError;
use crate::jetstream_layout;
use crate::messages::{DenoiseJob, JobEvent, JobKind};
use crate::reconnects::Reconnects;
use crate::reopening_watch::{reopening, WATCH_REOPEN_WINDOW};
use crate::transient::{self, KvUpdated};

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Accepted by the gateway, not yet running on a denoiser (possibly waiting in a queue).
    Queued,
    Running,
    Done,
    Failed,
    /// Cancelled by its owner (or its synchronous client went away) before it finished.
    Cancelled,
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Done | JobState::Failed | JobState::Cancelled
        )
    }
}

/// Why a job failed, as shown to the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobFailure {
    pub message: String,
    /// One of `messages::error_types`.
    pub error_type: String,
}

/// What a capture job stored (its [`JobEvent::Captured`]). Kept on the job's record too, so
/// the template can still be finished, or its cache removed, when the gateway that registered
/// it stopped before recording it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureReport {
    pub cache_key: String,
    pub steps: u32,
    pub blocks: u32,
    pub bytes: u64,
}

impl CaptureReport {
    /// The report a `Captured` event carries; `None` for every other event.
    pub fn from_event(event: &JobEvent) -> Option<Self> {
        match event {
            JobEvent::Captured {
                cache_key,
                steps,
                blocks,
                bytes,
            } => Some(Self {
                cache_key: cache_key.clone(),
                steps: *steps,
                blocks: *blocks,
                bytes: *bytes,
            }),
            _ => None,
        }
    }
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
    /// When a denoiser started the job / when it reached a terminal state (Unix ms).
    #[serde(default)]
    pub started_at_ms: Option<u64>,
    #[serde(default)]
    pub finished_at_ms: Option<u64>,
    /// Denoiser running (or that last ran) the job.
    #[serde(default)]
    pub worker_id: Option<String>,
    /// Jobs ahead of this one in its denoiser's queue when it was queued there (0 = next).
    #[serde(default)]
    pub queue_position: Option<u32>,
    /// Denoising steps done and in total (0 of 0 until the job is submitted).
    #[serde(default)]
    pub step: u32,
    #[serde(default)]
    pub steps_total: u32,
    /// Placements so far (retries after a lost worker increase it).
    #[serde(default)]
    pub attempt: u32,
    /// Object-store keys of the final PNGs once done.
    #[serde(default)]
    pub result_keys: Vec<String>,
    #[serde(default)]
    pub error: Option<JobFailure>,
    /// Who created the job (the gateway's API key id); `None` when authentication is off.
    #[serde(default)]
    pub owner: Option<String>,
    /// The prepared job as submitted, so it can be placed again after a restart.
    #[serde(default)]
    pub submitted: Option<DenoiseJob>,
    /// Accepted with `Prefer: respond-async`: no client connection waits for it, so it must
    /// run even if the gateway that accepted it dies.
    #[serde(default)]
    pub detached: bool,
    /// Accepted synchronously with an `Idempotency-Key`: should its gateway die, the client
    /// can repeat the request through another gateway and get this job, so a router places it
    /// like a detached job instead of cancelling it.
    #[serde(default)]
    pub resumable: bool,
    /// Unix ms by which the job's driver has placed it or given up (ending the record); from
    /// the record's creation until the job is prepared, the time by which it will be. A record
    /// still unplaced after that lost its driver: a router adopts it, or ends it when the job
    /// was never prepared (see [`JobRecord::lost_its_driver`]).
    #[serde(default)]
    pub place_by_ms: Option<u64>,
    /// Placed by a router after the gateway driving it died.
    #[serde(default)]
    pub adopted: bool,
    /// A capture job's stored cache, once its denoiser reported it.
    #[serde(default)]
    pub captured: Option<CaptureReport>,
}

/// How often at most a running job's step progress is written to its record.
pub const PROGRESS_WRITE_INTERVAL: Duration = Duration::from_millis(200);

/// A record change, as [`ProgressWrites::change_for`] gives it.
pub type RecordChange = Box<dyn Fn(&mut JobRecord) + Send + Sync>;

/// What a job's progress events change in its record, for whoever drives the job (its gateway,
/// or the router that adopted it): queued on a worker, started, a step (at most every
/// [`PROGRESS_WRITE_INTERVAL`]), placed again. Endings are written by their own paths.
#[derive(Debug, Default)]
pub struct ProgressWrites {
    last_step_write: Option<Instant>,
}

impl ProgressWrites {
    /// The change `event` calls for at `now`; `None` for endings, captures, and a step too soon
    /// after the last one written.
    pub fn change_for(&mut self, event: &JobEvent, now: Instant) -> Option<RecordChange> {
        match event.clone() {
            JobEvent::Queued {
                worker_id,
                position,
            } => Some(Box::new(move |r| r.mark_queued_on(&worker_id, position))),
            JobEvent::Started { worker_id } => Some(Box::new(move |r| r.mark_running(&worker_id))),
            JobEvent::Retrying { attempt, .. } => Some(Box::new(move |r| r.mark_retrying(attempt))),
            JobEvent::Step { step, total } => {
                if self
                    .last_step_write
                    .is_some_and(|t| now.duration_since(t) < PROGRESS_WRITE_INTERVAL)
                {
                    return None;
                }
                self.last_step_write = Some(now);
                Some(Box::new(move |r| r.mark_step(step, total)))
            }
            JobEvent::Done { .. } | JobEvent::Failed { .. } | JobEvent::Captured { .. } => None,
        }
    }
}

/// Current time in Unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// State changes of a record. A terminal record (done, failed, cancelled) never changes state
/// again: whichever ending was recorded first wins, so a late `Done` cannot undo a cancel.
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
            started_at_ms: None,
            finished_at_ms: None,
            worker_id: None,
            queue_position: None,
            step: 0,
            steps_total: 0,
            attempt: 0,
            result_keys: Vec::new(),
            error: None,
            owner: None,
            submitted: None,
            detached: false,
            resumable: false,
            place_by_ms: None,
            adopted: false,
            captured: None,
        }
    }

    /// Whether the job lost its driver before it was placed: still queued, never placed, and
    /// its driver's deadline (for preparing it, then for placing it) passed before `now_ms`.
    /// With its prepared job on record it can still be placed; without, it never will be.
    pub fn lost_its_driver(&self, now_ms: u64) -> bool {
        self.state == JobState::Queued
            && self.worker_id.is_none()
            && self.place_by_ms.is_some_and(|t| now_ms > t)
    }

    /// The driver is about to submit `job` and will have placed it (or ended the record) by
    /// `place_by_ms`.
    pub fn record_submission(&mut self, job: &DenoiseJob, place_by_ms: u64) {
        self.submitted = Some(job.clone());
        self.steps_total = job.params.num_inference_steps;
        self.place_by_ms = Some(place_by_ms);
    }

    /// The job was placed on `worker_id` (it may still wait in that worker's queue).
    pub fn mark_placed(&mut self, worker_id: &str) {
        if self.state.is_terminal() {
            return;
        }
        self.worker_id = Some(worker_id.to_string());
        self.updated_at_ms = now_ms();
    }

    /// The job waits in `worker_id`'s queue with `position` jobs ahead of it.
    pub fn mark_queued_on(&mut self, worker_id: &str, position: u32) {
        if self.state.is_terminal() {
            return;
        }
        self.state = JobState::Queued;
        self.worker_id = Some(worker_id.to_string());
        self.queue_position = Some(position);
        self.updated_at_ms = now_ms();
    }

    /// The job lost its worker and is being placed again (`attempt` placements so far).
    pub fn mark_retrying(&mut self, attempt: u32) {
        if self.state.is_terminal() {
            return;
        }
        self.state = JobState::Queued;
        self.attempt = attempt;
        self.queue_position = None;
        self.step = 0;
        self.updated_at_ms = now_ms();
    }

    pub fn mark_running(&mut self, worker_id: &str) {
        if self.state.is_terminal() {
            return;
        }
        self.state = JobState::Running;
        self.worker_id = Some(worker_id.to_string());
        self.queue_position = None;
        let now = now_ms();
        self.started_at_ms.get_or_insert(now);
        self.updated_at_ms = now;
    }

    /// Progress of a running job: `step` of `total` denoising steps done.
    pub fn mark_step(&mut self, step: u32, total: u32) {
        if self.state.is_terminal() {
            return;
        }
        self.step = step;
        self.steps_total = total;
        self.updated_at_ms = now_ms();
    }

    /// The denoiser stored the capture's cache. Recorded whatever the job's state: the cache
    /// exists even if the job ended otherwise meanwhile.
    pub fn mark_captured(&mut self, report: CaptureReport) {
        self.captured = Some(report);
        self.updated_at_ms = now_ms();
    }

    pub fn mark_done(&mut self, result_keys: Vec<String>) {
        if self.state.is_terminal() {
            return;
        }
        self.state = JobState::Done;
        self.step = self.steps_total;
        self.result_keys = result_keys;
        self.error = None;
        self.finish();
    }

    pub fn mark_failed(&mut self, message: impl Into<String>, error_type: impl Into<String>) {
        if self.state.is_terminal() {
            return;
        }
        self.state = JobState::Failed;
        self.error = Some(JobFailure {
            message: message.into(),
            error_type: error_type.into(),
        });
        self.finish();
    }

    pub fn mark_cancelled(&mut self, message: impl Into<String>) {
        if self.state.is_terminal() {
            return;
        }
        self.state = JobState::Cancelled;
        self.error = Some(JobFailure {
            message: message.into(),
            error_type: crate::messages::error_types::CANCELLED.to_string(),
        });
        self.finish();
    }

    fn finish(&mut self) {
        let now = now_ms();
        self.finished_at_ms = Some(now);
        self.updated_at_ms = now;
    }
}

/// Job records by job id in the KV bucket.
///
/// Every call is tried again while the bucket has no leader (`transient`): on a cluster a
/// node loss would otherwise fail the requests that touch a job in that moment.
#[derive(Clone)]
pub struct JobStore {
    kv: kv::Store,
    /// How long a failing call is tried again (default [`transient::ELECTION_WINDOW`]).
    retry_window: Duration,
    /// For the inboxes of record watches.
    client: async_nats::Client,
    /// The records this store last wrote or read, with their revisions, when enabled
    /// ([`JobStore::with_known_revisions`]): an update first tries its compare-and-set on
    /// these and reads the record only when another writer got in first.
    known: Option<moka::sync::Cache<String, (JobRecord, u64)>>,
}

/// Compare-and-set attempts before an update gives up under contention.
const MAX_UPDATE_ATTEMPTS: u32 = 16;

/// How long a known record revision is kept ([`JobStore::with_known_revisions`]): longer
/// than the time between a job's updates, far shorter than the record's life.
pub const KNOWN_REVISION_TTL: Duration = Duration::from_secs(300);

impl JobStore {
    /// Open `subjects::JOB_BUCKET`, creating it when missing (records expire after a week,
    /// [`jetstream_layout::JOBS`]).
    pub async fn open(js: &jetstream::Context) -> Result<Self, MeshError> {
        let kv = jetstream_layout::JOBS.open_kv(js).await?;
        Ok(Self {
            kv,
            retry_window: transient::ELECTION_WINDOW,
            client: js.client(),
            known: None,
        })
    }

    /// Remember up to `capacity` records this store wrote or read (each for
    /// [`KNOWN_REVISION_TTL`]) and write updates of them without reading them first. For
    /// the writer of most of a job's changes (the gateway driving it); a store whose records
    /// others change in between would pay a failed write for each stale one.
    pub fn with_known_revisions(mut self, capacity: u64) -> Self {
        self.known = Some(
            moka::sync::Cache::builder()
                .max_capacity(capacity)
                .time_to_live(KNOWN_REVISION_TTL)
                .build(),
        );
        self
    }

    fn remember(&self, record: &JobRecord, revision: u64) {
        if let Some(known) = &self.known {
            known.insert(record.job_id.clone(), (record.clone(), revision));
        }
    }

    /// Try failing calls again for `window` instead of [`transient::ELECTION_WINDOW`].
    pub fn with_retry_window(mut self, window: Duration) -> Self {
        self.retry_window = window;
        self
    }

    /// Store a new record; fails if the job id already exists.
    ///
    /// A write that landed but whose reply was lost reads as "already exists" on the next
    /// attempt (async-nats also looks the key up after a failed create): that counts as
    /// created when the stored record is this one.
    pub async fn create(&self, record: &JobRecord) -> Result<(), MeshError> {
        let value = Bytes::from(serde_json::to_vec(record)?);
        let revision = transient::kv_create(
            &self.kv,
            "job.create",
            self.retry_window,
            &record.job_id,
            value,
        )
        .await?;
        self.remember(record, revision);
        Ok(())
    }

    /// Overwrite the record unconditionally.
    pub async fn put(&self, record: &JobRecord) -> Result<(), MeshError> {
        let value = Bytes::from(serde_json::to_vec(record)?);
        let revision = transient::retried_bounded(
            "job.put",
            self.retry_window,
            Some(transient::REQUEST_ATTEMPT_TIMEOUT),
            transient::kv_put_settled,
            || self.kv.put(&record.job_id, value.clone()),
        )
        .await?;
        self.remember(record, revision);
        Ok(())
    }

    pub async fn get(&self, job_id: &str) -> Result<Option<JobRecord>, MeshError> {
        Ok(self.get_with_revision(job_id).await?.map(|(r, _)| r))
    }

    async fn get_with_revision(&self, job_id: &str) -> Result<Option<(JobRecord, u64)>, MeshError> {
        let read = transient::kv_get_json(&self.kv, "job.get", self.retry_window, job_id).await?;
        if let Some((record, revision)) = &read {
            self.remember(record, *revision);
        }
        Ok(read)
    }

    /// The record now (first item, once it exists) and every later version of it. The watch
    /// is opened again when its consumer stops (a server restart, a leader change) or NATS
    /// reconnects, for up to [`WATCH_REOPEN_WINDOW`] ([`reopening`]).
    pub async fn watch(
        &self,
        job_id: &str,
    ) -> Result<BoxStream<'static, Result<JobRecord, MeshError>>, MeshError> {
        let reconnects = Reconnects::from_now();
        let first = records(self.kv.watch_with_history(job_id).await?);
        let (kv, job_id) = (self.kv.clone(), job_id.to_string());
        Ok(reopening(
            "job.watch",
            WATCH_REOPEN_WINDOW,
            reconnects,
            first,
            move || {
                let (kv, job_id) = (kv.clone(), job_id.clone());
                async move { Ok(records(kv.watch_with_history(&job_id).await?)) }
            },
        ))
    }

    /// Every version of any record written from `lookback` ago on, then every new one. Older
    /// records are not replayed (a week of finished jobs would be): a reader that was down
    /// longer than `lookback` misses records that did not change since. Only opening the first
    /// watch can fail: after that the watch is opened again, for as long as it takes, whenever
    /// its consumer stops or NATS reconnects ([`reopening`]), and goes on after the last record
    /// it passed on (by stream sequence), so nothing is skipped or given twice.
    pub async fn watch_since(
        &self,
        lookback: Duration,
    ) -> Result<BoxStream<'static, Result<JobRecord, MeshError>>, MeshError> {
        let reconnects = Reconnects::from_now();
        let delivered = Arc::new(AtomicU64::new(0));
        let first = records_since(&self.kv, &self.client, lookback, delivered.clone()).await?;
        let (kv, client) = (self.kv.clone(), self.client.clone());
        Ok(reopening(
            "job.watch_since",
            Duration::MAX,
            reconnects,
            first,
            move || {
                let (kv, client, delivered) = (kv.clone(), client.clone(), delivered.clone());
                async move { records_since(&kv, &client, lookback, delivered).await }
            },
        ))
    }

    /// Read-modify-write with compare-and-set, retrying when another writer got in between.
    /// Returns the record as written, or as it is when `change` changed nothing but its time
    /// (a placement already recorded, a mark on an ended job): nothing is written then, which
    /// saves the write the gateway and the router would both make of a placement or an ending.
    pub async fn update<F>(&self, job_id: &str, mut change: F) -> Result<JobRecord, MeshError>
    where
        F: FnMut(&mut JobRecord),
    {
        let updated = self
            .change_record(job_id, |record| {
                let before = record.clone();
                change(record);
                record.updated_at_ms = before.updated_at_ms;
                *record != before
            })
            .await?;
        match updated {
            KvUpdated::Written(record, _) | KvUpdated::Declined(record, _) => Ok(record),
            KvUpdated::Missing => Err(MeshError::JobNotFound {
                job_id: job_id.to_string(),
            }),
        }
    }

    /// [`JobStore::update`] where `change` may decline (return false, leaving the record as it
    /// is): `None` then. The decision is made on the latest revision, so two writers racing
    /// for the same change (two routers adopting one job) cannot both make it.
    /// A write that failed otherwise than by a newer revision is tried again
    /// ([`transient::kv_update_json`]).
    pub async fn update_if<F>(
        &self,
        job_id: &str,
        change: F,
    ) -> Result<Option<JobRecord>, MeshError>
    where
        F: FnMut(&mut JobRecord) -> bool,
    {
        match self.change_record(job_id, change).await? {
            KvUpdated::Written(record, _) => Ok(Some(record)),
            KvUpdated::Declined(..) => Ok(None),
            KvUpdated::Missing => Err(MeshError::JobNotFound {
                job_id: job_id.to_string(),
            }),
        }
    }

    /// Compare-and-set of `job_id`'s record with `change` (declining when it returns false),
    /// stamping the update time of what it writes; starting from the known revision, if any.
    async fn change_record<F>(
        &self,
        job_id: &str,
        mut change: F,
    ) -> Result<KvUpdated<JobRecord>, MeshError>
    where
        F: FnMut(&mut JobRecord) -> bool,
    {
        let guess = self.known.as_ref().and_then(|known| known.get(job_id));
        let updated = transient::kv_update_json(
            &self.kv,
            "job.update",
            self.retry_window,
            job_id,
            MAX_UPDATE_ATTEMPTS,
            guess,
            |record: &mut JobRecord| {
                if !change(record) {
                    return false;
                }
                record.updated_at_ms = now_ms();
                true
            },
        )
        .await;
        if let Some(known) = &self.known {
            match &updated {
                Ok(
                    KvUpdated::Written(record, revision) | KvUpdated::Declined(record, revision),
                ) => self.remember(record, *revision),
                _ => known.invalidate(job_id),
            }
        }
        updated
    }
}

/// One watch of every record written from `lookback` ago on, or, once `delivered` holds the
/// stream sequence of a record passed on (a reopening), of every record after that one: a
/// reopened watch replays nothing it already gave (see [`JobStore::watch_since`]).
async fn records_since(
    kv: &kv::Store,
    client: &async_nats::Client,
    lookback: Duration,
    delivered: Arc<AtomicU64>,
) -> Result<BoxStream<'static, Result<JobRecord, MeshError>>, MeshError> {
    let watch_error = |e: &dyn std::fmt::Display| MeshError::RecordWatch(e.to_string());
    let deliver_policy = match delivered.load(Ordering::Acquire) {
        0 => consumer::DeliverPolicy::ByStartTime {
            start_time: time::OffsetDateTime::now_utc() - lookback,
        },
        last => consumer::DeliverPolicy::ByStartSequence {
            start_sequence: last + 1,
        },
    };
    let consumer = kv
        .stream
        .create_consumer(consumer::push::OrderedConfig {
            deliver_subject: client.new_inbox(),
            description: Some("job records since a start time".to_string()),
            filter_subject: format!("{}>", kv.prefix),
            replay_policy: consumer::ReplayPolicy::Instant,
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| watch_error(&e))?;
    let messages = consumer.messages().await.map_err(|e| watch_error(&e))?;
    Ok(messages
        .filter_map(move |message| {
            // Taken when the message is read: a stream's items are passed on in order, so the
            // last one read was given to the reader unless the whole stream was dropped.
            if let Ok(Ok(info)) = message.as_ref().map(|m| m.info()) {
                delivered.store(info.stream_sequence, Ordering::Release);
            }
            async move {
                match message {
                    // An empty payload is a deletion marker (records only expire, but be safe).
                    Ok(m) if m.payload.is_empty() => None,
                    Ok(m) => Some(
                        serde_json::from_slice::<JobRecord>(&m.payload).map_err(MeshError::from),
                    ),
                    Err(err) => Some(Err(MeshError::RecordWatch(err.to_string()))),
                }
            }
        })
        .boxed())
}

/// The records a KV watch delivers (deletions skipped).
fn records(watch: kv::Watch) -> BoxStream<'static, Result<JobRecord, MeshError>> {
    watch
        .filter_map(|entry| async move {
            match entry {
                Ok(e) if e.operation == kv::Operation::Put => {
                    Some(serde_json::from_slice::<JobRecord>(&e.value).map_err(MeshError::from))
                }
                Ok(_) => None,
                Err(err) => Some(Err(MeshError::RecordWatch(err.to_string()))),
            }
        })
        .boxed()
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

    #[test]
    fn terminal_records_keep_their_ending() {
        let mut r = JobRecord::new("j2", JobKind::Generate);
        r.mark_placed("w1");
        assert_eq!(
            (r.state, r.worker_id.as_deref()),
            (JobState::Queued, Some("w1"))
        );
        r.mark_running("w1");
        r.mark_step(2, 4);
        assert!(r.started_at_ms.is_some());
        r.mark_cancelled("cancelled by its owner");
        assert_eq!(r.state, JobState::Cancelled);
        assert!(r.finished_at_ms.is_some());
        // A late Done or Failed does not undo the cancel.
        r.mark_done(vec!["k".into()]);
        r.mark_failed("boom", "internal_error");
        r.mark_running("w2");
        assert_eq!(r.state, JobState::Cancelled);
        assert!(r.result_keys.is_empty());
        assert_eq!(r.error.as_ref().unwrap().error_type, "cancelled");
        assert_eq!(r.worker_id.as_deref(), Some("w1"));
    }

    #[test]
    fn a_record_lost_its_driver_only_when_unplaced_past_its_deadline() {
        let mut r = JobRecord::new("j3", JobKind::Generate);
        // Not prepared by its deadline: lost too (nothing to place; a router ends it).
        r.place_by_ms = Some(100);
        assert!(!r.lost_its_driver(100));
        assert!(r.lost_its_driver(200));
        r.submitted = Some(crate::testing::generation_job("j3", "a red circle", 1, 4));
        assert!(!r.lost_its_driver(100), "not past the deadline yet");
        assert!(r.lost_its_driver(101));
        let mut placed = r.clone();
        placed.mark_placed("w1");
        assert!(!placed.lost_its_driver(200));
        let mut ended = r.clone();
        ended.mark_cancelled("gone");
        assert!(!ended.lost_its_driver(200));
        r.place_by_ms = None;
        assert!(
            !r.lost_its_driver(u64::MAX),
            "no deadline: an older gateway drives it"
        );
    }

    fn apply(p: &mut ProgressWrites, r: &mut JobRecord, event: JobEvent, at: Instant) -> bool {
        match p.change_for(&event, at) {
            Some(change) => {
                change(r);
                true
            }
            None => false,
        }
    }

    #[test]
    fn progress_events_change_the_record_with_steps_throttled() {
        let (mut p, mut r) = (
            ProgressWrites::default(),
            JobRecord::new("j", JobKind::Generate),
        );
        let t0 = Instant::now();
        let queued = JobEvent::Queued {
            worker_id: "d1".into(),
            position: 2,
        };
        assert!(apply(&mut p, &mut r, queued, t0));
        assert_eq!(
            (r.worker_id.as_deref(), r.queue_position),
            (Some("d1"), Some(2))
        );
        let started = JobEvent::Started {
            worker_id: "d1".into(),
        };
        assert!(apply(&mut p, &mut r, started, t0));
        assert_eq!(r.state, JobState::Running);
        assert!(r.started_at_ms.is_some());
        let step = |s| JobEvent::Step { step: s, total: 20 };
        assert!(apply(&mut p, &mut r, step(1), t0));
        assert!(!apply(
            &mut p,
            &mut r,
            step(2),
            t0 + Duration::from_millis(150)
        ));
        assert!(apply(
            &mut p,
            &mut r,
            step(3),
            t0 + Duration::from_millis(200)
        ));
        assert_eq!((r.step, r.steps_total), (3, 20));
        let done = JobEvent::Done { png_keys: vec![] };
        assert!(!apply(&mut p, &mut r, done, t0));
        assert_eq!(r.state, JobState::Running, "endings are written elsewhere");
    }

    /// Records written before the progress and owner fields existed still load.
    #[test]
    fn old_records_load() {
        let old =
            r#"{"job_id":"j","kind":"Edit","state":"running","created_at_ms":1,"updated_at_ms":2}"#;
        let r: JobRecord = serde_json::from_str(old).unwrap();
        assert_eq!((r.step, r.steps_total, r.owner), (0, 0, None));
        assert_eq!(r.captured, None);
    }

    /// A capture's report comes from its `Captured` event only and stays on the record even
    /// when the job ended first (the cache exists either way).
    #[test]
    fn a_capture_report_is_kept_whatever_the_ending() {
        let event = JobEvent::Captured {
            cache_key: "tpl-abc".into(),
            steps: 4,
            blocks: 6,
            bytes: 1024,
        };
        let report = CaptureReport::from_event(&event).unwrap();
        assert_eq!((report.cache_key.as_str(), report.steps), ("tpl-abc", 4));
        let done = JobEvent::Done {
            png_keys: Vec::new(),
        };
        assert_eq!(CaptureReport::from_event(&done), None);
        let mut r = JobRecord::new("j4", JobKind::Capture);
        r.mark_cancelled("client went away");
        r.mark_captured(report.clone());
        assert_eq!(r.captured.as_ref(), Some(&report));
        let back: JobRecord = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.captured, Some(report));
    }
}
