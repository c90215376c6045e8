//! The three-way block planner: per block, compute every token, load its K/V, or load its
//! hidden stream (FlashPS's Y cache: half the bytes of K/V, plus the compute of projecting K/V
//! from it), minimising the step's latency under the copy stream's bandwidth.
//!
//! The timeline is [`crate::planner::schedule`]'s with a third option: loads run back to back in
//! block order on a copy stream that starts with the step, and a block that reads a cache starts
//! once both the previous block and its own load are done. As in [`crate::planner::plan_prefix`],
//! an engine that drops the unmasked tokens once it reads a cache cannot compute a later block in
//! full, so the feasible plans are "first `k` blocks full, then each block K/V or Y". Which of
//! the two a block reads is free: the loads differ in size and the computes in cost, and which
//! one wins depends on how far the copy stream is ahead of the compute there.
//!
//! [`plan_three_way`] is exact over those plans: a forward pass over the Pareto front of
//! (compute finish, load finish) states of the plans that already read a cache, beside the one
//! all-full state. Per-block costs may all differ (double and single blocks, measured per block).
use crate::cost_model::BlockCosts;
use crate::planner::plan_prefix;

/// One block's costs for the batch of a step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ThreeWayCosts {
    /// Compute of every token (no cache read).
    pub full_s: f64,
    /// Compute with the block's K/V loaded (text and masked tokens only).
    pub kv_compute_s: f64,
    /// Loading the block's K/V.
    pub kv_load_s: f64,
    /// Compute with the block's hidden stream loaded: the masked tokens plus K/V projected for
    /// the cached ones.
    pub y_compute_s: f64,
    /// Loading the block's hidden stream (about half of `kv_load_s`).
    pub y_load_s: f64,
}

impl ThreeWayCosts {
    /// The block's costs as the two-way (K/V only) prefix planner takes them.
    pub fn kv_only(&self) -> BlockCosts {
        BlockCosts {
            cached_s: self.kv_compute_s,
            full_s: self.full_s,
            load_s: self.kv_load_s,
        }
    }
}

/// What a block does in a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockChoice {
    Full,
    Kv,
    Y,
}

impl BlockChoice {
    pub fn as_str(self) -> &'static str {
        match self {
            BlockChoice::Full => "full",
            BlockChoice::Kv => "kv",
            BlockChoice::Y => "y",
        }
    }

    /// (compute, load) seconds of `c` under this choice.
    fn costs(self, c: &ThreeWayCosts) -> (f64, f64) {
        match self {
            BlockChoice::Full => (c.full_s, 0.0),
            BlockChoice::Kv => (c.kv_compute_s, c.kv_load_s),
            BlockChoice::Y => (c.y_compute_s, c.y_load_s),
        }
    }
}

/// A step's per-block choices and predicted latency.
#[derive(Debug, Clone, PartialEq)]
pub struct ThreeWayPlan {
    pub choices: Vec<BlockChoice>,
    /// Finish time of the last block.
    pub latency_s: f64,
    /// Time the compute waited for loads (bubbles).
    pub compute_idle_s: f64,
}

impl ThreeWayPlan {
    /// How many blocks take each choice: (full, kv, y).
    pub fn counts(&self) -> (usize, usize, usize) {
        let count = |want| self.choices.iter().filter(|&&c| c == want).count();
        (
            count(BlockChoice::Full),
            count(BlockChoice::Kv),
            count(BlockChoice::Y),
        )
    }
}

/// Timeline of fixed choices (any order: the oracle of the tests and the planners' evaluator).
pub fn schedule_three_way(costs: &[ThreeWayCosts], choices: &[BlockChoice]) -> ThreeWayPlan {
    let (mut comp, mut load, mut idle) = (0.0f64, 0.0f64, 0.0f64);
    for (c, &choice) in costs.iter().zip(choices) {
        let (compute, load_s) = choice.costs(c);
        let start = match choice {
            BlockChoice::Full => comp,
            BlockChoice::Kv | BlockChoice::Y => {
                load += load_s;
                comp.max(load)
            }
        };
        idle += start - comp;
        comp = start + compute;
    }
    ThreeWayPlan {
        choices: choices.iter().take(costs.len()).copied().collect(),
        latency_s: comp,
        compute_idle_s: idle,
    }
}

/// A state of the forward pass: where the compute and copy streams stand after a block, and
/// how it got there.
#[derive(Clone, Copy)]
struct State {
    comp: f64,
    load: f64,
    /// Index of the previous state in the layer before (`usize::MAX` for the all-full state's
    /// first layer).
    parent: usize,
    choice: BlockChoice,
}

