//! Discrete-event simulator: the live router's [`Policy`] places each arrival; workers follow the
//! engine's step-level continuous batching ([`crate::batching`]); each step lasts the planner's
//! latency for the batch under the fitted cost models. Policies see only [`WorkerState`]
//! snapshots, exactly what the live router builds from heartbeats.
pub mod metrics;
pub mod workload;

use crate::batching::{admit_count, BatchLimits};
use crate::calibration::StepCalibration;
use crate::cost_model::{BatchTotals, CostModels, Footprint};
use crate::policy::{ActiveRequest, Policy, RequestInfo, WorkerState};
use crate::queue_order::{QueueOrder, QueuedJob};
use metrics::{percentile, Summary};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::VecDeque;
pub use workload::Arrival;

/// Simulation settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    pub workers: u32,
    pub limits: BatchLimits,
    /// Deadline = arrival + `slo_factor` x the request's standalone service time.
    pub slo_factor: f64,
    /// Std-dev of multiplicative Gaussian noise on each step's latency (0: steps take exactly
    /// what the cost model predicts, so a model-based policy predicts perfectly).
    pub step_noise: f64,
    /// Seeds the step noise (arrivals are generated outside, so every policy sees the same ones).
    pub seed: u64,
    /// Seconds every request spends outside the denoisers (a live mesh's uploads, codec pre-
    /// and post-processing, NATS hops, result download), added to its latency and its
    /// standalone time. The denoisers' queues do not see it: a constant shift of every arrival
    /// leaves their order and gaps as they were.
    pub request_overhead_s: f64,
    /// Workers that share a machine's cores with each other and with the rest of the mesh (a
    /// CPU deployment); `None`: each worker has its own device, as on GPUs.
    pub shared_cpu: Option<SharedCpu>,
    /// Per worker, how much longer its steps take than the cost models predict (worker `i`
    /// gets entry `i mod len`; empty: all as predicted): a fleet of unlike machines.
    pub worker_step_factors: Vec<f64>,
    /// Policies see each worker's step-time factor learned from the steps it ran
    /// ([`crate::calibration`]), as the live router learns it from heartbeats; false: every
    /// view says 1 (the router trusts the profile).
    pub calibrate: bool,
    /// Most requests the router holds while no worker takes them (the live router's
    /// `--max-queue`); an arrival beyond it is rejected.
    pub router_queue: usize,
    /// Longest a policy may hold a request back while a worker would take it (the live router:
    /// half of `--admission-wait-ms`); past it the request is placed where it can go.
    pub max_hold_s: f64,
    /// The order each worker admits its queue in (FCFS, SRTF on the cost model's remaining
    /// time, EDF on the SLO deadline), as the engine's `--queue-order`.
    pub queue_order: QueueOrder,
    /// With SRTF or EDF: at every step boundary the running jobs compete for the batch slots
    /// with the waiting ones, and those the order leaves out wait with their progress kept
    /// (GF-DiT's rescheduling at trajectory-task boundaries). The engine does not do this yet.
    pub preempt: bool,
    /// What steered requests ([`Arrival::steered`]) cost each worker's step loop.
    pub controlnets: SimControlNets,
}

/// Steered requests in the simulator: each adds, to every step it runs in, the seconds its
/// worker spends on a ControlNet outside the batched forward (a worker that computes its
/// ControlNets itself pays the forward; one with ControlNet workers keeping up, about 0).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimControlNets {
    /// Per worker (worker `i` gets entry `i mod len`; empty: free everywhere).
    pub step_s: Vec<f64>,
    /// Policies see the costs (as the live router does from heartbeats); false: they do not
    /// (the router before it learned them), though steps still take them.
    pub visible: bool,
}

/// The key steered requests' ControlNet has in the policies' views.
const SIM_CONTROLNET: u64 = 1;

impl SimConfig {
    /// What one steered request costs worker `i`'s step loop a step.
    pub fn control_step_s(&self, i: usize) -> f64 {
        match self.controlnets.step_s.len() {
            0 => 0.0,
            n => self.controlnets.step_s[i % n],
        }
    }

