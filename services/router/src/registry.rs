//! Worker registry built from denoiser heartbeats, plus the jobs this router placed on each worker.
//!
//! Pure state (no NATS, no clock of its own): callers pass `Instant`s, so the expiry and failover
//! logic is unit-tested with hand-built heartbeats.
use diffmesh_shared::messages::{DenoiseJob, Heartbeat, RunningJob};
use std::collections::{BTreeMap, HashMap, HashSet};
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

/// One live worker as the router knows it: its last heartbeat plus what this router placed on
/// it since. [`crate::worker_state`] turns it into the policies' `WorkerState`.
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
    /// The running batch from the last heartbeat (masked tokens and remaining steps per job).
    pub running: Vec<RunningJob>,
    /// Jobs the worker reported waiting in its queue (possibly placed by another router).
    pub reported_queued: u32,
    /// Jobs this router placed on the worker that its last heartbeat did not list as running
    /// (waiting in its queue, or not seen by it yet), in placement order.
    pub waiting: Vec<DenoiseJob>,
    /// Jobs this router placed that are running, by id (their mask ratio and image count).
    pub running_jobs: HashMap<String, DenoiseJob>,
    /// Template cache keys resident on the worker (from its heartbeat).
    pub cached_templates: Vec<String>,
    /// LoRA ids in the worker's memory (from its heartbeat).
    pub cached_loras: Vec<String>,
}

impl WorkerView {
    /// Whether one more job fits in the worker's batch plus its queue.
    pub fn has_capacity(&self) -> bool {
        !self.draining && self.outstanding < self.max_batch + self.queue_capacity
    }
}

/// A borrowed look at one live worker, for the placement hot path (no copies of jobs).
#[derive(Debug, Clone, Copy)]
pub struct LiveWorker<'a> {
    pub worker_id: &'a str,
    pub heartbeat: &'a Heartbeat,
    /// Unfinished jobs this router placed here, with their placement sequence number.
    pub placed: &'a HashMap<String, (u64, DenoiseJob)>,
    /// Jobs known to have ended that the last heartbeat may still list as running.
    pub finished: &'a HashSet<String>,
    /// When the last heartbeat arrived.
    pub last_seen: Instant,
}

impl LiveWorker<'_> {
    /// The heartbeat's running jobs that have not ended since it was sent.
    pub fn running(&self) -> impl Iterator<Item = &RunningJob> {
        self.heartbeat
            .running
            .iter()
            .filter(|r| !self.finished.contains(&r.job_id))
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
    /// Unfinished jobs this router placed here, with their placement sequence number.
    placed: HashMap<String, (u64, DenoiseJob)>,
    /// Jobs that ended (their `Done`/`Failed` event came) but the last heartbeat, sent before,
    /// still lists as running; forgotten once a heartbeat no longer lists them.
    finished: HashSet<String>,
}

/// Live workers keyed by id (a `BTreeMap` so iteration, and thus round-robin, is deterministic).
#[derive(Debug)]
pub struct WorkerRegistry {
    policy: ExpiryPolicy,
    workers: BTreeMap<String, WorkerEntry>,
    /// job id -> worker id, for cancel forwarding and completion.
    owners: HashMap<String, String>,
    /// Next placement sequence number (orders each worker's waiting jobs).
    next_seq: u64,
}

impl WorkerRegistry {
    pub fn new(policy: ExpiryPolicy) -> Self {
        Self {
            policy,
            workers: BTreeMap::new(),
            owners: HashMap::new(),
            next_seq: 0,
        }
    }

