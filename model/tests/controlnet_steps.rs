//! ControlNet-steered requests in the step-level stepper: steering changes the result, a fresh
//! (zero-initialised) ControlNet changes nothing, and a batch that mixes steered rows (two
//! ControlNets of different depths) with plain rows steps every row as it steps alone.
use diffmesh_model::flux::{ControlResiduals, FluxControlNet};
use diffmesh_model::noise_scheduler::{
    FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig,
};
use diffmesh_model::pipeline::control::ControlInput;
use diffmesh_model::pipeline::stepper::{
    step_batch_controlled, DenoiseState, EditSpec, StepMode, StepRequest, TrueCfg,
};
use diffmesh_model::pipeline::FluxPipeline;
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use diffmesh_model::tiny::controlnet_train::controlnet_from_transformer;
use diffmesh_model::tiny::model::{scheduler_config_json, TinyModel};

/// Tests draw weights and inputs from torch's global generator, re-seeding it: they take
/// turns, so one test's draws never interleave with another thread's.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn scheduler() -> FlowMatchEulerDiscreteScheduler {
    let cfg: FlowMatchEulerDiscreteSchedulerConfig =
        serde_json::from_value(scheduler_config_json()).unwrap();
    FlowMatchEulerDiscreteScheduler::new(cfg).unwrap()
}

/// A ControlNet of `m` with every weight random (non-zero), so its residuals matter.
fn random_net(
    m: &TinyModel,
    double: i64,
    single: i64,
    seed: i64,
) -> (FluxControlNet, nn::VarStore) {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = controlnet_from_transformer(&vs, &m.transformer, &m.transformer_vs, double, single)
        .unwrap();
    tch::manual_seed(seed);
    tch::no_grad(|| {
        for (name, mut v) in vs.variables() {
            if name.starts_with("controlnet_") {
                v.copy_(&(Tensor::randn(v.size(), (Kind::Float, Device::Cpu)) * 0.05));
            }
        }
    });
    (net, vs)
}

fn image(seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::rand([1, 3, 64, 64], (Kind::Float, Device::Cpu)) * 2.0 - 1.0
}

fn req(prompt: &str, seed: u64, control: Option<ControlInput>) -> StepRequest {
    StepRequest {
        true_cfg: None,
        cache_threshold: None,
        cache_method: Default::default(),
        prompt: prompt.into(),
        seed,
        height: 64,
        width: 64,
        steps: 4,
        guidance_scale: 1.0,
        edit: None,
        control,
    }
}

/// Step `states` together to the end, each steered one by its net (index into `nets`).
fn run(p: &FluxPipeline<'_>, states: &mut [DenoiseState], nets: &[Option<&FluxControlNet>]) {
    while states.iter().any(|s| !s.is_done()) {
        let residuals: Vec<Option<ControlResiduals>> = states
            .iter()
            .zip(nets)
            .map(|(s, net)| {
                s.control_step().unwrap().map(|step| {
                    step.residuals(net.expect("steered state has a net"))
                        .unwrap()
                })
            })
            .collect();
        let mut refs: Vec<&mut DenoiseState> = states.iter_mut().collect();
        let modes = vec![StepMode::Full; refs.len()];
        step_batch_controlled(p, &mut refs, &modes, 0, &residuals).unwrap();
    }
}

/// Steps the states `make` builds together to the end, then each alone from a fresh copy, and
/// asserts every row ends where it ends alone; returns the batched states.
fn batched_as_alone(
    p: &FluxPipeline<'_>,
    make: impl Fn() -> Vec<DenoiseState>,
    nets: &[Option<&FluxControlNet>],
) -> Vec<DenoiseState> {
    let mut batch = make();
    run(p, &mut batch, nets);
    for (i, mut st) in make().into_iter().enumerate() {
        run(p, std::slice::from_mut(&mut st), &nets[i..=i]);
        let d = max_diff(batch[i].latents(), st.latents());
        assert!(d < 1e-4, "row {i}: batched vs alone differ by {d}");
    }
    batch
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    f64::try_from((a - b).abs().max()).unwrap()
}

