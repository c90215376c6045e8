use super::*;
use crate::noise_scheduler::{
    FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig,
};
use crate::pipeline::{inpaint, text_to_image, InpaintInputs};
use crate::tiny::model::TinyModel;
use tch::Device;

fn model() -> (TinyModel, FlowMatchEulerDiscreteScheduler) {
    let m = TinyModel::random_for_tests(7, Device::Cpu).unwrap();
    let cfg: FlowMatchEulerDiscreteSchedulerConfig =
        serde_json::from_value(crate::tiny::model::scheduler_config_json()).unwrap();
    (m, FlowMatchEulerDiscreteScheduler::new(cfg).unwrap())
}

fn req(prompt: &str, seed: u64, steps: usize) -> StepRequest {
    StepRequest {
        true_cfg: None,
        cache_threshold: None,
        cache_method: Default::default(),
        control: None,
        prompt: prompt.into(),
        seed,
        height: 64,
        width: 64,
        steps,
        guidance_scale: 1.0,
        edit: None,
    }
}

/// The pipeline functions' options for [`req`]'s requests.
fn opts(steps: usize) -> GenerateOptions {
    GenerateOptions {
        height: 64,
        width: 64,
        steps,
        ..Default::default()
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    a.f_sub(b).unwrap().abs().max().double_value(&[])
}

#[test]
fn stepping_alone_matches_text_to_image() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let mut st = DenoiseState::new(&p, &req("a red circle", 3, 4)).unwrap();
    while !st.is_done() {
        st.step(&p).unwrap();
    }
    assert_eq!(st.progress(), (4, 4));
    let opts = opts(4);
    let reference = text_to_image(
        &p,
        &[GenerationRequest {
            prompt: "a red circle".into(),
            seed: 3,
        }],
        &opts,
        None,
    )
    .unwrap();
    let diff = max_diff(st.latents(), &reference.latents);
    assert!(diff < 1e-5, "max diff {diff}");
}

#[test]
fn batch_at_different_steps_matches_alone() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let run_alone = |r: StepRequest| {
        let mut st = DenoiseState::new(&p, &r).unwrap();
        while !st.is_done() {
            st.step(&p).unwrap();
        }
        st.latents().shallow_clone()
    };
    let a_alone = run_alone(req("a red circle", 1, 4));
    let b_alone = run_alone(req("a blue square", 2, 6));
    let mut a = DenoiseState::new(&p, &req("a red circle", 1, 4)).unwrap();
    let mut b = DenoiseState::new(&p, &req("a blue square", 2, 6)).unwrap();
    b.step(&p).unwrap(); // b is one step ahead
    while !a.is_done() || !b.is_done() {
        step_batch(&p, &mut [&mut a, &mut b]).unwrap();
    }
    for (x, y) in [(a.latents(), &a_alone), (b.latents(), &b_alone)] {
        let diff = x.f_sub(y).unwrap().abs().max().double_value(&[]);
        assert!(diff < 1e-4, "max diff {diff}");
    }
}

#[test]
fn edit_matches_inpaint_pipeline() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let template = Tensor::rand([1, 3, 64, 64], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
    // Repaint the top-left quarter: pixel mask and the matching 16x16 token mask.
    let mask = Tensor::zeros([1, 1, 64, 64], (Kind::Float, Device::Cpu));
    let _ = mask.narrow(2, 0, 32).narrow(3, 0, 32).fill_(1.0);
    let token_mask = crate::packing::token_mask(&mask, 4).unwrap().view([-1]);
    let mut r = req("a green triangle", 5, 4);
    r.edit = Some(EditSpec {
        template: template.shallow_clone(),
        token_mask,
        strength: 1.0,
        template_seed: None,
    });
    let mut st = DenoiseState::new(&p, &r).unwrap();
    while !st.is_done() {
        st.step(&p).unwrap();
    }
    let opts = opts(4);
    let requests = [GenerationRequest {
        prompt: "a green triangle".into(),
        seed: 5,
    }];
    let reference = inpaint(
        &p,
        &InpaintInputs {
            requests: &requests,
            templates: &template,
            masks: &mask,
            strength: 1.0,
        },
        &opts,
        None,
    )
    .unwrap();
    let diff = max_diff(st.latents(), &reference.latents);
    assert!(diff < 1e-5, "max diff {diff}");
}

