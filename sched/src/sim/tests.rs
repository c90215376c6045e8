use super::*;
use crate::policy::{policy_by_name, Footprint, RequestCount};
use crate::queue_order::QueueOrder;
use crate::synthetic;

fn cfg(workers: u32, max_batch: u32) -> SimConfig {
    SimConfig {
        workers,
        limits: BatchLimits {
            max_batch,
            ..BatchLimits::default()
        },
        slo_factor: 3.0,
        step_noise: 0.0,
        seed: 1,
        request_overhead_s: 0.0,
        shared_cpu: None,
        worker_step_factors: Vec::new(),
        calibrate: true,
        router_queue: 1_000_000,
        max_hold_s: f64::INFINITY,
        queue_order: QueueOrder::Fcfs,
        preempt: false,
        controlnets: SimControlNets::default(),
    }
}

fn arrival(time_s: f64, masked: u32) -> Arrival {
    Arrival {
        time_s,
        masked_tokens: masked,
        footprint: Footprint::ONE_ROW,
        steps: 28,
        template: None,
        steered: false,
    }
}

fn guided(time_s: f64, masked: u32) -> Arrival {
    Arrival {
        footprint: Footprint::new(1, true),
        ..arrival(time_s, masked)
    }
}

#[test]
fn a_guided_request_takes_two_rows_of_the_batch() {
    // A step costs its rows' summed masked tokens: a guided request alone runs twice as long.
    let m = crate::forecast::tests::token_seconds_model();
    let one = simulate(&cfg(1, 4), &m, &mut RequestCount, &[arrival(0.0, 10)]);
    let two = simulate(&cfg(1, 4), &m, &mut RequestCount, &[guided(0.0, 10)]);
    assert!((two.p50 - 2.0 * one.p50).abs() < 1e-9, "{one:?} {two:?}");
    assert_eq!(two.mean_batch, 2.0);
    // Batches of 3 rows: two guided requests arriving together cannot share a step; the second
    // waits for the whole first request. Two plain ones share from the second step on (the
    // first's step had started when the second was placed).
    let (a, b) = (guided(0.0, 10), guided(0.0, 10));
    let s = simulate(&cfg(1, 3), &m, &mut RequestCount, &[a, b]);
    assert!((s.mean_queue - two.p50 / 2.0).abs() < 1e-9, "{s:?}");
    let s = simulate(
        &cfg(1, 3),
        &m,
        &mut RequestCount,
        &[arrival(0.0, 10), arrival(0.0, 10)],
    );
    let one_step = one.p50 / 28.0;
    assert!((s.mean_queue - one_step / 2.0).abs() < 1e-9, "{s:?}");
}

#[test]
fn lone_request_takes_its_standalone_time() {
    let m = synthetic::default_models();
    let s = simulate(&cfg(2, 8), &m, &mut RequestCount, &[arrival(1.0, 450)]);
    assert_eq!(s.completed, 1);
    assert!((s.p50 - m.standalone_s(450, 28)).abs() < 1e-9);
    assert_eq!(s.mean_queue, 0.0);
    assert_eq!(s.slo_attainment, 1.0);
    assert!((s.standalone_p95 - s.p50).abs() < 1e-9, "{s:?}");
}

#[test]
fn no_policy_beats_the_no_contention_floor() {
    for policy in crate::policy::POLICY_NAMES {
        let s = poisson_run(policy, 4, 0.0);
        assert!(s.standalone_p95 > 0.0, "{s:?}");
        // Contention at 3 req/s on 4 workers must cost something, yet never go below the floor.
        assert!(s.p95 > s.standalone_p95, "{policy}: {s:?}");
        let light = simulate(
            &cfg(4, 8),
            &synthetic::default_models(),
            policy_by_name(policy).unwrap().as_mut(),
            &[arrival(0.0, 100), arrival(100.0, 900), arrival(200.0, 20)],
        );
        // Far-apart arrivals meet no contention: latency is the floor exactly.
        assert!(
            (light.p95 - light.standalone_p95).abs() < 1e-9,
            "{policy}: {light:?}"
        );
    }
}

