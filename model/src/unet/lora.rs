//! LoRA files for the UNet family in the two layouts people have (issue 48), read into a
//! [`LoraAdapter`] that [`crate::lora::LoraPatcher`] patches into the UNet's linear layers:
//!
//! - **diffusers / PEFT**: `unet.<module>.lora_A.weight` and `.lora_B.weight`, the scale
//!   `lora_alpha / r` from the PEFT config in the `lora_adapter_metadata` entry (keys prefixed
//!   `unet.`), else 1 (alpha = rank), as `load_lora_weights` reads them;
//! - **kohya / A1111**: `lora_unet_<name>.lora_down.weight`, `.lora_up.weight` and `.alpha`
//!   (scale `alpha / rank`), where `<name>` is the module path with `_` for `.`, in diffusers'
//!   block names (kohya's SD1.x files) or in SGM's (`input_blocks_4_1_...`, `middle_block_1_...`,
//!   `output_blocks_2_0_...`: its SDXL files). Names are resolved against the UNet's own
//!   modules, so nothing is guessed from the underscores.
//!
//! Text encoders' adapters (`text_encoder.`, `text_encoder_2.`, kohya's `lora_te_`, `lora_te1_`,
//! `lora_te2_`) are read against the CLIP encoders' linear layers the caller passes
//! ([`crate::text::clip_lora`]) and patched by [`crate::stable_diffusion::text_lora`]; a caller
//! with no CLIP encoders (the tiny text encoder) passes none, and they are counted and left out.
//! Adapters of convolutions (LoCon) are refused, naming the key.
use super::config::UNetConfig;
use crate::error::{ModelError, Result};
use crate::lora::{LoraAdapter, LoraDelta};
use crate::safetensors_file::SafetensorsFile;
use crate::text::clip_lora::{
    is_text_encoder_key, metadata_prefix, resolve_text_encoder_key, LoraRole,
};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// A UNet LoRA file, read.
#[derive(Debug)]
pub struct UNetLora {
    /// The UNet's adapter (no layer when the file adapts only text encoders).
    pub adapter: LoraAdapter,
    /// Per text encoder the caller passed (in the pipeline's order), its adapter where the file
    /// has one.
    pub text_encoders: Vec<Option<LoraAdapter>>,
    /// Keys of text-encoder adapters left out (the caller passed no text encoders).
    pub text_encoder_keys: usize,
}

/// What a file's adapters may patch: the UNet, and the pipeline's CLIP text encoders (none:
/// their keys are left out).
#[derive(Debug, Clone, Copy)]
pub struct LoraTargets<'a> {
    pub config: &'a UNetConfig,
    /// The UNet's linear layers (paths without `.weight`).
    pub unet_modules: &'a [String],
    /// Per CLIP text encoder, its linear layers.
    pub text_modules: &'a [Vec<String>],
}

/// Where an adapter's layer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Network {
    Unet,
    TextEncoder(usize),
}

/// The PEFT config entries that set a module's scale.
#[derive(Debug, Default, serde::Deserialize)]
struct Peft {
    r: Option<f64>,
    lora_alpha: Option<f64>,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    rank_pattern: BTreeMap<String, f64>,
    #[serde(default)]
    alpha_pattern: BTreeMap<String, f64>,
}

/// Read the adapters of the LoRA file `path` for `targets`.
pub fn read_unet_lora(id: &str, path: &Path, targets: LoraTargets<'_>) -> Result<UNetLora> {
    read_unet_lora_from(id, SafetensorsFile::open(path)?, targets)
}

/// [`read_unet_lora`] of a file held in memory (the denoiser's LoRA cache holds them so).
pub fn read_unet_lora_bytes<B: AsRef<[u8]> + Send + 'static>(
    id: &str,
    bytes: B,
    targets: LoraTargets<'_>,
) -> Result<UNetLora> {
    read_unet_lora_from(id, SafetensorsFile::from_bytes(id, bytes)?, targets)
}

