//! Continuous against static batching (FlashPS §4.3, Fig. 16-Left): the same seeded Poisson
//! arrivals of edits and generations with varied step counts, at a set fraction of the engine's
//! measured capacity, through the real engine in each mode; p95 end-to-end latency compared.
//! Edits read a registered template's cache (mask-aware steps) unless `template_caches` is off,
//! so they cost less than generations, as in production.
use crate::driver::{
    continuous_capacity_rps, open_loop, BenchEngine, BenchModel, Pooled, RunTimes, StepStats,
};
use crate::report::{Latencies, Report};
use crate::template_caches::BenchTemplates;
use crate::workload::{engine_job, requests, BenchRequest, WorkloadSpec};
use anyhow::{Context, Result};
use diffmesh_denoiser::engine::{Batching, EngineConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

#[derive(Debug, Clone)]
pub struct BatchingOptions {
    pub model: BenchModel,
    pub workload: WorkloadSpec,
    pub mask_ratios: Vec<f64>,
    /// Arrival rate as a fraction of the continuous engine's full-batch capacity.
    pub utilisation: f64,
    pub max_batch: usize,
    pub token_budget: Option<u64>,
    /// Times both modes run (new arrivals each round; latencies pooled per mode).
    pub rounds: usize,
    /// Edits read their template's cache (one captured template per step count); off: edits
    /// run in full, costing as much as generations.
    pub template_caches: bool,
}

/// Requests per second of static batching with the queue never empty: full batches of
/// `step_s.len()` requests whose step counts are uniform in `steps_min..=steps_max`, each batch
/// stepping until its longest request is done (fewer rows as requests finish). Monte Carlo.
pub fn static_capacity_rps(step_s: &[f64], steps_min: u32, steps_max: u32, seed: u64) -> f64 {
    let b = step_s.len();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let batches = 4000;
    let mut total = 0.0;
    for _ in 0..batches {
        let mut steps: Vec<u32> = (0..b)
            .map(|_| rng.random_range(steps_min..=steps_max))
            .collect();
        steps.sort_unstable();
        let mut t = 0;
        for (i, &s) in steps.iter().enumerate() {
            // Steps t+1..=s run with the b - i requests not finished yet.
            total += f64::from(s - t) * step_s[b - i - 1];
            t = s;
        }
    }
    (batches * b) as f64 / total
}

async fn run_mode(
    opts: &BatchingOptions,
    batching: Batching,
    reqs: &[BenchRequest],
    rate: f64,
    templates: Option<&BenchTemplates>,
) -> Result<(RunTimes, StepStats)> {
    let config = EngineConfig {
        max_batch: opts.max_batch,
        batching,
        token_budget: opts.token_budget,
        ..EngineConfig::default()
    };
    let mut engine = BenchEngine::start(&opts.model, config)?;
    // One untimed job first: the first forward pays one-off allocations.
    let grid = engine.grid;
    let job_of = |r: &BenchRequest| match templates {
        Some(t) => t.attach(engine_job(r, grid)),
        None => engine_job(r, grid),
    };
    let mut warm = job_of(&reqs[0]);
    warm.job.job_id = "warm-up".into();
    engine.submit(warm).await?;
    engine.next_finished().await?;
    let jobs = reqs
        .iter()
        .map(|r| (r.arrival_s(rate), job_of(r)))
        .collect();
    let times = open_loop(&mut engine, jobs)
        .await
        .with_context(|| format!("{batching:?} batching run"))?;
    let stats = engine.step_stats();
    engine.stop().await;
    Ok((times, stats))
}

/// Run both modes on the same arrivals, `opts.rounds` times (new arrivals each round, modes
/// alternating); `step_s` is the engine's step time by batch size.
pub async fn run(opts: &BatchingOptions, step_s: &[f64], report: &mut Report) -> Result<()> {
    let spec = &opts.workload;
    let templates = if opts.template_caches {
        let t =
            BenchTemplates::capture(&opts.model, spec.steps_min, spec.steps_max, spec.seed).await?;
        report.say(format!(
            "batching: {} templates captured ({:.1} MB of cache) in {:.1} s",
            spec.steps_max - spec.steps_min + 1,
            t.bytes as f64 / 1e6,
            t.capture_seconds
        ));
        Some(t)
    } else {
        None
    };
    let capacity = match &templates {
        // Edits cost less than the generations the step-time line was measured on: measure the
        // mix itself, every request queued at once (full batches throughout, bar the drain).
        Some(t) => {
            let reqs = requests(spec, &opts.mask_ratios)?;
            let (times, _) =
                run_mode(opts, Batching::Continuous, &reqs, f64::INFINITY, Some(t)).await?;
            reqs.len() as f64 / times.makespan_s()
        }
        None => continuous_capacity_rps(step_s, spec.mean_steps()),
    };
    // The static estimate rests on the step-time line of generations: only meaningful when
    // edits run in full too.
    let static_capacity = templates
        .is_none()
        .then(|| static_capacity_rps(step_s, spec.steps_min, spec.steps_max, spec.seed));
    let rate = opts.utilisation * capacity;
    let static_note = match static_capacity {
        Some(c) => format!(
            "; {c:.2} req/s static (estimated): arrivals {:.0}% of it",
            rate / c * 100.0
        ),
        None => String::new(),
    };
    report.say(format!(
        "batching: {} rounds of {} requests ({:.0}% edits, {}), steps {}..={}, max batch {}; \
         capacity {:.2} req/s continuous ({}); arrivals {:.2} req/s = {:.0}% of it{static_note}",
        opts.rounds,
        spec.requests,
        spec.edit_fraction * 100.0,
        if templates.is_some() {
            "mask-aware from template caches"
        } else {
            "in full"
        },
        spec.steps_min,
        spec.steps_max,
        opts.max_batch,
        capacity,
        if templates.is_some() {
            "measured: the mix queued at once"
        } else {
            "from the step-time line"
        },
        rate,
        opts.utilisation * 100.0,
    ));
    let modes = [
        ("continuous", Batching::Continuous),
        ("static", Batching::Static),
    ];
    let mut pooled = vec![Pooled::default(); modes.len()];
    for round in 0..opts.rounds.max(1) {
        let round_spec = WorkloadSpec {
            seed: spec.seed + round as u64,
            ..spec.clone()
        };
        let reqs = requests(&round_spec, &opts.mask_ratios)?;
        for ((_, mode), pool) in modes.iter().zip(pooled.iter_mut()) {
            let (times, stats) = run_mode(opts, *mode, &reqs, rate, templates.as_ref()).await?;
            pool.add(&times, stats)?;
        }
    }
    let mut json_modes = serde_json::Map::new();
    let mut p95 = Vec::new();
    for ((name, _), pool) in modes.iter().zip(&pooled) {
        let lat = Latencies::of(&pool.latencies).context("no requests")?;
        let mask_aware_share = pool.stats.mask_aware_rows as f64 / pool.stats.rows.max(1.0);
        report.say(format!(
            "  {name:<10} {}; mean queueing {:.3} s, mean running {:.2}, {:.1} ms per \
             row-step, {:.0}% of rows mask-aware, stepping {:.0}% of the time",
            lat.line(),
            pool.mean_queueing_s(),
            pool.mean_running(),
            pool.stats.ms_per_row(),
            mask_aware_share * 100.0,
            pool.busy() * 100.0
        ));
        pool.note_saturation(name, report);
        report.insert(&format!("{name}_p50_s"), lat.p50_s);
        report.insert(&format!("{name}_p95_s"), lat.p95_s);
        let mut m = lat.to_json();
        m["mean_queueing_s"] = json!(pool.mean_queueing_s());
        m["mean_running"] = json!(pool.mean_running());
        m["ms_per_row_step"] = json!(pool.stats.ms_per_row());
        m["engine_busy"] = json!(pool.busy());
        m["mask_aware_row_share"] = json!(mask_aware_share);
        json_modes.insert(name.to_string(), m);
        p95.push(lat.p95_s);
    }
    let ratio = p95[0] / p95[1];
    report.say(format!(
        "  continuous_over_static_p95 = {ratio:.3} (FlashPS target <= 0.71)"
    ));
    report.insert("continuous_over_static_p95", ratio);
    report.insert(
        "batching",
        json!({
            "rounds": opts.rounds,
            "requests_per_round": spec.requests,
            "edit_fraction": spec.edit_fraction,
            "steps_min": spec.steps_min,
            "steps_max": spec.steps_max,
            "max_batch": opts.max_batch,
            "token_budget": opts.token_budget,
            "template_caches": opts.template_caches,
            "capacity_rps": capacity,
            "static_capacity_rps_est": static_capacity,
            "arrival_rps": rate,
            "utilisation": opts.utilisation,
            "utilisation_static_est": static_capacity.map(|c| rate / c),
            "modes": json_modes,
        }),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_capacity_equals_continuous_when_steps_are_equal_and_cost_flat() {
        let step_s = [0.01; 8];
        let c = continuous_capacity_rps(&step_s, 20.0);
        let s = static_capacity_rps(&step_s, 20, 20, 1);
        assert!((c - s).abs() < 1e-9 * c, "{c} vs {s}");
    }

    #[test]
    fn static_capacity_drops_with_varied_steps_on_flat_step_cost() {
        // Flat cost per step: a batch lasts as long as its longest request.
        let step_s = [0.01; 8];
        let c = continuous_capacity_rps(&step_s, 25.0);
        let s = static_capacity_rps(&step_s, 10, 40, 1);
        // E[max of 8 uniform on 10..=40] = 40 - sum_{j=1}^{30} (j/31)^8 = 37.03 steps
        // against a mean of 25.
        assert!((s / c - 25.0 / 37.03).abs() < 0.01, "{}", s / c);
    }

    #[test]
    fn static_capacity_equals_continuous_when_cost_is_per_row() {
        // Cost proportional to rows: finished requests free their share, nothing is wasted.
        let step_s: Vec<f64> = (1..=8).map(|b| 0.01 * b as f64).collect();
        let c = continuous_capacity_rps(&step_s, 25.0);
        let s = static_capacity_rps(&step_s, 10, 40, 1);
        assert!((s / c - 1.0).abs() < 0.01, "{}", s / c);
    }
}
