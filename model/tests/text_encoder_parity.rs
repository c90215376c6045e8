//! CLIPTextModel and T5EncoderModel against transformers 5.25 (python/parity/gen_text_encoders.py)
//! on reduced configs with random weights: last hidden states and CLIP's pooled output within
//! 1e-4 in f32 (for CLIP also the penultimate hidden states SDXL reads, and the projected
//! pooled output of `CLIPTextModelWithProjection`), and within one unit in the last place in bf16 and f16 (where transformers keeps
//! T5's `wo` in f32; T5 v1.1's `gelu_new` is computed op by op as transformers writes it). Checkpoints in transformers 4's key names and sharded ones load too.
mod py_fixture;

use diffmesh_model::text::{ClipTextModel, ClipTextModelWithProjection, T5EncoderModel};
use py_fixture::{generate, max_abs_diff, read_tensors};
use tch::{Device, Kind, Tensor};

const F32_TOL: f64 = 1e-4;

/// Allowed error relative to the reference's largest magnitude, by dtype.
fn tolerance(tag: &str, reference: &Tensor) -> f64 {
    let scale = reference.abs().max().double_value(&[]).max(1.0);
    match tag {
        "f32" => F32_TOL,
        // The same ops in the same order as transformers: measured 0 on every case; one unit in
        // the last place of the largest value is the margin.
        "f16" => 1e-3 * scale,
        _ => 8e-3 * scale,
    }
}

const DTYPES: [(&str, Kind); 3] = [
    ("f32", Kind::Float),
    ("bf16", Kind::BFloat16),
    ("f16", Kind::Half),
];

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    family: String,
    lengths: Vec<i64>,
}

#[test]
fn text_encoders_match_transformers() {
    let dir = generate("gen_text_encoders.py", &[], "parity-text-encoders");
    let cases: Vec<Case> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).expect("cases"))
            .expect("json");
    assert_eq!(cases.len(), 5);
    for case in &cases {
        let folder = dir.join(&case.name);
        let io = read_tensors(&folder.join("io.safetensors"));
        for (tag, kind) in DTYPES {
            for length in &case.lengths {
                let ids = &io[&format!("input_ids_{length}")];
                let mut outputs: Vec<(&str, Tensor)> = Vec::new();
                tch::no_grad(|| match case.family.as_str() {
                    "clip" => {
                        let (model, _vs) =
                            ClipTextModel::load(&folder, Device::Cpu, kind).expect("load clip");
                        let out = model.forward(ids).expect("clip forward");
                        outputs.push(("last_hidden_state", out.last_hidden_state));
                        outputs.push(("pooler_output", out.pooler_output));
                        outputs.push(("penultimate_hidden_state", out.penultimate_hidden_state));
                    }
                    "clip_projection" => {
                        let (model, _vs) =
                            ClipTextModelWithProjection::load(&folder, Device::Cpu, kind)
                                .expect("load clip with projection");
                        let out = model.forward(ids).expect("clip forward");
                        outputs.push(("text_embeds", out.text_embeds));
                        outputs.push(("last_hidden_state", out.text.last_hidden_state));
                        let penultimate = out.text.penultimate_hidden_state;
                        outputs.push(("penultimate_hidden_state", penultimate));
                    }
                    _ => {
                        let (model, _vs) =
                            T5EncoderModel::load(&folder, Device::Cpu, kind).expect("load t5");
                        outputs
                            .push(("last_hidden_state", model.forward(ids).expect("t5 forward")));
                    }
                });
                for (what, got) in outputs {
                    assert_eq!(got.kind(), kind, "{}: {what} dtype", case.name);
                    let want = &io[&format!("{what}_{length}_{tag}")];
                    let err = max_abs_diff(&got.to_kind(Kind::Float), want);
                    let tol = tolerance(tag, want);
                    println!(
                        "{} T={length} {tag} {what}: max abs error {err:.2e} (tol {tol:.1e})",
                        case.name
                    );
                    assert!(
                        err <= tol,
                        "{} T={length} {tag}: {what} max abs error {err} > {tol}",
                        case.name
                    );
                }
            }
        }
    }
}

#[test]
fn text_encoder_loading_names_what_is_wrong() {
    let dir = generate("gen_text_encoders.py", &[], "parity-text-encoders-errors");
    let scratch = tempfile::tempdir().expect("tempdir");

    // A weight of the wrong shape and a missing one are both named.
    let src = dir.join("clip_gelu_eos_id");
    let bad = scratch.path().join("clip_bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::copy(src.join("config.json"), bad.join("config.json")).unwrap();
    let mut tensors: Vec<(String, Tensor)> =
        Tensor::read_safetensors(src.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .filter(|(k, _)| k != "final_layer_norm.bias")
            .collect();
    for (k, t) in tensors.iter_mut() {
        if k == "encoder.layers.0.mlp.fc1.weight" {
            *t = Tensor::zeros([3, 3], (Kind::Float, Device::Cpu));
        }
    }
    Tensor::write_safetensors(&tensors, bad.join("model.safetensors")).unwrap();
    let err = ClipTextModel::load(&bad, Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing key: final_layer_norm.bias"), "{err}");
    assert!(
        err.contains("mis-shaped key: encoder.layers.0.mlp.fc1.weight"),
        "{err}"
    );

    // Config values that cannot work name their field.
    let t5 = dir.join("t5_relu_short_distance");
    for (field, value) in [
        ("feed_forward_proj", serde_json::json!("gated-gelu-new")),
        ("num_heads", serde_json::json!(0)),
    ] {
        let folder = scratch.path().join(format!("t5_{field}"));
        std::fs::create_dir(&folder).unwrap();
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(t5.join("config.json")).unwrap())
                .unwrap();
        config[field] = value;
        std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
        let err = T5EncoderModel::load(&folder, Device::Cpu, Kind::Float)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{field}: {err}");
    }

    // Too many tokens for CLIP's position table is an input error, not a panic.
    let (clip, _vs) = ClipTextModel::load(&src, Device::Cpu, Kind::Float).expect("load");
    let ids = Tensor::zeros([1, 78], (Kind::Int64, Device::Cpu));
    let err = clip.forward(&ids).unwrap_err().to_string();
    assert!(err.contains("input_ids"), "{err}");
}
