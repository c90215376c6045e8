//! LoRA patching against diffusers 0.42.1 + PEFT: the same random adapters, loaded by diffusers as
//! unmerged LoRA layers and by us from the same files and patched into the weights in place, give
//! the same outputs; and restoring gives the base model back bit for bit. Fixtures come from
//! `python/parity/gen_lora.py`, run here with `$DIFFMESH_PYTHON` (default: the project venv).
use diffmesh_denoiser::lora::adapter_from_bytes;
use diffmesh_model::flux::{FluxInputs, FluxTransformer};
use diffmesh_model::lora::{LoraAdapter, LoraPatcher, WeightedLora};
use diffmesh_model::tch::{self, Device, Kind, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const TOLERANCE: f64 = 1e-4;
/// The trained LoRA of the default model (`cargo xtask train-tiny lora`).
const SHIPPED_LORA: &str = "weights/tiny-loras/outline.safetensors";

fn fixtures() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(generate).clone()
}

fn generate() -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("lora_parity");
    let _ = std::fs::remove_dir_all(&out);
    let python = std::env::var("DIFFMESH_PYTHON")
        .unwrap_or_else(|_| "/root/.cache/diffmesh/venv/bin/python".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/parity/gen_lora.py");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let status = std::process::Command::new(&python)
        .arg(&script)
        .arg("--out")
        .arg(&out)
        .arg("--shipped")
        .arg(repo.join("weights/tiny"))
        .arg(repo.join(SHIPPED_LORA))
        .status()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    assert!(status.success(), "{} failed: {status}", script.display());
    out
}

fn read(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}

fn adapter(dir: &Path, name: &str) -> LoraAdapter {
    let bytes = std::fs::read(dir.join(format!("{name}.safetensors"))).unwrap();
    adapter_from_bytes(name, &bytes).unwrap()
}

fn max_err(a: &Tensor, b: &Tensor) -> f64 {
    f64::try_from((a - b).abs().max()).unwrap()
}

fn inputs_of(mut x: HashMap<String, Tensor>) -> FluxInputs {
    FluxInputs {
        hidden_states: x.remove("hidden_states").unwrap(),
        encoder_hidden_states: x.remove("encoder_hidden_states").unwrap(),
        pooled_projections: x.remove("pooled_projections").unwrap(),
        timestep: x.remove("timestep").unwrap(),
        img_ids: x.remove("img_ids").unwrap(),
        txt_ids: x.remove("txt_ids").unwrap(),
        guidance: None,
    }
}

#[test]
fn patched_weights_match_diffusers_peft_and_restore_exactly() {
    let dir = fixtures();
    let (model, vs) =
        FluxTransformer::load(&dir.join("transformer"), Device::Cpu, Kind::Float).unwrap();
    let inputs = inputs_of(read(&dir.join("inputs.safetensors")));
    let expected = read(&dir.join("outputs.safetensors"));
    let forward = || tch::no_grad(|| model.forward(&inputs)).unwrap();
    let base = forward();
    assert!(max_err(&base, &expected["base"]) <= TOLERANCE);

    let (a, b) = (adapter(&dir, "lora_a"), adapter(&dir, "lora_b"));
    assert_eq!(a.deltas.len(), 35, "every adapted layer of lora_a");
    let a = WeightedLora {
        adapter: &a,
        weight: 0.7,
    };
    let b = WeightedLora {
        adapter: &b,
        weight: -0.5,
    };
    let mut patcher = LoraPatcher::new(&vs);
    for (set, name) in [(vec![a], "a"), (vec![a, b], "ab")] {
        let stats = patcher.apply(&set).unwrap();
        assert!(stats.layers > 0);
        let got = forward();
        let err = max_err(&got, &expected[name]);
        let moved = max_err(&expected[name], &expected["base"]);
        println!("{name}: max abs err {err:.3e} (the adapters move the output by {moved:.3})");
        assert!(err <= TOLERANCE, "{name}: max abs err {err} > {TOLERANCE}");
    }
    patcher.restore().unwrap();
    assert!(
        forward().equal(&base),
        "restoring gives the base model back exactly"
    );
}

#[test]
fn an_adapter_for_another_model_is_refused_by_name() {
    let dir = fixtures();
    let (_, vs) =
        FluxTransformer::load(&dir.join("transformer"), Device::Cpu, Kind::Float).unwrap();
    let mut a =
        adapter_from_bytes("a", &std::fs::read(dir.join("lora_a.safetensors")).unwrap()).unwrap();
    a.deltas[0].module = "transformer_blocks.7.attn.to_q".into();
    let err = LoraPatcher::new(&vs).check(&a).unwrap_err().to_string();
    assert!(err.contains("transformer_blocks.7.attn.to_q"), "{err}");
}

#[test]
fn the_shipped_tiny_lora_loads_in_diffusers_as_it_does_here() {
    let dir = fixtures();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (model, vs) = FluxTransformer::load(
        &repo.join("weights/tiny/transformer"),
        Device::Cpu,
        Kind::Float,
    )
    .unwrap();
    let inputs = inputs_of(read(&dir.join("shipped_inputs.safetensors")));
    let expected = read(&dir.join("shipped_outputs.safetensors"));
    let lora =
        adapter_from_bytes("outline", &std::fs::read(repo.join(SHIPPED_LORA)).unwrap()).unwrap();
    let mut patcher = LoraPatcher::new(&vs);
    patcher
        .apply(&[WeightedLora {
            adapter: &lora,
            weight: 1.0,
        }])
        .unwrap();
    let got = tch::no_grad(|| model.forward(&inputs)).unwrap();
    let err = max_err(&got, &expected["lora"]);
    println!("shipped LoRA: max abs err {err:.3e}");
    assert!(err <= TOLERANCE, "max abs err {err} > {TOLERANCE}");
}
