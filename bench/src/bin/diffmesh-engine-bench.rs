//! `cargo xtask bench engine`: engine benchmarks (see the `diffmesh_benches` crate). Prints
//! human-readable lines, then one JSON line with every figure last (`--json`: only that line).
use anyhow::{ensure, Context, Result};
use clap::{Parser, ValueEnum};
use diffmesh_benches::batching::{self, BatchingOptions};
use diffmesh_benches::disaggregation::{self, DisaggregationOptions};
use diffmesh_benches::driver::{calibrate, BenchModel};
use diffmesh_benches::engine_steps;
use diffmesh_benches::mask_aware;
use diffmesh_benches::prompt_stage;
use diffmesh_benches::report::Report;
use diffmesh_benches::workload::WorkloadSpec;
use diffmesh_model::flux::kv_codec::CacheDtype;
use diffmesh_model::flux::MaskedAttention;
use diffmesh_model::tch::{self, Device};
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Part {
    /// Continuous against static batching.
    Batching,
    /// Pre/post-processing inline in the step loop against on codec workers.
    Disaggregation,
    /// Mask-aware step latency (medium config), throughput at batch 8, quality (tiny model).
    MaskAware,
    /// Whole engine steps of mask-aware edit batches, written into --engine-steps-profile (the
    /// router's and simulator's cost models add them to the transformer blocks' latency).
    EngineSteps,
    /// Only the quality figures of `mask-aware` (SSIM/PSNR with the tiny model; minutes, not
    /// the medium config's tens of minutes).
    Quality,
    /// Text encoding on the step loop against on the denoiser's prompt stage: the gaps between
    /// a running job's steps while new prompts arrive.
    PromptStage,
    /// A live run on elastic ranks (`--ranks`) against `diffmesh-sim --elastic` on the same
    /// arrivals (issue 47).
    Elastic,
}

