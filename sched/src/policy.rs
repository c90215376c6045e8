//! The placement trait shared by the live router and the simulator (the GF-DiT idea: a policy
//! compared offline is deployed unchanged), with the baseline policies.
//!
//! A policy sees only what a router can know from heartbeats and its own placements: each
//! worker's running batch and queue (masked tokens and remaining steps per request), template
//! cache residency, limits and liveness. It never sees simulator internals.
use crate::batching::BatchLimits;
use crate::cost_model::CostModels;
pub use crate::cost_model::Footprint;
use crate::error::SchedError;
use crate::mask_aware::{FlashPsGreedy, MaskAware, MaskAwareDeferring, MaskAwareMarginal};

/// A request to place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestInfo {
    /// Masked image tokens of each of its rows (what the mask-aware pass computes besides the
    /// text tokens).
    pub masked_tokens: u32,
    /// Its batch rows and cache streams.
    pub footprint: Footprint,
    pub steps: u32,
    /// Template whose cached activations the request reuses, if any.
    pub template: Option<u64>,
    /// LoRA adapters the request applies ([`template_key`] of each id).
    pub loras: NameKeys,
    /// The ControlNets steering it ([`template_key`] of each name), whose step costs each
    /// worker reports ([`WorkerState::controlnet_step_s`]).
    pub controlnets: NameKeys,
    /// `Some(n)` when the caller can keep the request waiting if the policy declines to place
    /// it although a worker accepts (the router's admission queue can), with the `n` requests
    /// waiting behind it, whom holding it delays too; `None` when it must go now (a lost
    /// worker's job).
    pub waiting_behind: Option<u32>,
}

/// A request on a worker, running or queued.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActiveRequest {
    /// Per row, as [`RequestInfo::masked_tokens`].
    pub masked_tokens: u32,
    pub footprint: Footprint,
    /// Steps not yet started (for a queued request: all its steps). A running request with 0
    /// finishes when the step in flight ends.
    pub remaining_steps: u32,
}

/// What a policy knows about one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerState {
    /// False when heartbeats stopped or the worker is draining.
    pub alive: bool,
    pub running: Vec<ActiveRequest>,
    /// FIFO order.
    pub queued: Vec<ActiveRequest>,
    /// Templates whose cached activations are in this worker's fast tier.
    pub resident_templates: Vec<u64>,
    /// LoRA adapters in this worker's memory ([`template_key`] of each id).
    pub resident_loras: Vec<u64>,
    pub limits: BatchLimits,
    /// Seconds until the step in flight ends (0 when idle).
    pub step_remaining_s: f64,
    /// This worker's measured step time over the cost models' prediction
    /// ([`crate::calibration::StepCalibration::factor`]); forecasts scale every step by it.
    pub step_time_factor: f64,
    /// Per ControlNet ([`template_key`] of its name): the seconds this worker's step loop
    /// spends on one steered request per step, as it measured them.
    pub controlnet_step_s: Vec<(u64, f64)>,
}

/// The step cost of `controlnets` in a worker's table ([`WorkerState::controlnet_step_s`]),
/// summed (each runs every step); 0 for one the worker has not measured.
pub fn controlnet_step_s(table: &[(u64, f64)], controlnets: NameKeys) -> f64 {
    controlnets
        .iter()
        .map(|c| table.iter().find(|(k, _)| *k == c).map_or(0.0, |(_, s)| *s))
        .sum()
}

impl WorkerState {
    pub fn idle(limits: BatchLimits) -> Self {
        WorkerState {
            alive: true,
            running: Vec::new(),
            queued: Vec::new(),
            resident_templates: Vec::new(),
            resident_loras: Vec::new(),
            limits,
            step_remaining_s: 0.0,
            step_time_factor: 1.0,
            controlnet_step_s: Vec::new(),
        }
    }

    /// `req`'s footprint on this worker: with the step cost of its ControlNets here (0 when
    /// the worker has not measured it yet).
    pub fn footprint_of(&self, req: &RequestInfo) -> Footprint {
        let control_s = controlnet_step_s(&self.controlnet_step_s, req.controlnets);
        req.footprint.with_control_s(control_s)
    }

    /// Alive and with room for one more request: a worker runs at most `max_batch` rows (a
    /// guided image is two) and keeps at most `queue_capacity` requests waiting. Its requests,
    /// running and queued, fill the batch in order as the engine admits them; the rest, and a
    /// new request when the batch has no row left, count against the queue. (Counting the
    /// total, not the queue alone, lets a router that sees a placement before the worker has
    /// batched it treat it as queued.)
    pub fn accepts(&self) -> bool {
        let rows_only = BatchLimits {
            token_budget: u64::MAX,
            ..self.limits
        };
        let requests = || self.running.iter().chain(&self.queued);
        let in_batch = crate::batching::admit_count(
            &rows_only,
            0,
            0,
            requests().map(|r| (r.footprint.rows, 0)),
        );
        let batch_rows: u64 = requests()
            .take(in_batch)
            .map(|r| u64::from(r.footprint.rows))
            .sum();
        let waiting = self.requests() - in_batch;
        let new_waits = waiting > 0 || batch_rows >= u64::from(self.limits.max_batch);
        let would_wait = waiting as u64 + u64::from(new_waits);
        self.alive && would_wait <= u64::from(self.limits.queue_capacity)
    }

