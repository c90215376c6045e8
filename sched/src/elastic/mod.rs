//! Elastic parallelism in simulation (GF-DiT §5.5, issue 47 point 4): requests of mixed
//! classes arrive on `G` ranks; at every arrival and step completion the policy
//! ([`policies::ElasticPolicy`], the trait a node's live ranks use too) decides which
//! ready tasks step next and on how many ranks; steps take what the parallel-cost model
//! ([`cost::StepCost`]) says; where the cost depends on how many ranks are busy (CPU ranks
//! sharing cores, [`cost::StepCost::step_s_loaded`]) a running step advances at the pace of
//! the ranks busy at each moment, re-evaluated at every event. A request whose degree
//! changes between steps pays a latents migration (small: they are replicated;
//! [`MIGRATION_S`]).
//!
//! `diffmesh-sim --elastic ...` ([`cli`]) runs it and prints `slo_attainment`,
//! `mean_latency`, `p95` and `throughput`.
pub mod cli;
pub mod cost;
pub mod policies;

use cost::{Class, StepCost};
use policies::{ElasticPolicy, Ready, View};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Seconds a step's start is delayed when its degree differs from the last step's.
pub const MIGRATION_S: f64 = 0.0005;

/// A request of the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub class: usize,
    pub arrival: f64,
    pub deadline: f64,
}

/// The arrivals to simulate.
#[derive(Debug, Clone)]
pub struct WorkloadSpec<'a> {
    pub classes: &'a [Class],
    pub cost: &'a StepCost,
    /// Weight of each class.
    pub mix: &'a [f64],
    pub ranks: u32,
    /// Arrival rate as a fraction of the ranks' SP1 capacity.
    pub load: f64,
    /// Multiplies every class's deadline factor.
    pub slo_scale: f64,
    /// Seconds of arrivals.
    pub duration: f64,
    pub seed: u64,
}

/// Poisson arrivals for `duration` seconds at `load` x the ranks' SP1 capacity, classes drawn
/// with weights `mix`; deadlines `slo_scale` x each class's factor x its SP1 service time.
pub fn workload(spec: &WorkloadSpec) -> Vec<Request> {
    let WorkloadSpec {
        classes,
        cost,
        mix,
        ranks,
        load,
        slo_scale,
        duration,
        seed,
    } = *spec;
    let total: f64 = mix.iter().sum();
    let service = |c: &Class| f64::from(c.steps) * cost.step_s(c, 1);
    let mean_service: f64 = classes
        .iter()
        .zip(mix)
        .map(|(c, w)| service(c) * w / total)
        .sum();
    let rate = load * f64::from(ranks) / mean_service;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut t = 0.0;
    loop {
        t += -(1.0 - rng.random::<f64>()).ln() / rate;
        if t > duration {
            return out;
        }
        let mut pick = rng.random::<f64>() * total;
        let class = mix
            .iter()
            .position(|w| {
                pick -= w;
                pick < 0.0
            })
            .unwrap_or(mix.len() - 1);
        let c = &classes[class];
        out.push(Request {
            class,
            arrival: t,
            deadline: t + slo_scale * c.slo_factor * service(c),
        });
    }
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub policy: String,
    pub requests: usize,
    /// Fraction of requests done by their deadline.
    pub slo_attainment: f64,
    pub mean_latency: f64,
    pub p95: f64,
    /// Requests done per second, from the first arrival to the last completion.
    pub throughput: f64,
    /// Steps whose degree differed from the request's previous step.
    pub degree_changes: u64,
    /// Steps run at each degree (index: log2 of the degree).
    pub steps_by_degree: Vec<u64>,
    /// Mean seconds of those steps, by degree (index: log2 of the degree; 0 where none ran).
    pub mean_step_s_by_degree: Vec<f64>,
}

/// A step running on `k` ranks: the fraction of it still to run.
#[derive(Debug, Clone)]
struct Running {
    id: usize,
    k: u32,
    left: f64,
    started: f64,
}

#[derive(Debug, Clone)]
struct State {
    steps_left: u32,
    degree: u32,
    running: bool,
    done_at: Option<f64>,
}

