//! Worker registry built from denoiser heartbeats, plus the jobs this router placed on each worker.
//!
//! Pure state (no NATS, no clock of its own): callers pass `Instant`s, so the expiry and failover
//! logic is unit-tested with hand-built heartbeats.
use diffmesh_shared::messages::{DenoiseJob, Heartbeat, RunningJob};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// When a worker counts as lost.
#[derive(Debug, Clone, Copy)]
pub struct ExpiryPolicy {
    /// How often denoisers send heartbeats.
    pub heartbeat_interval: Duration,
    /// A worker is lost after this many consecutive heartbeats did not arrive.
    pub missed_heartbeats: u32,
}

impl ExpiryPolicy {
    /// Silence longer than this expires a worker.
    pub fn timeout(&self) -> Duration {
        self.heartbeat_interval * self.missed_heartbeats.max(1)
    }
}

/// One live worker as placement policies see it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView {
    pub worker_id: String,
    pub model: String,
    pub draining: bool,
    pub max_batch: u32,
    pub queue_capacity: u32,
    /// Jobs the worker holds: the larger of what it reported and what this router placed on it
    /// (placements made since its last heartbeat are not in the report yet).
    pub outstanding: u32,
    /// The running batch from the last heartbeat (for load-aware policies).
    pub running: Vec<RunningJob>,
}

impl WorkerView {
    /// Whether one more job fits in the worker's batch plus its queue.
    pub fn has_capacity(&self) -> bool {
        !self.draining && self.outstanding < self.max_batch + self.queue_capacity
    }
}

/// A worker that stopped sending heartbeats, with the unfinished jobs this router had placed on it.
#[derive(Debug, Clone)]
pub struct LostWorker {
    pub worker_id: String,
    pub jobs: Vec<DenoiseJob>,
}

#[derive(Debug)]
struct WorkerEntry {
    heartbeat: Heartbeat,
    last_seen: Instant,
    placed: HashMap<String, DenoiseJob>,
}

/// Live workers keyed by id (a `BTreeMap` so iteration, and thus round-robin, is deterministic).
#[derive(Debug)]
pub struct WorkerRegistry {
    policy: ExpiryPolicy,
    workers: BTreeMap<String, WorkerEntry>,
    /// job id -> worker id, for cancel forwarding and completion.
    owners: HashMap<String, String>,
}

impl WorkerRegistry {
    pub fn new(policy: ExpiryPolicy) -> Self {
        Self {
            policy,
            workers: BTreeMap::new(),
            owners: HashMap::new(),
        }
    }

    /// Record a heartbeat. Returns true when the worker is new (or came back after expiry).
    pub fn observe(&mut self, heartbeat: Heartbeat, now: Instant) -> bool {
        match self.workers.get_mut(&heartbeat.worker_id) {
            Some(entry) => {
                entry.heartbeat = heartbeat;
                entry.last_seen = now;
                false
            }
            None => {
                let id = heartbeat.worker_id.clone();
                self.workers.insert(
                    id,
                    WorkerEntry {
                        heartbeat,
                        last_seen: now,
                        placed: HashMap::new(),
                    },
                );
                true
            }
        }
    }