/// Exact plan over "first `k` blocks full, then each block K/V or Y" (k = 0..=N). Ties go to
/// the plan found first: more full blocks, then K/V before Y. O(N x front).
pub fn plan_three_way(costs: &[ThreeWayCosts]) -> ThreeWayPlan {
    // Layer i holds the states after block i - 1; entry 0 of every layer is the all-full state.
    let mut layers: Vec<Vec<State>> = Vec::with_capacity(costs.len() + 1);
    layers.push(vec![State {
        comp: 0.0,
        load: 0.0,
        parent: usize::MAX,
        choice: BlockChoice::Full,
    }]);
    for c in costs {
        let prev = &layers[layers.len() - 1];
        let all_full = State {
            comp: prev[0].comp + c.full_s,
            load: 0.0,
            parent: 0,
            choice: BlockChoice::Full,
        };
        // Every state may read a cache here (the all-full one switches to cached mode).
        let mut next: Vec<State> = Vec::with_capacity(prev.len() * 2);
        for (pi, s) in prev.iter().enumerate() {
            for choice in [BlockChoice::Kv, BlockChoice::Y] {
                let (compute, load_s) = choice.costs(c);
                let load = s.load + load_s;
                next.push(State {
                    comp: s.comp.max(load) + compute,
                    load,
                    parent: pi,
                    choice,
                });
            }
        }
        // Keep the Pareto front: no state that finishes both streams later than another. A
        // stable sort keeps the first-found of equal states.
        next.sort_by(|a, b| a.load.total_cmp(&b.load).then(a.comp.total_cmp(&b.comp)));
        let mut layer = vec![all_full];
        for s in next {
            if layer.len() == 1 || s.comp < layer[layer.len() - 1].comp {
                layer.push(s);
            }
        }
        layers.push(layer);
    }
    let last = &layers[layers.len() - 1];
    let mut best = 0;
    for (i, s) in last.iter().enumerate() {
        if s.comp < last[best].comp {
            best = i;
        }
    }
    let mut choices = vec![BlockChoice::Full; costs.len()];
    let mut idx = best;
    for layer in (1..layers.len()).rev() {
        let s = layers[layer][idx];
        choices[layer - 1] = s.choice;
        idx = s.parent;
    }
    schedule_three_way(costs, &choices)
}

/// The best plan of the two-way prefix planner on the same costs (K/V only): what the engine
/// runs without a Y cache, the baseline of [`plan_three_way`].
pub fn plan_prefix_kv(costs: &[ThreeWayCosts]) -> ThreeWayPlan {
    let two_way: Vec<BlockCosts> = costs.iter().map(ThreeWayCosts::kv_only).collect();
    let choices: Vec<BlockChoice> = plan_prefix(&two_way)
        .blocks
        .iter()
        .map(|b| match b.use_cache {
            true => BlockChoice::Kv,
            false => BlockChoice::Full,
        })
        .collect();
    schedule_three_way(costs, &choices)
}

