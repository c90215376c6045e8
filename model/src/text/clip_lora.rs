//! Which CLIP text encoder's layer a LoRA key adapts, in the two layouts people have (issue 48):
//!
//! - **diffusers / PEFT**: `text_encoder.<module>.lora_A.weight` / `.lora_B.weight` (and
//!   `text_encoder_2.` for SDXL's second encoder), `<module>` being transformers' path
//!   (`encoder.layers.0.self_attn.q_proj`, `text_model.encoder...` from transformers 4);
//! - **kohya / A1111**: `lora_te_<name>` (SD 1.x/2.x's one encoder), `lora_te1_<name>` and
//!   `lora_te2_<name>` (SDXL's two), with `.lora_down.weight`, `.lora_up.weight` and `.alpha`,
//!   `<name>` being the path with `_` for `.`.
//!
//! Names are resolved against the encoder's own linear layers, so nothing is guessed from the
//! underscores; transformers 4's `text_model.` before the encoder's layers may be there or not.
use crate::error::{ModelError, Result};

/// A key's part of an adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraRole {
    /// `lora_A` / `lora_down`: `[rank, in]`.
    Down,
    /// `lora_B` / `lora_up`: `[out, rank]`.
    Up,
    /// kohya's (and diffusers' network) `alpha`.
    Alpha,
}

/// A text-encoder key, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextEncoderKey {
    /// The encoder, in the pipeline's order (0: `text_encoder`, 1: `text_encoder_2`).
    pub encoder: usize,
    /// The layer's path in diffmesh's CLIP (its weight is `<module>.weight`).
    pub module: String,
    pub role: LoraRole,
}

/// Whether `key` belongs to a text encoder's adapter (of either layout).
pub fn is_text_encoder_key(key: &str) -> bool {
    key.starts_with("text_encoder") || key.starts_with("lora_te")
}

/// The PEFT metadata prefix of encoder `encoder`'s config (`text_encoder.`, `text_encoder_2.`).
pub fn metadata_prefix(encoder: usize) -> String {
    match encoder {
        0 => "text_encoder.".into(),
        n => format!("text_encoder_{}.", n + 1),
    }
}

/// Resolve the text-encoder key `key` against `modules`, each encoder's linear layers as
/// diffmesh names them (`encoder.layers.0.self_attn.q_proj`, `text_projection`). The error
/// names the key.
pub fn resolve_text_encoder_key(key: &str, modules: &[Vec<String>]) -> Result<TextEncoderKey> {
    let (encoder, rest, kohya) = split_encoder(key).ok_or_else(|| {
        ModelError::input(
            key,
            "not a text-encoder LoRA key (`text_encoder.<module>.lora_A.weight`, or kohya's \
             `lora_te_`/`lora_te1_`/`lora_te2_<name>.lora_down.weight`)",
        )
    })?;
    let Some(own) = modules.get(encoder) else {
        return Err(ModelError::input(
            key,
            format!(
                "names text encoder {} of a model that has {}",
                encoder + 1,
                modules.len()
            ),
        ));
    };
    let suffixes: [(&str, LoraRole); 3] = if kohya {
        [
            (".lora_down.weight", LoraRole::Down),
            (".lora_up.weight", LoraRole::Up),
            (".alpha", LoraRole::Alpha),
        ]
    } else {
        [
            (".lora_A.weight", LoraRole::Down),
            (".lora_B.weight", LoraRole::Up),
            (".alpha", LoraRole::Alpha),
        ]
    };
    let (name, role) = suffixes
        .iter()
        .find_map(|(suffix, role)| rest.strip_suffix(suffix).map(|n| (n, *role)))
        .ok_or_else(|| {
            ModelError::input(
                key,
                "is neither an adapter's down (lora_A / lora_down) nor up (lora_B / lora_up) \
                 matrix nor its alpha",
            )
        })?;
    // transformers 4 names the encoder's layers under `text_model.` (kohya's files and older
    // diffusers files keep it); transformers 5 and diffmesh's CLIP do not.
    let name = name
        .strip_prefix(if kohya { "text_model_" } else { "text_model." })
        .unwrap_or(name);
    let module = own
        .iter()
        .find(|m| {
            if kohya {
                m.replace('.', "_") == name
            } else {
                m.as_str() == name
            }
        })
        .ok_or_else(|| {
            ModelError::input(key, "names no linear layer of this model's text encoder")
        })?;
    Ok(TextEncoderKey {
        encoder,
        module: module.clone(),
        role,
    })
}

/// The encoder a key names, the rest of the key, and whether it is kohya's layout.
fn split_encoder(key: &str) -> Option<(usize, &str, bool)> {
    let prefixes = [
        ("text_encoder_2.", 1, false),
        ("text_encoder.", 0, false),
        ("lora_te_", 0, true),
        ("lora_te1_", 0, true),
        ("lora_te2_", 1, true),
    ];
    prefixes
        .iter()
        .find_map(|(p, e, k)| key.strip_prefix(p).map(|rest| (*e, rest, *k)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn modules() -> Vec<Vec<String>> {
        let clip = vec![
            "encoder.layers.0.self_attn.q_proj".to_string(),
            "encoder.layers.0.mlp.fc1".to_string(),
        ];
        let mut second = clip.clone();
        second.push("text_projection".into());
        vec![clip, second]
    }

    #[test]
    fn both_layouts_resolve_to_the_encoders_layers() {
        let m = modules();
        let cases = [
            (
                "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight",
                0,
                "encoder.layers.0.self_attn.q_proj",
                LoraRole::Down,
            ),
            (
                "text_encoder.encoder.layers.0.mlp.fc1.lora_B.weight",
                0,
                "encoder.layers.0.mlp.fc1",
                LoraRole::Up,
            ),
            (
                "text_encoder_2.text_projection.lora_B.weight",
                1,
                "text_projection",
                LoraRole::Up,
            ),
            (
                "lora_te_text_model_encoder_layers_0_mlp_fc1.alpha",
                0,
                "encoder.layers.0.mlp.fc1",
                LoraRole::Alpha,
            ),
            (
                "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight",
                1,
                "encoder.layers.0.mlp.fc1",
                LoraRole::Up,
            ),
        ];
        for (key, encoder, module, role) in cases {
            let got = resolve_text_encoder_key(key, &m).unwrap();
            assert_eq!(
                got,
                TextEncoderKey {
                    encoder,
                    module: module.into(),
                    role
                },
                "{key}"
            );
        }
    }

    #[test]
    fn refusals_name_the_key() {
        let one = vec![modules().remove(0)];
        for (key, why) in [
            (
                "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight",
                "text encoder 2",
            ),
            (
                "lora_te1_text_model_encoder_layers_9_mlp_fc1.lora_up.weight",
                "no linear layer",
            ),
            (
                "text_encoder.text_model.encoder.layers.0.mlp.fc1.lora_magnitude_vector",
                "neither",
            ),
        ] {
            let err = resolve_text_encoder_key(key, &one).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(why), "{key}: {err}");
        }
    }
}
