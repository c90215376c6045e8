//! Mask-aware edits through the step-level API: template capture, cached steps, packing of
//! requests at different steps (random tiny model, fp32 CPU).
use diffmesh_model::flux::{KvCache, KvFormat};
use diffmesh_model::noise_scheduler::{
    FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig,
};
use diffmesh_model::pipeline::stepper::{
    step_batch_modes, DenoiseState, EditSpec, StepMode, StepRequest, TrueCfg,
};
use diffmesh_model::pipeline::template::{capture_template, TemplateKv, TemplateSpec};
use diffmesh_model::pipeline::FluxPipeline;
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::tiny::model::{scheduler_config_json, TinyModel};
use std::cell::Cell;
use std::sync::{Mutex, MutexGuard};

const SIZE: i64 = 64;
const TOKENS: i64 = 256;
const TEMPLATE_SEED: u64 = 99;

/// Tests draw templates and masks from torch's global generator: they take turns, so a test's
/// draws do not interleave with another thread's.
static TURN: Mutex<()> = Mutex::new(());

struct Fixture {
    _turn: MutexGuard<'static, ()>,
    model: TinyModel,
    scheduler: FlowMatchEulerDiscreteScheduler,
    template: Tensor,
}

impl Fixture {
    fn new() -> Self {
        let turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let model = TinyModel::random_for_tests(5, Device::Cpu).unwrap();
        let cfg: FlowMatchEulerDiscreteSchedulerConfig =
            serde_json::from_value(scheduler_config_json()).unwrap();
        diffmesh_model::tch::manual_seed(21);
        Self {
            _turn: turn,
            model,
            scheduler: FlowMatchEulerDiscreteScheduler::new(cfg).unwrap(),
            template: Tensor::rand([1, 3, SIZE, SIZE], (Kind::Float, Device::Cpu)) * 2.0 - 1.0,
        }
    }

    fn pipe(&self) -> FluxPipeline<'_> {
        self.model.pipeline(&self.scheduler)
    }

    fn capture(&self, steps: usize, format: KvFormat) -> TemplateKv {
        let mut kv = TemplateKv::new(format);
        let spec = TemplateSpec {
            template: self.template.shallow_clone(),
            prompt: "a blue background".into(),
            seed: TEMPLATE_SEED,
            steps,
            guidance_scale: 1.0,
        };
        let n = capture_template(&self.pipe(), &spec, &mut kv).unwrap();
        assert_eq!(n, steps);
        assert_eq!(kv.steps.len(), steps);
        kv
    }

    fn edit(&self, prompt: &str, seed: u64, steps: usize, mask: &Tensor) -> DenoiseState {
        self.guided_edit(prompt, seed, steps, mask, None)
    }

    fn guided_edit(
        &self,
        prompt: &str,
        seed: u64,
        steps: usize,
        mask: &Tensor,
        true_cfg: Option<TrueCfg>,
    ) -> DenoiseState {
        let req = self.edit_request(prompt, seed, steps, mask, true_cfg);
        DenoiseState::new(&self.pipe(), &req).unwrap()
    }

    /// An edit with TeaCache at `threshold`.
    fn caching_edit(&self, prompt: &str, seed: u64, mask: &Tensor, threshold: f64) -> DenoiseState {
        let mut req = self.edit_request(prompt, seed, 5, mask, None);
        req.cache_threshold = Some(threshold);
        DenoiseState::new(&self.pipe(), &req).unwrap()
    }

    fn edit_request(
        &self,
        prompt: &str,
        seed: u64,
        steps: usize,
        mask: &Tensor,
        true_cfg: Option<TrueCfg>,
    ) -> StepRequest {
        StepRequest {
            true_cfg,
            cache_threshold: None,
            cache_method: Default::default(),
            control: None,
            prompt: prompt.into(),
            seed,
            height: SIZE,
            width: SIZE,
            steps,
            guidance_scale: 1.0,
            edit: Some(EditSpec {
                template: self.template.shallow_clone(),
                token_mask: mask.shallow_clone(),
                strength: 1.0,
                template_seed: Some(TEMPLATE_SEED),
            }),
        }
    }
}