#[test]
fn request_overhead_adds_to_every_latency_not_to_the_queues() {
    let m = synthetic::default_models();
    let a = [arrival(0.0, 450), arrival(0.0, 450)];
    let base = simulate(&cfg(1, 1), &m, &mut RequestCount, &a);
    let with = SimConfig {
        request_overhead_s: 0.25,
        ..cfg(1, 1)
    };
    let s = simulate(&with, &m, &mut RequestCount, &a);
    assert!((s.p99 - base.p99 - 0.25).abs() < 1e-9, "{s:?} {base:?}");
    assert!((s.p50 - base.p50 - 0.25).abs() < 1e-9, "{s:?} {base:?}");
    assert_eq!(s.mean_queue, base.mean_queue);
}

#[test]
fn second_request_waits_when_the_batch_is_full() {
    let m = synthetic::default_models();
    let a = [arrival(0.0, 450), arrival(0.0, 450)];
    let s = simulate(&cfg(1, 1), &m, &mut RequestCount, &a);
    let t = m.standalone_s(450, 28);
    assert_eq!(s.completed, 2);
    assert!((s.mean_queue - t / 2.0).abs() < 1e-9, "{s:?}");
    assert!((s.p99 - 2.0 * t).abs() < 1e-9);
    // With max batch 2 they share steps instead. The first arrival's step is already in flight
    // when the second arrives, so the second joins one (batch-1) step later.
    let s2 = simulate(&cfg(1, 2), &m, &mut RequestCount, &a);
    assert!((s2.mean_queue - t / 28.0 / 2.0).abs() < 1e-9, "{s2:?}");
    assert!(s2.p99 < 2.0 * t && s2.p99 > t, "{s2:?}");
    assert!(s2.mean_batch > 1.9 && s2.mean_batch < 2.0, "{s2:?}");
}

#[test]
fn the_loops_job_work_delays_the_next_step_not_the_finishing_job() {
    let mut m = synthetic::default_models();
    m.job_work = Some(crate::cost_model::EngineJobWork {
        admit_s: 0.01,
        retire_s: 0.02,
    });
    let t = m.standalone_s(450, 28);
    // Alone: prepared, then stepped; its own decode is part of the time outside the denoiser.
    let lone = simulate(&cfg(1, 1), &m, &mut RequestCount, &[arrival(1.0, 450)]);
    assert!((lone.p50 - (t + 0.01)).abs() < 1e-9, "{lone:?}");
    assert!((lone.standalone_p95 - lone.p50).abs() < 1e-9, "{lone:?}");
    // One after the other: the second waits for the first's decode and its own preparation.
    let a = [arrival(0.0, 450), arrival(0.0, 450)];
    let s = simulate(&cfg(1, 1), &m, &mut RequestCount, &a);
    assert!(
        (s.p99 - (2.0 * t + 0.01 + 0.02 + 0.01)).abs() < 1e-9,
        "{s:?}"
    );
    // The busy time counts the loop's work too.
    let span = 2.0 * t + 0.04;
    assert!(
        (s.utilization - (2.0 * t + 0.04) / span).abs() < 1e-9,
        "{s:?}"
    );
}

fn poisson_run(policy: &str, arrival_seed: u64, noise: f64) -> metrics::Summary {
    let m = synthetic::default_models();
    let mut rng = ChaCha8Rng::seed_from_u64(arrival_seed);
    let ratios = [0.02, 0.1, 0.2, 0.4];
    let a = workload::poisson(&mut rng, 3.0, 200.0, &ratios, &m.shape, 28);
    let mut c = cfg(4, 8);
    c.step_noise = noise;
    let mut p = policy_by_name(policy).unwrap();
    simulate(&c, &m, p.as_mut(), &a)
}

#[test]
fn deterministic_for_a_seed() {
    for policy in crate::policy::POLICY_NAMES {
        let a = poisson_run(policy, 9, 0.05);
        let b = poisson_run(policy, 9, 0.05);
        assert_eq!(a, b, "{policy}");
        assert_eq!(a.completed + a.rejected, a.submitted);
        assert!(a.completed > 400, "{a:?}");
    }
    assert_ne!(
        poisson_run("mask-aware", 9, 0.0),
        poisson_run("mask-aware", 10, 0.0)
    );
}