    /// Worker `i`'s true step-time factor.
    pub fn step_factor(&self, i: usize) -> f64 {
        match self.worker_step_factors.len() {
            0 => 1.0,
            n => self.worker_step_factors[i % n],
        }
    }

    /// Workers' total speed in units of a worker stepping as predicted (`sum of 1 / factor`):
    /// what the cluster's capacity scales with.
    pub fn effective_workers(&self) -> f64 {
        (0..self.workers.max(1) as usize)
            .map(|i| 1.0 / self.step_factor(i))
            .sum()
    }
}

/// How workers on one CPU machine slow each other down. A step that starts while `k` workers
/// step (itself included) lasts the cost model's latency times
/// `(1 + co_run_slowdown * min(k - 1 + background, cores - 1)) * max(1, (k + background) / cores)`,
/// where `background` is the cores the rest of the mesh keeps busy: `background_cpu_s` per
/// request at the trace's mean arrival rate. The first factor is what work on the other cores
/// costs a step (shared caches and memory bandwidth), whether another worker's step or the
/// mesh's own work (a lone step on a busy mesh is slower too: measured, 2026-11-28); the second
/// is time slicing once demand passes the cores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SharedCpu {
    pub cores: f64,
    pub co_run_slowdown: f64,
    /// CPU seconds each request costs outside the workers (gateway, codec, NATS, router).
    pub background_cpu_s: f64,
}

impl SharedCpu {
    /// Step-latency factor when `stepping` workers (this one included) step at once.
    pub fn slowdown(&self, stepping: usize, background_cores: f64) -> f64 {
        let k = stepping.max(1) as f64;
        let beside = (k - 1.0 + background_cores).min((self.cores - 1.0).max(0.0));
        (1.0 + self.co_run_slowdown * beside) * ((k + background_cores) / self.cores).max(1.0)
    }
}

#[derive(Debug, Clone, Copy)]
struct Job {
    arrival_s: f64,
    masked: u32,
    footprint: Footprint,
    /// Steps not yet completed.
    remaining: u32,
    start_s: f64,
    /// Whether it has joined a batch (a preempted job keeps its first start and is not
    /// prepared again).
    started: bool,
    deadline_s: f64,
    /// Latency alone on an idle worker stepping as predicted, overhead included.
    standalone_s: f64,
}

#[derive(Debug, Default)]
struct Worker {
    running: Vec<Job>,
    queue: VecDeque<Job>,
    step_end: Option<f64>,
    /// The step in flight: what the cost models predicted for its batch, what it takes.
    step_predicted_s: f64,
    step_s: f64,
    calibration: StepCalibration,
    /// [`SimConfig::control_step_s`] of this worker.
    control_step_s: f64,
    busy_s: f64,
    /// When its last step ended, and how many jobs finished then: the loop decodes them
    /// before it steps again ([`CostModels::job_work`]).
    last_step_end_s: f64,
    retiring: u32,
}

struct Totals {
    latencies: Vec<f64>,
    /// Standalone times of the completed requests, for the no-contention floor.
    standalone: Vec<f64>,
    queue_sum: f64,
    slo_met: usize,
    last_finish: f64,
    steps: u64,
    batch_sum: u64,
}

/// Replays `arrivals` (sorted by time) through `policy` and returns the summary.
pub fn simulate(
    cfg: &SimConfig,
    model: &CostModels,
    policy: &mut dyn Policy,
    arrivals: &[Arrival],
) -> Summary {
    simulate_with_latencies(cfg, model, policy, arrivals).0
}