#[test]
fn bad_edit_inputs_name_the_field() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let mut r = req("x", 1, 2);
    r.edit = Some(EditSpec {
        template: Tensor::zeros([1, 3, 32, 32], (Kind::Float, Device::Cpu)),
        token_mask: Tensor::zeros([256], (Kind::Bool, Device::Cpu)),
        strength: 1.0,
        template_seed: None,
    });
    let err = DenoiseState::new(&p, &r).err().unwrap().to_string();
    assert!(err.contains("template"), "{err}");
    r.edit = Some(EditSpec {
        template: Tensor::zeros([1, 3, 64, 64], (Kind::Float, Device::Cpu)),
        token_mask: Tensor::zeros([10], (Kind::Bool, Device::Cpu)),
        strength: 1.0,
        template_seed: None,
    });
    let err = DenoiseState::new(&p, &r).err().unwrap().to_string();
    assert!(err.contains("token_mask"), "{err}");
}

#[test]
fn cached_preparation_steps_exactly_like_fresh_preparation() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let template = Tensor::rand([1, 3, 64, 64], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
    let edit = |prompt: &str, seed: u64, every: i64| {
        let mut r = req(prompt, seed, 3);
        r.edit = Some(EditSpec {
            template: template.shallow_clone(),
            token_mask: Tensor::arange(256, (Kind::Int64, Device::Cpu))
                .remainder(every)
                .eq(0),
            strength: 1.0,
            template_seed: Some(9),
        });
        r
    };
    let run = |mut st: DenoiseState| {
        while !st.is_done() {
            st.step(&p).unwrap();
        }
        st.latents().shallow_clone()
    };
    let mut cache = ConditioningCache::new(1 << 20);
    let requests = [
        edit("a red circle", 1, 3),
        edit("a red circle", 2, 5),
        edit("a blue square", 3, 2),
        edit("a red circle", 4, 7),
    ];
    for r in &requests {
        let fresh = run(DenoiseState::new(&p, r).unwrap());
        let cached = run(DenoiseState::new_cached(&p, r, &mut cache, Some("tpl-a")).unwrap());
        assert!(fresh.equal(&cached), "seed {}", r.seed);
    }
    let c = cache.counts();
    assert_eq!((c.prompts.hits, c.prompts.misses), (2, 2));
    assert_eq!((c.template_latents.hits, c.template_latents.misses), (3, 1));
    assert_eq!((c.template_noise.hits, c.template_noise.misses), (3, 1));
    // A template without a key is never shared; a budget of 0 keeps nothing.
    let mut none = ConditioningCache::new(0);
    for r in &requests[..2] {
        let fresh = run(DenoiseState::new(&p, r).unwrap());
        let cached = run(DenoiseState::new_cached(&p, r, &mut none, None).unwrap());
        assert!(fresh.equal(&cached));
    }
    let c = none.counts();
    assert_eq!(
        (
            c.prompts.hits,
            c.template_latents.hits,
            c.template_latents.misses
        ),
        (0, 0, 0)
    );
    assert_eq!(c.prompts.bytes + c.template_noise.bytes, 0);
}

fn guided(prompt: &str, seed: u64, steps: usize, negative: &str, scale: f64) -> StepRequest {
    let mut r = req(prompt, seed, steps);
    r.true_cfg = Some(TrueCfg {
        negative_prompt: negative.into(),
        scale,
    });
    r
}

fn run_alone(p: &FluxPipeline<'_>, r: &StepRequest) -> Tensor {
    let mut st = DenoiseState::new(p, r).unwrap();
    while !st.is_done() {
        st.step(p).unwrap();
    }
    st.latents().shallow_clone()
}

#[test]
fn guided_stepping_alone_matches_text_to_image_with_true_cfg() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let stepped = run_alone(&p, &guided("a red circle", 3, 4, "", 4.0));
    let opts = GenerateOptions {
        true_cfg_scale: 4.0,
        negative_prompt: Some(String::new()),
        ..opts(4)
    };
    let requests = [GenerationRequest {
        prompt: "a red circle".into(),
        seed: 3,
    }];
    let reference = text_to_image(&p, &requests, &opts, None).unwrap();
    let diff = max_diff(&stepped, &reference.latents);
    assert!(diff < 1e-5, "max diff {diff}");
    // Guidance changes the result, and the scale matters.
    let plain = run_alone(&p, &req("a red circle", 3, 4));
    assert!(max_diff(&stepped, &plain) > 1e-3);
    let weaker = run_alone(&p, &guided("a red circle", 3, 4, "", 2.0));
    assert!(max_diff(&stepped, &weaker) > 1e-3);
}

