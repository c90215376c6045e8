//! `cargo xtask sweep`: run the simulator over loads, policies and seeds, and write the runs as
//! CSV plus a plot of mean p95 latency against load per policy (PNG), and print each policy's
//! mean p95 relative to request-count per load.
use crate::plot::{line_plot, Axes, Line};
use anyhow::Context;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(clap::Args)]
pub struct SweepArgs {
    /// Mask-ratio file the simulated requests draw from.
    #[arg(long)]
    mask_ratios: PathBuf,
    /// Profile to fit the cost models from (default: the simulator's synthetic one).
    #[arg(long)]
    profile: Option<PathBuf>,
    #[arg(long, value_delimiter = ',', default_values_t = [0.3, 0.5, 0.7, 0.85, 0.95])]
    loads: Vec<f64>,
    #[arg(long, value_delimiter = ',', default_values_t = [
        "round-robin".to_string(), "request-count".to_string(), "token-count".to_string(),
        "mask-aware".to_string(), "mask-aware-marginal".to_string(),
        "mask-aware-deferring".to_string(), "flashps-greedy".to_string()])]
    policies: Vec<String>,
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 3])]
    seeds: Vec<u64>,
    #[arg(long, default_value_t = 8)]
    workers: u32,
    /// Seconds of arrivals per run.
    #[arg(long, default_value_t = 600.0)]
    duration: f64,
    /// Extra arguments for every simulator run (e.g. `--max-batch 1`), space-separated.
    #[arg(long, default_value = "")]
    sim_args: String,
    /// Output prefix: writes `<out>.csv` and `<out>.png`.
    #[arg(long)]
    out: PathBuf,
}

const COLUMNS: [&str; 11] = [
    "p50",
    "p95",
    "p99",
    "standalone_p95",
    "mean_queue",
    "throughput",
    "completed",
    "slo_attainment",
    "mean_batch",
    "utilization",
    "synthetic_profile",
];

pub fn sweep(sim: &Path, args: SweepArgs) -> anyhow::Result<()> {
    let trace = args
        .mask_ratios
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut csv = format!("trace,load,seed,policy,{}\n", COLUMNS.join(","));
    // (policy, load) -> p95 of every seed.
    let mut p95: BTreeMap<(String, u64), Vec<f64>> = BTreeMap::new();
    for &load in &args.loads {
        for &seed in &args.seeds {
            for policy in &args.policies {
                let run = run_sim(sim, &args, policy, load, seed)?;
                let mut row = format!("{trace},{load},{seed},{policy}");
                for c in COLUMNS {
                    let _ = write!(row, ",{}", run.get(c).unwrap_or(&Value::Null));
                }
                csv.push_str(&row);
                csv.push('\n');
                let v = run["p95"].as_f64().unwrap_or(f64::NAN);
                p95.entry((policy.clone(), load_key(load)))
                    .or_default()
                    .push(v);
            }
        }
        eprintln!("load {load}: done");
    }
    let csv_path = args.out.with_extension("csv");
    std::fs::write(&csv_path, csv).with_context(|| format!("writing {}", csv_path.display()))?;
    let mean = |v: &Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!(
        "mean p95 (s) over seeds {:?}; in brackets: relative to request-count",
        args.seeds
    );
    let mut lines = Vec::new();
    for policy in &args.policies {
        let mut points = Vec::new();
        let mut row = format!("{policy:>20}:");
        for &load in &args.loads {
            let key = (policy.clone(), load_key(load));
            let m = p95.get(&key).map(mean).unwrap_or(f64::NAN);
            let base = p95
                .get(&("request-count".to_string(), load_key(load)))
                .map(mean)
                .unwrap_or(f64::NAN);
            let _ = write!(row, " {load}: {m:.3} ({:.3})", m / base);
            points.push((load, m));
        }
        println!("{row}");
        lines.push(Line {
            label: policy.clone(),
            points,
        });
    }
    let png = args.out.with_extension("png");
    let title = format!("P95 LATENCY (S) VS LOAD, {trace}, {} WORKERS", args.workers);
    line_plot(
        &Axes {
            title: &title,
            x_label: "LOAD (FRACTION OF ESTIMATED CAPACITY)",
            x_min: 0.0,
            y_range: None,
            legend_top_left: true,
        },
        &lines,
        &png,
    )?;
    println!("wrote {} and {}", csv_path.display(), png.display());
    Ok(())
}

/// Loads as map keys (thousandths).
fn load_key(load: f64) -> u64 {
    (load * 1000.0).round() as u64
}

/// One simulator run; its last output line (JSON).
fn run_sim(
    sim: &Path,
    args: &SweepArgs,
    policy: &str,
    load: f64,
    seed: u64,
) -> anyhow::Result<Value> {
    let mut cmd = Command::new(sim);
    cmd.arg("--policy")
        .arg(policy)
        .arg("--mask-ratios")
        .arg(&args.mask_ratios)
        .arg("--load")
        .arg(load.to_string())
        .arg("--workers")
        .arg(args.workers.to_string())
        .arg("--duration")
        .arg(args.duration.to_string())
        .arg("--seed")
        .arg(seed.to_string())
        .arg("--json")
        .args(args.sim_args.split_whitespace());
    if let Some(p) = &args.profile {
        cmd.arg("--profile").arg(p);
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {}", sim.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "simulator failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let last = text.lines().last().unwrap_or("");
    serde_json::from_str(last).with_context(|| format!("simulator printed `{last}`"))
}
