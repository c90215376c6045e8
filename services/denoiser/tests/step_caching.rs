//! Step caching (TeaCache) on the serving path, `CachedStepper` (random tiny model): a
//! request's `cache_threshold` is decided before the loader starts, so a mask-aware edit whose
//! step reuses its residual loads no cache block for it; threshold 0 is bit for bit no caching;
//! a batch of caching and plain requests reports the reused rows. A first-block-caching edit
//! of a template computes in full (it reads no cache) and reports its reused rows too.
use diffmesh_denoiser::cached_step::{CacheSettings, CachedStepper, CaptureSink, PrefixPolicy};
use diffmesh_denoiser::templates::{CacheLayout, TemplateEntry};
use diffmesh_model::flux::kv_codec::CacheDtype;
use diffmesh_model::flux::step_cache::CacheMethod;
use diffmesh_model::flux::KvFormat;
use diffmesh_model::noise_scheduler::{
    FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig,
};
use diffmesh_model::pipeline::stepper::{DenoiseState, EditSpec, StepRequest};
use diffmesh_model::pipeline::template::{capture_state, TemplateSpec};
use diffmesh_model::pipeline::FluxPipeline;
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::tiny::model::{scheduler_config_json, TinyModel};
use std::sync::Arc;

const STEPS: usize = 6;
const TEMPLATE_SEED: u64 = 31;

fn scheduler() -> FlowMatchEulerDiscreteScheduler {
    let cfg: FlowMatchEulerDiscreteSchedulerConfig =
        serde_json::from_value(scheduler_config_json()).unwrap();
    FlowMatchEulerDiscreteScheduler::new(cfg).unwrap()
}

fn template() -> Tensor {
    Tensor::linspace(-1.0, 1.0, 3 * 64 * 64, (Kind::Float, Device::Cpu)).view([1, 3, 64, 64])
}

fn capture(p: &FluxPipeline<'_>) -> Arc<TemplateEntry> {
    let spec = TemplateSpec {
        template: template(),
        prompt: "a blue background".into(),
        seed: TEMPLATE_SEED,
        steps: STEPS,
        guidance_scale: 1.0,
    };
    let mut state = capture_state(p, &spec).unwrap();
    let mut sink = CaptureSink::new(CacheLayout::One(KvFormat::Prepared), CacheDtype::F32);
    while !state.is_done() {
        state.capture_step(p, &mut sink).unwrap();
        sink.end_step();
    }
    Arc::new(
        sink.finish("tpl".into(), p.transformer.num_blocks())
            .unwrap(),
    )
}

/// An edit repainting the top quarter of the token grid, or a generation without `edit`.
fn request(edit: bool, threshold: Option<f64>) -> StepRequest {
    StepRequest {
        prompt: "a red circle".into(),
        seed: 5,
        height: 64,
        width: 64,
        steps: STEPS,
        guidance_scale: 1.0,
        edit: edit.then(|| EditSpec {
            template: template(),
            token_mask: Tensor::arange(256, (Kind::Int64, Device::Cpu)).lt(64),
            strength: 1.0,
            template_seed: Some(TEMPLATE_SEED),
        }),
        control: None,
        true_cfg: None,
        cache_threshold: threshold,
        cache_method: Default::default(),
    }
}

/// Run `requests` together to the end; their latents, the reused rows the steps reported and
/// the cache blocks the loader read.
fn run(
    p: &FluxPipeline<'_>,
    entry: &Arc<TemplateEntry>,
    requests: &[StepRequest],
) -> (Vec<Tensor>, usize, u64) {
    let settings = CacheSettings {
        layout: CacheLayout::One(KvFormat::Prepared),
        dtype: CacheDtype::F32,
        lookahead: 2,
        prefix: PrefixPolicy::Fixed(0),
    };
    let mut stepper = CachedStepper::new(settings, None).unwrap();
    let mut states: Vec<DenoiseState> = requests
        .iter()
        .map(|r| DenoiseState::new(p, r).unwrap())
        .collect();
    let caches: Vec<_> = requests
        .iter()
        .map(|r| r.edit.as_ref().map(|_| entry.clone()))
        .collect();
    let mut reused = 0;
    while states.iter().any(|s| !s.is_done()) {
        let mut refs: Vec<&mut DenoiseState> = states.iter_mut().collect();
        reused += stepper.step(p, &mut refs, &caches).unwrap().reused;
    }
    let latents = states.iter().map(|s| s.latents().shallow_clone()).collect();
    (latents, reused, stepper.load_stats().blocks)
}

#[test]
fn reused_steps_load_nothing_and_threshold_zero_changes_nothing() {
    let model = TinyModel::random_for_tests(17, Device::Cpu).unwrap();
    let scheduler = scheduler();
    let p = model.pipeline(&scheduler);
    let entry = capture(&p);
    let blocks = p.transformer.num_blocks() as u64;

    let (plain, reused, loaded) = run(&p, &entry, &[request(true, None)]);
    assert_eq!((reused, loaded), (0, STEPS as u64 * blocks));
    let (zero, reused, loaded) = run(&p, &entry, &[request(true, Some(0.0))]);
    assert_eq!((reused, loaded), (0, STEPS as u64 * blocks));
    assert!(zero[0].equal(&plain[0]), "threshold 0 changed the edit");

    // Every middle step reuses: only the first and the last step load their cache.
    let (lazy, reused, loaded) = run(&p, &entry, &[request(true, Some(1e9))]);
    assert_eq!((reused, loaded), (STEPS - 2, 2 * blocks));
    let change = (&lazy[0] - &plain[0]).abs().max().double_value(&[]);
    assert!(change > 1e-5 && change.is_finite(), "{change}");

    // Beside a plain generation and a plain edit, in one batch each step.
    let mixed = [
        request(true, Some(1e9)),
        request(false, None),
        request(true, None),
    ];
    let (together, reused, loaded) = run(&p, &entry, &mixed);
    assert_eq!(reused, STEPS - 2);
    assert_eq!(loaded, (2 + STEPS as u64) * blocks);
    let err = (&together[0] - &lazy[0]).abs().max().double_value(&[]);
    assert!(err < 1e-4, "{err}");
    let err = (&together[2] - &plain[0]).abs().max().double_value(&[]);
    assert!(err < 1e-4, "{err}");
}

/// First-block caching runs every token through the first block: its edit of a template runs
/// full-compute steps (no cache block loaded) beside a mask-aware edit, ends as it does alone,
/// and its steps after the first reuse.
#[test]
fn a_first_block_caching_edit_computes_in_full_and_reports_its_reuse() {
    let model = TinyModel::random_for_tests(17, Device::Cpu).unwrap();
    let scheduler = scheduler();
    let p = model.pipeline(&scheduler);
    let entry = capture(&p);
    let blocks = p.transformer.num_blocks() as u64;
    let first_block = || {
        let mut r = request(true, Some(1e9));
        r.cache_method = CacheMethod::FirstBlock;
        r
    };
    let (alone, reused, loaded) = run(&p, &entry, &[first_block()]);
    assert_eq!((reused, loaded), (STEPS - 1, 0));
    let (together, reused, loaded) = run(&p, &entry, &[first_block(), request(true, None)]);
    assert_eq!((reused, loaded), (STEPS - 1, STEPS as u64 * blocks));
    let err = (&together[0] - &alone[0]).abs().max().double_value(&[]);
    assert!(err < 1e-4, "{err}");
}
