//! `cargo xtask bench collectives --ranks R [--json]`: what a logical group costs and how fast
//! the group-free collectives move data on this machine's CPU ranks (threads sharing memory).
//!
//! - `group_setup_us`: creating a group descriptor over a random member set (p50, p99).
//! - `fresh_group_barrier_us` against `same_group_barrier_us`: a barrier on a group never seen
//!   before against one on a group used many times; equal when groups carry no state.
//! - all-gather and all-to-all over all R ranks per message size (bytes each rank puts in):
//!   time per collective (the slowest rank) and bytes each rank receives per second.
//!
//! - one thread's memcpy of 8 MiB, the machine's copy rate to read those against.
//!
//! Prints a table, then (with `--json`) one JSON line last.
use std::time::Instant;

use clap::Parser;
use diffmesh_parallel::{Collectives, Group, RankConfig, Ranks};
use serde_json::json;

#[derive(Parser)]
#[command(name = "diffmesh-collectives-bench")]
struct Args {
    /// Ranks (threads) in the world.
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Print one JSON line last.
    #[arg(long)]
    json: bool,
    /// Collectives timed per message size.
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

/// p50 and p99 of `samples` (sorted here).
fn percentiles(samples: &mut [f64]) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// A small deterministic generator (xorshift), so every rank draws the same groups.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Descriptor creation over random member sets of 2..=world ranks, in microseconds each.
fn group_setup(world: usize, samples: usize) -> Vec<f64> {
    let mut state = 0x9e37_79b9_7f4a_7c15;
    let mut out = Vec::with_capacity(samples);
    for id in 0..samples {
        let size = 2 + (next(&mut state) as usize) % (world - 1);
        let mut members: Vec<usize> = (0..world).collect();
        for i in (1..world).rev() {
            members.swap(i, (next(&mut state) as usize) % (i + 1));
        }
        members.truncate(size);
        let me = members[0];
        let started = Instant::now();
        let group = Group::new(id as u64, &members, me, world).expect("a valid group");
        out.push(started.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(group);
    }
    out
}

/// Per-barrier microseconds on rank 0, on a new group id each time or always the same one.
fn barriers(ranks: &Ranks, fresh: bool, count: usize) -> Vec<f64> {
    let world = ranks.len();
    let members: Vec<usize> = (0..world).collect();
    let results = ranks.on_all(move |ep| {
        let me = ep.rank();
        let mut times = Vec::with_capacity(count);
        for i in 0..count {
            let id = if fresh { 10_000 + i as u64 } else { 1 };
            let started = Instant::now();
            let g = Group::new(id, &members, me, world).expect("group");
            ep.barrier(&g).expect("barrier");
            times.push(started.elapsed().as_secs_f64() * 1e6);
        }
        times
    });
    results.into_iter().next().flatten().expect("rank 0")
}

/// Seconds per collective (the slowest rank's mean over `iters`, after a warm-up).
fn timed(ranks: &Ranks, floats: usize, iters: usize, all_to_all: bool) -> f64 {
    let world = ranks.len();
    let results = ranks.on_all(move |ep| {
        let me = ep.rank();
        let g = Group::new(2, &(0..world).collect::<Vec<_>>(), me, world).expect("group");
        let input = vec![me as f32; floats];
        let mut out = vec![0.0f32; if all_to_all { floats } else { floats * world }];
        let mut run = |ep: &mut diffmesh_parallel::shm::Endpoint| {
            if all_to_all {
                ep.all_to_all(&g, &input, &mut out).expect("all_to_all");
            } else {
                ep.all_gather(&g, &input, &mut out).expect("all_gather");
            }
        };
        run(ep);
        ep.barrier(&g).expect("barrier");
        let started = Instant::now();
        for _ in 0..iters {
            run(ep);
        }
        ep.barrier(&g).expect("barrier");
        started.elapsed().as_secs_f64() / iters as f64
    });
    results.into_iter().flatten().fold(0.0, f64::max)
}

/// One thread copying `bytes` from one buffer to another, GB/s (the best of 20): the
/// machine's copy rate, against which the collectives' rates read.
fn memcpy_gb_per_s(bytes: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    let mut best = f64::MAX;
    for _ in 0..20 {
        let started = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        best = best.min(started.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    bytes as f64 / best / 1e9
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.ranks >= 2, "--ranks must be at least 2");
    let mut setup = group_setup(args.ranks, 100_000);
    let (setup_p50, setup_p99) = percentiles(&mut setup);
    let ranks = Ranks::start(RankConfig::new(args.ranks))?;
    let (fresh_p50, fresh_p99) = percentiles(&mut barriers(&ranks, true, 2000));
    let (same_p50, same_p99) = percentiles(&mut barriers(&ranks, false, 2000));
    println!(
        "ranks {} (threads on {} cores)",
        args.ranks,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("group descriptor: p50 {setup_p50:.3} us, p99 {setup_p99:.3} us");
    println!("barrier on a fresh group: p50 {fresh_p50:.1} us, p99 {fresh_p99:.1} us; on a used one: p50 {same_p50:.1} us, p99 {same_p99:.1} us");
    let memcpy = memcpy_gb_per_s(8 << 20);
    println!("one thread's memcpy of 8 MiB: {memcpy:.2} GB/s");
    let mut rows = Vec::new();
    for (name, all_to_all) in [("all_gather", false), ("all_to_all", true)] {
        let mut per_size = Vec::new();
        for bytes in [64usize << 10, 1 << 20, 8 << 20] {
            let floats = bytes / 4;
            let seconds = timed(&ranks, floats, args.iters, all_to_all);
            let k = args.ranks as f64;
            // Bytes each rank receives from its peers per collective.
            let received = if all_to_all {
                bytes as f64 * (k - 1.0) / k
            } else {
                bytes as f64 * (k - 1.0)
            };
            let gb_per_s = received / seconds / 1e9;
            println!(
                "{name:<10} {:>6} KiB per rank: {:>9.1} us, {gb_per_s:>6.2} GB/s received per rank",
                bytes >> 10,
                seconds * 1e6
            );
            per_size.push(json!({"bytes": bytes, "us": seconds * 1e6, "gb_per_s": gb_per_s}));
        }
        rows.push((name, per_size));
    }
    if args.json {
        let mut out = json!({
            "ranks": args.ranks,
            "memcpy_8mib_gb_per_s": memcpy,
            "group_setup_us": {"p50": setup_p50, "p99": setup_p99},
            "fresh_group_barrier_us": {"p50": fresh_p50, "p99": fresh_p99},
            "same_group_barrier_us": {"p50": same_p50, "p99": same_p99},
        });
        for (name, per_size) in rows {
            out[name] = json!(per_size);
        }
        println!("{out}");
    }
    Ok(())
}