/// A token mask repainting `count` tokens chosen by `seed`.
fn mask(count: i64, seed: i64) -> Tensor {
    diffmesh_model::tch::manual_seed(seed);
    let idx = Tensor::randperm(TOKENS, (Kind::Int64, Device::Cpu)).narrow(0, 0, count);
    Tensor::zeros([TOKENS], (Kind::Bool, Device::Cpu)).index_fill(0, &idx, 1)
}

fn max_err(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// A cache that holds the engine's streamed caches to the `KvCache` contract: each block is
/// handed out once, in order.
struct OnceInOrder<'c> {
    inner: &'c dyn KvCache,
    next: Cell<usize>,
}

impl KvCache for OnceInOrder<'_> {
    fn block_kv(&self, block: usize) -> diffmesh_model::Result<(Tensor, Tensor)> {
        assert_eq!(block, self.next.get(), "blocks read once, in order");
        self.next.set(block + 1);
        self.inner.block_kv(block)
    }

    fn format(&self) -> KvFormat {
        self.inner.format()
    }
}

/// Step every state to the end, each with the cache of its own current step.
fn run_cached(f: &Fixture, kv: &TemplateKv, states: &mut [&mut DenoiseState], prefix: usize) {
    while states.iter().any(|s| !s.is_done()) {
        let caches: Vec<OnceInOrder> = states
            .iter()
            .map(|s| OnceInOrder {
                inner: kv.step(s.step_index().min(kv.steps.len() - 1)).unwrap(),
                next: Cell::new(prefix),
            })
            .collect();
        let modes: Vec<StepMode> = caches.iter().map(|c| StepMode::Cached(c)).collect();
        step_batch_modes(&f.pipe(), states, &modes, prefix).unwrap();
    }
}

fn run_full(f: &Fixture, state: &mut DenoiseState) {
    while !state.is_done() {
        state.step(&f.pipe()).unwrap();
    }
}

#[test]
fn every_token_masked_equals_full_compute() {
    let f = Fixture::new();
    let all = Tensor::ones([TOKENS], (Kind::Bool, Device::Cpu));
    let empty = TemplateKv::new(KvFormat::Raw); // never read when every token is computed
    let mut full = f.edit("a red circle", 3, 4, &all);
    run_full(&f, &mut full);
    let mut cached = f.edit("a red circle", 3, 4, &all);
    while !cached.is_done() {
        let cache = diffmesh_model::flux::CapturedKv::new(KvFormat::Raw);
        step_batch_modes(
            &f.pipe(),
            &mut [&mut cached],
            &[StepMode::Cached(&cache)],
            0,
        )
        .unwrap();
    }
    let err = max_err(cached.latents(), full.latents());
    println!("mask 1.0: max abs err {err:.3e}");
    assert!(err <= 1e-5, "{err}");
    assert!(empty.steps.is_empty());
}

/// At the first step the edit's unmasked inputs are pure template noise, exactly what the capture
/// saw; with the template's prompt the cached K/V are then exact, so the first cached step equals
/// the first full step. This pins down capture inputs, timesteps, noise seeds and step indexing.
#[test]
fn first_cached_step_with_the_templates_prompt_is_exact() {
    let f = Fixture::new();
    for format in [KvFormat::Raw, KvFormat::Prepared] {
        let kv = f.capture(4, format);
        let m = mask(40, 1);
        let mut full = f.edit("a blue background", TEMPLATE_SEED, 4, &m);
        full.step(&f.pipe()).unwrap();
        let mut cached = f.edit("a blue background", TEMPLATE_SEED, 4, &m);
        let modes = [StepMode::Cached(kv.step(0).unwrap())];
        step_batch_modes(&f.pipe(), &mut [&mut cached], &modes, 0).unwrap();
        let err = max_err(cached.latents(), full.latents());
        println!("{format:?} first step: max abs err {err:.3e}");
        assert!(err <= 1e-5, "{format:?}: {err}");

        // The wrong step's cache gives a different result: the step index matters.
        let mut wrong = f.edit("a blue background", TEMPLATE_SEED, 4, &m);
        let modes = [StepMode::Cached(kv.step(2).unwrap())];
        step_batch_modes(&f.pipe(), &mut [&mut wrong], &modes, 0).unwrap();
        assert!(max_err(wrong.latents(), full.latents()) > 1e-4);
    }
}