#[derive(Debug, Parser)]
#[command(
    name = "diffmesh-engine-bench",
    about = "Engine benchmarks (in-process; CPU, and the mask-aware latency figures on a GPU with --device)"
)]
struct Args {
    /// Mask-ratio trace: one ratio a line (relative paths from the repository root).
    #[arg(long, default_value = "../shared/data/mask-ratios/production-edit.txt")]
    mask_ratios: PathBuf,
    /// Print only the JSON line.
    #[arg(long)]
    json: bool,
    /// Parts to run (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values_t = [Part::MaskAware, Part::Batching, Part::Disaggregation]
    )]
    parts: Vec<Part>,
    /// Model directory (diffusers layout; relative paths from the repository root).
    #[arg(long, default_value = "weights/tiny")]
    model_dir: PathBuf,
    /// Device of the mask-aware latency figures: cpu, cuda, cuda:N or auto (the quality part
    /// runs on the CPU; --engine-device places the batching and disaggregation engines).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Mask-aware latency figures on full-size FLUX.1-dev (random weights, 1024x1024: about
    /// 48 GB of f32 weights while they are made) instead of the medium config; for a GPU.
    #[arg(long)]
    flux_dev: bool,
    /// Device of the engine in the batching, disaggregation and engine-steps parts: cpu, cuda,
    /// cuda:N or auto (the codec work of the disaggregation part stays on the CPU).
    #[arg(long, default_value = "cpu")]
    engine_device: String,
    /// Weights and activations of the engine: f32, bf16, or auto (bf16 where the CPU has bf16
    /// units, as the denoiser's `--dtype auto`).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Attention of a packed mask-aware batch, in the mask-aware figures and the engine: auto
    /// (one padded call on a GPU, a loop over the requests on a CPU), per-request or padded.
    #[arg(long, default_value = "auto")]
    masked_attention: String,
    /// Storage dtype of the cache in the mask-aware latency figures: f32, f16, bf16 or fp8.
    #[arg(long, default_value = "bf16")]
    latency_cache_dtype: String,
    /// Decode an fp8 cache on a GPU through tch instead of the fused kernel (to compare).
    #[arg(long)]
    no_fused_kernels: bool,
    /// Timed rounds per mask-aware latency figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    mask_aware_runs: usize,
    /// Edits per cache dtype in the quality measurement (tiny model).
    #[arg(long, default_value_t = 24)]
    quality_edits: usize,
    /// Denoising steps of each quality edit (the gateway's default is 20).
    #[arg(long, default_value_t = 20)]
    quality_steps: usize,
    /// Requests per round (batching and disaggregation parts: each round runs the same
    /// requests in both modes).
    #[arg(long, default_value_t = 60)]
    requests: usize,
    /// Rounds per part, modes alternating, new arrivals each round; latencies pooled per mode
    /// (so a slow spell of a shared machine weighs on both modes alike).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Arrival rate as a fraction of the engine's measured full-batch capacity.
    #[arg(long, default_value_t = 0.7)]
    utilisation: f64,
    /// Fraction of requests that are edits (masks from --mask-ratios); the rest generate.
    #[arg(long, default_value_t = 0.8)]
    edit_fraction: f64,
    /// Fewest denoising steps of a request (drawn uniformly up to --steps-max).
    #[arg(long, default_value_t = 5)]
    steps_min: u32,
    #[arg(long, default_value_t = 25)]
    steps_max: u32,
    /// Batch rows of the engine.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Batching part: edits read a captured template's cache (mask-aware steps, as edits by
    /// `template_id`); `false`: edits run in full compute, as costly as generations.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    batching_template_caches: bool,
    /// Token budget of the engine (masked image tokens per step); unset: none.
    #[arg(long)]
    token_budget: Option<u64>,
    /// Side of the uploaded PNG templates and masks (disaggregation part).
    #[arg(long, default_value_t = 1024)]
    image_size: u32,
    /// Distinct template images (disaggregation part).
    #[arg(long, default_value_t = 4)]
    templates: usize,
    /// Codec worker threads of the disaggregated mode.
    #[arg(long, default_value_t = 1)]
    codec_workers: usize,
    /// Intra-op threads of the engine's torch (the rest of the cores serve the codec workers).
    #[arg(long, default_value_t = 1)]
    torch_threads: i32,
    /// Timed steps per batch size when measuring the engine's step cost.
    #[arg(long, default_value_t = 10)]
    calibration_steps: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Profile (measured on this machine by `cargo xtask profile`) that the engine-steps part
    /// writes its samples into (relative paths from the repository root).
    #[arg(long, default_value = "sched/profiles/tiny-cpu.json")]
    engine_steps_profile: PathBuf,
    /// Denoising steps of each edit the engine-steps part times (the gateway's default is 20).
    #[arg(long, default_value_t = 20)]
    engine_steps_steps: u32,
    /// Sweeps over batch sizes 1..=--max-batch in the engine-steps part.
    #[arg(long, default_value_t = 3)]
    engine_steps_rounds: usize,
    /// Prompt-stage part: layers and tokens of the T5 encode (T5-small widths, random weights)
    /// each prompt pays for, standing in for a real text encoder's cost.
    #[arg(long, default_value_t = 4)]
    prompt_stage_encoder_layers: i64,
    #[arg(long, default_value_t = 256)]
    prompt_stage_encoder_tokens: i64,
    /// Prompt-stage part: jobs stepping all along (and their steps), and short jobs with a new
    /// prompt each, arriving --prompt-stage-gap apart.
    #[arg(long, default_value_t = 2)]
    prompt_stage_long_jobs: usize,
    #[arg(long, default_value_t = 120)]
    prompt_stage_long_steps: u32,
    #[arg(long, default_value_t = 12)]
    prompt_stage_short_jobs: usize,
    #[arg(long, default_value_t = 4)]
    prompt_stage_short_steps: u32,
    #[arg(long, default_value = "250ms", value_parser = humantime::parse_duration)]
    prompt_stage_gap: std::time::Duration,
    /// Elastic part: ranks, policy, class image sides (pixels) and weights, steps per request,
    /// load (fraction of the ranks' SP1 capacity), deadline scale and seconds of arrivals.
    #[arg(long, default_value_t = 4)]
    elastic_ranks: usize,
    #[arg(long, default_value = "slo-elastic")]
    elastic_policy: String,
    #[arg(long, value_delimiter = ',', default_values_t = [128, 192, 256])]
    elastic_sizes: Vec<u32>,
    #[arg(long, value_delimiter = ',', default_values_t = [0.6, 0.3, 0.1])]
    elastic_mix: Vec<f64>,
    #[arg(long, default_value_t = 8)]
    elastic_steps: u32,
    #[arg(long, default_value_t = 0.8)]
    elastic_load: f64,
    #[arg(long, default_value_t = 1.0)]
    elastic_slo_scale: f64,
    #[arg(long, default_value_t = 60.0)]
    elastic_duration: f64,
    /// Elastic part: where to write the ranks' measured step-cost table.
    #[arg(long)]
    elastic_cost_out: Option<PathBuf>,
}