/// Run `requests` (by arrival) on `ranks` ranks under `policy`.
pub fn simulate(
    requests: &[Request],
    classes: &[Class],
    cost: &StepCost,
    ranks: u32,
    policy: &mut dyn ElasticPolicy,
) -> Outcome {
    let mut state: Vec<State> = requests
        .iter()
        .map(|r| State {
            steps_left: classes[r.class].steps,
            degree: 0,
            running: false,
            done_at: None,
        })
        .collect();
    let mut running: Vec<Running> = Vec::new();
    let (mut next_arrival, mut ready, mut busy) = (0usize, Vec::<usize>::new(), 0u32);
    let (mut changes, mut by_degree, mut step_sums) = (0u64, vec![0u64; 8], vec![0.0f64; 8]);
    let mut now = 0.0;
    // Seconds a whole step of `r` takes at the ranks busy now.
    let pace =
        |r: &Running, busy: u32| cost.step_s_loaded(&classes[requests[r.id].class], r.k, busy);
    loop {
        // The next event: an arrival or a step completion (each running step advancing at
        // the pace the ranks busy now allow).
        let arrival = requests.get(next_arrival).map(|r| r.arrival);
        let completion = running
            .iter()
            .enumerate()
            .map(|(i, r)| (now + r.left * pace(r, busy), i))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let (next, ending) = match (arrival, completion) {
            (None, None) => break,
            (Some(a), Some((c, i))) if c <= a => (c, Some(i)),
            (Some(a), _) => (a, None),
            (None, Some((c, i))) => (c, Some(i)),
        };
        for r in &mut running {
            r.left -= (next - now) / pace(r, busy);
        }
        if let Some(i) = ending {
            running[i].left = 0.0;
        }
        now = next;
        while requests.get(next_arrival).is_some_and(|r| r.arrival <= now) {
            ready.push(next_arrival);
            next_arrival += 1;
        }
        let (ended, still): (Vec<Running>, Vec<Running>) =
            running.drain(..).partition(|r| r.left <= 1e-9);
        running = still;
        for r in ended {
            let id = r.id;
            step_sums[(r.k.trailing_zeros() as usize).min(7)] += now - r.started;
            let s = &mut state[id];
            s.running = false;
            s.steps_left -= 1;
            busy -= s.degree;
            if s.steps_left == 0 {
                s.done_at = Some(now);
            } else {
                ready.push(id);
            }
        }
        if ready.is_empty() {
            continue;
        }
        let tasks: Vec<Ready> = ready
            .iter()
            .map(|&id| Ready {
                id,
                class: requests[id].class,
                arrival: requests[id].arrival,
                deadline: requests[id].deadline,
                steps_left: state[id].steps_left,
                degree: state[id].degree,
            })
            .collect();
        let view = View {
            now,
            free: ranks - busy,
            classes,
            cost,
        };
        let mut chosen = policy.assign(&view, &tasks);
        // The runtime checks the decision: known ready tasks, at most the free ranks.
        let mut free = ranks - busy;
        chosen.retain(|&(id, k)| {
            // Not running means ready: every request not running and not done is in `ready`.
            let ok = k >= 1
                && k <= free
                && id < state.len()
                && !state[id].running
                && state[id].done_at.is_none()
                && requests[id].arrival <= now;
            if ok {
                free -= k;
            }
            ok
        });
        if chosen.is_empty() && busy == 0 {
            // A policy that starts nothing on an idle machine would stall the run.
            chosen.push((ready[0], 1));
        }
        let mut started = Vec::new();
        for (id, k) in chosen {
            let s = &mut state[id];
            if s.running {
                continue; // named twice
            }
            let moved = s.degree != 0 && s.degree != k;
            changes += u64::from(moved);
            s.degree = k;
            s.running = true;
            busy += k;
            by_degree[(k.trailing_zeros() as usize).min(7)] += 1;
            started.push((id, k, moved));
        }
        for (id, k, moved) in started {
            let mut r = Running {
                id,
                k,
                left: 1.0,
                started: now,
            };
            if moved {
                r.left += MIGRATION_S / pace(&r, busy);
            }
            running.push(r);
        }
        ready.retain(|&r| !state[r].running);
    }
    let done_at: Vec<Option<f64>> = state.iter().map(|s| s.done_at).collect();
    Outcome {
        degree_changes: changes,
        mean_step_s_by_degree: step_sums
            .iter()
            .zip(&by_degree)
            .map(|(s, &n)| if n > 0 { s / n as f64 } else { 0.0 })
            .collect(),
        steps_by_degree: by_degree,
        ..Outcome::of_completions(policy.name(), requests, &done_at)
    }
}