#[test]
fn guided_and_plain_states_at_different_steps_batch_like_alone() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let requests = [
        guided("a red circle", 1, 4, "", 3.0),
        req("a blue square", 2, 6),
        guided("x", 3, 5, "a blue square", 5.0),
    ];
    let alone: Vec<Tensor> = requests.iter().map(|r| run_alone(&p, r)).collect();
    let mut states: Vec<DenoiseState> = requests
        .iter()
        .map(|r| DenoiseState::new(&p, r).unwrap())
        .collect();
    assert_eq!(
        states.iter().map(DenoiseState::rows).collect::<Vec<_>>(),
        [2, 1, 2]
    );
    states[1].step(&p).unwrap(); // the plain one is a step ahead
    while states.iter().any(|s| !s.is_done()) {
        let mut refs: Vec<&mut DenoiseState> = states.iter_mut().collect();
        step_batch(&p, &mut refs).unwrap();
    }
    for (i, (s, a)) in states.iter().zip(&alone).enumerate() {
        let diff = max_diff(s.latents(), a);
        assert!(diff < 1e-4, "request {i}: max diff {diff}");
    }
}

#[test]
fn true_cfg_errors_name_the_field() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    for scale in [1.0, 0.5, f64::NAN] {
        let err = DenoiseState::new(&p, &guided("x", 1, 2, "", scale))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("true_cfg.scale"), "{err}");
    }
    // Steered and guided is a valid request (tested in `tests/controlnet_steps.rs`).
    let mut steered = guided("x", 1, 2, "", 3.0);
    steered.control = Some(ControlInput {
        image: Tensor::zeros([1, 3, 64, 64], (Kind::Float, Device::Cpu)),
        scale: 1.0,
    });
    let state = DenoiseState::new(&p, &steered).unwrap();
    assert!(state.has_control() && state.rows() == 2);
}

#[test]
fn a_step_in_two_halves_equals_a_step() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    for r in [
        req("a red circle", 5, 3),
        guided("a red circle", 6, 3, "blue", 3.0),
    ] {
        let mut halves = DenoiseState::new(&p, &r).unwrap();
        while !halves.is_done() {
            let velocities = halves
                .step_inputs()
                .unwrap()
                .iter()
                .map(|x| tch::no_grad(|| p.transformer.forward(x)).unwrap())
                .collect();
            halves.apply_velocities(velocities).unwrap();
        }
        // A guided state's two rows share one forward in `step`, here one each: batch size
        // changes the float sums' order, nothing else.
        let diff = max_diff(halves.latents(), &run_alone(&p, &r));
        assert!(diff < 1e-4, "{diff}");
        assert!(halves.step_inputs().is_err(), "no step is left");
    }
    let mut st = DenoiseState::new(&p, &guided("x", 1, 2, "y", 2.0)).unwrap();
    let err = st.apply_velocities(vec![]).unwrap_err().to_string();
    assert!(err.contains("velocities"), "{err}");
}

/// A cache whose every read fails (a tier that lost the template mid-step).
struct FailingCache;

impl KvCache for FailingCache {
    fn block_kv(&self, block: usize) -> Result<(Tensor, Tensor)> {
        Err(ModelError::input("cache", format!("block {block} is gone")))
    }
}