    pub fn holds(&self, template: Option<u64>) -> bool {
        template.is_none_or(|t| self.resident_templates.contains(&t))
    }

    /// Holds everything the request reads besides the model: its template's cache and its LoRA
    /// adapters (a worker without the adapters runs the request too, fetching them meanwhile).
    pub fn holds_all(&self, req: &RequestInfo) -> bool {
        self.holds(req.template) && req.loras.iter().all(|l| self.resident_loras.contains(&l))
    }

    pub fn requests(&self) -> usize {
        self.running.len() + self.queued.len()
    }

    /// Batch rows of every request on the worker, running or queued.
    pub fn rows(&self) -> u64 {
        self.running
            .iter()
            .chain(&self.queued)
            .map(|r| u64::from(r.footprint.rows))
            .sum()
    }

    pub fn masked_tokens(&self) -> u64 {
        self.running
            .iter()
            .chain(&self.queued)
            .map(|r| u64::from(r.masked_tokens) * u64::from(r.footprint.rows))
            .sum()
    }
}

/// Up to four names of a request (its LoRA adapters, its ControlNets) as keys; fixed-size so
/// [`RequestInfo`] stays `Copy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NameKeys {
    keys: [u64; 4],
    len: u8,
}

impl NameKeys {
    pub const NONE: NameKeys = NameKeys {
        keys: [0; 4],
        len: 0,
    };

    /// The keys of up to four names (a request carries at most four; more are ignored).
    pub fn of<'a>(ids: impl IntoIterator<Item = &'a str>) -> Self {
        Self::of_keys(ids.into_iter().map(template_key))
    }

    /// Up to four keys as they are.
    pub fn of_keys(keys: impl IntoIterator<Item = u64>) -> Self {
        let mut k = Self::NONE;
        for key in keys.into_iter().take(4) {
            k.keys[k.len as usize] = key;
            k.len += 1;
        }
        k
    }

    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.keys[..self.len as usize].iter().copied()
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Stable 64-bit key of a template id (FNV-1a of its text), so the live router (string ids:
/// the SHA-256 of the prepared template) and traces (numeric ids) share `RequestInfo::template`.
pub fn template_key(id: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.as_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Chooses a worker for each arriving request.
pub trait Policy: Send {
    fn name(&self) -> &str;
    /// Index into `workers` of the chosen one, or `None` when no worker accepts.
    fn place(
        &mut self,
        req: &RequestInfo,
        workers: &[WorkerState],
        model: &CostModels,
    ) -> Option<usize>;
}

/// Every policy name [`policy_by_name`] knows.
pub const POLICY_NAMES: [&str; 7] = [
    "round-robin",
    "request-count",
    "token-count",
    "mask-aware",
    "mask-aware-marginal",
    "mask-aware-deferring",
    "flashps-greedy",
];

pub fn policy_by_name(name: &str) -> Result<Box<dyn Policy>, SchedError> {
    Ok(match name {
        "round-robin" => Box::new(RoundRobin::default()),
        "request-count" => Box::new(RequestCount),
        "token-count" => Box::new(TokenCount),
        "mask-aware" => Box::new(MaskAware::default()),
        "mask-aware-marginal" => Box::new(MaskAwareMarginal::default()),
        "mask-aware-deferring" => Box::new(MaskAwareDeferring::default()),
        "flashps-greedy" => Box::new(FlashPsGreedy),
        other => return Err(SchedError::UnknownPolicy(other.to_string())),
    })
}

/// Index of the accepting worker with the smallest key; ties go to the lowest index.
pub(crate) fn argmin_by<K: PartialOrd>(
    workers: &[WorkerState],
    mut key: impl FnMut(&WorkerState) -> K,
) -> Option<usize> {
    let mut best: Option<(usize, K)> = None;
    for (i, w) in workers.iter().enumerate() {
        if !w.accepts() {
            continue;
        }
        let k = key(w);
        if best.as_ref().is_none_or(|(_, b)| k < *b) {
            best = Some((i, k));
        }
    }
    best.map(|(i, _)| i)
}

/// Next accepting worker in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &str {
        "round-robin"
    }
    fn place(&mut self, _: &RequestInfo, workers: &[WorkerState], _: &CostModels) -> Option<usize> {
        let n = workers.len();
        let chosen = (0..n)
            .map(|o| (self.next + o) % n)
            .find(|&i| workers[i].accepts())?;
        self.next = (chosen + 1) % n;
        Some(chosen)
    }
}

/// Fewest requests (running + queued).
#[derive(Debug, Default)]
pub struct RequestCount;

impl Policy for RequestCount {
    fn name(&self) -> &str {
        "request-count"
    }
    fn place(&mut self, _: &RequestInfo, workers: &[WorkerState], _: &CostModels) -> Option<usize> {
        argmin_by(workers, |w| w.requests())
    }
}

