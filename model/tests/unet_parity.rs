//! Parity of `UNet2DConditionModel` with diffusers 0.42.1 on reduced SD2.1-like and SDXL-like
//! random-weight configs (batches of 1 and 2, sides that do and do not divide by the
//! downsampling, linear and conv projections, several transformer layers per level, SDXL's
//! added conditioning), through `cargo xtask forward --component unet`'s code path; and the
//! errors of strict loading and of bad inputs; ControlNets' residuals, and a UNet steered by two
//! ControlNets at once. Fixtures come from `python/parity/gen_unet.py`,
//! run here with `$DIFFMESH_PYTHON` (default: the project venv) into this test's tmp dir.
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::unet::{cli_forward_unet, UNet2DConditionModel, UNetInputs};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const TOLERANCE: f64 = 1e-4;

fn fixtures() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("unet_parity");
        let _ = std::fs::remove_dir_all(&out);
        let python = std::env::var("DIFFMESH_PYTHON")
            .unwrap_or_else(|_| "/root/.cache/diffmesh/venv/bin/python".into());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/parity/gen_unet.py");
        let status = std::process::Command::new(&python)
            .arg(&script)
            .arg("--out")
            .arg(&out)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
        assert!(status.success(), "{} failed: {status}", script.display());
        out
    })
}

