//! `cargo xtask bench sp`: seconds of one sequence-parallel transformer step at degree 1, 2
//! and 4 on this machine's CPU ranks (threads; ring attention, since the shipped tiny
//! model's 3 heads divide by neither 2 nor 4), for the elastic simulator's three request
//! classes scaled to the tiny model. Writes the table `diffmesh-sim --elastic --cost FILE`
//! reads (one JSON object) and prints it.
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use diffmesh_model::flux::sequence_parallel::SequenceParallel;
use diffmesh_model::flux::{FluxInputs, FluxTransformer};
use diffmesh_model::tch::{self, Device, Kind, Tensor};
use diffmesh_parallel::{Group, RankConfig, Ranks};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// The model directory (its `transformer/`).
    #[arg(long, default_value = "weights/tiny")]
    model_dir: PathBuf,
    /// Where to write the table.
    #[arg(long)]
    out: PathBuf,
    /// Timed steps per point (the median is kept), after one warm-up.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

/// The classes: name, image token grid (rows x cols), steps.
const CLASSES: [(&str, i64, i64, u32); 3] =
    [("S", 16, 16, 28), ("M", 32, 32, 28), ("L", 48, 48, 28)];
const TEXT_TOKENS: i64 = 32;

fn inputs(n_h: i64, n_w: i64) -> FluxInputs {
    let opts = (Kind::Float, Device::Cpu);
    let rows = Tensor::arange(n_h, opts)
        .view([n_h, 1])
        .expand([n_h, n_w], false);
    let cols = Tensor::arange(n_w, opts)
        .view([1, n_w])
        .expand([n_h, n_w], false);
    FluxInputs {
        hidden_states: Tensor::ones([1, n_h * n_w, 48], opts)
            .f_mul_scalar(0.1)
            .unwrap(),
        encoder_hidden_states: Tensor::ones([1, TEXT_TOKENS, 128], opts),
        pooled_projections: Tensor::ones([1, 128], opts),
        timestep: Tensor::from_slice(&[0.5f32]),
        img_ids: Tensor::stack(&[Tensor::zeros([n_h, n_w], opts), rows, cols], -1)
            .view([n_h * n_w, 3]),
        txt_ids: Tensor::zeros([TEXT_TOKENS, 3], opts),
        guidance: None,
    }
}

/// Median seconds of one step at `ranks` ranks.
fn step_s(dir: &Path, n_h: i64, n_w: i64, ranks: usize, repeats: usize) -> anyhow::Result<f64> {
    let world = Ranks::start(RankConfig::new(ranks))?;
    let dir = dir.to_path_buf();
    let times = world.on_all(move |ep| -> Result<Vec<f64>, String> {
        let (model, _vs) =
            FluxTransformer::load(&dir, Device::Cpu, Kind::Float).map_err(|e| e.to_string())?;
        let x = inputs(n_h, n_w);
        let members: Vec<usize> = (0..ranks).collect();
        let group = Group::new(1, &members, ep.rank(), ranks).map_err(|e| e.to_string())?;
        let mut times = Vec::new();
        for i in 0..=repeats {
            diffmesh_parallel::Collectives::barrier(ep, &group).map_err(|e| e.to_string())?;
            let started = Instant::now();
            let _velocity = tch::no_grad(|| {
                if ranks == 1 {
                    model.forward(&x)
                } else {
                    model.forward_sequence_parallel(&x, ep, &group, SequenceParallel::Ring)
                }
            })
            .map_err(|e| e.to_string())?;
            if i > 0 {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        Ok(times)
    });
    // A step ends when its slowest rank does: the max over ranks of each repeat, then the median.
    let per_rank: Vec<Vec<f64>> = times
        .into_iter()
        .map(|t| {
            t.ok_or_else(|| anyhow::anyhow!("a rank stopped"))?
                .map_err(anyhow::Error::msg)
        })
        .collect::<anyhow::Result<_>>()?;
    let mut slowest: Vec<f64> = (0..repeats)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect();
    slowest.sort_by(f64::total_cmp);
    Ok(slowest[slowest.len() / 2])
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = args.model_dir.join("transformer");
    // One intra-op thread per rank: the ranks are the parallelism being measured.
    tch::set_num_threads(1);
    let mut classes = Vec::new();
    for (name, n_h, n_w, steps) in CLASSES {
        let mut per_degree = Vec::new();
        for ranks in [1usize, 2, 4] {
            let s = step_s(&dir, n_h, n_w, ranks, args.repeats)?;
            println!(
                "{name} ({} image tokens) on {ranks} ranks: {:.2} ms a step",
                n_h * n_w,
                s * 1e3
            );
            per_degree.push(json!({"degree": ranks, "step_s": s}));
        }
        classes.push(json!({"name": name, "image_tokens": n_h * n_w, "steps": steps, "per_degree": per_degree}));
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let table = json!({
        "label": format!(
            "measured: the tiny model's step on {} CPU rank threads of {} ({} cores), ring attention, 1 intra-op thread each",
            "1/2/4", cpu, std::thread::available_parallelism().map_or(0, |n| n.get())
        ),
        "classes": classes,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&table)? + "\n")?;
    println!("wrote {}", args.out.display());
    Ok(())
}