#[test]
fn mixed_batches_step_each_row_as_alone() {
    let _turn = turn();
    let m = TinyModel::random_for_tests(7, Device::Cpu).unwrap();
    let s = scheduler();
    let p = m.pipeline(&s);
    let (deep, _dvs) = random_net(&m, 2, 2, 1);
    let (shallow, _svs) = random_net(&m, 1, 0, 2);
    let control = |seed, scale| {
        Some(ControlInput {
            image: image(seed),
            scale,
        })
    };
    let make = || {
        vec![
            DenoiseState::new(&p, &req("a red circle", 3, control(10, 1.0))).unwrap(),
            DenoiseState::new(&p, &req("a blue square", 4, None)).unwrap(),
            DenoiseState::new(&p, &req("a green triangle", 5, control(11, 0.6))).unwrap(),
        ]
    };
    let batch = batched_as_alone(&p, make, &[Some(&deep), None, Some(&shallow)]);
    // Steering changes the result; the plain row is the plain model's.
    let mut plain = vec![DenoiseState::new(&p, &req("a red circle", 3, None)).unwrap()];
    run(&p, &mut plain, &[None]);
    let moved = max_diff(plain[0].latents(), batch[0].latents());
    assert!(
        moved > 1e-2,
        "the ControlNet moved the latents by only {moved}"
    );
}

/// True CFG on a steered request: the negative prompt's row takes the prompt row's residuals
/// (diffusers' `FluxControlNetPipeline`). One Euler step is linear in the velocity, so the
/// guided step lands at `neg + scale * (cond - neg)`, where `cond` and `neg` are unguided states
/// of the prompt and of the negative prompt, both stepped with the prompt's residuals.
#[test]
fn a_guided_steered_request_guides_both_rows_with_the_prompts_residuals() {
    let _turn = turn();
    let m = TinyModel::random_for_tests(10, Device::Cpu).unwrap();
    let s = scheduler();
    let p = m.pipeline(&s);
    let (net, _vs) = random_net(&m, 2, 1, 3);
    let control = || {
        Some(ControlInput {
            image: image(12),
            scale: 1.0,
        })
    };
    let scale = 3.0;
    let guided = || {
        let mut r = req("a red circle", 6, control());
        r.true_cfg = Some(TrueCfg {
            negative_prompt: "a blue square".into(),
            scale,
        });
        r
    };
    let mut g = DenoiseState::new(&p, &guided()).unwrap();
    let mut cond = DenoiseState::new(&p, &req("a red circle", 6, control())).unwrap();
    let mut neg = DenoiseState::new(&p, &req("a blue square", 6, control())).unwrap();
    let residuals =
        |st: &DenoiseState| st.control_step().unwrap().unwrap().residuals(&net).unwrap();
    let (rg, rc) = (residuals(&g), residuals(&cond));
    step_batch_controlled(&p, &mut [&mut g], &[StepMode::Full], 0, &[Some(rg)]).unwrap();
    let both = [Some(rc.shallow_clone()), Some(rc)];
    let modes = [StepMode::Full, StepMode::Full];
    step_batch_controlled(&p, &mut [&mut cond, &mut neg], &modes, 0, &both).unwrap();
    let expect = neg.latents() + (cond.latents() - neg.latents()) * scale;
    let d = max_diff(g.latents(), &expect);
    assert!(d < 1e-4, "guided step off the CFG combination by {d}");
    assert!(
        max_diff(g.latents(), cond.latents()) > 1e-3,
        "guidance changed nothing"
    );

    // To the end, batched with a plain and another steered request: as alone.
    let (other, _ovs) = random_net(&m, 1, 0, 4);
    let make = || {
        vec![
            DenoiseState::new(&p, &guided()).unwrap(),
            DenoiseState::new(&p, &req("a blue square", 4, None)).unwrap(),
            DenoiseState::new(&p, &req("a green triangle", 5, control())).unwrap(),
        ]
    };
    batched_as_alone(&p, make, &[Some(&net), None, Some(&other)]);
}

