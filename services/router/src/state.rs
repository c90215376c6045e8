//! The router's decision state: registry + placement policy + failover rules, all synchronous so
//! it sits behind one short-held mutex and is unit-tested without NATS.
use crate::placement::Placement;
use crate::registry::{ExpiryPolicy, LostWorker, WorkerRegistry, WorkerView};
use diffmesh_shared::messages::{DenoiseJob, Heartbeat};
use std::time::Instant;

/// Outcome of one placement decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The job is recorded on this worker (undo with [`RouterState::unplace`] if it refuses).
    Chosen(String),
    /// No worker is live at all (or every live one was excluded).
    NoLiveWorker,
    /// Workers are live, but none has a free slot now.
    NoCapacity,
}

/// What to do with one job of a lost worker.
#[derive(Debug, Clone)]
pub enum Failover {
    /// Place this copy (attempt incremented) on another worker.
    Retry(DenoiseJob),
    /// Give up and publish `JobEvent::Failed` with this message.
    Fail { job_id: String, message: String },
}

pub struct RouterState {
    pub registry: WorkerRegistry,
    placement: Box<dyn Placement>,
    max_attempts: u32,
}

impl RouterState {
    pub fn new(policy: ExpiryPolicy, placement: Box<dyn Placement>, max_attempts: u32) -> Self {
        Self {
            registry: WorkerRegistry::new(policy),
            placement,
            max_attempts: max_attempts.max(1),
        }
    }

    pub fn policy_name(&self) -> &'static str {
        self.placement.name()
    }

    pub fn observe(&mut self, heartbeat: Heartbeat, now: Instant) -> bool {
        self.registry.observe(heartbeat, now)
    }

    /// Choose a worker for `job` among live workers not in `exclude`, and record the placement
    /// (before the request goes out, so a fast `Done` event cannot race the bookkeeping).
    pub fn place(&mut self, job: &DenoiseJob, exclude: &[String]) -> Decision {
        let views: Vec<WorkerView> = self
            .registry
            .views()
            .into_iter()
            .filter(|w| !exclude.contains(&w.worker_id))
            .collect();
        if views.is_empty() {
            return Decision::NoLiveWorker;
        }
        match self.placement.choose(job, &views) {
            Some(i) => {
                let worker = views[i].worker_id.clone();
                self.registry.record_placement(&worker, job.clone());
                Decision::Chosen(worker)
            }
            None => Decision::NoCapacity,
        }
    }

    /// Undo a placement the worker refused or never answered.
    pub fn unplace(&mut self, job_id: &str) {
        self.registry.finish(job_id);
    }

    /// The next attempt of a job whose worker was lost, or why it must fail.
    pub fn failover(&self, lost_worker: &str, job: &DenoiseJob) -> Failover {
        let attempt = job.attempt + 1;
        if attempt >= self.max_attempts {
            return Failover::Fail {
                job_id: job.job_id.clone(),
                message: format!(
                    "denoiser {lost_worker} lost; job already placed {attempt} times (max attempts {})",
                    self.max_attempts
                ),
            };
        }
        let mut retry = job.clone();
        retry.attempt = attempt;
        Failover::Retry(retry)
    }

    /// Expire silent workers; each lost job comes back with its failover decision.
    pub fn expire(&mut self, now: Instant) -> Vec<(LostWorker, Vec<Failover>)> {
        self.registry
            .expire(now)
            .into_iter()
            .map(|lost| {
                let plans = lost
                    .jobs
                    .iter()
                    .map(|j| self.failover(&lost.worker_id, j))
                    .collect();
                (lost, plans)
            })
            .collect()
    }
}

