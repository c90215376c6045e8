//! Progress of adopted jobs. The gateway driving a job writes its progress into the record (queued
//! on a worker, started, steps, retries); an adopted job has no gateway left, so the router that
//! adopted it writes the same from the job's events, steps at most every 200 ms as the gateway
//! does, one write after another in event order.
use diffmesh_shared::job::{JobRecord, JobStore};
use diffmesh_shared::messages::JobEvent;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// Least time between two step writes of one job (the gateway's interval).
const STEP_WRITE_INTERVAL: Duration = Duration::from_millis(200);

/// A record change; `None` when the event changes nothing in the record now.
type Change = Box<dyn Fn(&mut JobRecord) + Send + Sync>;

#[derive(Default)]
struct Followed {
    last_step_write: Option<Instant>,
    /// The job's previous write, awaited before the next so writes land in event order.
    pending: Option<JoinHandle<()>>,
}

/// The adopted jobs this router writes progress for.
#[derive(Default)]
pub struct AdoptedProgress {
    followed: Mutex<HashMap<String, Followed>>,
}

impl AdoptedProgress {
    /// Write `job_id`'s progress from now on (it was adopted and placed by this router).
    pub fn follow(&self, job_id: &str) {
        self.lock().entry(job_id.to_string()).or_default();
    }

    /// Whether this router writes `job_id`'s progress.
    pub fn follows(&self, job_id: &str) -> bool {
        self.lock().contains_key(job_id)
    }

    /// The job ended: stop following it (its ending is written with every placed job's).
    pub fn forget(&self, job_id: &str) {
        self.lock().remove(job_id);
    }

    /// Write what `event` says of a followed job into its record, in the background, after
    /// the job's previous write. Events of other jobs are left to their gateways.
    pub fn on_event(&self, jobs: &JobStore, job_id: &str, event: &JobEvent) {
        let mut followed = self.lock();
        let Some(f) = followed.get_mut(job_id) else {
            return;
        };
        let Some(change) = change_for(f, event, Instant::now()) else {
            return;
        };
        let previous = f.pending.take();
        let (jobs, id) = (jobs.clone(), job_id.to_string());
        f.pending = Some(tokio::spawn(async move {
            if let Some(p) = previous {
                let _ = p.await;
            }
            if let Err(err) = jobs.update(&id, |r| change(r)).await {
                tracing::warn!(job_id = %id, error = %err, "could not record an adopted job's progress");
            }
        }));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Followed>> {
        self.followed.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The record change `event` calls for at `now` (steps throttled), as the gateway makes it.
fn change_for(f: &mut Followed, event: &JobEvent, now: Instant) -> Option<Change> {
    match event.clone() {
        JobEvent::Queued {
            worker_id,
            position,
        } => Some(Box::new(move |r| r.mark_queued_on(&worker_id, position))),
        JobEvent::Started { worker_id } => Some(Box::new(move |r| r.mark_running(&worker_id))),
        JobEvent::Retrying { attempt, .. } => Some(Box::new(move |r| r.mark_retrying(attempt))),
        JobEvent::Step { step, total } => {
            if f.last_step_write
                .is_some_and(|t| now.duration_since(t) < STEP_WRITE_INTERVAL)
            {
                return None;
            }
            f.last_step_write = Some(now);
            Some(Box::new(move |r| r.mark_step(step, total)))
        }
        // Endings are written for every job the router placed; captures record nothing.
        JobEvent::Done { .. } | JobEvent::Failed { .. } | JobEvent::Captured { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffmesh_shared::job::JobState;
    use diffmesh_shared::messages::JobKind;

    fn apply(f: &mut Followed, r: &mut JobRecord, event: JobEvent, at: Instant) -> bool {
        match change_for(f, &event, at) {
            Some(change) => {
                change(r);
                true
            }
            None => false,
        }
    }

    #[test]
    fn events_change_the_record_as_the_gateway_would_with_steps_throttled() {
        let (mut f, mut r) = (Followed::default(), JobRecord::new("j", JobKind::Generate));
        let t0 = Instant::now();
        let queued = JobEvent::Queued {
            worker_id: "d1".into(),
            position: 2,
        };
        assert!(apply(&mut f, &mut r, queued, t0));
        assert_eq!(
            (r.worker_id.as_deref(), r.queue_position),
            (Some("d1"), Some(2))
        );
        let started = JobEvent::Started {
            worker_id: "d1".into(),
        };
        assert!(apply(&mut f, &mut r, started, t0));
        assert_eq!(r.state, JobState::Running);
        assert!(r.started_at_ms.is_some());
        let step = |s| JobEvent::Step { step: s, total: 20 };
        assert!(apply(&mut f, &mut r, step(1), t0));
        assert!(!apply(
            &mut f,
            &mut r,
            step(2),
            t0 + Duration::from_millis(150)
        ));
        assert!(apply(
            &mut f,
            &mut r,
            step(3),
            t0 + Duration::from_millis(200)
        ));
        assert_eq!((r.step, r.steps_total), (3, 20));
        let done = JobEvent::Done { png_keys: vec![] };
        assert!(!apply(&mut f, &mut r, done, t0));
        assert_eq!(r.state, JobState::Running, "endings are written elsewhere");
    }

    #[test]
    fn only_followed_jobs_are_followed() {
        let p = AdoptedProgress::default();
        p.follow("a");
        assert!(p.follows("a") && !p.follows("b"));
        p.forget("a");
        assert!(!p.follows("a"));
    }
}