/// Requests with different masks, prompts and seeds, at different steps, packed in one batch:
/// each reads its own step's cache and ends exactly where it ends alone; full prefixes of any
/// length agree too.
#[test]
fn packed_requests_at_different_steps_match_each_alone() {
    let f = Fixture::new();
    let kv = f.capture(5, KvFormat::Prepared);
    let specs = [
        ("a red circle", 1u64, mask(30, 2)),
        ("a green square", 2, mask(90, 3)),
        ("x", 3, mask(7, 4)),
    ];
    let n_blocks = f.model.transformer.num_blocks();
    for prefix in [0, 1, n_blocks] {
        let alone: Vec<Tensor> = specs
            .iter()
            .map(|(p, s, m)| {
                let mut st = f.edit(p, *s, 5, m);
                run_cached(&f, &kv, &mut [&mut st], prefix);
                st.latents().shallow_clone()
            })
            .collect();
        let mut states: Vec<DenoiseState> =
            specs.iter().map(|(p, s, m)| f.edit(p, *s, 5, m)).collect();
        // Stagger: the second request starts two steps ahead, the third one step ahead.
        for (i, ahead) in [(1usize, 2usize), (2, 1)] {
            for _ in 0..ahead {
                let step = states[i].step_index();
                let modes = [StepMode::Cached(kv.step(step).unwrap())];
                step_batch_modes(&f.pipe(), &mut [&mut states[i]], &modes, prefix).unwrap();
            }
        }
        let mut refs: Vec<&mut DenoiseState> = states.iter_mut().collect();
        run_cached(&f, &kv, &mut refs, prefix);
        for (i, (s, a)) in states.iter().zip(&alone).enumerate() {
            let err = max_err(s.latents(), a);
            println!("prefix {prefix} request {i}: max abs err {err:.3e}");
            assert!(err <= 1e-4, "prefix {prefix} request {i}: {err}");
        }
    }
}

/// Step caching combines with mask-aware edits: at threshold 0 a cached edit is bit for bit
/// the uncached one; a threshold no change reaches skips every middle step (reading no cache
/// block there) and changes only the masked tokens, packed beside a computing edit or alone.
#[test]
fn step_caching_combines_with_mask_aware_edits() {
    let f = Fixture::new();
    let kv = f.capture(5, KvFormat::Prepared);
    let m = mask(40, 5);
    let mut plain = f.edit("a red circle", 1, 5, &m);
    run_cached(&f, &kv, &mut [&mut plain], 1);
    let mut zero = f.caching_edit("a red circle", 1, &m, 0.0);
    run_cached(&f, &kv, &mut [&mut zero], 1);
    assert!(zero.latents().equal(plain.latents()));
    assert_eq!(zero.skipped_steps(), 0);

    let mut lazy_alone = f.caching_edit("a red circle", 1, &m, 1e9);
    run_cached(&f, &kv, &mut [&mut lazy_alone], 1);
    assert_eq!(lazy_alone.skipped_steps(), 3);
    let change = max_err(lazy_alone.latents(), plain.latents());
    assert!(change > 1e-4 && change.is_finite(), "{change}");
    let keep = m.logical_not().to_kind(Kind::Float).view([1, TOKENS, 1]);
    let outside = max_err(&(lazy_alone.latents() * &keep), &(plain.latents() * &keep));
    assert_eq!(outside, 0.0, "skipping changed unmasked tokens");

    let mut lazy = f.caching_edit("a red circle", 1, &m, 1e9);
    let mut other = f.edit("a green square", 2, 5, &mask(90, 6));
    run_cached(&f, &kv, &mut [&mut lazy, &mut other], 1);
    let mut other_alone = f.edit("a green square", 2, 5, &mask(90, 6));
    run_cached(&f, &kv, &mut [&mut other_alone], 1);
    assert!(max_err(lazy.latents(), lazy_alone.latents()) <= 1e-4);
    assert!(max_err(other.latents(), other_alone.latents()) <= 1e-4);
}