fn cases() -> Vec<String> {
    let text = std::fs::read_to_string(fixtures().join("manifest.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect()
}

fn read(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}

#[test]
fn forward_matches_diffusers() {
    let names = cases();
    assert!(names.len() >= 4, "expected several cases, got {names:?}");
    for name in names {
        let dir = fixtures().join(&name);
        let out = dir.join("ours.safetensors");
        cli_forward_unet(&dir, &dir.join("inputs.safetensors"), &out).unwrap();
        let got = read(&out).remove("sample").unwrap();
        let expected = read(&dir.join("output.safetensors"))
            .remove("sample")
            .unwrap();
        assert_eq!(got.size(), expected.size(), "{name}: shape");
        let err = f64::try_from((&got - &expected).abs().max()).unwrap();
        let scale = f64::try_from(expected.abs().max()).unwrap();
        println!("{name}: max abs err {err:.3e} (output max {scale:.3})");
        assert!(scale > 0.1, "{name}: reference output is degenerate");
        assert!(err <= TOLERANCE, "{name}: max abs err {err} > {TOLERANCE}");
    }
}

fn inputs(case: &str) -> UNetInputs {
    let mut x = read(&fixtures().join(case).join("inputs.safetensors"));
    UNetInputs {
        sample: x.remove("sample").unwrap(),
        timestep: x.remove("timestep").unwrap(),
        encoder_hidden_states: x.remove("encoder_hidden_states").unwrap(),
        text_embeds: x.remove("text_embeds"),
        time_ids: x.remove("time_ids"),
    }
}

#[test]
fn bad_inputs_name_the_field() {
    let dir = fixtures().join("sdxl").join("unet");
    let unet = UNet2DConditionModel::load(&dir, Device::Cpu, Kind::Float).unwrap();
    type Spoil = Box<dyn Fn(&mut UNetInputs)>;
    let cases: Vec<(&str, Spoil)> = vec![
        ("sample", Box::new(|x| x.sample = x.sample.narrow(1, 0, 3))),
        (
            "encoder_hidden_states",
            Box::new(|x| x.encoder_hidden_states = x.encoder_hidden_states.narrow(2, 0, 5)),
        ),
        (
            "timestep",
            Box::new(|x| x.timestep = Tensor::zeros([3], (Kind::Float, Device::Cpu))),
        ),
        ("text_embeds", Box::new(|x| x.text_embeds = None)),
        (
            "text_embeds",
            Box::new(|x| x.text_embeds = x.text_embeds.as_ref().map(|t| t.narrow(1, 0, 4))),
        ),
        (
            "time_ids",
            Box::new(|x| x.time_ids = x.time_ids.as_ref().map(|t| t.narrow(0, 0, 1))),
        ),
    ];
    for (field, spoil) in cases {
        let mut x = inputs("sdxl");
        spoil(&mut x);
        let err = unet.forward(&x).unwrap_err().to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    // One timestep for every row is diffusers' broadcast.
    let mut x = inputs("sdxl");
    let per_row = unet.forward(&x).unwrap();
    x.timestep = x.timestep.narrow(0, 0, 1).squeeze();
    let shared = unet.forward(&x).unwrap();
    assert_eq!(shared.size(), per_row.size());
}

#[test]
fn loading_names_missing_and_misshaped_keys() {
    let src = fixtures().join("sd21").join("unet");
    let bad = Path::new(env!("CARGO_TARGET_TMPDIR")).join("unet_parity_bad");
    let _ = std::fs::remove_dir_all(&bad);
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(src.join("config.json"), bad.join("config.json")).unwrap();
    let mut ckpt = read(&src.join("diffusion_pytorch_model.safetensors"));
    let missing = "up_blocks.1.attentions.2.transformer_blocks.0.attn2.to_k.weight";
    let misshaped = "mid_block.resnets.1.time_emb_proj.weight";
    assert!(ckpt.remove(missing).is_some());
    let w = ckpt.remove(misshaped).unwrap();
    ckpt.insert(misshaped.into(), w.narrow(0, 0, 3));
    let named: Vec<(String, Tensor)> = ckpt.into_iter().collect();
    Tensor::write_safetensors(&named, bad.join("diffusion_pytorch_model.safetensors")).unwrap();
    let err = UNet2DConditionModel::load(&bad, Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("missing key: {missing}")), "{err}");
    assert!(
        err.contains(&format!("mis-shaped key: {misshaped}")),
        "{err}"
    );
}

/// A ControlNet's residuals (`--component controlnet`), and a UNet steered by two ControlNets
/// whose residuals are summed (diffusers' `MultiControlNetModel`, scales 0.7 and 0.4), both
/// through the forward tool's inputs and through the API.
#[test]
fn controlnets_match_diffusers() {
    use diffmesh_model::unet::controlnet::cli_forward_controlnet;
    use diffmesh_model::unet::ControlNetModel;
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).unwrap())
            .unwrap();
    let controlled: Vec<&str> = v["controlnet_cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(controlled.len(), 2);
    for name in controlled {
        let dir = fixtures().join(name);
        let err_of = |got: &Tensor, want: &Tensor, what: &str| {
            assert_eq!(got.size(), want.size(), "{name} {what}");
            let err = f64::try_from((got - want).abs().max()).unwrap();
            println!("{name} {what}: max abs err {err:.3e}");
            assert!(err <= TOLERANCE, "{name} {what}: {err}");
        };
        let out = dir.join("cn_ours.safetensors");
        cli_forward_controlnet(&dir, &dir.join("controlnet_inputs.safetensors"), &out).unwrap();
        let got = read(&out);
        let want = read(&dir.join("controlnet_output.safetensors"));
        assert_eq!(got.len(), want.len(), "{name}: residual count");
        for (key, w) in &want {
            err_of(&got[key], w, key);
        }

        let out = dir.join("controlled_ours.safetensors");
        cli_forward_unet(&dir, &dir.join("controlled_inputs.safetensors"), &out).unwrap();
        let mut expected = read(&dir.join("controlled_output.safetensors"));
        let want = expected.remove("sample").unwrap();
        err_of(
            &read(&out).remove("sample").unwrap(),
            &want,
            "steered by two (tool)",
        );

        let x = inputs(name);
        let mut c = read(&dir.join("controlnet_inputs.safetensors"));
        let cond = c.remove("controlnet_cond").unwrap();
        let cond_2 = expected.remove("controlnet_cond_2").unwrap();
        let load = |d: &str| ControlNetModel::load(&dir.join(d), Device::Cpu, Kind::Float).unwrap();
        let (first, second) = (load("controlnet"), load("controlnet_2"));
        let unet = UNet2DConditionModel::load(&dir.join("unet"), Device::Cpu, Kind::Float).unwrap();
        let got = diffmesh_model::tch::no_grad(|| {
            let a = first.forward(&x, &cond, 0.7).unwrap();
            let b = second.forward(&x, &cond_2, 0.4).unwrap();
            unet.forward_controlled(&x, Some(&a.sum(&b).unwrap()))
        })
        .unwrap();
        err_of(&got, &want, "steered by two (API)");
        let err = first
            .forward(&x, &cond.narrow(2, 0, 8), 1.0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("controlnet_cond"), "{err}");
    }
}