impl Outcome {
    /// The figures of a run in which request `i` ended at `done_at[i]` (None: never), on the
    /// run's clock (the requests' arrivals'); no step counts. A live run is scored with it
    /// too, so both use one percentile and one attainment.
    pub fn of_completions(policy: String, requests: &[Request], done_at: &[Option<f64>]) -> Self {
        let mut latencies: Vec<f64> = requests
            .iter()
            .zip(done_at)
            .filter_map(|(r, d)| d.map(|d| d - r.arrival))
            .collect();
        latencies.sort_by(f64::total_cmp);
        let met = requests
            .iter()
            .zip(done_at)
            .filter(|(r, d)| d.is_some_and(|d| d <= r.deadline))
            .count();
        let n = requests.len().max(1) as f64;
        let last = done_at.iter().flatten().fold(0.0, |a: f64, &b| a.max(b));
        let first = requests.first().map_or(0.0, |r| r.arrival);
        Outcome {
            policy,
            requests: requests.len(),
            slo_attainment: met as f64 / n,
            mean_latency: latencies.iter().sum::<f64>() / latencies.len().max(1) as f64,
            p95: latencies
                .get(((latencies.len() as f64 * 0.95).ceil() as usize).saturating_sub(1))
                .copied()
                .unwrap_or(0.0),
            throughput: latencies.len() as f64 / (last - first).max(1e-9),
            degree_changes: 0,
            steps_by_degree: Vec::new(),
            mean_step_s_by_degree: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::cost::image_classes;
    use super::policies::{by_name, StaticSp};
    use super::*;

    fn spec<'a>(
        classes: &'a [Class],
        cost: &'a StepCost,
        load: f64,
        duration: f64,
        seed: u64,
    ) -> WorkloadSpec<'a> {
        WorkloadSpec {
            classes,
            cost,
            mix: &[0.6, 0.3, 0.1],
            ranks: 8,
            load,
            slo_scale: 1.0,
            duration,
            seed,
        }
    }

    #[test]
    fn one_request_alone_takes_its_steps_at_its_degree() {
        let (classes, cost) = (image_classes(), StepCost::h100_flux());
        let r = [Request {
            class: 1,
            arrival: 1.0,
            deadline: 100.0,
        }];
        let out = simulate(&r, &classes, &cost, 8, &mut StaticSp(4));
        let expect = 28.0 * cost.step_s(&classes[1], 4);
        assert!((out.mean_latency - expect).abs() < 1e-9, "{out:?}");
        assert_eq!((out.slo_attainment, out.degree_changes), (1.0, 0));
        assert_eq!(out.steps_by_degree[2], 28);
    }

    #[test]
    fn every_request_finishes_under_every_policy() {
        let (classes, cost) = (image_classes(), StepCost::h100_flux());
        let reqs = workload(&spec(&classes, &cost, 1.2, 60.0, 3));
        assert!(reqs.len() > 50, "{}", reqs.len());
        for name in [
            "static-sp1",
            "static-sp8",
            "fcfs-elastic",
            "srtf-elastic",
            "edf-bestfit",
            "slo-elastic",
        ] {
            let out = simulate(&reqs, &classes, &cost, 8, by_name(name).unwrap().as_mut());
            assert!(
                out.mean_latency > 0.0 && out.throughput > 0.0,
                "{name}: {out:?}"
            );
            assert_eq!(
                out.steps_by_degree.iter().sum::<u64>() as usize,
                reqs.iter()
                    .map(|r| classes[r.class].steps as usize)
                    .sum::<usize>(),
                "{name}"
            );
        }
    }

    #[test]
    fn elastic_policies_change_degrees_and_static_ones_do_not() {
        let (classes, cost) = (image_classes(), StepCost::h100_flux());
        let reqs = workload(&spec(&classes, &cost, 0.8, 120.0, 5));
        let run = |name: &str| simulate(&reqs, &classes, &cost, 8, by_name(name).unwrap().as_mut());
        assert_eq!(run("static-sp2").degree_changes, 0);
        assert!(run("slo-elastic").degree_changes > 0);
        // The same seed, the same run.
        assert_eq!(
            run("slo-elastic").slo_attainment,
            run("slo-elastic").slo_attainment
        );
    }
}
