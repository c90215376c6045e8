//! `cargo xtask elastic-sweep`: GF-DiT's elastic parallelism in the simulator, every policy at
//! every load on each rank count; writes the runs as JSON lines and one plot of SLO
//! attainment against load per rank count (PNG), and prints each policy against the best
//! static SP-k at each load.
use crate::plot::{line_plot, Axes, Line};
use anyhow::Context;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(clap::Args)]
pub struct ElasticSweepArgs {
    /// Rank counts, each with its seconds of arrivals (`--durations`, same order).
    #[arg(long, value_delimiter = ',', default_values_t = [8, 72])]
    gpus: Vec<u32>,
    #[arg(long, value_delimiter = ',', default_values_t = [600.0, 120.0])]
    durations: Vec<f64>,
    #[arg(long, value_delimiter = ',', default_values_t = [0.5, 0.8, 1.0, 1.2, 1.5])]
    loads: Vec<f64>,
    #[arg(long, value_delimiter = ',', default_values_t = [
        "static-sp1".to_string(), "static-sp2".to_string(), "static-sp4".to_string(),
        "static-sp8".to_string(), "fcfs-elastic".to_string(), "srtf-elastic".to_string(),
        "edf-bestfit".to_string(), "slo-elastic".to_string()])]
    policies: Vec<String>,
    #[arg(long, default_value = "mix:S=0.6,M=0.3,L=0.1")]
    workload: String,
    #[arg(long, default_value_t = 1.0)]
    slo_scale: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output prefix: writes `<out>.jsonl` and `<out>-g<G>.png`.
    #[arg(long)]
    out: PathBuf,
}

pub fn sweep(sim: &Path, args: ElasticSweepArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.gpus.len() == args.durations.len(),
        "--gpus and --durations need one entry each"
    );
    let mut all = String::new();
    for (&gpus, &duration) in args.gpus.iter().zip(&args.durations) {
        let mut runs: Vec<(String, f64, Value)> = Vec::new();
        for &load in &args.loads {
            for policy in &args.policies {
                let run = run_sim(sim, &args, gpus, duration, policy, load)?;
                writeln!(all, "{run}")?;
                runs.push((policy.clone(), load, run));
            }
        }
        let get = |policy: &str, load: f64, key: &str| {
            runs.iter()
                .find(|(p, l, _)| p == policy && *l == load)
                .and_then(|(_, _, v)| v[key].as_f64())
                .unwrap_or(f64::NAN)
        };
        println!("{gpus} ranks: SLO attainment (mean latency s, throughput req/s) by load");
        for &load in &args.loads {
            let best_static = args
                .policies
                .iter()
                .filter(|p| p.starts_with("static-"))
                .max_by(|a, b| {
                    get(a, load, "slo_attainment").total_cmp(&get(b, load, "slo_attainment"))
                })
                .cloned()
                .unwrap_or_default();
            let mut row = format!("  load {load}: best static {best_static}");
            for p in &args.policies {
                let _ = write!(
                    row,
                    "; {p} {:.3} ({:.1}, {:.2})",
                    get(p, load, "slo_attainment"),
                    get(p, load, "mean_latency"),
                    get(p, load, "throughput")
                );
            }
            println!("{row}");
        }
        let lines: Vec<Line> = args
            .policies
            .iter()
            .map(|p| Line {
                label: p.to_uppercase(),
                points: args
                    .loads
                    .iter()
                    .map(|&l| (l, get(p, l, "slo_attainment")))
                    .collect(),
            })
            .collect();
        let png = PathBuf::from(format!("{}-g{gpus}.png", args.out.display()));
        let title = format!("SLO ATTAINMENT VS LOAD, {gpus} RANKS (MODELLED COSTS)");
        line_plot(
            &Axes {
                title: &title,
                x_label: "LOAD (FRACTION OF THE RANKS' SP1 CAPACITY)",
                x_min: 0.0,
                y_range: Some((0.0, 1.0)),
                legend_top_left: false,
            },
            &lines,
            &png,
        )?;
        println!("wrote {}", png.display());
    }
    let jsonl = args.out.with_extension("jsonl");
    std::fs::write(&jsonl, all).with_context(|| format!("writing {}", jsonl.display()))?;
    println!("wrote {}", jsonl.display());
    Ok(())
}

fn run_sim(
    sim: &Path,
    args: &ElasticSweepArgs,
    gpus: u32,
    duration: f64,
    policy: &str,
    load: f64,
) -> anyhow::Result<Value> {
    let out = Command::new(sim)
        .args([
            "--elastic",
            "--json",
            "--policy",
            policy,
            "--workload",
            &args.workload,
        ])
        .args(["--gpus", &gpus.to_string(), "--load", &load.to_string()])
        .args([
            "--slo-scale",
            &args.slo_scale.to_string(),
            "--seed",
            &args.seed.to_string(),
        ])
        .args(["--duration", &duration.to_string()])
        .output()
        .with_context(|| format!("running {}", sim.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "diffmesh-sim --elastic --policy {policy} --load {load}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let last = text.lines().last().context("no output")?;
    Ok(serde_json::from_str(last)?)
}
