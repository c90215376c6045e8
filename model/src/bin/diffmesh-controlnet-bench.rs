//! What a ControlNet costs beside the transformer (Katz's case for ControlNet-as-a-Service):
//! per-forward latency (median after warm-up) of the transformer alone, of a ControlNet of each
//! depth, and of the transformer with the residuals added, on random weights.
//!
//! `diffmesh-controlnet-bench [--config medium|flux-dev] [--device cpu|cuda] [--layouts 1x2,4x8]`
//! prints a line per measurement, then one JSON line with every figure last.
use anyhow::{bail, Result};
use clap::Parser;
use diffmesh_model::bench_inputs::{
    flux_dev_config, medium_config, random_inputs_on, FLUX_SIDE, FLUX_TXT, MEDIUM_SIDE, MEDIUM_TXT,
};
use diffmesh_model::flux::{FluxConfig, FluxControlNet, FluxInputs, FluxTransformer};
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use serde_json::{json, Map, Value};
use std::time::Instant;

#[derive(Debug, Parser)]
#[command(about = "ControlNet vs transformer forward latency")]
struct Args {
    /// `medium` (CPU-sized) or `flux-dev` (full size; a GPU).
    #[arg(long, default_value = "medium")]
    config: String,
    /// `cpu` or `cuda` (bf16 on cuda).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// ControlNet depths as DOUBLExSINGLE blocks (InstantX's Flux ControlNets: 5x10 of 19x38).
    #[arg(long, value_delimiter = ',', default_value = "1x2,2x0,4x8")]
    layouts: Vec<String>,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    #[arg(long)]
    threads: Option<i32>,
}

fn parse_layout(s: &str) -> Result<(i64, i64)> {
    let Some((d, s2)) = s.split_once('x') else {
        bail!("layouts: `{s}` is not DOUBLExSINGLE");
    };
    Ok((d.parse()?, s2.parse()?))
}

fn median_ms(
    runs: usize,
    warmup: usize,
    device: Device,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
        let t = Instant::now();
        f()?;
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn cast(inputs: FluxInputs, kind: Kind) -> FluxInputs {
    let c = |t: Tensor| t.to_kind(kind);
    FluxInputs {
        hidden_states: c(inputs.hidden_states),
        encoder_hidden_states: c(inputs.encoder_hidden_states),
        pooled_projections: c(inputs.pooled_projections),
        timestep: inputs.timestep,
        img_ids: inputs.img_ids,
        txt_ids: inputs.txt_ids,
        guidance: inputs.guidance,
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(t) = args.threads {
        tch::set_num_threads(t);
    }
    let (cfg, side, txt): (FluxConfig, i64, i64) = match args.config.as_str() {
        "medium" => (medium_config(), MEDIUM_SIDE, MEDIUM_TXT),
        "flux-dev" => (flux_dev_config(), FLUX_SIDE, FLUX_TXT),
        other => bail!("config: `{other}` is not medium or flux-dev"),
    };
    let (device, kind) = match args.device.as_str() {
        "cpu" => (Device::Cpu, Kind::Float),
        "cuda" => (Device::Cuda(0), Kind::BFloat16),
        other => bail!("device: `{other}` is not cpu or cuda"),
    };
    let layouts: Vec<(i64, i64)> = args
        .layouts
        .iter()
        .map(|s| parse_layout(s))
        .collect::<Result<_>>()?;
    tch::manual_seed(0);
    let _guard = tch::no_grad_guard();
    let mut vs = nn::VarStore::new(device);
    let base = FluxTransformer::new(&vs.root(), cfg.clone())?;
    vs.set_kind(kind);
    let inputs = cast(random_inputs_on(&cfg, side, txt, 1, device), kind);
    let control = Tensor::randn([1, side * side, cfg.in_channels], (kind, device));
    let base_ms = median_ms(args.runs, args.warmup, device, || {
        let _ = base.forward(&inputs)?;
        Ok(())
    })?;
    println!(
        "{} on {}: transformer {}x{} blocks, {base_ms:.2} ms",
        args.config, args.device, cfg.num_layers, cfg.num_single_layers
    );
    let mut report = Map::new();
    report.insert("config".into(), json!(args.config));
    report.insert("device".into(), json!(args.device));
    report.insert("transformer_ms".into(), json!(base_ms));
    let mut rows = Vec::new();
    for (double, single) in layouts {
        let mut cvs = nn::VarStore::new(device);
        let net = FluxControlNet::new(
            &cvs.root(),
            FluxConfig {
                num_layers: double,
                num_single_layers: single,
                ..cfg.clone()
            },
        )?;
        cvs.set_kind(kind);
        let residuals = net.forward(&inputs, &control, 1.0)?;
        let net_ms = median_ms(args.runs, args.warmup, device, || {
            net.forward(&inputs, &control, 1.0)?;
            Ok(())
        })?;
        let controlled_ms = median_ms(args.runs, args.warmup, device, || {
            let _ = base.forward_controlled(&inputs, &residuals)?;
            Ok(())
        })?;
        let bytes: i64 = residuals
            .tensors()
            .map(|t| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64)
            .sum();
        println!(
            "  ControlNet {double}x{single}: {net_ms:.2} ms ({:.2} of the transformer), transformer with residuals {controlled_ms:.2} ms, residuals {:.2} MiB a step",
            net_ms / base_ms,
            bytes as f64 / (1 << 20) as f64
        );
        rows.push(json!({
            "double": double, "single": single, "controlnet_ms": net_ms,
            "controlnet_over_transformer": net_ms / base_ms,
            "controlled_transformer_ms": controlled_ms, "residual_bytes": bytes,
        }));
    }
    report.insert("controlnets".into(), Value::Array(rows));
    println!("{}", Value::Object(report));
    Ok(())
}
