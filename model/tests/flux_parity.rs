//! Parity of `FluxTransformer` with diffusers 0.42.1 `FluxTransformer2DModel` on reduced random-weight
//! configs, and strict-loading failures. Fixtures come from `python/parity/gen_flux.py`, run here
//! with `$DIFFMESH_PYTHON` (default: the project venv) into this test's target tmp dir.
use diffmesh_model::flux::{FluxInputs, FluxTransformer};
use diffmesh_model::tch::{self, Device, Kind, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const TOLERANCE: f64 = 1e-4;

fn fixtures() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flux_parity");
        let _ = std::fs::remove_dir_all(&out);
        let python = std::env::var("DIFFMESH_PYTHON")
            .unwrap_or_else(|_| "/root/.cache/diffmesh/venv/bin/python".into());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/parity/gen_flux.py");
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
    assert!(
        names.len() >= 4,
        "expected several fixture cases, got {names:?}"
    );
    for name in names {
        let dir = fixtures().join(&name);
        let (model, _vs) =
            FluxTransformer::load(&dir.join("transformer"), Device::Cpu, Kind::Float).unwrap();
        let mut x = read(&dir.join("inputs.safetensors"));
        let inputs = FluxInputs {
            hidden_states: x.remove("hidden_states").unwrap(),
            encoder_hidden_states: x.remove("encoder_hidden_states").unwrap(),
            pooled_projections: x.remove("pooled_projections").unwrap(),
            timestep: x.remove("timestep").unwrap(),
            img_ids: x.remove("img_ids").unwrap(),
            txt_ids: x.remove("txt_ids").unwrap(),
            guidance: x.remove("guidance"),
        };
        assert_eq!(
            inputs.guidance.is_some(),
            model.cfg.guidance_embeds,
            "{name}"
        );
        let expected = read(&dir.join("output.safetensors"))
            .remove("sample")
            .unwrap();
        let got = tch::no_grad(|| model.forward(&inputs)).unwrap();
        assert_eq!(got.size(), expected.size(), "{name}: shape");
        let err = f64::try_from((&got - &expected).abs().max()).unwrap();
        let scale = f64::try_from(expected.abs().max()).unwrap();
        println!("{name}: max abs err {err:.3e} (output max {scale:.3})");
        assert!(scale > 0.1, "{name}: reference output is degenerate");
        assert!(err <= TOLERANCE, "{name}: max abs err {err} > {TOLERANCE}");
    }
}

#[test]
fn forward_is_differentiable() {
    let dir = fixtures().join("basic");
    let cfg = diffmesh_model::flux::FluxConfig::from_dir(&dir.join("transformer")).unwrap();
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let model = FluxTransformer::new(&vs.root(), cfg).unwrap();
    let mut x = read(&dir.join("inputs.safetensors"));
    let inputs = FluxInputs {
        hidden_states: x.remove("hidden_states").unwrap(),
        encoder_hidden_states: x.remove("encoder_hidden_states").unwrap(),
        pooled_projections: x.remove("pooled_projections").unwrap(),
        timestep: x.remove("timestep").unwrap(),
        img_ids: x.remove("img_ids").unwrap(),
        txt_ids: x.remove("txt_ids").unwrap(),
        guidance: None,
    };
    let loss = model.forward(&inputs).unwrap().square().mean(Kind::Float);
    loss.backward();
    let w = &model.transformer_blocks[0].img.to_k.weight;
    let g = w.grad();
    assert!(
        g.defined() && f64::try_from(g.abs().sum(Kind::Float)).unwrap() > 0.0,
        "no gradient reached to_k"
    );
}

#[test]
fn loading_names_missing_and_misshaped_keys() {
    let src = fixtures().join("basic").join("transformer");
    let bad = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flux_parity_bad");
    let _ = std::fs::remove_dir_all(&bad);
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(src.join("config.json"), bad.join("config.json")).unwrap();
    let mut ckpt = read(&src.join("diffusion_pytorch_model.safetensors"));
    assert!(ckpt
        .remove("transformer_blocks.1.attn.norm_added_k.weight")
        .is_some());
    let w = ckpt
        .remove("single_transformer_blocks.0.proj_mlp.weight")
        .unwrap();
    ckpt.insert(
        "single_transformer_blocks.0.proj_mlp.weight".into(),
        w.narrow(0, 0, 3),
    );
    let named: Vec<(String, Tensor)> = ckpt.into_iter().collect();
    Tensor::write_safetensors(&named, bad.join("diffusion_pytorch_model.safetensors")).unwrap();
    let err = FluxTransformer::load(&bad, Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("missing key: transformer_blocks.1.attn.norm_added_k.weight"),
        "{err}"
    );
    assert!(
        err.contains("mis-shaped key: single_transformer_blocks.0.proj_mlp.weight"),
        "{err}"
    );
}
