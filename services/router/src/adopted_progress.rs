//! Progress of adopted jobs. The gateway driving a job writes its progress into the record (queued
//! on a worker, started, steps, retries); an adopted job has no gateway left, so the router that
//! adopted it writes the same from the job's events ([`ProgressWrites`], the gateway's rules),
//! one write after another in event order.
use diffmesh_shared::stores::job::{JobStore, ProgressWrites};
use diffmesh_shared::wire::messages::JobEvent;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;
use tokio::task::JoinHandle;

#[derive(Default)]
struct Followed {
    progress: ProgressWrites,
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
        let Some(change) = f.progress.change_for(event, Instant::now()) else {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_followed_jobs_are_followed() {
        let p = AdoptedProgress::default();
        p.follow("a");
        assert!(p.follows("a") && !p.follows("b"));
        p.forget("a");
        assert!(!p.follows("a"));
    }
}