#[test]
fn cached_mode_on_a_generation_names_the_field() {
    let f = Fixture::new();
    let kv = f.capture(2, KvFormat::Raw);
    let req = StepRequest {
        true_cfg: None,
        cache_threshold: None,
        cache_method: Default::default(),
        control: None,
        prompt: "x".into(),
        seed: 1,
        height: SIZE,
        width: SIZE,
        steps: 2,
        guidance_scale: 1.0,
        edit: None,
    };
    let mut st = DenoiseState::new(&f.pipe(), &req).unwrap();
    let modes = [StepMode::Cached(kv.step(0).unwrap())];
    let err = step_batch_modes(&f.pipe(), &mut [&mut st], &modes, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("modes"), "{err}");
    let missing = kv.step(7).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(missing.contains("step 7 missing"), "{missing}");
}

fn cfg(negative: &str, scale: f64) -> Option<TrueCfg> {
    Some(TrueCfg {
        negative_prompt: negative.into(),
        scale,
    })
}

/// With every token masked a guided mask-aware step reads no cache: it must equal the guided
/// full-compute step, which proves both rows are computed and combined on the packed path.
#[test]
fn guided_edit_with_every_token_masked_equals_guided_full_compute() {
    let f = Fixture::new();
    let all = Tensor::ones([TOKENS], (Kind::Bool, Device::Cpu));
    let mut full = f.guided_edit("a red circle", 3, 4, &all, cfg("", 4.0));
    run_full(&f, &mut full);
    let mut cached = f.guided_edit("a red circle", 3, 4, &all, cfg("", 4.0));
    let cache = diffmesh_model::flux::CapturedKv::new(KvFormat::Raw);
    while !cached.is_done() {
        let modes = [StepMode::Cached(&cache)];
        step_batch_modes(&f.pipe(), &mut [&mut cached], &modes, 0).unwrap();
    }
    let err = max_err(cached.latents(), full.latents());
    assert!(err <= 1e-5, "{err}");
    let mut plain = f.edit("a red circle", 3, 4, &all);
    run_full(&f, &mut plain);
    assert!(max_err(plain.latents(), full.latents()) > 1e-3);
}

/// Guided edits (two rows reading the same step's cache) packed with plain ones at different
/// steps end where each ends alone, with and without a full prefix.
#[test]
fn guided_edits_packed_with_plain_ones_match_each_alone() {
    let f = Fixture::new();
    let kv = f.capture(4, KvFormat::Prepared);
    let specs = [
        ("a red circle", 1u64, mask(30, 2), cfg("", 3.0)),
        ("a green square", 2, mask(90, 3), None),
        ("x", 3, mask(7, 4), cfg("a blue background", 5.0)),
    ];
    for prefix in [0, 1] {
        let alone: Vec<Tensor> = specs
            .iter()
            .map(|(p, s, m, c)| {
                let mut st = f.guided_edit(p, *s, 4, m, c.clone());
                run_cached(&f, &kv, &mut [&mut st], prefix);
                st.latents().shallow_clone()
            })
            .collect();
        let mut states: Vec<DenoiseState> = specs
            .iter()
            .map(|(p, s, m, c)| f.guided_edit(p, *s, 4, m, c.clone()))
            .collect();
        let modes = [StepMode::Cached(kv.step(0).unwrap())];
        step_batch_modes(&f.pipe(), &mut [&mut states[2]], &modes, prefix).unwrap();
        let mut refs: Vec<&mut DenoiseState> = states.iter_mut().collect();
        run_cached(&f, &kv, &mut refs, prefix);
        for (i, (s, a)) in states.iter().zip(&alone).enumerate() {
            let err = max_err(s.latents(), a);
            assert!(err <= 1e-4, "prefix {prefix} request {i}: {err}");
        }
    }
}

