//! `cargo xtask bench controlnet-service`: the default model's `silhouette` ControlNet on the
//! engine thread (`off`), on a ControlNet worker for the step about to run (`sync`), and on a
//! worker one step behind (`pipelined`); see `diffmesh_benches::controlnet_service`.
//! Needs `nats-server` on the PATH (it starts its own on a free port). Prints a line per mode,
//! then one JSON line with every figure last.
use anyhow::Result;
use clap::Parser;
use diffmesh_benches::controlnet_service::{psnr, start_worker, steered_engine, steered_job};
use diffmesh_denoiser::controlnet_service::RemoteMode;
use diffmesh_model::tch;
use diffmesh_model::tiny::controlnet_eval::silhouette_iou;
use diffmesh_model::tiny::controlnet_train::render_silhouette;
use diffmesh_model::tiny::data::{scene_for, Scene, Split};
use rand::SeedableRng;
use serde_json::json;
use std::collections::HashMap;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "diffmesh-controlnet-service-bench",
    about = "Steered generations: the ControlNet on the engine thread against on ControlNet workers"
)]
struct Args {
    #[arg(long, default_value = "weights/tiny")]
    model_dir: PathBuf,
    /// Folder of named ControlNets (the engine's own and the workers').
    #[arg(long, default_value = "weights/tiny-controlnets")]
    controlnet_dir: PathBuf,
    #[arg(long, default_value = "silhouette")]
    controlnet: String,
    #[arg(long, default_value_t = 20)]
    steps: u32,
    /// Held-out scenes generated one at a time per mode (latency, quality).
    #[arg(long, default_value_t = 12)]
    images: usize,
    /// Scenes submitted at once per mode (throughput).
    #[arg(long, default_value_t = 4)]
    concurrent: usize,
    /// Rounds of the sequential part; the modes alternate within each round.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Torch threads of the process (the engine and the worker's compute thread each run
    /// their ops on their own thread at 1).
    #[arg(long, default_value_t = 1)]
    torch_threads: i32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

const MODES: [RemoteMode; 3] = [RemoteMode::Off, RemoteMode::Sync, RemoteMode::Pipelined];

fn mode_name(m: RemoteMode) -> &'static str {
    match m {
        RemoteMode::Off => "off",
        RemoteMode::Sync => "sync",
        RemoteMode::Pipelined => "pipelined",
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    tch::set_num_threads(args.torch_threads);
    let nats = diffmesh_shared::testing::NatsServer::start();
    let url = nats.url();
    let worker = start_worker(&url, &args.controlnet_dir, "bench-controlnet").await?;
    let mut engines = Vec::new();
    for mode in MODES {
        let e = steered_engine(&url, &args.model_dir, &args.controlnet_dir, mode, 8).await?;
        if mode != RemoteMode::Off {
            e.wait_for_workers(&args.controlnet, true).await?;
        }
        engines.push(e);
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    let scenes: Vec<Scene> = Split::new()
        .held_out
        .into_iter()
        .take(args.images.max(args.concurrent))
        .map(|k| scene_for(k, &mut rng))
        .collect();
    let job = |mode: RemoteMode, tag: &str, i: usize| {
        let s = &scenes[i];
        steered_job(
            &format!("{}-{tag}-{i}", mode_name(mode)),
            &s.key.prompt(),
            args.seed + i as u64,
            args.steps,
            &args.controlnet,
            render_silhouette(s),
        )
    };
    // Warm-up: one image per mode (loads the ControlNet on both sides, opens NATS paths).
    for (e, mode) in engines.iter_mut().zip(MODES) {
        e.run(vec![job(mode, "warm", 0)]).await?;
    }

    // Latency: one image at a time, modes alternating per image so drift hits all alike; the
    // same generation without a ControlNet is the floor a hidden ControlNet would reach.
    let mut seconds: HashMap<&str, Vec<f64>> = HashMap::new();
    let mut images: HashMap<&str, Vec<Vec<u8>>> = HashMap::new();
    for round in 0..args.rounds {
        for i in 0..args.images {
            let mut plain = job(RemoteMode::Off, &format!("plain-r{round}"), i);
            plain.job.params.controlnet = None;
            plain.control_rgb = Vec::new();
            let (_, s) = engines[0].run(vec![plain]).await?;
            seconds.entry("plain").or_default().push(s);
            for (e, mode) in engines.iter_mut().zip(MODES) {
                let (mut out, s) = e.run(vec![job(mode, &format!("r{round}"), i)]).await?;
                seconds.entry(mode_name(mode)).or_default().push(s);
                if round == 0 {
                    let img = out.drain().next().expect("one image").1;
                    images.entry(mode_name(mode)).or_default().push(img);
                }
            }
        }
    }
    // Throughput: `concurrent` images at once.
    let mut per_second = HashMap::new();
    for (e, mode) in engines.iter_mut().zip(MODES) {
        let jobs = (0..args.concurrent)
            .map(|i| job(mode, "batch", i))
            .collect();
        let (_, s) = e.run(jobs).await?;
        per_second.insert(mode_name(mode), args.concurrent as f64 / s);
    }

    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let iou = |mode: &str| {
        let imgs = &images[mode];
        imgs.iter()
            .zip(&scenes)
            .map(|(img, s)| silhouette_iou(img, s))
            .sum::<f64>()
            / imgs.len() as f64
    };
    let psnr_vs_off = |mode: &str| {
        let (a, b) = (&images[mode], &images["off"]);
        a.iter()
            .zip(b)
            .map(|(x, y)| psnr(x, y).min(99.0))
            .sum::<f64>()
            / a.len() as f64
    };
    let mut report = serde_json::Map::new();
    for (e, mode) in engines.iter().zip(MODES) {
        let name = mode_name(mode);
        let ms = 1e3 * median(&seconds[name]);
        println!(
            "{name:>9}: {ms:7.1} ms per image ({:.2} ms per step), {:.2} images/s with {} at once, \
             IoU {:.3}, PSNR vs off {:.1} dB, engine wait for residuals {:.2} ms per step, \
             fallbacks {}",
            ms / args.steps as f64,
            per_second[name],
            args.concurrent,
            iou(name),
            psnr_vs_off(name),
            e.mean_wait_ms(),
            e.remote("fallback_local"),
        );
        report.insert(format!("{name}_ms"), json!(ms));
        report.insert(format!("{name}_images_per_s"), json!(per_second[name]));
        report.insert(format!("{name}_iou"), json!(iou(name)));
        report.insert(format!("{name}_psnr_vs_off"), json!(psnr_vs_off(name)));
        report.insert(format!("{name}_wait_ms_per_step"), json!(e.mean_wait_ms()));
    }
    let plain = 1e3 * median(&seconds["plain"]);
    println!(
        "    plain: {plain:7.1} ms per image ({:.2} ms per step): the same generations without a ControlNet",
        plain / args.steps as f64
    );
    report.insert("plain_ms".into(), json!(plain));
    let off = 1e3 * median(&seconds["off"]);
    for name in ["sync", "pipelined"] {
        report.insert(
            format!("{name}_over_off"),
            json!(1e3 * median(&seconds[name]) / off),
        );
    }
    let f = &worker.metrics.forward_seconds;
    report.insert(
        "worker_forward_ms".into(),
        json!(1e3 * f.get_sample_sum() / f.get_sample_count().max(1) as f64),
    );
    report.insert("steps".into(), json!(args.steps));
    report.insert("images".into(), json!(args.images));
    report.insert("rounds".into(), json!(args.rounds));
    report.insert("torch_threads".into(), json!(args.torch_threads));
    drop(engines);
    worker.shutdown().await;
    println!("{}", serde_json::Value::Object(report));
    Ok(())
}