/// [`simulate`], plus every completed request's latency (sorted), for CDF plots.
pub fn simulate_with_latencies(
    cfg: &SimConfig,
    model: &CostModels,
    policy: &mut dyn Policy,
    arrivals: &[Arrival],
) -> (Summary, Vec<f64>) {
    let n = cfg.workers.max(1) as usize;
    let mut workers: Vec<Worker> = (0..n)
        .map(|i| Worker {
            control_step_s: cfg.control_step_s(i),
            ..Worker::default()
        })
        .collect();
    let mut views: Vec<WorkerState> = (0..n).map(|_| WorkerState::idle(cfg.limits)).collect();
    let mut noise = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x005e_ed0f_57e9);
    let mut tot = Totals {
        latencies: Vec::with_capacity(arrivals.len()),
        standalone: Vec::with_capacity(arrivals.len()),
        queue_sum: 0.0,
        slo_met: 0,
        last_finish: 0.0,
        steps: 0,
        batch_sum: 0,
    };
    let background = background_cores(cfg, arrivals);
    let mut rejected = 0;
    let mut next_arrival = 0;
    // The router's admission queue: requests no worker took yet, in arrival order.
    let mut waiting: VecDeque<Arrival> = VecDeque::new();
    let mut now = 0.0;
    loop {
        place_waiting(
            &mut waiting,
            now,
            &mut Placement {
                cfg,
                model,
                policy: &mut *policy,
                workers: &mut workers,
                views: &mut views,
                background,
                noise: &mut noise,
                tot: &mut tot,
            },
        );
        let step = workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.step_end.map(|t| (t, i)))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let arrival = arrivals.get(next_arrival);
        match (step, arrival) {
            (None, None) if waiting.is_empty() => break,
            (None, None) => {
                // Nothing steps and nothing arrives, yet requests wait: the policy held them
                // with every worker idle, which no placement rule may do.
                rejected += waiting.len();
                waiting.clear();
                break;
            }
            (Some((t, w)), a) if a.is_none_or(|a| t <= a.time_s) => {
                now = t;
                finish_step(&mut workers[w], t, cfg.request_overhead_s, &mut tot);
                let slow = slowdown(cfg, &workers, w, background);
                start_step(&mut workers[w], t, slow, cfg, model, &mut noise, &mut tot);
            }
            (_, Some(a)) => {
                next_arrival += 1;
                now = a.time_s;
                if waiting.len() >= cfg.router_queue {
                    rejected += 1;
                } else {
                    waiting.push_back(*a);
                }
            }
            (Some(_), None) => unreachable!("handled by the guard above"),
        }
    }
    summarize(policy.name(), arrivals, rejected, &workers, tot)
}

/// What placing a request touches.
struct Placement<'a> {
    cfg: &'a SimConfig,
    model: &'a CostModels,
    policy: &'a mut dyn Policy,
    workers: &'a mut [Worker],
    views: &'a mut [WorkerState],
    background: f64,
    noise: &'a mut ChaCha8Rng,
    tot: &'a mut Totals,
}

/// Offers the router's waiting requests to the policy in arrival order, as the live router's
/// dispatcher does, until one is not placed (no worker takes it, or the policy holds it back).
fn place_waiting(waiting: &mut VecDeque<Arrival>, now: f64, p: &mut Placement) {
    while let Some(a) = waiting.front().copied() {
        let visible = p.cfg.controlnets.visible;
        for (w, v) in p.workers.iter().zip(p.views.iter_mut()) {
            snapshot(w, now, visible, v);
            v.step_time_factor = if p.cfg.calibrate {
                w.calibration.factor()
            } else {
                1.0
            };
        }
        let req = RequestInfo {
            masked_tokens: a.masked_tokens,
            footprint: a.footprint,
            steps: a.steps.max(1),
            template: a.template,
            loras: crate::policy::NameKeys::NONE,
            controlnets: crate::policy::NameKeys::of_keys(a.steered.then_some(SIM_CONTROLNET)),
            waiting_behind: (now - a.time_s < p.cfg.max_hold_s)
                .then_some((waiting.len() - 1) as u32),
        };
        let Some(w) = p
            .policy
            .place(&req, p.views, p.model)
            .filter(|&w| w < p.workers.len())
        else {
            return;
        };
        waiting.pop_front();
        let admit_s = p.model.job_work.map_or(0.0, |w| w.admit_s);
        let standalone = p
            .model
            .standalone_request_s(a.masked_tokens, req.steps, a.footprint)
            + admit_s
            + p.cfg.request_overhead_s;
        let control_s = if a.steered {
            p.workers[w].control_step_s
        } else {
            0.0
        };
        p.workers[w].queue.push_back(Job {
            arrival_s: a.time_s,
            masked: a.masked_tokens,
            footprint: a.footprint.with_control_s(control_s),
            remaining: req.steps,
            start_s: now,
            started: false,
            deadline_s: a.time_s + p.cfg.slo_factor * standalone,
            standalone_s: standalone,
        });
        if p.workers[w].step_end.is_none() {
            let slow = slowdown(p.cfg, p.workers, w, p.background);
            start_step(&mut p.workers[w], now, slow, p.cfg, p.model, p.noise, p.tot);
        }
    }
}