fn read_unet_lora_from(
    id: &str,
    mut file: SafetensorsFile,
    targets: LoraTargets<'_>,
) -> Result<UNetLora> {
    let LoraTargets {
        config,
        unet_modules: modules,
        text_modules,
    } = targets;
    let encoders = text_modules.len();
    let mut pefts = vec![peft_config(file.metadata(), "unet.")?];
    for e in 0..encoders {
        pefts.push(peft_config(file.metadata(), &metadata_prefix(e))?);
    }
    // Every linear layer by its path with `_` for `.` (kohya's spelling).
    let by_kohya: HashMap<String, &String> =
        modules.iter().map(|m| (m.replace('.', "_"), m)).collect();
    let keys: Vec<String> = file.entries().keys().cloned().collect();
    #[derive(Default)]
    struct Parts {
        down: Option<String>,
        up: Option<String>,
        alpha: Option<String>,
    }
    let mut parts: BTreeMap<(Network, String), Parts> = BTreeMap::new();
    let mut text_encoder_keys = 0;
    for key in &keys {
        if is_text_encoder_key(key) {
            if encoders == 0 {
                text_encoder_keys += 1;
                continue;
            }
            let resolved = resolve_text_encoder_key(key, text_modules)?;
            let role = match resolved.role {
                LoraRole::Down => 0,
                LoraRole::Up => 1,
                LoraRole::Alpha => 2,
            };
            let entry = parts
                .entry((Network::TextEncoder(resolved.encoder), resolved.module))
                .or_default();
            *[&mut entry.down, &mut entry.up, &mut entry.alpha][role] = Some(key.clone());
            continue;
        }
        let (module, role) = if let Some(rest) = key.strip_prefix("unet.") {
            let split = [(".lora_A.weight", 0), (".lora_B.weight", 1), (".alpha", 2)]
                .into_iter()
                .find_map(|(suffix, role)| {
                    rest.strip_suffix(suffix).map(|m| (m.to_string(), role))
                });
            split.ok_or_else(|| not_lora(key))?
        } else if let Some(rest) = key.strip_prefix("lora_unet_") {
            let (name, role) = [
                (".lora_down.weight", 0),
                (".lora_up.weight", 1),
                (".alpha", 2),
            ]
            .into_iter()
            .find_map(|(suffix, role)| rest.strip_suffix(suffix).map(|m| (m, role)))
            .ok_or_else(|| not_lora(key))?;
            let diffusers_name = from_sgm(name, config)?.unwrap_or_else(|| name.to_string());
            let module = by_kohya.get(&diffusers_name).ok_or_else(|| {
                ModelError::input(
                    key.as_str(),
                    "names no linear layer of this UNet (convolution adapters are not supported)",
                )
            })?;
            ((*module).clone(), role)
        } else {
            return Err(not_lora(key));
        };
        let entry = parts.entry((Network::Unet, module)).or_default();
        let slot = match role {
            0 => &mut entry.down,
            1 => &mut entry.up,
            _ => &mut entry.alpha,
        };
        *slot = Some(key.clone());
    }
    let mut deltas: Vec<Vec<LoraDelta>> = (0..=encoders).map(|_| Vec::new()).collect();
    for ((network, module), p) in parts {
        let slot = match network {
            Network::Unet => 0,
            Network::TextEncoder(e) => e + 1,
        };
        let peft = &pefts[slot];
        let (Some(down_key), Some(up_key)) = (p.down, p.up) else {
            return Err(ModelError::input(
                module.as_str(),
                "needs both the down (lora_A) and the up (lora_B) matrix",
            ));
        };
        let down = file.read(&down_key)?;
        let up = file.read(&up_key)?;
        if down.dim() != 2 || up.dim() != 2 {
            return Err(ModelError::input(
                down_key.as_str(),
                format!(
                    "{:?} and {:?}: only linear layers' adapters (2-D) are supported",
                    down.size(),
                    up.size()
                ),
            ));
        }
        let rank = down.size()[0] as f64;
        let alpha = match &p.alpha {
            Some(key) => Some(file.read(key)?.f_double_value(&[])?),
            None => None,
        };
        let scale = match alpha {
            // rsLoRA divides by the rank's root whatever gives alpha (as the gateway's parse).
            Some(alpha) if peft.use_rslora => alpha / rank.sqrt(),
            Some(alpha) => alpha / rank,
            None => peft.scale(rank),
        };
        if !scale.is_finite() {
            return Err(ModelError::input(
                down_key.as_str(),
                format!("scale {scale} is not finite"),
            ));
        }
        deltas[slot].push(LoraDelta {
            module,
            down,
            up,
            scale,
        });
    }
    if deltas.iter().all(Vec::is_empty) {
        return Err(ModelError::input(
            "file",
            "holds no adapter of this model (UNet or text encoder)",
        ));
    }
    let mut deltas = deltas.into_iter();
    let adapter = |deltas: Vec<LoraDelta>| LoraAdapter {
        id: id.to_string(),
        deltas,
    };
    Ok(UNetLora {
        adapter: adapter(deltas.next().unwrap_or_default()),
        text_encoders: deltas
            .map(|d| (!d.is_empty()).then(|| adapter(d)))
            .collect(),
        text_encoder_keys,
    })
}

