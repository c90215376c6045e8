//! The mask-aware part of `cargo xtask bench engine` (FlashPS §4.2 and §5):
//!
//! - latency, on the medium random config: one denoising step (one transformer forward) in full
//!   compute against a mask-aware step at mask ratio 0.2 whose cache is (a) already resident as
//!   tensors ("ideal"), (b) streamed block by block from the local tier's encoded entry by the
//!   engine's loader thread while earlier blocks compute ("pipelined", what the engine does), and
//!   (c) decoded completely before the compute starts ("naive");
//! - throughput at batch 8, masks drawn from the mask-ratio file: a full batched forward of 8
//!   against one packed mask-aware forward of the same 8 (pipelined loads);
//! - the Y (hidden-stream) cache at mask 0.2, ideal and pipelined, and its bytes against K/V's;
//! - the three-way planner (full, K/V or Y per block) against the K/V prefix planner, on
//!   per-block costs from those steps, both plans measured streamed from a cache holding both;
//! - quality, with the trained tiny model: edits of a rendered template run to the end in full
//!   compute and through the engine's `CachedStepper` (the serving path), composited like the
//!   codec does; SSIM and PSNR of mask-aware against full, whole image, over the mask's box
//!   and over the masked pixels, per K/V cache dtype and for the Y cache;
//! - step caching (TeaCache) against and with mask-aware editing ([`crate::step_caching`]).
use crate::driver::BenchModel;
use crate::edit_quality::{mean_min, EditScores, QualityEdits};
use crate::report::Report;
use anyhow::{Context, Result};
use diffmesh_denoiser::cached_step::{CacheSettings, CachedStepper, CaptureSink, PrefixPolicy};
use diffmesh_denoiser::templates::{CacheLayout, GpuCopy, KvLoader, TemplateEntry};
use diffmesh_model::bench_inputs::{
    flux_dev_config, medium_config, random_inputs_on, FLUX_SIDE, FLUX_TXT, MEDIUM_SIDE, MEDIUM_TXT,
};
use diffmesh_model::flux::kv_codec::{decode_block, CacheDtype};
use diffmesh_model::flux::{
    CapturedKv, FluxInputs, FluxTransformer, KvCache, KvFormat, MaskedAttention, MaskedRequest,
};
use diffmesh_model::model_dir::LoadedModel;
use diffmesh_model::pipeline::stepper::DenoiseState;
use diffmesh_model::quality::{psnr, ssim};
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use diffmesh_sched::three_way::{
    plan_prefix_kv, plan_three_way, BlockChoice, ThreeWayCosts, ThreeWayPlan,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::Instant;

/// Settings of the mask-aware measurements.
#[derive(Debug, Clone)]
pub struct MaskAwareOptions {
    /// Mask ratios to draw from (the production trace).
    pub mask_ratios: Vec<f64>,
    /// Timed rounds per latency figure (medians are reported).
    pub runs: usize,
    /// Trained tiny model for the quality figures, in the dtype the engine serves it (the
    /// latency figures use that dtype too).
    pub tiny: BenchModel,
    /// Where the latency figures run: the CPU, or a GPU (cache streamed through the copy
    /// stream from pinned memory).
    pub device: Device,
    /// Latency figures on full-size FLUX.1-dev (random weights, 1024x1024) instead of the
    /// medium config: for a GPU.
    pub flux_dev: bool,
    /// Attention of packed mask-aware batches (the batch-8 figure).
    pub masked_attention: MaskedAttention,
    /// Storage dtype of the cache the latency figures load.
    pub latency_cache_dtype: CacheDtype,
    /// On a GPU, decode fp8 blocks with the fused kernel (where NVRTC loads) rather than tch.
    pub fused_kernels: bool,
    /// Edits per cache dtype in the quality measurement.
    pub quality_edits: usize,
    /// Denoising steps of the quality edits.
    pub quality_steps: usize,
    pub seed: u64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Wall time of `f` in ms, a GPU's queued work included.
fn ms(device: Device, f: impl FnOnce() -> diffmesh_model::Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    if let Device::Cuda(ordinal) = device {
        tch::Cuda::synchronize(ordinal as i64);
    }
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// The float inputs in `kind` (position ids stay f32, as the pipeline passes them).
pub(crate) fn inputs_as(inputs: FluxInputs, kind: Kind) -> FluxInputs {
    FluxInputs {
        hidden_states: inputs.hidden_states.to_kind(kind),
        encoder_hidden_states: inputs.encoder_hidden_states.to_kind(kind),
        pooled_projections: inputs.pooled_projections.to_kind(kind),
        timestep: inputs.timestep.to_kind(kind),
        guidance: inputs.guidance.map(|g| g.to_kind(kind)),
        ..inputs
    }
}

/// Capture one forward's K/V and/or hidden stream as an encoded one-step cache entry.
fn capture_entry(
    model: &FluxTransformer,
    inputs: &FluxInputs,
    dtype: CacheDtype,
    layout: CacheLayout,
) -> Result<Arc<TemplateEntry>> {
    let mut sink = CaptureSink::new(layout, dtype);
    // Only the captured K/V are wanted here, not the step's output.
    let _output = model.forward_capture(inputs, &mut sink)?;
    sink.end_step();
    let entry = sink
        .finish("bench".into(), model.num_blocks())
        .map_err(anyhow::Error::msg)?;
    Ok(Arc::new(entry))
}

/// Decode every block of step 0 onto `device` (the "naive" load, and the resident cache of
/// "ideal").
fn decode_all(entry: &TemplateEntry, kind: Kind, device: Device) -> Result<CapturedKv> {
    let mut kv = CapturedKv::new(entry.layout.kv());
    for b in 0..entry.blocks() {
        let blob = entry.block(0, b).context("block missing")?;
        let (k, v, _) = decode_block(blob, kind)?;
        kv.blocks.push((k.to_device(device), v.to_device(device)));
    }
    Ok(kv)
}

fn masked_request<'a>(
    inputs: &FluxInputs,
    row: i64,
    index: &Tensor,
    cache: &'a dyn KvCache,
) -> MaskedRequest<'a> {
    MaskedRequest {
        hidden_states: inputs.hidden_states.get(row).index_select(0, index),
        token_index: index.shallow_clone(),
        encoder_hidden_states: inputs.encoder_hidden_states.get(row),
        pooled_projections: inputs.pooled_projections.get(row),
        timestep: 0.5,
        guidance: inputs.guidance.as_ref().map(|_| 3.5),
        img_ids: inputs.img_ids.shallow_clone(),
        txt_ids: inputs.txt_ids.shallow_clone(),
        cache,
        // Read only when a full prefix of blocks runs.
        full_hidden_states: Some(inputs.hidden_states.get(row)),
    }
}

fn random_index(rng: &mut ChaCha8Rng, n: i64, ratio: f64) -> Tensor {
    let m = ((ratio * n as f64).round() as i64).clamp(1, n - 1);
    let mut all: Vec<i64> = (0..n).collect();
    for i in 0..m as usize {
        let j = rng.random_range(i..n as usize);
        all.swap(i, j);
    }
    let mut chosen = all[..m as usize].to_vec();
    chosen.sort_unstable();
    Tensor::from_slice(&chosen)
}

/// Latency and throughput figures on the medium config (or full-size FLUX.1-dev).
fn latency(opts: &MaskAwareOptions, report: &mut Report) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let (device, kind) = (opts.device, opts.tiny.kind);
    let (cfg, side, txt) = if opts.flux_dev {
        (flux_dev_config(), FLUX_SIDE, FLUX_TXT)
    } else {
        (medium_config(), MEDIUM_SIDE, MEDIUM_TXT)
    };
    tch::manual_seed(opts.seed as i64);
    let mut vs = nn::VarStore::new(device);
    let mut model = FluxTransformer::new(&vs.root(), cfg.clone())?;
    model.masked_attention = opts.masked_attention;
    vs.set_kind(kind);
    let n = side * side;
    let inputs = inputs_as(random_inputs_on(&cfg, side, txt, 1, device), kind);
    let dtype = opts.latency_cache_dtype;
    let entry = capture_entry(&model, &inputs, dtype, CacheLayout::One(KvFormat::Prepared))?;
    let entry_y = capture_entry(&model, &inputs, dtype, CacheLayout::One(KvFormat::Hidden))?;
    // Both, as `--cache-format prepared+hidden` holds them: what a mixed plan streams from.
    let entry_both = capture_entry(
        &model,
        &inputs,
        dtype,
        CacheLayout::KvAndHidden(KvFormat::Prepared),
    )?;
    let resident = decode_all(&entry, kind, device)?;
    let resident_y = decode_all(&entry_y, kind, device)?;
    // On a GPU: the local tier's pinned form and the copy stream, as a GPU denoiser runs them.
    let gpu = match device {
        Device::Cuda(ordinal) => {
            Some(GpuCopy::new(ordinal, GpuCopy::RING).map_err(anyhow::Error::msg)?)
        }
        _ => None,
    };
    if let Some(gpu) = &gpu {
        let fused = gpu.use_fused_kernels(opts.fused_kernels);
        report.insert("fused_kernels", json!(fused));
    }
    let pin = |entry: Arc<TemplateEntry>| -> Result<Arc<TemplateEntry>> {
        Ok(match &gpu {
            Some(gpu) => Arc::new(gpu.pin(&entry).map_err(anyhow::Error::msg)?),
            None => entry,
        })
    };
    let (entry, entry_y, entry_both) = (pin(entry)?, pin(entry_y)?, pin(entry_both)?);
    let loader = KvLoader::spawn(2, gpu)?;
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let index = random_index(&mut rng, n, 0.2).to_device(device);
    // FlashPS's production median mask is about 0.11: the step at that ratio as well.
    // Its own generator, so the batch figures below draw the same ratios as before.
    let mut rng_011 = ChaCha8Rng::seed_from_u64(opts.seed + 11);
    let index_011 = random_index(&mut rng_011, n, 0.11).to_device(device);

    let (mut full, mut ideal, mut pipelined, mut naive) = (vec![], vec![], vec![], vec![]);
    let (mut ideal_011, mut pipelined_011) = (vec![], vec![]);
    let (mut ideal_y, mut pipelined_y) = (vec![], vec![]);
    // The mask-aware step at `index` from a resident cache (ideal) and streamed (pipelined)
    // from `entry` with the first `prefix` blocks computed in full.
    let ideal_ms = |index: &Tensor, resident: &CapturedKv| {
        ms(device, || {
            model
                .forward_masked(&[masked_request(&inputs, 0, index, resident)])
                .map(drop)
        })
    };
    let streamed_ms = |index: &Tensor, entry: &Arc<TemplateEntry>, prefix: usize| {
        ms(device, || {
            let stream = loader.load_step(vec![(entry.clone(), 0)], prefix, kind, device);
            model
                .forward_masked_prefix(&[masked_request(&inputs, 0, index, &stream[0])], prefix)
                .map(drop)
        })
    };
    let pipelined_ms = |index: &Tensor| streamed_ms(index, &entry, 0);
    for round in 0..opts.runs + 1 {
        let f = ms(device, || model.forward(&inputs).map(drop))?;
        let i = ideal_ms(&index, &resident)?;
        let p = pipelined_ms(&index)?;
        let iy = ideal_ms(&index, &resident_y)?;
        let py = streamed_ms(&index, &entry_y, 0)?;
        let nv = ms(device, || {
            let kv = decode_all(&entry, kind, device)
                .map_err(|e| diffmesh_model::ModelError::input("cache", e.to_string()))?;
            model
                .forward_masked(&[masked_request(&inputs, 0, &index, &kv)])
                .map(drop)
        })?;
        let i11 = ideal_ms(&index_011, &resident)?;
        let p11 = pipelined_ms(&index_011)?;
        if round > 0 {
            full.push(f);
            ideal.push(i);
            pipelined.push(p);
            naive.push(nv);
            ideal_011.push(i11);
            pipelined_011.push(p11);
            ideal_y.push(iy);
            pipelined_y.push(py);
        }
    }
    let (ideal_y, pipelined_y) = (median(ideal_y), median(pipelined_y));
    let (ideal_011, pipelined_011) = (median(ideal_011), median(pipelined_011));
    let (full, ideal, pipelined, naive) = (
        median(full),
        median(ideal),
        median(pipelined),
        median(naive),
    );
    report.say(format!(
        "{} step at mask 0.2 ({device:?}, {kind:?}): full {full:.1} ms, mask-aware ideal {ideal:.1} ms, pipelined {pipelined:.1} ms, naive {naive:.1} ms",
        if opts.flux_dev { "FLUX.1-dev" } else { "medium" }
    ));
    report.say(format!(
        "at mask 0.11: mask-aware ideal {ideal_011:.1} ms, pipelined {pipelined_011:.1} ms"
    ));
    let bw = loader.stats().bytes_per_second().unwrap_or(0.0);
    report.say(format!(
        "cache: {} bytes per step ({} blocks, {}), loader {:.2} GB/s",
        entry.bytes(),
        entry.blocks(),
        opts.latency_cache_dtype.as_str(),
        bw / 1e9
    ));
    report.insert("medium_full_step_ms", json!(full));
    report.insert("medium_masked_ideal_ms", json!(ideal));
    report.insert("medium_masked_pipelined_ms", json!(pipelined));
    report.insert("medium_masked_naive_ms", json!(naive));
    report.insert("cache_step_bytes", json!(entry.bytes()));
    report.insert(
        "latency_cache_dtype",
        json!(opts.latency_cache_dtype.as_str()),
    );
    report.insert(
        "masked_attention",
        json!(format!("{:?}", opts.masked_attention)),
    );
    report.insert("loader_gb_per_s", json!(bw / 1e9));
    report.insert("speedup_at_0_2", json!(full / pipelined));
    report.insert("masked_ideal_ms_at_0_11", json!(ideal_011));
    report.insert("masked_pipelined_ms_at_0_11", json!(pipelined_011));
    report.insert("speedup_at_0_11", json!(full / pipelined_011));
    report.insert("pipelined_over_ideal", json!(pipelined / ideal));
    report.insert("naive_over_ideal", json!(naive / ideal));

    // The Y (hidden-stream) cache: half the bytes, K/V projected in the edit.
    let y_over_kv = entry_y.bytes() as f64 / entry.bytes() as f64;
    report.say(format!(
        "Y cache at mask 0.2: ideal {ideal_y:.1} ms, pipelined {pipelined_y:.1} ms, {} bytes per step ({y_over_kv:.3} of K/V)",
        entry_y.bytes()
    ));
    report.insert("y_masked_ideal_ms", json!(ideal_y));
    report.insert("y_masked_pipelined_ms", json!(pipelined_y));
    report.insert("y_cache_step_bytes", json!(entry_y.bytes()));
    report.insert("y_over_kv_bytes", json!(y_over_kv));
    report.insert("y_cache_speedup_at_0_2", json!(full / pipelined_y));
    let steps = StepFigures {
        full_ms: full,
        kv_ideal_ms: ideal,
        y_ideal_ms: ideal_y,
        kv_bytes: entry.bytes() as f64,
        y_bytes: entry_y.bytes() as f64,
        bytes_per_s: loader.stats().bytes_per_second().unwrap_or(0.0),
    };
    three_way_planner(
        &steps,
        model.num_blocks(),
        |plan| {
            // Each plan runs as the engine runs it: streamed from a cache holding K/V and Y,
            // the first blocks in full, each later block loading the format its plan reads.
            let (full_blocks, _, _) = plan.counts();
            let formats: Vec<KvFormat> = plan
                .choices
                .iter()
                .map(|c| match c {
                    BlockChoice::Y => KvFormat::Hidden,
                    BlockChoice::Full | BlockChoice::Kv => KvFormat::Prepared,
                })
                .collect();
            let run = || {
                ms(device, || {
                    let parts = vec![(entry_both.clone(), 0, formats.clone())];
                    let stream = loader.load_step_as(parts, full_blocks, kind, device);
                    let request = masked_request(&inputs, 0, &index, &stream[0]);
                    model
                        .forward_masked_prefix(&[request], full_blocks)
                        .map(drop)
                })
            };
            let runs: Result<Vec<f64>> = (0..opts.runs + 1).map(|_| run()).collect();
            Ok(Some(median(runs?.split_off(1))))
        },
        report,
    )?;

    // Batch of 8 with ratios from the trace.
    let b = 8i64;
    let ratios: Vec<f64> = (0..b)
        .map(|_| opts.mask_ratios[rng.random_range(0..opts.mask_ratios.len())])
        .collect();
    let batch = FluxInputs {
        hidden_states: inputs.hidden_states.repeat([b, 1, 1]),
        encoder_hidden_states: inputs.encoder_hidden_states.repeat([b, 1, 1]),
        pooled_projections: inputs.pooled_projections.repeat([b, 1]),
        timestep: inputs.timestep.repeat([b]),
        img_ids: inputs.img_ids.shallow_clone(),
        txt_ids: inputs.txt_ids.shallow_clone(),
        guidance: inputs.guidance.as_ref().map(|g| g.repeat([b])),
    };
    let indexes: Vec<Tensor> = ratios
        .iter()
        .map(|&r| random_index(&mut rng, n, r).to_device(device))
        .collect();
    let (mut full_b, mut masked_b) = (vec![], vec![]);
    for round in 0..opts.runs.div_ceil(2) + 1 {
        let f = ms(device, || model.forward(&batch).map(drop))?;
        let m = ms(device, || {
            let parts = (0..b).map(|_| (entry.clone(), 0)).collect();
            let streams = loader.load_step(parts, 0, kind, device);
            let reqs: Vec<MaskedRequest> = indexes
                .iter()
                .zip(&streams)
                .map(|(idx, s)| masked_request(&inputs, 0, idx, s))
                .collect();
            model.forward_masked(&reqs).map(drop)
        })?;
        if round > 0 {
            full_b.push(f);
            masked_b.push(m);
        }
    }
    let (full_b, masked_b) = (median(full_b), median(masked_b));
    let mean_ratio = ratios.iter().sum::<f64>() / ratios.len() as f64;
    report.say(format!(
        "batch 8 (mean mask ratio {mean_ratio:.3}): full {full_b:.1} ms, mask-aware {masked_b:.1} ms per step"
    ));
    report.insert("b8_mask_ratios", json!(ratios));
    report.insert("b8_full_step_ms", json!(full_b));
    report.insert("b8_masked_step_ms", json!(masked_b));
    report.insert("throughput_ratio_b8", json!(full_b / masked_b));
    Ok(())
}

