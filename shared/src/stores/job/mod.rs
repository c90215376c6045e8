//! Job records in JetStream KV (`subjects::JOB_BUCKET`): the durable state of every accepted
//! job, so a restarted service can see what was in flight. Stored as JSON so operators can read
//! them with `nats kv get`.
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::wire::messages::{DenoiseJob, JobEvent, JobKind};

pub mod owner_index;
mod store;
mod webhook;
pub use store::{JobStore, KNOWN_REVISION_TTL};
pub use webhook::Webhook;

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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaptureReport {
    pub cache_key: String,
    pub steps: u32,
    pub blocks: u32,
    pub bytes: u64,
    /// The capture's quality guard, where it ran.
    #[serde(default)]
    pub quality: Option<crate::wire::templates::CacheQuality>,
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
                quality,
            } => Some(Self {
                cache_key: cache_key.clone(),
                steps: *steps,
                blocks: *blocks,
                bytes: *bytes,
                quality: *quality,
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
    /// run even if the gateway that accepted it dies. Set when the job is in the durable queue
    /// (by its gateway, and again by the router that takes it from there): only then is its
    /// webhook due at its ending, not for a job refused before (its client had an error).
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
    /// Its sequence in the durable queue of async jobs (`stores::async_queue`) while it waits
    /// there for a router to place it.
    #[serde(default)]
    pub queue_seq: Option<u64>,
    /// Where the job's ending is posted (`callback_url`), and how that went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<Webhook>,
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
    /// The change `event` calls for at `now`; `None` for endings, captures, previews, and a step too soon
    /// after the last one written.
    pub fn change_for(&mut self, event: &JobEvent, now: Instant) -> Option<RecordChange> {
        match event.clone() {
            JobEvent::Queued {
                worker_id,
                position,
            } => Some(Box::new(move |r| r.mark_queued_on(&worker_id, position))),
            JobEvent::Started { worker_id } => Some(Box::new(move |r| r.mark_running(&worker_id))),
            JobEvent::Retrying { attempt, .. } => Some(Box::new(move |r| r.mark_retrying(attempt))),
            JobEvent::Step { step, total, .. } => {
                if self
                    .last_step_write
                    .is_some_and(|t| now.duration_since(t) < PROGRESS_WRITE_INTERVAL)
                {
                    return None;
                }
                self.last_step_write = Some(now);
                Some(Box::new(move |r| r.mark_step(step, total)))
            }
            JobEvent::Done { .. }
            | JobEvent::Failed { .. }
            | JobEvent::Captured { .. }
            | JobEvent::Preview { .. } => None,
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
            queue_seq: None,
            webhook: None,
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

    /// The async job waits in the durable queue at `sequence`: routers place it from there, so
    /// no router adopts it (no `place_by_ms`) and the job no longer needs its gateway.
    pub fn record_queued(&mut self, job: &DenoiseJob, sequence: u64) {
        self.submitted = Some(job.clone());
        self.steps_total = job.params.num_inference_steps;
        self.detached = true;
        self.queue_seq = Some(sequence);
        self.place_by_ms = None;
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
            error_type: crate::wire::messages::error_types::CANCELLED.to_string(),
        });
        self.finish();
    }

    fn finish(&mut self) {
        let now = now_ms();
        self.finished_at_ms = Some(now);
        self.updated_at_ms = now;
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
        let step = |s| JobEvent::Step {
            step: s,
            total: 20,
            ranks: None,
        };
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
            quality: None,
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