#[test]
fn workers_on_a_shared_cpu_slow_each_other_only_when_they_overlap() {
    let m = synthetic::default_models();
    let shared = SimConfig {
        shared_cpu: Some(SharedCpu {
            cores: 2.0,
            co_run_slowdown: 0.25,
            background_cpu_s: 0.0,
        }),
        ..cfg(2, 8)
    };
    let alone = m.standalone_s(450, 28);
    // Far apart: each request steps alone, as on its own device.
    let apart = [arrival(0.0, 450), arrival(10.0 * alone, 450)];
    let s = simulate(&shared, &m, &mut RequestCount, &apart);
    assert!((s.p95 - alone).abs() < 1e-9, "{} vs {alone}", s.p95);
    // Together on the two workers: every step of both but the very first overlaps another.
    let together = [arrival(0.0, 450), arrival(0.0, 450)];
    let s = simulate(&shared, &m, &mut RequestCount, &together);
    // The first worker's first step ran alone; the second started against it, so all of its
    // steps and the first worker's other 27 overlap.
    let step = alone / 28.0;
    let expected = ((step + 27.0 * step * 1.25) + 28.0 * step * 1.25) / 2.0;
    assert!(
        (s.mean_latency - expected).abs() < 1e-9,
        "{} vs {expected}",
        s.mean_latency
    );
    let own = simulate(&cfg(2, 8), &m, &mut RequestCount, &together);
    assert!((own.mean_latency - alone).abs() < 1e-9);
}

#[test]
fn shared_cpu_slowdown_time_slices_beyond_the_cores() {
    let cpu = SharedCpu {
        cores: 2.0,
        co_run_slowdown: 0.1,
        background_cpu_s: 0.05,
    };
    assert_eq!(cpu.slowdown(1, 0.0), 1.0);
    // A lone step beside the mesh's own work on the other core.
    assert!((cpu.slowdown(1, 0.5) - 1.05).abs() < 1e-12);
    assert!((cpu.slowdown(2, 0.0) - 1.1).abs() < 1e-12);
    // The other core is full either way; the excess is time slicing.
    assert!((cpu.slowdown(2, 0.5) - 1.1 * 1.25).abs() < 1e-12);
    assert!((cpu.slowdown(3, 0.0) - 1.1 * 1.5).abs() < 1e-12);
}

#[test]
fn a_slower_worker_steps_by_its_factor() {
    let m = synthetic::default_models();
    let slow = SimConfig {
        worker_step_factors: vec![2.5],
        ..cfg(1, 8)
    };
    let s = simulate(&slow, &m, &mut RequestCount, &[arrival(1.0, 450)]);
    assert!((s.p50 - 2.5 * m.standalone_s(450, 28)).abs() < 1e-9);
    let fleet = SimConfig {
        worker_step_factors: vec![1.0, 2.0],
        ..cfg(4, 8)
    };
    assert_eq!(fleet.step_factor(3), 2.0);
    assert!((fleet.effective_workers() - 3.0).abs() < 1e-12);
}

/// Mask-aware placement on a fleet of two fast and two slow workers (steps 3x the profile's),
/// with and without learning the workers' step-time factors.
fn mixed_fleet_p95(calibrate: bool) -> f64 {
    let m = synthetic::default_models();
    let fleet = SimConfig {
        worker_step_factors: vec![1.0, 1.0, 3.0, 3.0],
        calibrate,
        ..cfg(4, 8)
    };
    let limits = fleet.limits;
    let cap = workload::capacity_rps(
        &m,
        &limits,
        fleet.effective_workers(),
        0.2,
        28,
        Footprint::ONE_ROW,
    );
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let a = workload::poisson(&mut rng, 0.7 * cap, 3000.0, &[0.05, 0.2, 0.5], &m.shape, 28);
    let mut policy = policy_by_name("mask-aware").unwrap();
    simulate(&fleet, &m, policy.as_mut(), &a).p95
}

#[test]
fn learning_step_factors_places_better_on_a_mixed_fleet() {
    let (learned, trusted) = (mixed_fleet_p95(true), mixed_fleet_p95(false));
    // Trusting the profile, mask-aware sends slow workers as much as fast ones.
    assert!(
        learned < 0.85 * trusted,
        "p95 learned {learned:.2} s vs profile trusted {trusted:.2} s"
    );
}