/// `path` as given when it exists, else relative to the repository root.
fn from_repo_root(path: &Path) -> PathBuf {
    if path.is_absolute() || path.exists() {
        return path.to_path_buf();
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path);
    if repo.exists() {
        repo
    } else {
        path.to_path_buf()
    }
}

fn mask_ratios(path: &Path) -> Result<Vec<f64>> {
    let resolved = from_repo_root(path);
    ensure!(
        resolved.is_file(),
        "--mask-ratios {}: no such file (relative paths are read from the working directory, \
         then from the repository root; pass --mask-ratios FILE)",
        path.display()
    );
    diffmesh_sched::sim::workload::read_mask_ratios(&resolved)
        .with_context(|| format!("--mask-ratios {}", resolved.display()))
}

/// The engine's step time by batch size, measured right before a part runs (the machine's load
/// may have changed since the last part); reported as `<part>_step_ms_by_batch`.
fn calibrate_and_say(
    args: &Args,
    model: &BenchModel,
    report: &mut Report,
    part: &str,
) -> Result<Vec<f64>> {
    let step_s = calibrate(model, args.max_batch, args.calibration_steps, 3)?;
    let step_ms: Vec<f64> = step_s.iter().map(|s| s * 1e3).collect();
    // Throughput gained by stepping a full batch together instead of one row at a time.
    let gain = step_s.len() as f64 * step_s[0] / step_s[step_s.len() - 1];
    report.say(format!(
        "{part}: engine step (ms, line fit) at batch 1..={}: {} (batch {} steps {gain:.2}x \
         the images/s of batch 1)",
        args.max_batch,
        step_ms
            .iter()
            .map(|m| format!("{m:.1}"))
            .collect::<Vec<_>>()
            .join(", "),
        step_s.len()
    ));
    report.insert(&format!("{part}_step_ms_by_batch"), json!(step_ms));
    report.insert(&format!("{part}_batch_gain"), gain);
    Ok(step_s)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.utilisation > 0.0 && args.utilisation < 1.0,
        "--utilisation must be in (0, 1), got {}",
        args.utilisation
    );
    ensure!(args.max_batch >= 1, "--max-batch must be at least 1");
    ensure!(args.rounds >= 1, "--rounds must be at least 1");
    ensure!(
        args.torch_threads >= 1,
        "--torch-threads must be at least 1"
    );
    ensure!(
        args.calibration_steps >= 1,
        "--calibration-steps must be at least 1"
    );
    let ratios = mask_ratios(&args.mask_ratios)?;
    let model_dir = from_repo_root(&args.model_dir);
    let device = diffmesh_model::device::parse_device(&args.device)
        .map_err(|expected| anyhow::anyhow!("--device {}: expected {expected}", args.device))?;
    ensure!(
        !device.is_cuda() || tch::Cuda::is_available(),
        "--device {}: libtorch sees no CUDA device here",
        args.device
    );
    let dtype_on = |device| {
        diffmesh_model::device::parse_model_dtype(&args.dtype, device)
            .map_err(|expected| anyhow::anyhow!("--dtype {}: expected {expected}", args.dtype))
    };
    let kind = dtype_on(device)?;
    let engine_device =
        diffmesh_model::device::parse_device(&args.engine_device).map_err(|expected| {
            anyhow::anyhow!(
                "--engine-device {}: expected {expected}",
                args.engine_device
            )
        })?;
    ensure!(
        !engine_device.is_cuda() || tch::Cuda::is_available(),
        "--engine-device {}: libtorch sees no CUDA device here",
        args.engine_device
    );
    let masked_attention = MaskedAttention::parse(&args.masked_attention)
        .map_err(|e| anyhow::anyhow!("invalid --masked-attention: expected {e}"))?;
    // The quality figures run on the CPU whatever the devices (the mask-aware part's model).
    let model = BenchModel {
        dir: model_dir.clone(),
        kind,
        device: Device::Cpu,
        masked_attention,
    };
    let engine_model = BenchModel {
        device: engine_device,
        kind: dtype_on(engine_device)?,
        ..model.clone()
    };
    tch::set_num_threads(args.torch_threads);
    let workload = WorkloadSpec {
        requests: args.requests,
        edit_fraction: args.edit_fraction,
        steps_min: args.steps_min,
        steps_max: args.steps_max,
        seed: args.seed,
    };
    workload.validate()?;

    let mut report = Report::new(args.json);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    report.say(format!(
        "engine bench: model {} ({kind:?}), engine on {engine_device:?}, {cores} cores, torch threads {}, mask ratios {} ({} values)",
        model_dir.display(),
        args.torch_threads,
        args.mask_ratios.display(),
        ratios.len()
    ));
    report.insert("cores", cores);
    report.insert("torch_threads", args.torch_threads);
    report.insert("dtype", format!("{kind:?}"));
    report.insert("device", format!("{device:?}"));
    report.insert("engine_device", format!("{engine_device:?}"));
    report.insert("flux_dev", args.flux_dev);
    report.insert("seed", args.seed);

    let with_latency = args.parts.contains(&Part::MaskAware);
    if with_latency || args.parts.contains(&Part::Quality) {
        let opts = mask_aware::MaskAwareOptions {
            mask_ratios: ratios.clone(),
            runs: args.mask_aware_runs,
            tiny: model.clone(),
            device,
            flux_dev: args.flux_dev,
            masked_attention,
            latency_cache_dtype: CacheDtype::parse(&args.latency_cache_dtype)
                .map_err(|e| anyhow::anyhow!("invalid --latency-cache-dtype: {e}"))?,
            fused_kernels: !args.no_fused_kernels,
            quality_edits: args.quality_edits,
            quality_steps: args.quality_steps,
            seed: args.seed,
        };
        mask_aware::run(&opts, with_latency, &mut report)?;
    }
    if args.parts.contains(&Part::EngineSteps) {
        let opts = engine_steps::EngineStepsOptions {
            model: engine_model.clone(),
            mask_ratios: ratios.clone(),
            max_batch: args.max_batch,
            steps: args.engine_steps_steps,
            rounds: args.engine_steps_rounds,
            seed: args.seed,
            profile: from_repo_root(&args.engine_steps_profile),
        };
        engine_steps::run(&opts, &mut report).await?;
    }
    if args.parts.contains(&Part::Batching) {
        let opts = BatchingOptions {
            model: engine_model.clone(),
            workload: workload.clone(),
            mask_ratios: ratios.clone(),
            utilisation: args.utilisation,
            max_batch: args.max_batch,
            token_budget: args.token_budget,
            rounds: args.rounds,
            template_caches: args.batching_template_caches,
        };
        let step_s = calibrate_and_say(&args, &engine_model, &mut report, "batching")?;
        batching::run(&opts, &step_s, &mut report).await?;
    }
    if args.parts.contains(&Part::Disaggregation) {
        let opts = DisaggregationOptions {
            model: engine_model.clone(),
            workload: workload.clone(),
            mask_ratios: ratios.clone(),
            utilisation: args.utilisation,
            max_batch: args.max_batch,
            image_size: args.image_size,
            templates: args.templates,
            codec_workers: args.codec_workers,
            rounds: args.rounds,
        };
        let step_s = calibrate_and_say(&args, &engine_model, &mut report, "disaggregation")?;
        disaggregation::run(&opts, &step_s, &mut report).await?;
    }
    if args.parts.contains(&Part::PromptStage) {
        let opts = prompt_stage::PromptStageOptions {
            model: engine_model.clone(),
            encoder_layers: args.prompt_stage_encoder_layers,
            encoder_tokens: args.prompt_stage_encoder_tokens,
            long_jobs: args.prompt_stage_long_jobs,
            long_steps: args.prompt_stage_long_steps,
            short_jobs: args.prompt_stage_short_jobs,
            short_steps: args.prompt_stage_short_steps,
            arrival_gap: args.prompt_stage_gap,
            max_batch: args.max_batch,
        };
        prompt_stage::run(&opts, &mut report).await?;
    }
    if args.parts.contains(&Part::Elastic) {
        let opts = diffmesh_benches::elastic::ElasticOptions {
            model: engine_model.clone(),
            ranks: args.elastic_ranks,
            policy: args.elastic_policy.clone(),
            sizes: args.elastic_sizes.clone(),
            steps: args.elastic_steps,
            mix: args.elastic_mix.clone(),
            load: args.elastic_load,
            slo_scale: args.elastic_slo_scale,
            duration: args.elastic_duration,
            seed: args.seed,
            threads_per_rank: args.torch_threads,
            cost_out: args.elastic_cost_out.clone(),
        };
        diffmesh_benches::elastic::run(&opts, &mut report).await?;
    }
    println!("{}", report.json_line());
    Ok(())
}