#[test]
fn a_batch_that_fails_part_way_steps_no_one() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let mut plain = DenoiseState::new(&p, &req("a red circle", 1, 4)).unwrap();
    let template = Tensor::rand([1, 3, 64, 64], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
    let mask = Tensor::zeros([1, 1, 64, 64], (Kind::Float, Device::Cpu));
    let _ = mask.narrow(2, 0, 32).narrow(3, 0, 32).fill_(1.0);
    let mut r = req("a green triangle", 5, 4);
    r.edit = Some(EditSpec {
        template,
        token_mask: crate::packing::token_mask(&mask, 4).unwrap().view([-1]),
        strength: 1.0,
        template_seed: None,
    });
    let mut edit = DenoiseState::new(&p, &r).unwrap();
    let before = plain.latents().copy();
    // The full-compute state's forward runs before the mask-aware one fails.
    let modes = [StepMode::Full, StepMode::Cached(&FailingCache)];
    let err = step_batch_modes(&p, &mut [&mut plain, &mut edit], &modes, 0).unwrap_err();
    assert!(err.to_string().contains("is gone"), "{err}");
    assert_eq!(plain.progress(), (0, 4), "the plain state stepped");
    assert_eq!(max_diff(plain.latents(), &before), 0.0);
    assert_eq!(edit.progress(), (0, 4));
}

/// `r` with TeaCache at `threshold`.
fn caching(mut r: StepRequest, threshold: f64) -> StepRequest {
    r.cache_threshold = Some(threshold);
    r
}

/// Run a state to its end alone; its final latents and the steps its step cache skipped.
fn run_counting(p: &FluxPipeline<'_>, r: &StepRequest) -> (Tensor, usize) {
    let mut st = DenoiseState::new(p, r).unwrap();
    while !st.is_done() {
        st.step(p).unwrap();
    }
    (st.latents().shallow_clone(), st.skipped_steps())
}

/// Step caching at threshold 0 (TeaCache and first-block caching) probes every step and skips
/// none: bit for bit no caching, plain, guided and edited.
#[test]
fn step_caching_at_threshold_zero_equals_no_caching() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let edit = || {
        let mut r = req("a green triangle", 5, 4);
        r.edit = Some(EditSpec {
            template: Tensor::ones([1, 3, 64, 64], (Kind::Float, Device::Cpu)) * 0.3,
            token_mask: Tensor::arange(256, (Kind::Int64, Device::Cpu))
                .remainder(3)
                .eq(0),
            strength: 1.0,
            template_seed: None,
        });
        r
    };
    let requests: [&dyn Fn() -> StepRequest; 3] = [
        &|| req("a red circle", 3, 5),
        &|| guided("a red circle", 4, 5, "blue", 3.0),
        &edit,
    ];
    for make in requests {
        let plain = run_alone(&p, &make());
        // First-block caching runs the first block and the rest as two parts of one forward.
        for cache in [caching(make(), 0.0), first_block(make(), 0.0)] {
            let (cached, skipped) = run_counting(&p, &cache);
            assert_eq!(skipped, 0);
            let method = cache.cache_method;
            assert!(
                cached.equal(&plain),
                "threshold 0 changed the latents ({method:?})"
            );
        }
    }
    let err = DenoiseState::new(&p, &caching(req("x", 1, 2), -1.0))
        .err()
        .unwrap();
    assert!(err.to_string().contains("cache_threshold"), "{err}");
}

/// A threshold no change reaches skips every step but the first and the last; skipping
/// changes the image, and a caching state batched with a guided one at another step ends as
/// each does alone.
#[test]
fn a_large_threshold_skips_the_middle_steps_and_batches_like_alone() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let lazy = || caching(req("a red circle", 3, 6), 1e9);
    let (alone, skipped) = run_counting(&p, &lazy());
    assert_eq!(skipped, 4);
    let computed = run_alone(&p, &req("a red circle", 3, 6));
    let change = max_diff(&alone, &computed);
    assert!(change > 1e-4 && change.is_finite(), "{change}");

    let other = || caching(guided("a blue square", 8, 4, "", 2.0), 1e9);
    let (other_alone, other_skipped) = run_counting(&p, &other());
    assert_eq!(other_skipped, 2);
    let mut a = DenoiseState::new(&p, &lazy()).unwrap();
    let mut b = DenoiseState::new(&p, &other()).unwrap();
    a.step(&p).unwrap();
    while !(a.is_done() && b.is_done()) {
        step_batch(&p, &mut [&mut a, &mut b]).unwrap();
    }
    assert_eq!((a.skipped_steps(), b.skipped_steps()), (4, 2));
    assert!(max_diff(a.latents(), &alone) < 1e-4);
    assert!(max_diff(b.latents(), &other_alone) < 1e-4);
}