/// Cores the rest of the mesh keeps busy over the trace (0 without a shared CPU).
fn background_cores(cfg: &SimConfig, arrivals: &[Arrival]) -> f64 {
    let (Some(cpu), Some(first), Some(last)) = (cfg.shared_cpu, arrivals.first(), arrivals.last())
    else {
        return 0.0;
    };
    let span = last.time_s - first.time_s;
    if span <= 0.0 {
        return 0.0;
    }
    cpu.background_cpu_s * arrivals.len() as f64 / span
}

/// Step-latency factor for worker `w` starting a step now: its own speed, and who else is
/// stepping on a shared CPU.
fn slowdown(cfg: &SimConfig, workers: &[Worker], w: usize, background: f64) -> f64 {
    cfg.step_factor(w)
        * cfg.shared_cpu.map_or(1.0, |cpu| {
            let others = workers
                .iter()
                .enumerate()
                .filter(|(i, o)| *i != w && o.step_end.is_some())
                .count();
            cpu.slowdown(others + 1, background)
        })
}

/// What the router would know about a worker at `now` (ControlNet costs only if `visible`).
fn snapshot(w: &Worker, now: f64, visible: bool, v: &mut WorkerState) {
    let in_flight = w.step_end.is_some();
    let seen = |j: &Job| {
        if visible {
            j.footprint
        } else {
            j.footprint.with_control_s(0.0)
        }
    };
    v.running.clear();
    v.running.extend(w.running.iter().map(|j| ActiveRequest {
        masked_tokens: j.masked,
        footprint: seen(j),
        remaining_steps: j.remaining - u32::from(in_flight),
    }));
    v.queued.clear();
    v.queued.extend(w.queue.iter().map(|j| ActiveRequest {
        masked_tokens: j.masked,
        footprint: seen(j),
        remaining_steps: j.remaining,
    }));
    v.controlnet_step_s.clear();
    if visible {
        v.controlnet_step_s.push((SIM_CONTROLNET, w.control_step_s));
    }
    v.step_remaining_s = w.step_end.map_or(0.0, |t| (t - now).max(0.0));
}

/// End the worker's step at `t`; requests that finish leave `overhead_s` later.
fn finish_step(w: &mut Worker, t: f64, overhead_s: f64, tot: &mut Totals) {
    w.step_end = None;
    w.last_step_end_s = t;
    // The live router learns from a step once the worker reports it: when it has ended.
    w.calibration.observe(w.step_s, w.step_predicted_s);
    for j in &mut w.running {
        j.remaining -= 1;
        if j.remaining == 0 {
            w.retiring += 1;
            let done = t + overhead_s;
            tot.latencies.push(done - j.arrival_s);
            tot.standalone.push(j.standalone_s);
            tot.queue_sum += j.start_s - j.arrival_s;
            tot.slo_met += usize::from(done <= j.deadline_s + 1e-12);
            tot.last_finish = tot.last_finish.max(t);
        }
    }
    w.running.retain(|j| j.remaining > 0);
}