/// Whole-step figures of one mask ratio that the planners' per-block costs come from.
struct StepFigures {
    full_ms: f64,
    kv_ideal_ms: f64,
    y_ideal_ms: f64,
    kv_bytes: f64,
    y_bytes: f64,
    /// The loader's measured bandwidth (0: none measured).
    bytes_per_s: f64,
}

/// The three-way planner (full, K/V or Y per block) against the K/V prefix planner the engine
/// runs, on per-block costs from the measured steps (each step's time over its blocks: the
/// blocks of a Flux model cost about the same per token) and the loader's measured bandwidth.
/// `measure` runs a plan streamed where it can (every plan, from a cache holding both
/// formats): then the figure is measured,
/// otherwise predicted, and the report says which.
fn three_way_planner(
    s: &StepFigures,
    blocks: usize,
    mut measure: impl FnMut(&ThreeWayPlan) -> Result<Option<f64>>,
    report: &mut Report,
) -> Result<()> {
    let per_block = |ms: f64| ms / 1e3 / blocks.max(1) as f64;
    let load = |bytes: f64| match s.bytes_per_s > 0.0 {
        true => bytes / blocks.max(1) as f64 / s.bytes_per_s,
        false => 0.0,
    };
    let costs = vec![
        ThreeWayCosts {
            full_s: per_block(s.full_ms),
            kv_compute_s: per_block(s.kv_ideal_ms),
            kv_load_s: load(s.kv_bytes),
            y_compute_s: per_block(s.y_ideal_ms),
            y_load_s: load(s.y_bytes),
        };
        blocks
    ];
    let (prefix, three) = (plan_prefix_kv(&costs), plan_three_way(&costs));
    let predicted = three.latency_s / prefix.latency_s;
    let (f, kv, y) = three.counts();
    // The same plan runs the same step: measuring it twice would only measure noise.
    let same = three.choices == prefix.choices;
    let measured = match same {
        true => None,
        false => match (measure(&prefix)?, measure(&three)?) {
            (Some(a), Some(b)) => Some(b / a),
            _ => None,
        },
    };
    report.say(format!(
        "three-way planner at mask 0.2: {f} full, {kv} K/V, {y} Y blocks; predicted {:.1} ms vs the K/V prefix planner's {:.1} ms ({predicted:.3}), measured streamed ratio {}",
        three.latency_s * 1e3,
        prefix.latency_s * 1e3,
        match (same, measured) {
            (true, _) => "1 (the same plan)".into(),
            (false, Some(m)) => format!("{m:.3}"),
            (false, None) => "n/a (a plan mixing K/V and Y blocks)".into(),
        }
    ));
    let (value, basis) = match (same, measured) {
        (true, _) => (1.0, "same plan"),
        (false, Some(m)) => (m, "measured"),
        (false, None) => (predicted, "predicted"),
    };
    report.insert("planner_three_way_over_prefix", json!(value));
    report.insert("planner_three_way_basis", json!(basis));
    report.insert("planner_three_way_predicted_over_prefix", json!(predicted));
    report.insert(
        "planner_three_way_blocks",
        json!({"full": f, "kv": kv, "y": y}),
    );
    Ok(())
}

