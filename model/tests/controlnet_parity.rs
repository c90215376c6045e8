//! Parity of `FluxControlNet` and `FluxTransformer::forward_controlled` with diffusers 0.42.1
//! (`FluxControlNetModel` feeding `FluxTransformer2DModel`) on reduced random-weight configs.
//! Fixtures come from `python/parity/gen_controlnet.py`, run with `$DIFFMESH_PYTHON`.
use diffmesh_model::flux::{ControlResiduals, FluxControlNet, FluxInputs, FluxTransformer};
use diffmesh_model::tch::{self, Device, Kind, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const TOLERANCE: f64 = 1e-4;

fn fixtures() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("controlnet_parity");
        let _ = std::fs::remove_dir_all(&out);
        let python = std::env::var("DIFFMESH_PYTHON")
            .unwrap_or_else(|_| "/root/.cache/diffmesh/venv/bin/python".into());
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/parity/gen_controlnet.py");
        let shipped =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny-controlnets/silhouette");
        let status = std::process::Command::new(&python)
            .arg(&script)
            .arg("--out")
            .arg(&out)
            .arg("--shipped")
            .arg(&shipped)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
        assert!(status.success(), "{} failed: {status}", script.display());
        out
    })
}

fn manifest() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn read(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}

fn inputs(x: &mut HashMap<String, Tensor>) -> FluxInputs {
    FluxInputs {
        hidden_states: x.remove("hidden_states").unwrap(),
        encoder_hidden_states: x.remove("encoder_hidden_states").unwrap(),
        pooled_projections: x.remove("pooled_projections").unwrap(),
        timestep: x.remove("timestep").unwrap(),
        img_ids: x.remove("img_ids").unwrap(),
        txt_ids: x.remove("txt_ids").unwrap(),
        guidance: x.remove("guidance"),
    }
}

fn max_err(got: &Tensor, expected: &Tensor, what: &str) -> f64 {
    assert_eq!(got.size(), expected.size(), "{what}: shape");
    let err = f64::try_from((got - expected).abs().max()).unwrap();
    let scale = f64::try_from(expected.abs().max()).unwrap();
    println!("{what}: max abs err {err:.3e} (reference max {scale:.3})");
    assert!(scale > 0.05, "{what}: reference is degenerate");
    err
}

#[test]
fn controlnet_and_controlled_forward_match_diffusers() {
    let m = manifest();
    let names: Vec<String> = m["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect();
    assert!(names.len() >= 2, "expected several cases, got {names:?}");
    for name in names {
        let dir = fixtures().join(&name);
        let scale = m["scales"][&name].as_f64().unwrap();
        let (base, _bvs) =
            FluxTransformer::load(&dir.join("transformer"), Device::Cpu, Kind::Float).unwrap();
        let (net, _cvs) =
            FluxControlNet::load(&dir.join("controlnet"), Device::Cpu, Kind::Float).unwrap();
        net.check_compatible(&base.cfg).unwrap();
        let mut x = read(&dir.join("inputs.safetensors"));
        let control = x.remove("controlnet_cond").unwrap();
        let inputs = inputs(&mut x);
        let mut expected = read(&dir.join("output.safetensors"));

        let residuals = tch::no_grad(|| net.forward(&inputs, &control, scale)).unwrap();
        assert_eq!(residuals.double.len(), net.transformer_blocks.len());
        assert_eq!(residuals.single.len(), net.single_transformer_blocks.len());
        for (kind, list) in [("double", &residuals.double), ("single", &residuals.single)] {
            for (i, r) in list.iter().enumerate() {
                let key = format!("{kind}_{i}");
                let want = expected
                    .remove(&key)
                    .unwrap_or_else(|| panic!("{name}: no {key}"));
                let err = max_err(r, &want, &format!("{name} {key}"));
                assert!(err <= TOLERANCE, "{name} {key}: max abs err {err}");
            }
        }
        let sample = expected.remove("sample").unwrap();
        let got = tch::no_grad(|| base.forward_controlled(&inputs, &residuals)).unwrap();
        let err = max_err(&got, &sample, &format!("{name} sample"));
        assert!(err <= TOLERANCE, "{name} sample: max abs err {err}");
        // The residuals change the output (else the comparison above would not test them).
        let plain = tch::no_grad(|| base.forward(&inputs)).unwrap();
        let moved = f64::try_from((&plain - &sample).abs().max()).unwrap();
        assert!(
            moved > 1e-2,
            "{name}: residuals moved the output by only {moved}"
        );
    }
}

#[test]
fn bad_control_inputs_name_the_field() {
    let dir = fixtures().join("fewer_blocks");
    let (base, _bvs) =
        FluxTransformer::load(&dir.join("transformer"), Device::Cpu, Kind::Float).unwrap();
    let (net, _cvs) =
        FluxControlNet::load(&dir.join("controlnet"), Device::Cpu, Kind::Float).unwrap();
    let mut x = read(&dir.join("inputs.safetensors"));
    let control = x.remove("controlnet_cond").unwrap();
    let inputs = inputs(&mut x);
    let short = control.narrow(1, 0, 3);
    let err = net.forward(&inputs, &short, 1.0).unwrap_err().to_string();
    assert!(err.contains("control"), "{err}");

    let residuals = tch::no_grad(|| net.forward(&inputs, &control, 1.0)).unwrap();
    let wrong = ControlResiduals {
        double: vec![residuals.double[0].narrow(1, 0, 2)],
        single: vec![],
    };
    let err = base
        .forward_controlled(&inputs, &wrong)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("control") && err.contains("residuals"),
        "{err}"
    );

    // A union ControlNet is refused by its config key.
    let union = Path::new(env!("CARGO_TARGET_TMPDIR")).join("controlnet_union");
    let _ = std::fs::remove_dir_all(&union);
    std::fs::create_dir_all(&union).unwrap();
    let cfg = std::fs::read_to_string(dir.join("controlnet").join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    cfg["num_mode"] = serde_json::json!(10);
    std::fs::write(union.join("config.json"), cfg.to_string()).unwrap();
    let err = FluxControlNet::load(&union, Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(err.contains("num_mode"), "{err}");
}

/// The shipped silhouette ControlNet is a diffusers `FluxControlNetModel` folder: diffusers
/// loads it and computes the residuals we compute.
#[test]
fn the_shipped_controlnet_loads_in_diffusers_as_it_does_here() {
    let dir = fixtures().join("shipped");
    let shipped =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny-controlnets/silhouette");
    let (net, _vs) = FluxControlNet::load(&shipped, Device::Cpu, Kind::Float).unwrap();
    let mut x = read(&dir.join("inputs.safetensors"));
    let control = x.remove("controlnet_cond").unwrap();
    let inputs = inputs(&mut x);
    let residuals = tch::no_grad(|| net.forward(&inputs, &control, 1.0)).unwrap();
    let mut expected = read(&dir.join("output.safetensors"));
    assert_eq!(
        expected.len(),
        residuals.double.len() + residuals.single.len()
    );
    for (kind, list) in [("double", &residuals.double), ("single", &residuals.single)] {
        for (i, r) in list.iter().enumerate() {
            let key = format!("{kind}_{i}");
            let want = expected.remove(&key).unwrap();
            let err = max_err(r, &want, &format!("shipped {key}"));
            // Trained residuals reach the hundreds: compare relative to their size.
            let scale = f64::try_from(want.abs().max()).unwrap().max(1.0);
            assert!(
                err <= TOLERANCE * scale,
                "shipped {key}: max abs err {err} of {scale}"
            );
        }
    }
}