/// A guided and a plain edit stepped in two halves (`masked_step_rows`, the mask-aware
/// forward split over 2 and 3 CPU ranks, `apply_masked_velocities`) end where the engine's
/// one-device cached steps end: what a denoiser's elastic ranks do with an edit.
#[test]
fn an_edit_stepped_on_ranks_equals_its_cached_steps() {
    use diffmesh_model::flux::{CapturedKv, FluxTransformer};
    use diffmesh_model::pipeline::stepper::MaskedRow;
    use diffmesh_parallel::{Group, RankConfig, Ranks};
    use std::sync::Arc;
    let f = Fixture::new();
    let kv = f.capture(3, KvFormat::Prepared);
    // Every rank loads the fixture's weights, as a device's rank would.
    let dir = tempfile::tempdir().unwrap();
    f.model.save(dir.path(), None).unwrap();
    let transformer_dir = Arc::new(diffmesh_model::flux::component_dir(dir.path()));
    for (prompt, seed, m, c) in [
        ("a red circle", 1u64, mask(40, 2), cfg("", 3.0)),
        ("a green square", 2, mask(5, 3), None),
    ] {
        let mut reference = f.guided_edit(prompt, seed, 3, &m, c.clone());
        run_cached(&f, &kv, &mut [&mut reference], 0);
        for ranks in [2usize, 3] {
            let world = Ranks::start(RankConfig::new(ranks)).unwrap();
            let mut st = f.guided_edit(prompt, seed, 3, &m, c.clone());
            while !st.is_done() {
                let step = st.step_index();
                let rows = st.masked_step_rows().unwrap();
                // Each rank gets its own handles on the rows and the step's cache (tensors are
                // shared by reference count, not copied).
                let outs: Vec<_> = (0..ranks)
                    .map(|rank| {
                        let rows: Vec<MaskedRow> =
                            rows.iter().map(MaskedRow::shallow_clone).collect();
                        let cache = CapturedKv {
                            blocks: kv.steps[step]
                                .blocks
                                .iter()
                                .map(|(k, v)| (k.shallow_clone(), v.shallow_clone()))
                                .collect(),
                            format: kv.format,
                        };
                        let dir = transformer_dir.clone();
                        world.submit(rank, move |ep| {
                            let (model, _vs) =
                                FluxTransformer::load(&dir, Device::Cpu, Kind::Float).unwrap();
                            let reqs: Vec<_> = rows.iter().map(|r| r.request(&cache)).collect();
                            let group =
                                Group::new(1, &(0..ranks).collect::<Vec<_>>(), ep.rank(), ranks)
                                    .unwrap();
                            diffmesh_model::tch::no_grad(|| {
                                model.forward_masked_sequence_parallel(&reqs, ep, &group)
                            })
                            .unwrap()
                        })
                    })
                    .collect();
                let mut outs = outs.into_iter().map(|rx| rx.recv().expect("the rank ran"));
                let velocities = outs.next().unwrap();
                outs.for_each(drop);
                st.apply_masked_velocities(velocities).unwrap();
            }
            let err = max_err(st.latents(), reference.latents());
            assert!(err <= 1e-4, "{prompt} on {ranks} ranks: {err}");
        }
    }
}