/// Mask-aware placement of a workload where a third of the requests are steered, on four
/// workers of which two compute their ControlNets themselves (0.3 s a steered request a
/// step), with and without seeing those costs.
fn steered_p95(visible: bool) -> f64 {
    let m = synthetic::default_models();
    let fleet = SimConfig {
        controlnets: SimControlNets {
            step_s: vec![0.3, 0.3, 0.0, 0.0],
            visible,
        },
        ..cfg(4, 8)
    };
    assert_eq!(fleet.control_step_s(5), 0.3);
    let cap = workload::capacity_rps(&m, &fleet.limits, 4.0, 0.2, 28, Footprint::ONE_ROW);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut a = workload::poisson(&mut rng, 0.5 * cap, 3000.0, &[0.05, 0.2, 0.5], &m.shape, 28);
    for (i, a) in a.iter_mut().enumerate() {
        a.steered = i % 3 == 0;
    }
    let mut policy = policy_by_name("mask-aware").unwrap();
    simulate(&fleet, &m, policy.as_mut(), &a).p95
}

#[test]
fn seeing_controlnet_costs_keeps_steered_requests_off_workers_that_compute_them() {
    let (seen, blind) = (steered_p95(true), steered_p95(false));
    assert!(
        seen < 0.9 * blind,
        "p95 seen {seen:.2} s vs blind {blind:.2} s"
    );
}

/// Places only on an idle worker: everything else waits at the router.
struct IdleOnly;

impl Policy for IdleOnly {
    fn name(&self) -> &str {
        "idle-only"
    }
    fn place(&mut self, _: &RequestInfo, ws: &[WorkerState], _: &CostModels) -> Option<usize> {
        ws.iter()
            .position(|w| w.accepts() && w.requests() == 0 && w.step_remaining_s == 0.0)
    }
}

#[test]
fn requests_the_policy_holds_wait_at_the_router_in_order_up_to_its_queue() {
    let m = synthetic::default_models();
    let burst: Vec<_> = (0..5).map(|_| arrival(0.0, 450)).collect();
    let one = m.standalone_s(450, 28);
    let (s, lat) = simulate_with_latencies(&cfg(1, 8), &m, &mut IdleOnly, &burst);
    // One worker, one request at a time, first come first served.
    assert_eq!((s.completed, s.rejected), (5, 0), "{s:?}");
    for (i, l) in lat.iter().enumerate() {
        assert!((l - one * (i + 1) as f64).abs() < 1e-9, "{i}: {l} vs {one}");
    }
    assert_eq!(s.mean_batch, 1.0);
    // A router queue of 2: the first goes to the idle worker, two wait, two are turned away.
    let small = SimConfig {
        router_queue: 2,
        ..cfg(1, 8)
    };
    let s = simulate(&small, &m, &mut IdleOnly, &burst);
    assert_eq!((s.submitted, s.completed, s.rejected), (5, 3, 2), "{s:?}");
}

#[test]
fn deferring_completes_every_request_and_runs_alone_where_batches_save_nothing() {
    // A batch costs the sum of its rows: mask-aware-deferring keeps workers first come first
    // served (batches of one) and loses no request.
    let m = crate::forecast::tests::token_seconds_model();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut t = 0.0;
    let arrivals: Vec<_> = (0..400)
        .map(|_| {
            t += -(1.0 - rng.random::<f64>()).ln() / 0.3;
            Arrival {
                time_s: t,
                masked_tokens: 1 + rng.random_range(0..40),
                footprint: Footprint::ONE_ROW,
                steps: 5,
                template: None,
                steered: false,
            }
        })
        .collect();
    let mut deferring = policy_by_name("mask-aware-deferring").unwrap();
    let s = simulate(&cfg(2, 8), &m, deferring.as_mut(), &arrivals);
    assert_eq!((s.completed, s.rejected), (400, 0), "{s:?}");
    assert_eq!(s.mean_batch, 1.0, "{s:?}");
    let mut marginal = policy_by_name("mask-aware-marginal").unwrap();
    let shared = simulate(&cfg(2, 8), &m, marginal.as_mut(), &arrivals);
    assert_eq!(shared.completed, 400);
    assert!(shared.mean_batch > 1.0, "{shared:?}");
    // Allowed to hold nothing (as the live router past half its admission wait), it places
    // as the marginal policy does.
    let no_hold = SimConfig {
        max_hold_s: 0.0,
        ..cfg(2, 8)
    };
    let mut deferring = policy_by_name("mask-aware-deferring").unwrap();
    let capped = simulate(&no_hold, &m, deferring.as_mut(), &arrivals);
    assert_eq!(
        capped,
        Summary {
            policy: capped.policy.clone(),
            ..shared
        }
    );
}