fn not_lora(key: &str) -> ModelError {
    ModelError::input(
        key,
        "not a UNet LoRA key (`unet.<module>.lora_A.weight` / `.lora_B.weight`, or kohya's \
         `lora_unet_<name>.lora_down.weight` / `.lora_up.weight` / `.alpha`)",
    )
}

impl Peft {
    fn scale(&self, rank: f64) -> f64 {
        let alpha = self.lora_alpha.unwrap_or(self.r.unwrap_or(rank));
        if self.use_rslora {
            alpha / rank.sqrt()
        } else {
            alpha / rank
        }
    }
}

/// The part of the PEFT config in the file's metadata under `prefix` (`unet.`,
/// `text_encoder.`, ...; patterns are refused).
fn peft_config(metadata: &BTreeMap<String, String>, prefix: &str) -> Result<Peft> {
    let Some(raw) = metadata.get("lora_adapter_metadata") else {
        return Ok(Peft::default());
    };
    let all: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(raw).map_err(|e| {
            ModelError::input(
                "lora_adapter_metadata",
                format!("is not a JSON object: {e}"),
            )
        })?;
    let ours: serde_json::Map<String, serde_json::Value> = all
        .into_iter()
        .filter_map(|(k, v)| k.strip_prefix(prefix).map(|k| (k.to_string(), v)))
        .collect();
    let network = prefix.trim_end_matches('.');
    let peft: Peft = serde_json::from_value(serde_json::Value::Object(ours)).map_err(|e| {
        ModelError::input("lora_adapter_metadata", format!("{network} config: {e}"))
    })?;
    if !peft.rank_pattern.is_empty() || !peft.alpha_pattern.is_empty() {
        return Err(ModelError::input(
            "lora_adapter_metadata",
            format!("rank_pattern / alpha_pattern ({network}) are not supported yet"),
        ));
    }
    Ok(peft)
}

