//! Step caching (TeaCache and first-block caching) as the baselines FlashPS is compared
//! against, and combined with it (issue 50): the held-in edits of the quality figures, each run
//! to the end with the trained tiny model five ways on the serving path (`CachedStepper`):
//!
//! - full compute (the reference every score is taken against, and the time every speedup
//!   divides);
//! - TeaCache at a threshold, every token computed on the steps it does not skip;
//! - first-block caching at a threshold (every step runs the first block);
//! - mask-aware with the bf16 K/V cache;
//! - mask-aware with TeaCache on top (skipped steps compute nothing, read no cache).
//!
//! Speedups are wall time over all edits, full against each way, measured in one run on this
//! machine; the scores are SSIM/PSNR against full compute, whole image, over the mask's box
//! and over the masked pixels.
use crate::edit_quality::{EditScores, QualityEdits};
use crate::mask_aware::MaskAwareOptions;
use crate::report::Report;
use anyhow::{Context, Result};
use diffmesh_denoiser::cached_step::{CacheSettings, CachedStepper, PrefixPolicy};
use diffmesh_denoiser::templates::{CacheLayout, TemplateEntry};
use diffmesh_model::flux::kv_codec::CacheDtype;
use diffmesh_model::flux::step_cache::{
    CacheMethod, DEFAULT_CACHE_THRESHOLD, DEFAULT_FIRST_BLOCK_THRESHOLD,
};
use diffmesh_model::flux::KvFormat;
use diffmesh_model::model_dir::LoadedModel;
use diffmesh_model::pipeline::stepper::DenoiseState;
use diffmesh_model::pipeline::FluxPipeline;
use diffmesh_model::tch::{self, Device};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::Instant;

/// Thresholds of the sweep, for both methods (a speed/quality curve; each method's default is
/// one of them).
const SWEEP: [f64; 4] = [0.05, 0.1, 0.2, 0.4];

/// One way of running every edit: its wall time, its skipped steps and its scores.
struct Way {
    seconds: f64,
    skipped: usize,
    steps: usize,
    scores: EditScores,
}

/// Run every edit one way; `cache`: mask-aware with that entry, `step_cache`: caching steps
/// by that method at that threshold.
fn run_way(
    p: &FluxPipeline<'_>,
    edits: &QualityEdits,
    references: &[diffmesh_model::tch::Tensor],
    cache: Option<&Arc<TemplateEntry>>,
    step_cache: Option<(CacheMethod, f64)>,
) -> Result<Way> {
    let mut stepper = CachedStepper::new(
        CacheSettings {
            layout: CacheLayout::One(KvFormat::Prepared),
            dtype: CacheDtype::Bf16,
            lookahead: 2,
            prefix: PrefixPolicy::Fixed(0),
        },
        None,
    )?;
    let mut way = Way {
        seconds: 0.0,
        skipped: 0,
        steps: 0,
        scores: EditScores::default(),
    };
    for (e, reference) in references.iter().enumerate() {
        let mut state = DenoiseState::new(p, &edits.request(e, step_cache))?;
        let started = Instant::now();
        while !state.is_done() {
            stepper.step(p, &mut [&mut state], &[cache.cloned()])?;
        }
        way.seconds += started.elapsed().as_secs_f64();
        way.skipped += state.skipped_steps();
        way.steps += state.progress().1;
        let b = edits.composite(e, &state, p)?;
        way.scores.add(reference, &b, &edits.pixel_mask(e))?;
    }
    Ok(way)
}

