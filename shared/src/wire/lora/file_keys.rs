//! How a LoRA file's header is read key by key: which network and layout a key belongs to and
//! its role (`key_role`), the PEFT config diffusers stores in the metadata (`PeftConfig`), and
//! the dtypes and `alpha` scalars it holds.
use super::{
    bad, LoraFormatError, LoraTarget, KOHYA_UNET_PREFIX, METADATA_KEY, TRANSFORMER_PREFIX,
    UNET_PREFIX,
};
use safetensors::tensor::Dtype;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};

/// The PEFT config fields that change a module's scale (the rest is ignored).
#[derive(Debug, Default, Deserialize)]
pub(super) struct PeftConfig {
    pub(super) r: Option<f64>,
    pub(super) lora_alpha: Option<f64>,
    #[serde(default)]
    pub(super) use_rslora: bool,
    #[serde(default)]
    pub(super) use_dora: bool,
    #[serde(default)]
    pub(super) lora_bias: bool,
    #[serde(default)]
    pub(super) rank_pattern: BTreeMap<String, f64>,
    #[serde(default)]
    pub(super) alpha_pattern: BTreeMap<String, f64>,
}

impl PeftConfig {
    /// One network's config out of diffusers' metadata, which prefixes every key with the
    /// network's (`transformer.`, `unet.`).
    pub(super) fn from_metadata(
        metadata: Option<&HashMap<String, String>>,
        prefix: &str,
    ) -> Result<Self, LoraFormatError> {
        let Some(raw) = metadata.and_then(|m| m.get(METADATA_KEY)) else {
            return Ok(Self::default());
        };
        let all: serde_json::Map<String, serde_json::Value> = serde_json::from_str(raw)
            .map_err(|e| bad(METADATA_KEY, format!("is not a JSON object: {e}")))?;
        let ours: serde_json::Map<String, serde_json::Value> = all
            .into_iter()
            .filter_map(|(k, v)| k.strip_prefix(prefix).map(|k| (k.to_string(), v)))
            .collect();
        serde_json::from_value(serde_json::Value::Object(ours))
            .map_err(|e| bad(METADATA_KEY, format!("{prefix} config: {e}")))
    }

    /// PEFT's pattern rule: a key matches a module whose path is the key or ends in `.key`
    /// (keys are taken literally, not as regular expressions). The longest match wins.
    pub(super) fn pattern<'a>(
        patterns: &'a BTreeMap<String, f64>,
        module: &str,
    ) -> Option<&'a f64> {
        patterns
            .iter()
            .filter(|(k, _)| module == k.as_str() || module.ends_with(&format!(".{k}")))
            .max_by_key(|(k, _)| k.len())
            .map(|(_, v)| v)
    }

    pub(super) fn scale(&self, module: &str, rank: usize, alpha_tensor: Option<f64>) -> f64 {
        let rank_f = rank as f64;
        let alpha = alpha_tensor
            .or_else(|| Self::pattern(&self.alpha_pattern, module).copied())
            .or(self.lora_alpha)
            // diffusers without metadata: alpha = rank.
            .unwrap_or(rank_f);
        if self.use_rslora {
            alpha / rank_f.sqrt()
        } else {
            alpha / rank_f
        }
    }
}

