//! `diffmesh-sim --elastic --gpus G --policy P --workload mix:S=a,M=b,L=c --load F
//! --slo-scale X --seed N [--json]`: one elastic-parallelism run; the last line is one JSON
//! object with `slo_attainment`, `mean_latency`, `p95` and `throughput`.
use anyhow::{bail, Context};
use clap::Parser;
use serde_json::json;

use super::cost::{image_classes, StepCost};
use super::policies::by_name;
use super::{simulate, workload, WorkloadSpec};

/// Simulate elastic sequence parallelism (GF-DiT) under a policy.
#[derive(Debug, Parser)]
#[command(name = "diffmesh-sim --elastic")]
pub struct ElasticArgs {
    /// Selects this simulation (the placement simulator's flags do not apply).
    #[arg(long)]
    pub elastic: bool,
    /// Ranks (GPUs) of the node.
    #[arg(long, default_value_t = 8)]
    pub gpus: u32,
    /// static-sp<k> (k a power of two), fcfs-elastic, srtf-elastic, edf-bestfit, slo-elastic.
    #[arg(long, default_value = "slo-elastic")]
    pub policy: String,
    /// Class weights, `mix:S=a,M=b,L=c` (classes of 512^2, 1024^2 and 1536^2 images).
    #[arg(long, default_value = "mix:S=0.6,M=0.3,L=0.1")]
    pub workload: String,
    /// Arrival rate as a fraction of the ranks' capacity at SP1.
    #[arg(long, default_value_t = 1.0)]
    pub load: f64,
    /// Multiplies every class's deadline factor (1.5 / 2.0 / 6.0 x its SP1 service time).
    #[arg(long, default_value_t = 1.0)]
    pub slo_scale: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Seconds of arrivals (the run then drains).
    #[arg(long, default_value_t = 600.0)]
    pub duration: f64,
    /// Print only the JSON line.
    #[arg(long)]
    pub json: bool,
    /// Step costs measured on ranks (`cargo xtask bench sp` writes the file; its classes
    /// replace S/M/L); without it the modelled H100 costs.
    #[arg(long)]
    pub cost: Option<std::path::PathBuf>,
}

/// `mix:S=a,M=b,L=c` as weights in the classes' order.
pub fn parse_mix(text: &str, names: &[&str]) -> anyhow::Result<Vec<f64>> {
    let body = text
        .strip_prefix("mix:")
        .context("--workload: expected mix:S=a,M=b,L=c")?;
    let mut weights = vec![0.0; names.len()];
    for part in body.split(',') {
        let (name, value) = part
            .split_once('=')
            .with_context(|| format!("--workload: `{part}` is not CLASS=WEIGHT"))?;
        let i = names
            .iter()
            .position(|n| *n == name)
            .with_context(|| format!("--workload: no class `{name}` (classes: {names:?})"))?;
        weights[i] = value
            .parse::<f64>()
            .ok()
            .filter(|w| w.is_finite() && *w >= 0.0)
            .with_context(|| format!("--workload: `{value}` is not a weight"))?;
    }
    if weights.iter().sum::<f64>() <= 0.0 {
        bail!("--workload: the weights sum to nothing");
    }
    Ok(weights)
}

pub fn run(args: &ElasticArgs) -> anyhow::Result<()> {
    let (cost, classes) = match &args.cost {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--cost {}", path.display()))?;
            let table = serde_json::from_str(&text)
                .with_context(|| format!("--cost {}: not a step-cost table", path.display()))?;
            StepCost::measured(table)
        }
        None => (StepCost::h100_flux(), image_classes().to_vec()),
    };
    let names: Vec<&str> = classes.iter().map(|c| c.name).collect();
    let mix = parse_mix(&args.workload, &names)?;
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if args.gpus == 0 || !positive(args.load) || !positive(args.slo_scale) {
        bail!("--gpus, --load and --slo-scale must be positive");
    }
    let mut policy = by_name(&args.policy).with_context(|| {
        format!(
            "--policy {}: expected static-sp<k>, fcfs-elastic, srtf-elastic, edf-bestfit or slo-elastic",
            args.policy
        )
    })?;
    let requests = workload(&WorkloadSpec {
        classes: &classes,
        cost: &cost,
        mix: &mix,
        ranks: args.gpus,
        load: args.load,
        slo_scale: args.slo_scale,
        duration: args.duration,
        seed: args.seed,
    });
    let out = simulate(&requests, &classes, &cost, args.gpus, policy.as_mut());
    if !args.json {
        let kind = if cost.measured.is_some() {
            "measured"
        } else {
            "MODELLED"
        };
        println!("cost model: {} ({kind})", cost.label);
        println!(
            "{} on {} ranks, load {}, {} requests: SLO attainment {:.3}, mean {:.2} s, p95 {:.2} s, {:.3} req/s, {} degree changes",
            out.policy, args.gpus, args.load, out.requests, out.slo_attainment, out.mean_latency,
            out.p95, out.throughput, out.degree_changes
        );
    }
    println!(
        "{}",
        json!({
            "policy": out.policy,
            "gpus": args.gpus,
            "workload": args.workload,
            "load": args.load,
            "slo_scale": args.slo_scale,
            "seed": args.seed,
            "requests": out.requests,
            "slo_attainment": out.slo_attainment,
            "mean_latency": out.mean_latency,
            "p95": out.p95,
            "throughput": out.throughput,
            "degree_changes": out.degree_changes,
            "steps_by_degree": out.steps_by_degree,
            "cost_model": cost.label,
            "cost_measured": cost.measured.is_some(),
        })
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixes_name_their_classes() {
        let names = ["S", "M", "L"];
        assert_eq!(parse_mix("mix:S=2,L=1", &names).unwrap(), [2.0, 0.0, 1.0]);
        for bad in ["S=1", "mix:X=1", "mix:S=-1", "mix:S=0"] {
            assert!(parse_mix(bad, &names).is_err(), "{bad}");
        }
    }
}
