//! The node's own parallel-cost table, measured at start on its ranks: for each request size
//! and each degree k (powers of two up to the ranks), the seconds of one step with **every
//! rank busy** (ranks / k groups of k stepping at once), since that is what a step costs
//! under load on ranks that share a machine (CPU ranks share its cores; GPU ranks their host
//! links), and with 1, 2, ... groups of k busy, by which the simulator paces each running
//! step for the ranks busy at each moment. The elastic policy plans with it, and
//! `diffmesh-sim --elastic --cost FILE` reads the same table, so a live run and its
//! simulation share one cost model.
use super::pool::RankPool;
use diffmesh_model::bench_inputs::random_inputs;
use diffmesh_model::flux::FluxConfig;
use diffmesh_sched::elastic::cost::{BusyCost, DegreeCost, MeasuredClass, MeasuredTable};
use std::time::Duration;

/// One request size to measure: its name and image tokens per side.
#[derive(Debug, Clone)]
pub struct SizeToMeasure {
    pub name: String,
    pub token_side: i64,
}

/// The median seconds of a step task (dispatch to its last member's end) while `groups`
/// groups of `k` ranks step at once, over `repeats` rounds after one warm-up round.
fn median_round(
    pool: &mut RankPool,
    inputs: &[diffmesh_model::flux::FluxInputs],
    k: usize,
    groups: usize,
    repeats: usize,
    task: &mut u64,
) -> Result<f64, String> {
    let mut seconds = Vec::new();
    for round in 0..=repeats.max(1) {
        for g in 0..groups {
            let members: Vec<usize> = (g * k..(g + 1) * k).collect();
            *task += 1;
            pool.dispatch(*task, &members, inputs)?;
        }
        while pool.in_flight() > 0 {
            for done in pool.poll(Duration::from_secs(60)) {
                done.outcome?;
                if round > 0 {
                    seconds.push(done.seconds);
                }
            }
        }
    }
    seconds.sort_by(f64::total_cmp);
    Ok(seconds[seconds.len() / 2])
}

/// Measure `sizes` at every power-of-two degree up to the pool's ranks: one warm-up round,
/// then the median of `repeats` rounds.
pub fn measure(
    pool: &mut RankPool,
    cfg: &FluxConfig,
    text_tokens: i64,
    sizes: &[SizeToMeasure],
    repeats: usize,
) -> Result<MeasuredTable, String> {
    let ranks = pool.size();
    let mut classes = Vec::new();
    let mut task = u64::MAX / 2;
    for size in sizes {
        let inputs = [random_inputs(cfg, size.token_side, text_tokens.max(1))];
        let mut per_degree = Vec::new();
        let mut k = 1;
        while k <= ranks {
            let mut by_busy_ranks = Vec::new();
            for groups in 1..=ranks / k {
                by_busy_ranks.push(BusyCost {
                    busy_ranks: (groups * k) as u32,
                    step_s: median_round(pool, &inputs, k, groups, repeats, &mut task)?,
                });
            }
            per_degree.push(DegreeCost {
                degree: k as u32,
                step_s: by_busy_ranks.last().map_or(0.0, |b| b.step_s),
                by_busy_ranks,
            });
            k *= 2;
        }
        classes.push(MeasuredClass {
            name: size.name.clone(),
            image_tokens: (size.token_side * size.token_side) as f64,
            // The policy reads each job's own steps; a workload drawn from the table sets them.
            steps: 0,
            per_degree,
        });
    }
    Ok(MeasuredTable {
        label: format!("measured at start on this node's {ranks} ranks, every rank busy"),
        classes,
    })
}
