//! Worker registry built from denoiser heartbeats, plus the jobs this router placed on each worker.
//!
//! Pure state (no NATS, no clock of its own): callers pass `Instant`s, so the expiry and failover
//! logic is unit-tested with hand-built heartbeats.
use diffmesh_shared::wire::messages::{DenoiseJob, Heartbeat, RunningJob};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

/// When a worker counts as lost.
#[derive(Debug, Clone, Copy)]
pub struct ExpiryPolicy {
    /// A worker is lost after this many consecutive heartbeats did not arrive (each worker's
    /// heartbeats say how often it sends them).
    pub missed_heartbeats: u32,
}

impl ExpiryPolicy {
    /// Silence longer than this expires a worker that sends heartbeats every `interval`.
    pub fn timeout(&self, interval: Duration) -> Duration {
        interval * self.missed_heartbeats.max(1)
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
        let policy = self.policy;
        let lost: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, e)| {
                now.saturating_duration_since(e.last_seen) > policy.timeout(e.heartbeat.interval())
            })
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
    use crate::worker_state::fill_worker_state;
    use diffmesh_sched::batching::BatchLimits;
    use diffmesh_sched::policy::template_key;
    use diffmesh_sched::WorkerState;

    pub fn heartbeat(id: &str, max_batch: u32, queued: u32) -> Heartbeat {
        Heartbeat {
            worker_id: id.into(),
            running: vec![],
            queued,
            waiting: vec![],
            max_batch,
            model: "tiny".into(),
            card: None,
            draining: false,
            queue_capacity: 2,
            cached_templates: vec![],
            cached_loras: vec![],
            controlnets: vec![],
            recent_steps: vec![],
            controlnet_step_s: vec![],
            interval_ms: 500,
            ranks: 0,
            free_ranks: 0,
        }
    }

    pub fn job(id: &str) -> DenoiseJob {
        diffmesh_shared::testing::generation_job(id, "a red circle", 1, 4)
    }

    pub fn policy() -> ExpiryPolicy {
        ExpiryPolicy {
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
    fn each_worker_expires_by_the_period_its_heartbeats_give() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        let fast = Heartbeat {
            interval_ms: 100,
            ..heartbeat("fast", 2, 0)
        };
        let old = Heartbeat {
            interval_ms: 0,
            ..heartbeat("old", 2, 0)
        };
        reg.observe(fast, t0);
        reg.observe(old, t0);
        // 3 x 100 ms missed by `fast`; `old` says no period: the default 500 ms.
        let lost = reg.expire(t0 + Duration::from_millis(400));
        assert_eq!(lost.len(), 1);
        assert_eq!(lost[0].worker_id, "fast");
        assert!(reg.expire(t0 + Duration::from_millis(1400)).is_empty());
        assert_eq!(reg.expire(t0 + Duration::from_millis(1600)).len(), 1);
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

    /// The policies' view of the only live worker (as placement builds it).
    /// (At the time of the heartbeats below, so the batch is not advanced.)
    fn state(reg: &WorkerRegistry) -> WorkerState {
        let mut ws = WorkerState::idle(BatchLimits::default());
        let models = crate::worker_state::tests::models();
        let w = reg.live().next().unwrap();
        fill_worker_state(w, &models, 1.0, w.last_seen, &mut ws);
        ws
    }

    #[test]
    fn placements_not_yet_reported_count_as_queued() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        reg.observe(heartbeat("a", 1, 0), t0);
        assert!(state(&reg).accepts());
        reg.record_placement("a", job("j1"));
        reg.record_placement("a", job("j2"));
        assert_eq!(state(&reg).requests(), 2);
        reg.record_placement("a", job("j3"));
        // max_batch 1 + queue 2 = 3 slots, all taken.
        assert!(!state(&reg).accepts());
        // The worker's own count wins when it is larger (jobs from another router).
        reg.observe(heartbeat("a", 1, 5), t0);
        assert_eq!(state(&reg).requests(), 5);
    }

    #[test]
    fn placed_jobs_split_into_running_and_waiting_in_order() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        let mut hb = heartbeat("a", 2, 0);
        reg.observe(hb.clone(), t0);
        for (id, steps) in [("j1", 11), ("j2", 12), ("j3", 13)] {
            let mut j = job(id);
            j.params.num_inference_steps = steps;
            reg.record_placement("a", j);
        }
        hb.running = vec![RunningJob {
            job_id: "j2".into(),
            masked_tokens: 10,
            remaining_steps: 3,
            rows: 1,
            images: 1,
            control_s: 0.0,
        }];
        hb.queued = 1;
        hb.cached_templates = vec!["t1".into()];
        reg.observe(hb, t0);
        let ws = state(&reg);
        let running: Vec<u32> = ws.running.iter().map(|r| r.remaining_steps).collect();
        assert_eq!(running, vec![3]);
        let waiting: Vec<u32> = ws.queued.iter().map(|r| r.remaining_steps).collect();
        assert_eq!(waiting, vec![11, 13]);
        assert!(ws.holds(Some(template_key("t1"))));
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
                control_s: 0.0,
            })
            .to_vec();
        reg.observe(hb.clone(), t0);
        // j1's Done event arrives; the last heartbeat still lists it.
        reg.finish("j1");
        let w = reg.live().next().unwrap();
        let running: Vec<&str> = w.running().map(|r| r.job_id.as_str()).collect();
        assert_eq!(running, vec!["j2"]);
        assert_eq!(state(&reg).requests(), 1);
        // The next heartbeat no longer lists it: nothing left to remember.
        hb.running.remove(0);
        reg.observe(hb, t0);
        assert!(reg.live().next().unwrap().finished.is_empty());
    }

    #[test]
    fn a_draining_worker_accepts_nothing() {
        let mut reg = WorkerRegistry::new(policy());
        let mut hb = heartbeat("a", 4, 0);
        hb.draining = true;
        reg.observe(hb, Instant::now());
        assert!(!state(&reg).accepts());
    }

    #[test]
    fn placement_on_unknown_worker_is_refused() {
        let mut reg = WorkerRegistry::new(policy());
        assert!(!reg.record_placement("ghost", job("j1")));
        assert_eq!(reg.tracked_jobs(), 0);
    }
}