/// The step-caching figures (see the module documentation).
pub fn run(opts: &MaskAwareOptions, report: &mut Report) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let model = LoadedModel::load(&opts.tiny.dir, Device::Cpu, opts.tiny.kind)
        .with_context(|| format!("loading {}", opts.tiny.dir.display()))?;
    let p = model.pipeline();
    let edits = QualityEdits::draw(opts, &p);
    let entry = edits.capture(&p, KvFormat::Prepared, CacheDtype::Bf16)?;
    // The references, timed: full compute on the same serving path, after one untimed edit
    // (the first steps after loading pay for allocations later ones do not).
    let mut stepper = CachedStepper::new(CacheSettings::default(), None)?;
    let mut warm = DenoiseState::new(&p, &edits.request(0, None))?;
    while !warm.is_done() {
        stepper.step(&p, &mut [&mut warm], &[None])?;
    }
    let mut references = Vec::with_capacity(edits.edits.len());
    let mut full_s = 0.0;
    for e in 0..edits.edits.len() {
        let mut state = DenoiseState::new(&p, &edits.request(e, None))?;
        let started = Instant::now();
        while !state.is_done() {
            stepper.step(&p, &mut [&mut state], &[None])?;
        }
        full_s += started.elapsed().as_secs_f64();
        references.push(edits.composite(e, &state, &p)?);
    }
    let describe = |name: &str, way: &Way| -> Value {
        let speedup = full_s / way.seconds.max(1e-9);
        let skipped = way.skipped as f64 / way.steps.max(1) as f64;
        report.say(format!(
            "step caching, {name} ({} edits): {speedup:.2}x full compute's time, {:.0}% of \
             steps skipped; {}",
            references.len(),
            100.0 * skipped,
            way.scores.summary()
        ));
        let mut figures = way.scores.figures();
        figures["speedup"] = json!(speedup);
        figures["skipped_fraction"] = json!(skipped);
        figures
    };
    let mask_aware = run_way(&p, &edits, &references, Some(&entry), None)?;
    let mask_aware = describe("mask-aware (bf16 K/V)", &mask_aware);
    let mut sweep = Map::new();
    let (mut default, mut first_block) = ((Value::Null, Value::Null), Value::Null);
    for t in SWEEP {
        let tea = Some((CacheMethod::TeaCache, t));
        let alone = run_way(&p, &edits, &references, None, tea)?;
        let alone = describe(&format!("TeaCache at {t}"), &alone);
        let both = run_way(&p, &edits, &references, Some(&entry), tea)?;
        let both = describe(&format!("mask-aware + TeaCache at {t}"), &both);
        let fb = Some((CacheMethod::FirstBlock, t));
        let fb = run_way(&p, &edits, &references, None, fb)?;
        let fb = describe(&format!("first-block caching at {t}"), &fb);
        if t == DEFAULT_CACHE_THRESHOLD {
            default = (alone.clone(), both.clone());
        }
        if t == DEFAULT_FIRST_BLOCK_THRESHOLD {
            first_block = fb.clone();
        }
        sweep.insert(
            format!("{t}"),
            json!({"teacache": alone, "mask_aware_teacache": both, "first_block": fb}),
        );
    }
    anyhow::ensure!(
        !default.0.is_null() && !first_block.is_null(),
        "the sweep must hold each method's default threshold"
    );
    report.insert("fbcache_threshold", json!(DEFAULT_FIRST_BLOCK_THRESHOLD));
    report.insert("fbcache_speedup", first_block["speedup"].clone());
    report.insert(
        "fbcache_skipped_fraction",
        first_block["skipped_fraction"].clone(),
    );
    report.insert(
        "ssim_box_mean_fbcache",
        first_block["ssim_box_mean"].clone(),
    );
    report.insert(
        "psnr_box_mean_fbcache",
        first_block["psnr_box_mean"].clone(),
    );
    report.insert("ssim_mean_fbcache", first_block["ssim_mean"].clone());
    let (alone, both) = default;
    report.insert("teacache_threshold", json!(DEFAULT_CACHE_THRESHOLD));
    report.insert("teacache_speedup", alone["speedup"].clone());
    report.insert(
        "teacache_skipped_fraction",
        alone["skipped_fraction"].clone(),
    );
    report.insert("ssim_box_mean_teacache", alone["ssim_box_mean"].clone());
    report.insert("psnr_box_mean_teacache", alone["psnr_box_mean"].clone());
    report.insert("ssim_mean_teacache", alone["ssim_mean"].clone());
    report.insert("mask_aware_teacache_speedup", both["speedup"].clone());
    report.insert(
        "ssim_box_mean_mask_aware_teacache",
        both["ssim_box_mean"].clone(),
    );
    report.insert("mask_aware_speedup_tiny", mask_aware["speedup"].clone());
    report.insert("step_caching_by_threshold", Value::Object(sweep));
    report.insert("step_caching_mask_aware_alone", mask_aware);
    Ok(())
}