/// Sorted latencies of `arrivals` on one worker with a batch of one under `order`.
fn one_slot_latencies(order: QueueOrder, m: &CostModels, arrivals: &[Arrival]) -> Vec<f64> {
    let c = SimConfig {
        queue_order: order,
        ..cfg(1, 1)
    };
    simulate_with_latencies(&c, m, &mut RequestCount, arrivals).1
}

fn assert_latencies(got: &[f64], mut want: Vec<f64>) {
    want.sort_by(f64::total_cmp);
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-9, "{got:?} vs {want:?}");
    }
}

#[test]
fn srtf_admits_the_short_request_first_fcfs_the_early_one() {
    let m = synthetic::default_models();
    let (a, b, c) = (arrival(0.0, 900), arrival(0.001, 900), arrival(0.001, 20));
    let (ta, tc) = (m.standalone_s(900, 28), m.standalone_s(20, 28));
    let fcfs = one_slot_latencies(QueueOrder::Fcfs, &m, &[a, b, c]);
    assert_latencies(&fcfs, vec![ta, 2.0 * ta - 0.001, 2.0 * ta + tc - 0.001]);
    let srtf = one_slot_latencies(QueueOrder::Srtf, &m, &[a, b, c]);
    assert_latencies(&srtf, vec![ta, ta + tc - 0.001, 2.0 * ta + tc - 0.001]);
}

#[test]
fn edf_admits_the_earliest_deadline_where_srtf_takes_the_shorter() {
    let m = synthetic::default_models();
    let (ta, tb, tc) = (
        m.standalone_s(900, 28),
        m.standalone_s(400, 28),
        m.standalone_s(300, 28),
    );
    // C is shorter than B but arrives late enough that its deadline (arrival + 3x standalone)
    // falls after B's; both wait while A runs.
    let c_at = 3.0 * (tb - tc) + 0.01;
    assert!(c_at < ta, "the test needs C queued while A runs");
    let arrivals = [arrival(0.0, 900), arrival(0.001, 400), arrival(c_at, 300)];
    let edf = one_slot_latencies(QueueOrder::Edf, &m, &arrivals);
    assert_latencies(&edf, vec![ta, ta + tb - 0.001, ta + tb + tc - c_at]);
    let srtf = one_slot_latencies(QueueOrder::Srtf, &m, &arrivals);
    assert_latencies(&srtf, vec![ta, ta + tc - c_at, ta + tc + tb - 0.001]);
}

#[test]
fn preempting_srtf_lets_a_short_arrival_take_the_slot_at_the_next_step() {
    let m = synthetic::default_models();
    let (ta, tc) = (m.standalone_s(900, 28), m.standalone_s(20, 28));
    let step_a = ta / 28.0;
    let c = SimConfig {
        queue_order: QueueOrder::Srtf,
        preempt: true,
        ..cfg(1, 1)
    };
    let arrivals = [arrival(0.0, 900), arrival(0.001, 20)];
    let (s, lat) = simulate_with_latencies(&c, &m, &mut RequestCount, &arrivals);
    // C takes the slot after A's first step; A resumes with its 27 steps left, not prepared
    // again and still counted as started at 0.
    assert_latencies(&lat, vec![step_a + tc - 0.001, ta + tc]);
    assert!(
        (s.mean_queue - (step_a - 0.001) / 2.0).abs() < 1e-9,
        "{s:?}"
    );
    // Without preemption A keeps its slot to the end.
    let lat = one_slot_latencies(QueueOrder::Srtf, &m, &arrivals);
    assert_latencies(&lat, vec![ta, ta + tc - 0.001]);
}