/// The message a job gets when its worker is lost and no other worker can take it.
pub fn no_worker_message(lost_worker: &str) -> String {
    format!("denoiser {lost_worker} lost; no other denoiser available")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::RoundRobin;
    use crate::registry::tests::{heartbeat, job, policy};
    use std::time::Duration;

    fn state(max_attempts: u32) -> RouterState {
        RouterState::new(policy(), Box::new(RoundRobin::default()), max_attempts)
    }

    #[test]
    fn place_records_and_unplace_forgets() {
        let mut s = state(3);
        let t0 = Instant::now();
        assert_eq!(s.place(&job("j1"), &[]), Decision::NoLiveWorker);
        s.observe(heartbeat("a", 1, 0), t0);
        assert_eq!(s.place(&job("j1"), &[]), Decision::Chosen("a".into()));
        assert_eq!(s.registry.owner("j1"), Some("a"));
        s.unplace("j1");
        assert_eq!(s.registry.owner("j1"), None);
    }

    #[test]
    fn excluded_and_full_workers() {
        let mut s = state(3);
        let t0 = Instant::now();
        s.observe(heartbeat("a", 1, 0), t0);
        s.observe(heartbeat("b", 1, 0), t0);
        assert_eq!(
            s.place(&job("j1"), &["a".into()]),
            Decision::Chosen("b".into())
        );
        assert_eq!(
            s.place(&job("j2"), &["a".into(), "b".into()]),
            Decision::NoLiveWorker
        );
        // Fill both: max_batch 1 + queue 2 = 3 slots each.
        for i in 0..5 {
            assert!(matches!(
                s.place(&job(&format!("f{i}")), &[]),
                Decision::Chosen(_)
            ));
        }
        assert_eq!(s.place(&job("over"), &[]), Decision::NoCapacity);
    }

    #[test]
    fn lost_worker_jobs_retry_with_next_attempt_then_fail_at_max() {
        let mut s = state(2);
        let t0 = Instant::now();
        s.observe(heartbeat("a", 2, 0), t0);
        s.observe(heartbeat("b", 2, 0), t0);
        let mut second_try = job("j2");
        second_try.attempt = 1;
        assert_eq!(
            s.place(&job("j1"), &["b".into()]),
            Decision::Chosen("a".into())
        );
        assert_eq!(
            s.place(&second_try, &["b".into()]),
            Decision::Chosen("a".into())
        );
        // b keeps beating, a goes silent.
        s.observe(heartbeat("b", 2, 0), t0 + Duration::from_secs(2));
        let lost = s.expire(t0 + Duration::from_millis(2100));
        assert_eq!(lost.len(), 1);
        let (worker, plans) = &lost[0];
        assert_eq!(worker.worker_id, "a");
        match &plans[0] {
            Failover::Retry(j) => {
                assert_eq!(j.job_id, "j1");
                assert_eq!(j.attempt, 1);
            }
            other => panic!("expected retry, got {other:?}"),
        }
        match &plans[1] {
            Failover::Fail { job_id, message } => {
                assert_eq!(job_id, "j2");
                assert!(message.contains("denoiser a lost"), "{message}");
            }
            other => panic!("expected failure, got {other:?}"),
        }
        // The retry goes to the surviving worker.
        let Failover::Retry(retry) = &plans[0] else {
            unreachable!()
        };
        assert_eq!(
            s.place(retry, std::slice::from_ref(&worker.worker_id)),
            Decision::Chosen("b".into())
        );
        assert_eq!(s.registry.owner("j1"), Some("b"));
    }

    #[test]
    fn no_survivor_means_no_live_worker() {
        let mut s = state(3);
        let t0 = Instant::now();
        s.observe(heartbeat("a", 2, 0), t0);
        s.place(&job("j1"), &[]);
        let lost = s.expire(t0 + Duration::from_secs(5));
        let Failover::Retry(retry) = &lost[0].1[0] else {
            panic!("expected retry")
        };
        assert_eq!(s.place(retry, &["a".into()]), Decision::NoLiveWorker);
        assert_eq!(
            no_worker_message("a"),
            "denoiser a lost; no other denoiser available"
        );
    }
}
