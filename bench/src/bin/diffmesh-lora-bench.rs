//! `cargo xtask bench lora`: LoRA switch costs (tiny model, medium config) and bounded
//! asynchronous loading's quality with a trained LoRA (see `diffmesh_benches::lora`).
//! Prints human-readable lines, then one JSON line with every figure last.
use anyhow::Result;
use clap::Parser;
use diffmesh_benches::lora::{bal_quality, config_switch_costs, tiny_switch_costs, SwitchTarget};
use diffmesh_denoiser::lora::LoraBlob;
use diffmesh_denoiser::model::EngineModel;
use diffmesh_model::lora::OriginalsOn;
use diffmesh_model::tch::{self, Device, Kind};
use serde_json::json;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "diffmesh-lora-bench",
    about = "LoRA switch costs and BAL quality"
)]
struct Args {
    #[arg(long, default_value = "weights/tiny")]
    model_dir: PathBuf,
    /// The trained LoRA of the BAL study.
    #[arg(long, default_value = "weights/tiny-loras/outline.safetensors")]
    lora: PathBuf,
    /// Rank of the random LoRAs of the switch timings.
    #[arg(long, default_value_t = 16)]
    rank: i64,
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Skip the medium config's switch timings (its random weights take ~1 GB).
    #[arg(long)]
    no_medium: bool,
    /// Skip the tiny model's switch timings and the BAL study (e.g. on a GPU machine, for the
    /// random-weights configs only).
    #[arg(long)]
    no_tiny: bool,
    /// Device of the random-weights configs' switch timings: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Their dtype: f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Time FLUX.1-dev at full size (random weights) as well as the medium config.
    #[arg(long)]
    flux_dev: bool,
    /// Where the patcher keeps the base copies of patched layers in those timings.
    #[arg(long, value_enum, default_value_t = OriginalsOn::Device)]
    originals: OriginalsOn,
    /// Held-out prompts of the BAL study.
    #[arg(long, default_value_t = 20)]
    prompts: usize,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Steps on the base model before the LoRA, one study per value.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 6, 8, 10])]
    bounds: Vec<usize>,
    #[arg(long, default_value_t = 1)]
    torch_threads: i32,
    /// Write the first prompts' images (columns: base model, each bound, LoRA from step 0) here.
    #[arg(long)]
    grid: Option<PathBuf>,
    /// Prompts in the picture.
    #[arg(long, default_value_t = 6)]
    grid_rows: usize,
}

/// Tile 64x64 RGB images into one PNG, a row per prompt.
fn write_grid(path: &std::path::Path, rows: &[Vec<Vec<u8>>]) -> Result<()> {
    let (side, cols) = (64u32, rows.first().map_or(0, |r| r.len()) as u32);
    let mut img = image::RgbImage::new(side * cols, side * rows.len() as u32);
    for (r, row) in rows.iter().enumerate() {
        for (c, rgb) in row.iter().enumerate() {
            let tile = image::RgbImage::from_raw(side, side, rgb.clone())
                .ok_or_else(|| anyhow::anyhow!("image of the wrong size"))?;
            image::imageops::replace(
                &mut img,
                &tile,
                (c as u32 * side).into(),
                (r as u32 * side).into(),
            );
        }
    }
    img.save(path)?;
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    tch::set_num_threads(args.torch_threads);
    let device = match args.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        d => match d.strip_prefix("cuda:").and_then(|i| i.parse().ok()) {
            Some(i) => Device::Cuda(i),
            None => anyhow::bail!("--device: expected cpu, cuda or cuda:N, got {d}"),
        },
    };
    let kind = match args.dtype.as_str() {
        "f32" => Kind::Float,
        "bf16" => Kind::BFloat16,
        d => anyhow::bail!("--dtype: expected f32 or bf16, got {d}"),
    };
    let mut switches = Vec::new();
    let model = if args.no_tiny {
        None
    } else {
        let m = EngineModel::load(
            &args.model_dir,
            Device::Cpu,
            Kind::Float,
            "tiny".into(),
            Some(64),
        )?;
        switches.push(tiny_switch_costs(&m, args.rank, args.rounds)?);
        Some(m)
    };
    let targets = [(!args.no_medium, false), (args.flux_dev, true)];
    for (_, flux_dev) in targets.into_iter().filter(|(on, _)| *on) {
        let target = SwitchTarget {
            flux_dev,
            device,
            kind,
            originals: args.originals,
        };
        switches.push(config_switch_costs(target, args.rank, args.rounds)?);
    }
    for s in &switches {
        println!(
            "{} ({}, {}, base copies on the {}): {} layers, rank {} ({:.1} MB): base->LoRA {:.2} ms, LoRA->LoRA {:.2} ms, LoRA->base {:.2} ms, reading the tensors {:.2} ms; one step {:.2} ms",
            s.model, s.device, s.dtype, s.originals, s.layers, args.rank, s.lora_bytes as f64 / 1e6,
            s.base_to_lora_s * 1e3, s.lora_to_lora_s * 1e3, s.lora_to_base_s * 1e3, s.read_s * 1e3, s.step_s * 1e3
        );
    }
    let Some(model) = model else {
        println!("{}", json!({"switch": switches}));
        return Ok(());
    };
    let bytes = std::fs::read(&args.lora)?;
    let blob = LoraBlob::new("bench", bytes.into())?;
    let mut rows = Vec::new();
    let study = bal_quality(
        &model,
        &blob,
        args.prompts,
        args.steps,
        &args.bounds,
        Some(&mut rows),
    )?;
    if let Some(path) = &args.grid {
        rows.truncate(args.grid_rows);
        write_grid(path, &rows)?;
        println!(
            "images: {} (columns: base, {:?} base steps, LoRA from step 0)",
            path.display(),
            args.bounds
        );
    }
    println!(
        "BAL, {} prompts x {} steps: base model vs LoRA SSIM {:.3}",
        study.prompts, study.steps, study.ssim_base_vs_sync
    );
    let cos: Vec<String> = study
        .latent_cosine
        .iter()
        .map(|c| format!("{c:.3}"))
        .collect();
    println!(
        "latent cosine (with vs without LoRA) per step: {}",
        cos.join(" ")
    );
    for b in &study.bounds {
        println!(
            "  {} base steps: SSIM vs sync {:.3} (min {:.3}), LoRA effect kept {:.3}",
            b.base_steps, b.ssim_vs_sync, b.min_ssim_vs_sync, b.lora_effect_kept
        );
    }
    println!("{}", json!({"switch": switches, "bal": study}));
    Ok(())
}