/// Fewest masked tokens (running + queued).
#[derive(Debug, Default)]
pub struct TokenCount;

impl Policy for TokenCount {
    fn name(&self) -> &str {
        "token-count"
    }
    fn place(&mut self, _: &RequestInfo, workers: &[WorkerState], _: &CostModels) -> Option<usize> {
        argmin_by(workers, |w| w.masked_tokens())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::synthetic;

    pub(crate) fn req(masked: u32) -> ActiveRequest {
        ActiveRequest {
            masked_tokens: masked,
            footprint: Footprint::ONE_ROW,
            remaining_steps: 10,
        }
    }

    pub(crate) fn worker(running: &[ActiveRequest], queued: &[ActiveRequest]) -> WorkerState {
        WorkerState {
            running: running.to_vec(),
            queued: queued.to_vec(),
            ..WorkerState::idle(BatchLimits::default())
        }
    }

    pub(crate) fn new_req() -> RequestInfo {
        RequestInfo {
            masked_tokens: 400,
            footprint: Footprint::ONE_ROW,
            steps: 28,
            template: None,
            loras: NameKeys::NONE,
            controlnets: crate::policy::NameKeys::NONE,
            waiting_behind: Some(0),
        }
    }

    #[test]
    fn round_robin_cycles_and_skips_dead_workers() {
        let m = synthetic::default_models();
        let mut ws = vec![worker(&[], &[]); 3];
        ws[1].alive = false;
        let mut p = RoundRobin::default();
        let got: Vec<_> = (0..4).map(|_| p.place(&new_req(), &ws, &m)).collect();
        assert_eq!(got, vec![Some(0), Some(2), Some(0), Some(2)]);
        for w in &mut ws {
            w.alive = false;
        }
        assert_eq!(p.place(&new_req(), &ws, &m), None);
    }

    #[test]
    fn request_count_picks_fewest_requests() {
        let m = synthetic::default_models();
        let ws = vec![
            worker(&[req(10), req(10)], &[req(10)]),
            worker(&[req(4000)], &[req(4000)]),
            worker(&[req(1), req(1)], &[]),
        ];
        // Worker 1 and 2 both hold 2; the tie goes to the lower index.
        assert_eq!(RequestCount.place(&new_req(), &ws, &m), Some(1));
    }

    #[test]
    fn token_count_picks_fewest_masked_tokens() {
        let m = synthetic::default_models();
        let ws = vec![
            worker(&[req(10), req(10)], &[req(10)]),
            worker(&[req(4000)], &[]),
            worker(&[req(100)], &[req(100)]),
        ];
        assert_eq!(TokenCount.place(&new_req(), &ws, &m), Some(0));
    }

    #[test]
    fn full_workers_are_skipped() {
        let m = synthetic::default_models();
        // Worker 0 is full: batch of 1 running plus a queue of 1 waiting.
        let mut ws = vec![
            worker(&[req(1)], &[req(1)]),
            worker(&[req(5), req(5)], &[req(5)]),
        ];
        ws[0].limits.max_batch = 1;
        ws[0].limits.queue_capacity = 1;
        assert!(!ws[0].accepts());
        assert_eq!(RequestCount.place(&new_req(), &ws, &m), Some(1));
        // A placement the worker has not batched yet counts as queued, not as over the limit.
        let mut fresh = worker(&[], &[req(1), req(1)]);
        fresh.limits.max_batch = 2;
        fresh.limits.queue_capacity = 1;
        assert!(fresh.accepts());
        // The batch holds rows: two guided requests fill a batch of 4, a third waits, and a
        // queue of one is then full (counting requests, the worker had room for two more).
        let guided = ActiveRequest {
            footprint: Footprint::new(1, true),
            ..req(1)
        };
        let mut w = worker(&[guided, guided], &[guided]);
        w.limits.max_batch = 4;
        w.limits.queue_capacity = 1;
        assert!(!w.accepts());
        w.queued.clear();
        assert!(w.accepts());
        // Without a queue a worker takes what its batch has rows for.
        let mut no_queue = worker(&[], &[]);
        no_queue.limits.max_batch = 1;
        no_queue.limits.queue_capacity = 0;
        assert!(no_queue.accepts());
        no_queue.running.push(req(1));
        assert!(!no_queue.accepts());
        // A request wider than the batch runs alone; the one behind it waits.
        let wide = ActiveRequest {
            footprint: Footprint::new(3, true),
            ..req(1)
        };
        let w = worker(&[wide], &[req(1)]);
        let w = WorkerState {
            limits: BatchLimits {
                max_batch: 4,
                queue_capacity: 1,
                ..w.limits
            },
            ..w
        };
        assert!(!w.accepts());
    }

    #[test]
    fn template_keys_are_stable_and_distinct() {
        assert_eq!(template_key(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(template_key("a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(template_key("ab"), template_key("ba"));
    }

    #[test]
    fn names_resolve() {
        for n in POLICY_NAMES {
            assert_eq!(policy_by_name(n).unwrap().name(), n);
        }
        assert!(policy_by_name("nope").is_err());
    }
}
