//! The discrete schedulers against diffusers 0.42.1 (python/parity/gen_discrete_schedulers.py):
//! Euler (also on Karras sigmas, trailing spacing, `sigma_min` final), Euler ancestral, DPM++
//! 2M (midpoint and Heun, Karras, short and long schedules), DPM++ 1S and DDIM (SD2.1's
//! v-prediction, clipping), each from its saved `scheduler_config.json`: the same timesteps,
//! sigmas and initial noise sigma, and along a trajectory driven by random model outputs the
//! same scaled inputs and steps. The `--scheduler` names give the same schedulers on a
//! checkpoint's base config as diffusers' `from_config` does.
mod py_fixture;

use diffmesh_model::schedulers::{DiscreteScheduler, DiscreteSchedulerConfig};
use py_fixture::{generate, max_abs_diff, read_tensors};
use tch::{Kind, Tensor};

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    steps: usize,
    named: Option<String>,
}

fn close(what: &str, got: &Tensor, want: &Tensor, tolerance: f64) {
    let err = max_abs_diff(got, want);
    let scale = want.abs().max().double_value(&[]).max(1.0);
    assert!(
        err <= tolerance * scale,
        "{what}: max abs error {err:e} (scale {scale})"
    );
}

fn check(case: &Case, scheduler: &DiscreteScheduler, dir: &std::path::Path) {
    let name = &case.name;
    let r = read_tensors(&dir.join("reference.safetensors"));
    let mut schedule = scheduler.set_timesteps(case.steps).unwrap();
    let timesteps = Tensor::from_slice(&schedule.timesteps);
    close(
        &format!("{name} timesteps"),
        &timesteps,
        &r["timesteps"],
        1e-6,
    );
    let init = r["init_noise_sigma"].double_value(&[0]);
    assert!(
        (schedule.init_noise_sigma - init).abs() <= 1e-6 * init,
        "{name}: init_noise_sigma {} != {init}",
        schedule.init_noise_sigma
    );
    match r.get("sigmas") {
        Some(want) => close(
            &format!("{name} sigmas"),
            &Tensor::from_slice(&schedule.sigmas),
            want,
            1e-6,
        ),
        None => assert!(schedule.sigmas.is_empty(), "{name}: DDIM has no sigmas"),
    }
    let (samples, scaled, outputs) = (&r["samples"], &r["scaled"], &r["model_outputs"]);
    let noises = r.get("noises");
    assert_eq!(schedule.needs_noise(), noises.is_some(), "{name}");
    for i in 0..case.steps {
        let at = |t: &Tensor| t.get(i as i64);
        // Each step from the reference's sample, so an error shows at its step.
        let sample = at(samples);
        let x = schedule.scale_model_input(&sample, i).unwrap();
        close(
            &format!("{name} step {i} scaled input"),
            &x,
            &at(scaled),
            1e-6,
        );
        let noise = noises.map(&at);
        let next = schedule
            .step(i, &at(outputs), &sample, noise.as_ref())
            .unwrap();
        assert_eq!(next.kind(), Kind::Float);
        close(
            &format!("{name} step {i}"),
            &next,
            &samples.get(i as i64 + 1),
            1e-5,
        );
    }
    assert!(schedule
        .step(case.steps, &at_zero(outputs), &at_zero(samples), None)
        .is_err());
}

fn at_zero(t: &Tensor) -> Tensor {
    t.get(0)
}

#[test]
fn discrete_schedulers_match_diffusers() {
    let dir = generate(
        "gen_discrete_schedulers.py",
        &["--out"],
        "parity-discrete-schedulers",
    );
    let cases: Vec<Case> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    assert!(cases.len() >= 12, "{} cases", cases.len());
    let mut named = 0;
    for case in &cases {
        let case_dir = dir.join(&case.name);
        let scheduler =
            DiscreteScheduler::from_config_file(&case_dir.join("scheduler_config.json"))
                .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        check(case, &scheduler, &case_dir);
        if let Some(name) = &case.named {
            let base =
                DiscreteSchedulerConfig::from_file(&case_dir.join("base_config.json")).unwrap();
            let scheduler = DiscreteScheduler::named(name, &base).unwrap();
            check(case, &scheduler, &case_dir);
            named += 1;
        }
    }
    assert_eq!(
        named,
        diffmesh_model::schedulers::NAMES.len(),
        "every name is checked"
    );
}

#[test]
fn refusals_name_the_field() {
    let cases = [
        ("_class_name", r#"{"_class_name": "PNDMScheduler"}"#),
        (
            "beta_schedule",
            r#"{"_class_name": "DDIMScheduler", "beta_schedule": "squaredcos_cap_v2"}"#,
        ),
        (
            "prediction_type",
            r#"{"_class_name": "DDIMScheduler", "prediction_type": "sample"}"#,
        ),
        (
            "algorithm_type",
            r#"{"_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "sde-dpmsolver++"}"#,
        ),
        (
            "solver_order",
            r#"{"_class_name": "DPMSolverMultistepScheduler", "solver_order": 3}"#,
        ),
        (
            "use_karras_sigmas",
            r#"{"_class_name": "DDIMScheduler", "use_karras_sigmas": true}"#,
        ),
        (
            "timestep_spacing",
            r#"{"_class_name": "EulerDiscreteScheduler", "timestep_spacing": "odd"}"#,
        ),
        (
            "rescale_betas_zero_snr",
            r#"{"_class_name": "EulerDiscreteScheduler", "rescale_betas_zero_snr": true}"#,
        ),
    ];
    let scratch = tempfile::tempdir().unwrap();
    for (field, json) in cases {
        let path = scratch.path().join("scheduler_config.json");
        std::fs::write(&path, json).unwrap();
        let err = DiscreteScheduler::from_config_file(&path)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    let base = DiscreteSchedulerConfig::default();
    let err = DiscreteScheduler::named("heun", &base)
        .unwrap_err()
        .to_string();
    assert!(err.contains("scheduler"), "{err}");
    let euler = DiscreteScheduler::named("euler", &base).unwrap();
    let err = euler.set_timesteps(0).unwrap_err().to_string();
    assert!(err.contains("num_inference_steps"), "{err}");
    let mut a = DiscreteScheduler::named("euler_a", &base)
        .unwrap()
        .set_timesteps(3)
        .unwrap();
    let x = Tensor::zeros([1, 4, 2, 2], (Kind::Float, tch::Device::Cpu));
    let err = a.step(0, &x, &x, None).unwrap_err().to_string();
    assert!(err.contains("noise"), "{err}");
}