#[test]
fn a_fresh_controlnet_steers_nothing() {
    let _turn = turn();
    let m = TinyModel::random_for_tests(8, Device::Cpu).unwrap();
    let s = scheduler();
    let p = m.pipeline(&s);
    let vs = nn::VarStore::new(Device::Cpu);
    let fresh = controlnet_from_transformer(&vs, &m.transformer, &m.transformer_vs, 1, 1).unwrap();
    let control = Some(ControlInput {
        image: image(3),
        scale: 1.0,
    });
    let mut steered = vec![DenoiseState::new(&p, &req("a red circle", 9, control)).unwrap()];
    run(&p, &mut steered, &[Some(&fresh)]);
    let mut plain = vec![DenoiseState::new(&p, &req("a red circle", 9, None)).unwrap()];
    run(&p, &mut plain, &[None]);
    assert_eq!(max_diff(steered[0].latents(), plain[0].latents()), 0.0);
}

#[test]
fn bad_control_requests_name_the_field() {
    let _turn = turn();
    let m = TinyModel::random_for_tests(9, Device::Cpu).unwrap();
    let s = scheduler();
    let p = m.pipeline(&s);
    let small = Some(ControlInput {
        image: Tensor::zeros([1, 3, 32, 32], (Kind::Float, Device::Cpu)),
        scale: 1.0,
    });
    let err = DenoiseState::new(&p, &req("a red circle", 1, small))
        .err()
        .unwrap();
    assert!(err.to_string().contains("control.image"), "{err}");

    let mut edit = req(
        "a red circle",
        1,
        Some(ControlInput {
            image: image(1),
            scale: 1.0,
        }),
    );
    edit.edit = Some(EditSpec {
        template: image(2),
        token_mask: Tensor::ones([256], (Kind::Int64, Device::Cpu)),
        strength: 1.0,
        template_seed: None,
    });
    let err = DenoiseState::new(&p, &edit).err().unwrap();
    assert!(err.to_string().contains("control"), "{err}");

    // A steered state stepped without its residuals is refused, not silently unsteered.
    let control = Some(ControlInput {
        image: image(4),
        scale: 1.0,
    });
    let mut st = DenoiseState::new(&p, &req("a red circle", 1, control)).unwrap();
    let err = step_batch_controlled(&p, &mut [&mut st], &[StepMode::Full], 0, &[None]).unwrap_err();
    assert!(err.to_string().contains("control"), "{err}");
}

/// A steered request with step caching: a step it reuses runs no ControlNet (the engine asks
/// `plan_step` first and brings no residuals for it) and ends exactly where the same request
/// ends when the residuals are computed every step anyway.
#[test]
fn a_reused_steered_step_needs_no_controlnet() {
    let _turn = turn();
    let m = TinyModel::random_for_tests(7, Device::Cpu).unwrap();
    let s = scheduler();
    let p = m.pipeline(&s);
    let (net, _vs) = random_net(&m, 2, 2, 1);
    let steered = || {
        let mut r = req(
            "a red circle",
            3,
            Some(ControlInput {
                image: image(10),
                scale: 1.0,
            }),
        );
        r.cache_threshold = Some(1e9);
        DenoiseState::new(&p, &r).unwrap()
    };
    let mut always = vec![steered()];
    run(&p, &mut always, &[Some(&net)]);
    let mut planned = steered();
    let mut skipped_nets = 0;
    while !planned.is_done() {
        let reuse = planned.plan_step(&p, false).unwrap();
        let residuals = match reuse {
            true => None,
            false => Some(
                planned
                    .control_step()
                    .unwrap()
                    .unwrap()
                    .residuals(&net)
                    .unwrap(),
            ),
        };
        skipped_nets += reuse as usize;
        step_batch_controlled(&p, &mut [&mut planned], &[StepMode::Full], 0, &[residuals]).unwrap();
    }
    assert_eq!((skipped_nets, planned.skipped_steps()), (2, 2));
    assert!(planned.latents().equal(always[0].latents()));
    // Without a plan, a computed steered step still needs its residuals.
    let mut fresh = steered();
    let modes = [StepMode::Full];
    let err = step_batch_controlled(&p, &mut [&mut fresh], &modes, 0, &[None]).unwrap_err();
    assert!(err.to_string().contains("control"), "{err}");
}