/// A batch that fails part-way keeps no state's step-cache decision either: the caching
/// state then ends exactly as one that never saw the failed batch.
#[test]
fn a_failed_batch_leaves_the_step_cache_as_it_was() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let lazy = || caching(req("a red circle", 3, 5), 1e9);
    let (reference, skipped) = run_counting(&p, &lazy());
    let mut st = DenoiseState::new(&p, &lazy()).unwrap();
    st.step(&p).unwrap();
    st.step(&p).unwrap();
    let mut r = req("a green triangle", 5, 4);
    r.edit = Some(EditSpec {
        template: Tensor::zeros([1, 3, 64, 64], (Kind::Float, Device::Cpu)),
        token_mask: Tensor::arange(256, (Kind::Int64, Device::Cpu)).lt(64),
        strength: 1.0,
        template_seed: None,
    });
    let mut edit = DenoiseState::new(&p, &r).unwrap();
    let modes = [StepMode::Full, StepMode::Cached(&FailingCache)];
    step_batch_modes(&p, &mut [&mut st, &mut edit], &modes, 0).unwrap_err();
    assert_eq!((st.progress().0, st.skipped_steps()), (2, 1));
    while !st.is_done() {
        st.step(&p).unwrap();
    }
    assert_eq!(st.skipped_steps(), skipped);
    assert!(st.latents().equal(&reference));
}

/// `r` with first-block caching at `threshold`.
fn first_block(mut r: StepRequest, threshold: f64) -> StepRequest {
    r.cache_threshold = Some(threshold);
    r.cache_method = CacheMethod::FirstBlock;
    r
}

/// With a threshold no change reaches, every step after the first reuses (first-block caching
/// forces only the first); batched in one forward with a TeaCache state and a plain one at
/// other steps, each ends as it does alone: the rows that compute run the rest of the blocks
/// without the reusing row. A mask-aware step is refused by name.
#[test]
fn first_block_caching_skips_after_the_first_step_and_batches_like_alone() {
    let (m, s) = model();
    let p = m.pipeline(&s);
    let lazy = || first_block(req("a red circle", 3, 6), 1e9);
    let (alone, skipped) = run_counting(&p, &lazy());
    assert_eq!(skipped, 5);
    let computed = run_alone(&p, &req("a red circle", 3, 6));
    let change = max_diff(&alone, &computed);
    assert!(change > 1e-4 && change.is_finite(), "{change}");

    let tea = || caching(guided("a blue square", 8, 4, "", 2.0), 1e9);
    let (tea_alone, tea_skipped) = run_counting(&p, &tea());
    let plain = || req("a green triangle", 4, 5);
    let plain_alone = run_alone(&p, &plain());
    let mut a = DenoiseState::new(&p, &lazy()).unwrap();
    let mut b = DenoiseState::new(&p, &tea()).unwrap();
    let mut c = DenoiseState::new(&p, &plain()).unwrap();
    a.step(&p).unwrap();
    while !(a.is_done() && b.is_done() && c.is_done()) {
        step_batch(&p, &mut [&mut a, &mut b, &mut c]).unwrap();
    }
    assert_eq!((a.skipped_steps(), b.skipped_steps()), (5, tea_skipped));
    assert!(max_diff(a.latents(), &alone) < 1e-4);
    assert!(max_diff(b.latents(), &tea_alone) < 1e-4);
    assert!(max_diff(c.latents(), &plain_alone) < 1e-4);

    let mut r = first_block(req("a green triangle", 5, 4), 0.1);
    r.edit = Some(EditSpec {
        template: Tensor::zeros([1, 3, 64, 64], (Kind::Float, Device::Cpu)),
        token_mask: Tensor::arange(256, (Kind::Int64, Device::Cpu)).lt(64),
        strength: 1.0,
        template_seed: None,
    });
    let mut edit = DenoiseState::new(&p, &r).unwrap();
    let empty = crate::flux::CapturedKv::new(crate::flux::KvFormat::Raw);
    let modes = [StepMode::Cached(&empty)];
    let err = step_batch_modes(&p, &mut [&mut edit], &modes, 0).unwrap_err();
    assert!(err.to_string().contains("cache_method"), "{err}");
    assert_eq!(edit.progress().0, 0);
}