/// Quality of mask-aware edits against full compute with the trained tiny model.
fn quality(opts: &MaskAwareOptions, report: &mut Report) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let load = |kind| {
        LoadedModel::load(&opts.tiny.dir, Device::Cpu, kind)
            .with_context(|| format!("loading {}", opts.tiny.dir.display()))
    };
    let model = load(opts.tiny.kind)?;
    let p = model.pipeline();
    // A model served in another dtype is also compared with f32 full compute: what the dtype
    // itself costs, on top of what the cache costs.
    let reference = (opts.tiny.kind != Kind::Float)
        .then(|| load(Kind::Float))
        .transpose()?;
    let mut vs_f32 = (vec![], vec![]);
    let edits = QualityEdits::draw(opts, &p);
    let (mut summary, mut by_format) = (Map::new(), Map::new());
    // Every K/V storage dtype, and the Y (hidden-stream) cache in the served dtype.
    let configs = [
        (KvFormat::Prepared, CacheDtype::F32),
        (KvFormat::Prepared, CacheDtype::Bf16),
        (KvFormat::Prepared, CacheDtype::Fp8),
        (KvFormat::Hidden, CacheDtype::Bf16),
    ];
    for (format, dtype) in configs {
        let kv_bf16 = (format, dtype) == (KvFormat::Prepared, CacheDtype::Bf16);
        let entry = edits.capture(&p, format, dtype)?;
        let mut stepper = CachedStepper::new(
            CacheSettings {
                layout: CacheLayout::One(format),
                dtype,
                lookahead: 2,
                prefix: PrefixPolicy::Fixed(0),
            },
            None,
        )?;
        let mut scores = EditScores::default();
        for e in 0..edits.edits.len() {
            let request = edits.request(e, None);
            let mut full = DenoiseState::new(&p, &request)?;
            while !full.is_done() {
                full.step(&p)?;
            }
            let mut cached = DenoiseState::new(&p, &request)?;
            while !cached.is_done() {
                stepper.step(&p, &mut [&mut cached], &[Some(entry.clone())])?;
            }
            let (a, b) = (
                edits.composite(e, &full, &p)?,
                edits.composite(e, &cached, &p)?,
            );
            scores.add(&a, &b, &edits.pixel_mask(e))?;
            if let (Some(f32_model), true) = (&reference, kv_bf16) {
                let rp = f32_model.pipeline();
                let mut f32_full = DenoiseState::new(&rp, &request)?;
                while !f32_full.is_done() {
                    f32_full.step(&rp)?;
                }
                let r = edits.composite(e, &f32_full, &rp)?;
                vs_f32.0.push(ssim(&r, &b)?);
                vs_f32.1.push(psnr(&r, &b)?.min(100.0));
            }
        }
        report.say(format!(
            "quality ({} {} cache, {} edits, {} steps): {}; cache {} bytes",
            format.as_str(),
            dtype.as_str(),
            opts.quality_edits,
            opts.quality_steps,
            scores.summary(),
            entry.bytes()
        ));
        let mut figures = scores.figures();
        figures["cache_bytes"] = json!(entry.bytes());
        let (s, _, q) = scores.whole();
        if format == KvFormat::Prepared {
            summary.insert(dtype.as_str().into(), figures.clone());
        }
        if format == KvFormat::Hidden {
            report.insert("ssim_mean_y", json!(s));
            for (key, name) in [
                ("ssim_box_mean_y", "ssim_box_mean"),
                ("psnr_box_mean_y", "psnr_box_mean"),
                ("ssim_masked_mean_y", "ssim_masked_mean"),
            ] {
                report.insert(key, figures[name].clone());
            }
        }
        if kv_bf16 {
            report.insert("ssim_mean", json!(s));
            report.insert("psnr_mean", json!(q));
            for key in [
                "ssim_box_mean",
                "psnr_box_mean",
                "ssim_masked_mean",
                "psnr_masked_mean",
            ] {
                report.insert(key, figures[key].clone());
            }
        }
        if dtype == CacheDtype::Bf16 {
            by_format.insert(format.as_str().into(), figures);
        }
    }
    report.insert("quality_by_cache_dtype", Value::Object(summary));
    report.insert("quality_by_cache_format", Value::Object(by_format));
    if reference.is_some() {
        let ((s, min_s), (q, _)) = (mean_min(&vs_f32.0), mean_min(&vs_f32.1));
        report.say(format!(
            "quality of the {:?} model (bf16 cache, mask-aware) against f32 full compute: SSIM mean {s:.4} (min {min_s:.4}), PSNR mean {q:.2} dB",
            opts.tiny.kind
        ));
        report.insert("ssim_vs_f32_full", json!(s));
        report.insert("psnr_vs_f32_full", json!(q));
    }
    Ok(())
}

/// Run the mask-aware measurements (the medium-config latency ones only when `with_latency`:
/// they take most of the time); figures go into `report` under the names the issue uses.
pub fn run(opts: &MaskAwareOptions, with_latency: bool, report: &mut Report) -> Result<()> {
    anyhow::ensure!(
        !opts.mask_ratios.is_empty(),
        "--mask-ratios: the file has no ratios"
    );
    if with_latency {
        latency(opts, report)?;
    }
    quality(opts, report)?;
    crate::step_caching::run(opts, report)
}