fn start_step(
    w: &mut Worker,
    now: f64,
    slowdown: f64,
    cfg: &SimConfig,
    model: &CostModels,
    noise: &mut ChaCha8Rng,
    tot: &mut Totals,
) {
    let preempt = cfg.preempt && cfg.queue_order != QueueOrder::Fcfs && !w.queue.is_empty();
    if preempt {
        // The running jobs compete for the slots again; whoever the order leaves out waits.
        w.queue.extend(w.running.drain(..));
    }
    order_queue(w, cfg.queue_order, model);
    let shape = &model.shape;
    let tokens: u64 = w
        .running
        .iter()
        .map(|j| shape.request_tokens(j.masked, j.footprint))
        .sum();
    let rows = rows_of(&w.running);
    let take = admit_count(
        &cfg.limits,
        rows,
        tokens,
        w.queue.iter().map(|j| {
            (
                j.footprint.rows,
                shape.request_tokens(j.masked, j.footprint),
            )
        }),
    );
    let mut admit = 0;
    for mut j in w.queue.drain(..take) {
        if !j.started {
            (j.start_s, j.started) = (now, true);
            admit += 1;
        }
        w.running.push(j);
    }
    if w.running.is_empty() {
        return;
    }
    // The step loop first decodes the jobs the last step finished, then prepares those it
    // admits; the step's jobs wait for both. Only the step itself is reported (and calibrated).
    let work = model.job_work.unwrap_or_default();
    let retire_s = work.retire_s * f64::from(w.retiring) * slowdown;
    let admit_s = work.admit_s * admit as f64 * slowdown;
    let begin = (w.last_step_end_s + retire_s).max(now) + admit_s;
    w.retiring = 0;
    let mut totals = BatchTotals::default();
    for j in &w.running {
        totals.add_request(shape, j.masked, j.footprint);
    }
    let modelled = model.step_latency(&totals);
    // What the router's cost model predicts (its calibration compares steps with that): the
    // ControlNet costs only when it sees them.
    let predicted = if cfg.controlnets.visible {
        modelled
    } else {
        modelled - totals.control_s
    };
    let mut latency = modelled * slowdown;
    if cfg.step_noise > 0.0 {
        let u1: f64 = 1.0 - noise.random::<f64>();
        let u2: f64 = noise.random::<f64>();
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        latency *= (1.0 + cfg.step_noise * z).max(0.1);
    }
    w.step_end = Some(begin + latency);
    (w.step_predicted_s, w.step_s) = (predicted, latency);
    w.busy_s += retire_s + admit_s + latency;
    tot.steps += 1;
    tot.batch_sum += u64::from(rows_of(&w.running));
}

fn rows_of(jobs: &[Job]) -> u32 {
    jobs.iter().map(|j| j.footprint.rows).sum()
}

/// Puts the worker's queue in its admission order (a no-op for FCFS).
fn order_queue(w: &mut Worker, order: QueueOrder, model: &CostModels) {
    if order == QueueOrder::Fcfs || w.queue.len() < 2 {
        return;
    }
    let keys: Vec<QueuedJob> = w
        .queue
        .iter()
        .map(|j| QueuedJob {
            arrival_s: j.arrival_s,
            deadline_s: Some(j.deadline_s),
            remaining_work: model.standalone_request_s(j.masked, j.remaining, j.footprint),
        })
        .collect();
    let mut old: Vec<Option<Job>> = w.queue.drain(..).map(Some).collect();
    w.queue
        .extend(order.order(&keys).into_iter().filter_map(|i| old[i].take()));
}

fn summarize(
    policy: &str,
    arrivals: &[Arrival],
    rejected: usize,
    workers: &[Worker],
    mut tot: Totals,
) -> (Summary, Vec<f64>) {
    tot.latencies.sort_by(f64::total_cmp);
    tot.standalone.sort_by(f64::total_cmp);
    let completed = tot.latencies.len();
    let first = arrivals.first().map_or(0.0, |a| a.time_s);
    let span = (tot.last_finish - first).max(f64::MIN_POSITIVE);
    let busy: f64 = workers.iter().map(|w| w.busy_s).sum();
    let div = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let summary = Summary {
        policy: policy.to_string(),
        submitted: arrivals.len(),
        completed,
        rejected,
        p50: percentile(&tot.latencies, 50.0),
        p95: percentile(&tot.latencies, 95.0),
        p99: percentile(&tot.latencies, 99.0),
        standalone_p95: percentile(&tot.standalone, 95.0),
        mean_latency: div(tot.latencies.iter().sum(), completed as f64),
        mean_queue: div(tot.queue_sum, completed as f64),
        throughput: div(completed as f64, span),
        slo_attainment: div(tot.slo_met as f64, arrivals.len() as f64),
        mean_batch: div(tot.batch_sum as f64, tot.steps as f64),
        utilization: div(busy, span * workers.len() as f64),
    };
    (summary, tot.latencies)
}

#[cfg(test)]
mod tests;