/// The module path and role of one key.
pub(super) enum KeyRole<'a> {
    Down(&'a str),
    Up(&'a str),
    Alpha(&'a str),
}

/// How one key of a file is read: its network, whether its module is named kohya's way, and its
/// role; `None` for a text encoder's key (the denoiser's to resolve); an error for a key of
/// neither.
pub(super) fn key_role(
    key: &str,
) -> Result<Option<(LoraTarget, bool, KeyRole<'_>)>, LoraFormatError> {
    if key.starts_with("text_encoder") || key.starts_with("lora_te") {
        return Ok(None);
    }
    if let Some(rest) = key.strip_prefix(KOHYA_UNET_PREFIX) {
        let role = if let Some(m) = rest.strip_suffix(".lora_down.weight") {
            KeyRole::Down(m)
        } else if let Some(m) = rest.strip_suffix(".lora_up.weight") {
            KeyRole::Up(m)
        } else if let Some(m) = rest.strip_suffix(".alpha") {
            KeyRole::Alpha(m)
        } else if rest.ends_with(".dora_scale") {
            return Err(bad(key, "DoRA adapters are not supported"));
        } else {
            return Err(bad(
                key,
                "not a kohya LoRA key (expected `lora_unet_<name>.lora_down.weight`, `.lora_up.weight` or `.alpha`; LyCORIS variants are not supported)",
            ));
        };
        return Ok(Some((LoraTarget::Unet, true, role)));
    }
    let (target, rest) = if let Some(rest) = key.strip_prefix(TRANSFORMER_PREFIX) {
        (LoraTarget::Transformer, rest)
    } else if let Some(rest) = key.strip_prefix(UNET_PREFIX) {
        (LoraTarget::Unet, rest)
    } else {
        return Err(bad(
            key,
            "only transformer adapters (keys starting with `transformer.`) and UNet adapters (`unet.`, or kohya's `lora_unet_`) are supported",
        ));
    };
    let role = if let Some(m) = rest.strip_suffix(".lora_A.weight") {
        KeyRole::Down(m)
    } else if let Some(m) = rest.strip_suffix(".lora_B.weight") {
        KeyRole::Up(m)
    } else if let Some(m) = rest.strip_suffix(".alpha") {
        KeyRole::Alpha(m)
    } else if rest.contains("lora_magnitude_vector") {
        return Err(bad(key, "DoRA adapters are not supported"));
    } else if rest.ends_with(".lora_B.bias") {
        return Err(bad(key, "LoRA biases (lora_bias) are not supported"));
    } else {
        return Err(bad(
            key,
            "not a LoRA key (expected `<module>.lora_A.weight`, `<module>.lora_B.weight` or `<module>.alpha`)",
        ));
    };
    Ok(Some((target, false, role)))
}

pub(super) fn dtype_name(d: Dtype) -> Option<&'static str> {
    match d {
        Dtype::F32 => Some("F32"),
        Dtype::F16 => Some("F16"),
        Dtype::BF16 => Some("BF16"),
        _ => None,
    }
}

/// A one-element float tensor's value.
pub(super) fn scalar(key: &str, dtype: Dtype, data: &[u8]) -> Result<f64, LoraFormatError> {
    let v = match (dtype, data.len()) {
        (Dtype::F32, 4) => f32::from_le_bytes([data[0], data[1], data[2], data[3]]) as f64,
        (Dtype::F64, 8) => f64::from_le_bytes(data.try_into().map_err(|_| bad(key, "bad size"))?),
        (Dtype::F16, 2) => half_to_f64(u16::from_le_bytes([data[0], data[1]]), false),
        (Dtype::BF16, 2) => half_to_f64(u16::from_le_bytes([data[0], data[1]]), true),
        (d, _) => return Err(bad(key, format!("alpha of dtype {d:?} is not supported"))),
    };
    if !v.is_finite() || v == 0.0 {
        return Err(bad(
            key,
            format!("alpha must be finite and non-zero, got {v}"),
        ));
    }
    Ok(v)
}

/// A 16-bit float as f64 (IEEE half, or bfloat16 when `bf16`).
fn half_to_f64(bits: u16, bf16: bool) -> f64 {
    if bf16 {
        return f32::from_bits(u32::from(bits) << 16) as f64;
    }
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((bits >> 10) & 0x1f);
    let frac = f64::from(bits & 0x3ff);
    sign * match exp {
        0 => frac * 2f64.powi(-24),
        31 if frac == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        e => (1.0 + frac / 1024.0) * 2f64.powi(e - 15),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_floats_decode() {
        assert_eq!(half_to_f64(0x3c00, false), 1.0);
        assert_eq!(half_to_f64(0xc000, false), -2.0);
        assert_eq!(half_to_f64(0x3f80, true), 1.0);
    }
}