/// A kohya name in SGM's block names as diffusers' (`_` for `.`), or None when it is not one.
/// SGM numbers the down path's blocks `input_blocks_<i>_<j>` (block 0 is `conv_in`; then per
/// level `layers_per_block` pairs of resnet `_0` and attention `_1`, and a downsampler `_0_op`),
/// the mid block's `middle_block_<0|1|2>` (resnet, attention, resnet), the up path's
/// `output_blocks_<i>_<j>` (`layers_per_block + 1` per level; `_2` or a level's last `_1` for
/// the upsampler), as diffusers' `_maybe_map_sgm_blocks_to_diffusers` reads them; and inside a
/// resnet `emb_layers_1` is `time_emb_proj`.
fn from_sgm(name: &str, config: &UNetConfig) -> Result<Option<String>> {
    let per_level = |field: &str| -> Result<i64> {
        match &config.layers_per_block {
            super::config::PerLevel::One(l) => Ok(*l),
            super::config::PerLevel::Each(_) => Err(ModelError::input(
                field,
                "SGM block names need one layers_per_block for every level",
            )),
        }
    };
    let fixed = [
        ("time_embed_0", "time_embedding_linear_1"),
        ("time_embed_2", "time_embedding_linear_2"),
        ("label_emb_0_0", "add_embedding_linear_1"),
        ("label_emb_0_2", "add_embedding_linear_2"),
    ];
    if let Some((_, to)) = fixed.iter().find(|(from, _)| name == *from) {
        return Ok(Some(to.to_string()));
    }
    let numbers = |rest: &str| -> Option<(i64, i64, String)> {
        let mut it = rest.splitn(3, '_');
        let i = it.next()?.parse().ok()?;
        let j = it.next()?.parse().ok()?;
        Some((i, j, it.next().unwrap_or("").to_string()))
    };
    let resnet_inside = |tail: &str| tail.replace("emb_layers_1", "time_emb_proj");
    let mapped = if let Some(rest) = name.strip_prefix("input_blocks_") {
        let l = per_level(name)?;
        let Some((i, j, tail)) = numbers(rest) else {
            return Ok(None);
        };
        if i == 0 {
            return Ok(None);
        }
        let (block, layer) = ((i - 1) / (l + 1), (i - 1) % (l + 1));
        match j {
            0 => format!(
                "down_blocks_{block}_resnets_{layer}_{}",
                resnet_inside(&tail)
            ),
            _ => format!("down_blocks_{block}_attentions_{layer}_{tail}"),
        }
    } else if let Some(rest) = name.strip_prefix("middle_block_") {
        let mut it = rest.splitn(2, '_');
        let i: i64 = it.next().and_then(|i| i.parse().ok()).unwrap_or(-1);
        let tail = it.next().unwrap_or("");
        match i {
            0 => format!("mid_block_resnets_0_{}", resnet_inside(tail)),
            1 => format!("mid_block_attentions_0_{tail}"),
            2 => format!("mid_block_resnets_1_{}", resnet_inside(tail)),
            _ => return Ok(None),
        }
    } else if let Some(rest) = name.strip_prefix("output_blocks_") {
        let l = per_level(name)?;
        let Some((i, j, tail)) = numbers(rest) else {
            return Ok(None);
        };
        let (block, layer) = (i / (l + 1), i % (l + 1));
        match j {
            0 => format!("up_blocks_{block}_resnets_{layer}_{}", resnet_inside(&tail)),
            1 => format!("up_blocks_{block}_attentions_{layer}_{tail}"),
            _ => format!("up_blocks_{block}_upsamplers_0_{tail}"),
        }
    } else {
        return Ok(None);
    };
    Ok(Some(mapped))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgm_names_map_to_diffusers_blocks() {
        let sdxl = UNetConfig::default(); // layers_per_block 2, as SDXL's
        let cases = [
            (
                "input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                "down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q",
            ),
            (
                "input_blocks_8_0_emb_layers_1",
                "down_blocks_2_resnets_1_time_emb_proj",
            ),
            ("middle_block_1_proj_in", "mid_block_attentions_0_proj_in"),
            (
                "middle_block_2_emb_layers_1",
                "mid_block_resnets_1_time_emb_proj",
            ),
            (
                "output_blocks_2_1_transformer_blocks_1_ff_net_2",
                "up_blocks_0_attentions_2_transformer_blocks_1_ff_net_2",
            ),
            (
                "output_blocks_5_0_emb_layers_1",
                "up_blocks_1_resnets_2_time_emb_proj",
            ),
            ("label_emb_0_2", "add_embedding_linear_2"),
        ];
        for (sgm, diffusers) in cases {
            assert_eq!(
                from_sgm(sgm, &sdxl).unwrap().as_deref(),
                Some(diffusers),
                "{sgm}"
            );
        }
        assert_eq!(
            from_sgm("down_blocks_1_attentions_0_proj_in", &sdxl).unwrap(),
            None
        );
    }
}
