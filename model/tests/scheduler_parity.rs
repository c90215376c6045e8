//! FlowMatchEulerDiscreteScheduler parity with diffusers 0.42.1: sigmas and timesteps must be
//! bit-identical float32, step() and scale_noise() outputs identical, for static and dynamic
//! shifting, the Flux pipeline's custom-sigma path and the plain set_timesteps path.
mod py_fixture;

use diffmesh_model::noise_scheduler::{
    FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig, Schedule,
};
use py_fixture::{generate, max_abs_diff, read_tensors};
use serde_json::Value;

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn schedule_for(case: &Value) -> Schedule {
    let config: FlowMatchEulerDiscreteSchedulerConfig =
        serde_json::from_value(case["config"].clone()).expect("scheduler config");
    let scheduler = FlowMatchEulerDiscreteScheduler::new(config).expect("valid config");
    let steps = case["steps"].as_u64().expect("steps") as usize;
    let mu = case["mu"].as_f64();
    match (
        case["mode"].as_str().expect("mode"),
        case.get("seq_len").and_then(Value::as_i64),
    ) {
        // The exact call the Flux pipelines make, mu derived from the image token count.
        ("flux", Some(seq_len)) => {
            let s = scheduler
                .flux_schedule(steps, seq_len)
                .expect("flux schedule");
            assert_eq!(
                scheduler.calculate_shift(seq_len),
                mu.expect("mu"),
                "calculate_shift({seq_len})"
            );
            s
        }
        ("flux", None) => scheduler
            .set_sigmas(&diffmesh_model::noise_scheduler::flux_sigmas(steps), mu)
            .expect("custom sigmas"),
        ("default", _) => scheduler.set_timesteps(steps, mu).expect("set_timesteps"),
        (m, _) => panic!("unknown mode {m}"),
    }
}

#[test]
fn scheduler_matches_diffusers() {
    let dir = generate("gen_vae_scheduler.py", &["scheduler"], "parity-scheduler");
    let cases: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).expect("cases.json"))
            .expect("json");
    assert!(
        cases.len() >= 30,
        "expected the full case list, got {}",
        cases.len()
    );
    for case in &cases {
        let name = case["name"].as_str().expect("name");
        let schedule = schedule_for(case);
        let (want_sigmas, want_timesteps) = (f32s(&case["sigmas"]), f32s(&case["timesteps"]));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&schedule.sigmas),
            bits(&want_sigmas),
            "{name}: sigmas {case}"
        );
        assert_eq!(
            bits(&schedule.timesteps),
            bits(&want_timesteps),
            "{name}: timesteps {case}"
        );

        let t = read_tensors(&dir.join(format!("{name}.safetensors")));
        let mut sample = t["sample_0"].shallow_clone();
        for k in 0..schedule.len() {
            sample = schedule
                .step(k, &t[&format!("model_output_{k}")], &sample)
                .expect("step");
            let d = max_abs_diff(&sample, &t[&format!("sample_{}", k + 1)]);
            assert_eq!(d, 0.0, "{name}: step {k} differs by {d}");
        }
        for k in 0..schedule.len() {
            let scaled = schedule
                .scale_noise(&t["clean"], k, &t["noise"])
                .expect("scale_noise");
            let d = max_abs_diff(&scaled, &t[&format!("scaled_{k}")]);
            assert_eq!(d, 0.0, "{name}: scale_noise at {k} differs by {d}");
        }
    }
}