    /// Remove every worker silent for longer than the policy allows; return them with their jobs.
    pub fn expire(&mut self, now: Instant) -> Vec<LostWorker> {
        let timeout = self.policy.timeout();
        let lost: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.last_seen) > timeout)
            .map(|(id, _)| id.clone())
            .collect();
        lost.into_iter().filter_map(|id| self.remove(&id)).collect()
    }

    /// Remove one worker (lost or shut down), returning the unfinished jobs placed on it.
    pub fn remove(&mut self, worker_id: &str) -> Option<LostWorker> {
        let entry = self.workers.remove(worker_id)?;
        let mut jobs: Vec<DenoiseJob> = entry.placed.into_values().collect();
        jobs.sort_by(|a, b| a.job_id.cmp(&b.job_id));
        for job in &jobs {
            self.owners.remove(&job.job_id);
        }
        Some(LostWorker {
            worker_id: worker_id.to_string(),
            jobs,
        })
    }

    /// Live workers as placement sees them, ordered by id.
    pub fn views(&self) -> Vec<WorkerView> {
        self.workers
            .iter()
            .map(|(id, e)| {
                let reported = e.heartbeat.running.len() as u32 + e.heartbeat.queued;
                WorkerView {
                    worker_id: id.clone(),
                    model: e.heartbeat.model.clone(),
                    draining: e.heartbeat.draining,
                    max_batch: e.heartbeat.max_batch,
                    queue_capacity: e.heartbeat.queue_capacity,
                    outstanding: reported.max(e.placed.len() as u32),
                    running: e.heartbeat.running.clone(),
                }
            })
            .collect()
    }

    pub fn live_workers(&self) -> usize {
        self.workers.len()
    }

    pub fn is_live(&self, worker_id: &str) -> bool {
        self.workers.contains_key(worker_id)
    }

    /// Remember that `job` now runs on `worker_id`. False when the worker is not live.
    pub fn record_placement(&mut self, worker_id: &str, job: DenoiseJob) -> bool {
        if !self.workers.contains_key(worker_id) {
            return false;
        }
        if let Some(previous) = self
            .owners
            .insert(job.job_id.clone(), worker_id.to_string())
        {
            if let Some(prev) = self.workers.get_mut(&previous) {
                prev.placed.remove(&job.job_id);
            }
        }
        if let Some(entry) = self.workers.get_mut(worker_id) {
            entry.placed.insert(job.job_id.clone(), job);
        }
        true
    }

    /// Forget a job (finished, failed, or its placement was refused). Returns its worker.
    pub fn finish(&mut self, job_id: &str) -> Option<String> {
        let worker_id = self.owners.remove(job_id)?;
        if let Some(entry) = self.workers.get_mut(&worker_id) {
            entry.placed.remove(job_id);
        }
        Some(worker_id)
    }

    /// The worker a job was placed on, if it is still tracked.
    pub fn owner(&self, job_id: &str) -> Option<&str> {
        self.owners.get(job_id).map(String::as_str)
    }

    /// Number of unfinished jobs this router placed, over all workers.
    pub fn tracked_jobs(&self) -> usize {
        self.owners.len()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn heartbeat(id: &str, max_batch: u32, queued: u32) -> Heartbeat {
        Heartbeat {
            worker_id: id.into(),
            running: vec![],
            queued,
            max_batch,
            model: "tiny".into(),
            draining: false,
            queue_capacity: 2,
        }
    }

    pub fn job(id: &str) -> DenoiseJob {
        diffmesh_shared::testing::generation_job(id, "a red circle", 1, 4)
    }

    pub fn policy() -> ExpiryPolicy {
        ExpiryPolicy {
            heartbeat_interval: Duration::from_millis(500),
            missed_heartbeats: 3,
        }
    }

    #[test]
    fn worker_expires_only_after_missed_heartbeats() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        assert!(reg.observe(heartbeat("a", 2, 0), t0));
        assert!(!reg.observe(heartbeat("a", 2, 0), t0 + Duration::from_millis(500)));
        // 1.4 s after the last heartbeat: fewer than 3 intervals missed.
        assert!(reg.expire(t0 + Duration::from_millis(1900)).is_empty());
        let lost = reg.expire(t0 + Duration::from_millis(2100));
        assert_eq!(lost.len(), 1);
        assert_eq!(lost[0].worker_id, "a");
        assert_eq!(reg.live_workers(), 0);
    }

    #[test]
    fn lost_worker_hands_back_its_unfinished_jobs() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        reg.observe(heartbeat("a", 2, 0), t0);
        reg.observe(heartbeat("b", 2, 0), t0);
        assert!(reg.record_placement("a", job("j1")));
        assert!(reg.record_placement("a", job("j2")));
        assert!(reg.record_placement("b", job("j3")));
        assert_eq!(reg.finish("j2").as_deref(), Some("a"));
        reg.observe(heartbeat("b", 2, 0), t0 + Duration::from_secs(2));
        let lost = reg.expire(t0 + Duration::from_millis(2100));
        assert_eq!(lost.len(), 1);
        let ids: Vec<&str> = lost[0].jobs.iter().map(|j| j.job_id.as_str()).collect();
        assert_eq!(ids, vec!["j1"]);
        assert_eq!(reg.owner("j1"), None);
        assert_eq!(reg.owner("j3"), Some("b"));
    }

    #[test]
    fn outstanding_counts_placements_not_yet_reported() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        reg.observe(heartbeat("a", 1, 0), t0);
        let view = &reg.views()[0];
        assert!(view.has_capacity());
        reg.record_placement("a", job("j1"));
        reg.record_placement("a", job("j2"));
        assert_eq!(reg.views()[0].outstanding, 2);
        reg.record_placement("a", job("j3"));
        // max_batch 1 + queue 2 = 3 slots, all taken.
        assert!(!reg.views()[0].has_capacity());
        // The worker's own report wins when it is larger (jobs from another router).
        reg.observe(heartbeat("a", 1, 5), t0);
        assert_eq!(reg.views()[0].outstanding, 5);
    }

    #[test]
    fn draining_worker_has_no_capacity() {
        let mut reg = WorkerRegistry::new(policy());
        let mut hb = heartbeat("a", 4, 0);
        hb.draining = true;
        reg.observe(hb, Instant::now());
        assert!(!reg.views()[0].has_capacity());
    }

    #[test]
    fn placement_on_unknown_worker_is_refused() {
        let mut reg = WorkerRegistry::new(policy());
        assert!(!reg.record_placement("ghost", job("j1")));
        assert_eq!(reg.tracked_jobs(), 0);
    }
}