/// The simulator's step: `n` blocks alike, each either computed, read as K/V (costs `kv`) or
/// read as Y (costs `y`; their `full_s` is not read), under [`plan_three_way`].
pub fn uniform_three_way_latency(n: u32, kv: BlockCosts, y: BlockCosts) -> f64 {
    let block = ThreeWayCosts {
        full_s: kv.full_s,
        kv_compute_s: kv.cached_s,
        kv_load_s: kv.load_s,
        y_compute_s: y.cached_s,
        y_load_s: y.load_s,
    };
    plan_three_way(&vec![block; n as usize]).latency_s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::schedule;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Every feasible plan (a full prefix, then K/V or Y per block), tried.
    fn brute_force(costs: &[ThreeWayCosts]) -> f64 {
        let n = costs.len();
        let mut best = f64::INFINITY;
        for full in 0..=n {
            let rest = n - full;
            for bits in 0u32..(1 << rest) {
                let choices: Vec<BlockChoice> = (0..n)
                    .map(|i| match i.checked_sub(full) {
                        None => BlockChoice::Full,
                        Some(j) if bits >> j & 1 == 1 => BlockChoice::Y,
                        Some(_) => BlockChoice::Kv,
                    })
                    .collect();
                best = best.min(schedule_three_way(costs, &choices).latency_s);
            }
        }
        best
    }

    /// Unequal per-block costs: every block draws its own compute, its K/V load, and a Y load of
    /// about half of it for a bit more compute.
    fn random_costs(rng: &mut ChaCha8Rng) -> ThreeWayCosts {
        let full = rng.random_range(0.5..3.0);
        let kv_compute = full * rng.random_range(0.05..1.0);
        let kv_load = rng.random_range(0.0..4.0);
        ThreeWayCosts {
            full_s: full,
            kv_compute_s: kv_compute,
            kv_load_s: kv_load,
            y_compute_s: kv_compute + full * rng.random_range(0.0..0.4),
            y_load_s: kv_load * rng.random_range(0.3..0.7),
        }
    }

    #[test]
    fn three_way_plan_matches_brute_force_on_small_instances() {
        let mut rng = ChaCha8Rng::seed_from_u64(50);
        let mut mixed = 0;
        for _ in 0..400 {
            let n = rng.random_range(1..=8);
            let costs: Vec<ThreeWayCosts> = (0..n).map(|_| random_costs(&mut rng)).collect();
            let plan = plan_three_way(&costs);
            let oracle = brute_force(&costs);
            assert!(
                (plan.latency_s - oracle).abs() <= 1e-9 * oracle.max(1.0),
                "{costs:?}: planned {} vs brute force {oracle}",
                plan.latency_s
            );
            // The plan is feasible: no full block after a cached one.
            let first_cached = plan.choices.iter().position(|&c| c != BlockChoice::Full);
            if let Some(k) = first_cached {
                assert!(plan.choices[k..].iter().all(|&c| c != BlockChoice::Full));
            }
            let (_, kv, y) = plan.counts();
            mixed += usize::from(kv > 0 && y > 0);
            // It is never worse than the K/V-only prefix planner.
            assert!(plan.latency_s <= plan_prefix_kv(&costs).latency_s + 1e-12);
        }
        // The instances exercise plans that mix the two cache kinds.
        assert!(mixed > 20, "only {mixed} mixed plans");
    }

    /// With the Y option priced out (it costs more on both streams), the three-way planner is
    /// the two-way prefix planner.
    #[test]
    fn without_a_useful_y_it_is_the_prefix_planner() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for _ in 0..200 {
            let n = rng.random_range(1..=12);
            let costs: Vec<ThreeWayCosts> = (0..n)
                .map(|_| {
                    let c = random_costs(&mut rng);
                    ThreeWayCosts {
                        y_compute_s: c.full_s * 2.0,
                        y_load_s: c.kv_load_s * 2.0 + 1.0,
                        ..c
                    }
                })
                .collect();
            let two_way: Vec<BlockCosts> = costs.iter().map(ThreeWayCosts::kv_only).collect();
            let prefix = plan_prefix(&two_way);
            let plan = plan_three_way(&costs);
            assert!((plan.latency_s - prefix.latency_s).abs() <= 1e-9);
            assert_eq!(plan.counts().2, 0);
            let kv: Vec<bool> = plan.choices.iter().map(|&c| c == BlockChoice::Kv).collect();
            assert!((schedule(&two_way, &kv).latency_s - plan.latency_s).abs() <= 1e-9);
        }
    }

    /// Where loading bounds the step (a slow copy stream), Y's half-size loads win; where it
    /// is free, K/V's cheaper compute does.
    #[test]
    fn the_bound_decides_between_kv_and_y() {
        let block = |kv_load_s: f64| ThreeWayCosts {
            full_s: 1.0,
            kv_compute_s: 0.2,
            kv_load_s,
            y_compute_s: 0.35,
            y_load_s: kv_load_s / 2.0,
        };
        let load_bound = plan_three_way(&[block(1.0); 10]);
        assert!(load_bound.counts().2 > 0, "{:?}", load_bound.choices);
        assert!(load_bound.latency_s < plan_prefix_kv(&[block(1.0); 10]).latency_s);
        let compute_bound = plan_three_way(&[block(0.0); 10]);
        assert_eq!(compute_bound.counts(), (0, 10, 0));
        assert!(plan_three_way(&[]).choices.is_empty());
    }

    /// The simulator's three-way step is never slower than either format alone under the
    /// prefix planner, and beats both where loads bound K/V and compute bounds Y.
    #[test]
    fn uniform_three_way_is_at_most_either_format_alone() {
        use crate::planner::uniform_latency;
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for _ in 0..300 {
            let c = random_costs(&mut rng);
            let kv = c.kv_only();
            let y = BlockCosts {
                cached_s: c.y_compute_s,
                full_s: c.full_s,
                load_s: c.y_load_s,
            };
            let n = rng.random_range(1..20u32);
            let three = uniform_three_way_latency(n, kv, y);
            let best_one = uniform_latency(n, kv).min(uniform_latency(n, y));
            assert!(
                three <= best_one + 1e-9,
                "{three} > {best_one} for {c:?} x {n}"
            );
        }
        // K/V bound by its loads, Y (half the bytes) by its compute: a mix of the two keeps
        // both streams busy.
        let kv = BlockCosts {
            cached_s: 0.3,
            full_s: 1.0,
            load_s: 0.6,
        };
        let y = BlockCosts {
            cached_s: 0.5,
            load_s: 0.3,
            ..kv
        };
        let three = uniform_three_way_latency(12, kv, y);
        let best_one = uniform_latency(12, kv).min(uniform_latency(12, y));
        assert!(three < best_one - 1e-9, "{three} vs {best_one}");
    }
}