    /// Record a heartbeat. Returns true when the worker is new (or came back after expiry).
    pub fn observe(&mut self, heartbeat: Heartbeat, now: Instant) -> bool {
        match self.workers.get_mut(&heartbeat.worker_id) {
            Some(entry) => {
                let running = &heartbeat.running;
                entry
                    .finished
                    .retain(|id| running.iter().any(|r| &r.job_id == id));
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
                        finished: HashSet::new(),
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
        let mut jobs: Vec<DenoiseJob> = entry.placed.into_values().map(|(_, j)| j).collect();
        jobs.sort_by(|a, b| a.job_id.cmp(&b.job_id));
        for job in &jobs {
            self.owners.remove(&job.job_id);
        }
        Some(LostWorker {
            worker_id: worker_id.to_string(),
            jobs,
        })
    }

    /// Live workers, ordered by id, borrowed.
    pub fn live(&self) -> impl Iterator<Item = LiveWorker<'_>> {
        self.workers.iter().map(|(id, e)| LiveWorker {
            worker_id: id,
            heartbeat: &e.heartbeat,
            placed: &e.placed,
            finished: &e.finished,
            last_seen: e.last_seen,
        })
    }

    /// Live workers with owned copies of what the router knows, ordered by id.
    pub fn views(&self) -> Vec<WorkerView> {
        self.live()
            .map(|w| {
                let hb = w.heartbeat;
                let running: Vec<RunningJob> = w.running().cloned().collect();
                let reported = running.len() as u32 + hb.queued;
                let mut waiting: Vec<&(u64, DenoiseJob)> = Vec::new();
                let mut running_jobs = HashMap::new();
                for (job_id, placed) in w.placed {
                    if running.iter().any(|r| &r.job_id == job_id) {
                        running_jobs.insert(job_id.clone(), placed.1.clone());
                    } else {
                        waiting.push(placed);
                    }
                }
                waiting.sort_by_key(|(seq, _)| *seq);
                WorkerView {
                    worker_id: w.worker_id.to_string(),
                    model: hb.model.clone(),
                    draining: hb.draining,
                    max_batch: hb.max_batch,
                    queue_capacity: hb.queue_capacity,
                    outstanding: reported.max(w.placed.len() as u32),
                    running,
                    reported_queued: hb.queued,
                    waiting: waiting.into_iter().map(|(_, j)| j.clone()).collect(),
                    running_jobs,
                    cached_templates: hb.cached_templates.clone(),
                    cached_loras: hb.cached_loras.clone(),
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
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some(entry) = self.workers.get_mut(worker_id) {
            entry.placed.insert(job.job_id.clone(), (seq, job));
        }
        true
    }

    /// Forget a job (finished, failed, or its placement was refused). Returns its worker.
    pub fn finish(&mut self, job_id: &str) -> Option<String> {
        let worker_id = self.owners.remove(job_id)?;
        if let Some(entry) = self.workers.get_mut(&worker_id) {
            entry.placed.remove(job_id);
            if entry.heartbeat.running.iter().any(|r| r.job_id == job_id) {
                entry.finished.insert(job_id.to_string());
            }
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
            waiting: vec![],
            max_batch,
            model: "tiny".into(),
            draining: false,
            queue_capacity: 2,
            cached_templates: vec![],
            cached_loras: vec![],
            controlnets: vec![],
            recent_steps: vec![],
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
    fn view_splits_placed_jobs_into_running_and_waiting_in_order() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        let mut hb = heartbeat("a", 2, 0);
        reg.observe(hb.clone(), t0);
        for id in ["j1", "j2", "j3"] {
            reg.record_placement("a", job(id));
        }
        hb.running = vec![RunningJob {
            job_id: "j2".into(),
            masked_tokens: 10,
            remaining_steps: 3,
            rows: 1,
            images: 1,
        }];
        hb.queued = 1;
        hb.cached_templates = vec!["t1".into()];
        reg.observe(hb, t0);
        let v = &reg.views()[0];
        let waiting: Vec<&str> = v.waiting.iter().map(|j| j.job_id.as_str()).collect();
        assert_eq!(waiting, vec!["j1", "j3"]);
        assert!(v.running_jobs.contains_key("j2"));
        assert_eq!(v.reported_queued, 1);
        assert_eq!(v.outstanding, 3);
        assert_eq!(v.cached_templates, vec!["t1".to_string()]);
    }

    #[test]
    fn a_finished_job_leaves_the_running_batch_before_the_next_heartbeat() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        let mut hb = heartbeat("a", 2, 0);
        reg.observe(hb.clone(), t0);
        reg.record_placement("a", job("j1"));
        reg.record_placement("a", job("j2"));
        hb.running = ["j1", "j2"]
            .map(|id| RunningJob {
                job_id: id.into(),
                masked_tokens: 10,
                remaining_steps: 3,
                rows: 1,
                images: 1,
            })
            .to_vec();
        reg.observe(hb.clone(), t0);
        // j1's Done event arrives; the last heartbeat still lists it.
        reg.finish("j1");
        let v = &reg.views()[0];
        let running: Vec<&str> = v.running.iter().map(|r| r.job_id.as_str()).collect();
        assert_eq!(running, vec!["j2"]);
        assert_eq!(v.outstanding, 1);
        // The next heartbeat no longer lists it: nothing left to remember.
        hb.running.remove(0);
        reg.observe(hb, t0);
        assert!(reg.live().next().unwrap().finished.is_empty());
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
