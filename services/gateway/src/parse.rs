//! Request fields into raw parameters: the JSON body of generations and the text fields of
//! multipart forms, read field by field so every type error names its field.
use std::collections::HashMap;

use diffmesh_shared::wire::messages::FieldError;
use serde_json::Value;

use crate::loras::params as lora_params;
use crate::validate::RawParams;

/// A JSON number with no fractional part (JSON Schema's `integer`: `2.0` is one, as some
/// clients encode whole numbers).
fn whole_number(value: &Value) -> Option<f64> {
    value.as_f64().filter(|f| f.is_finite() && f.fract() == 0.0)
}

fn int_field(name: &str, value: &Value) -> Result<i64, FieldError> {
    // i64's range is [-2^63, 2^63); the float comparison is exact at these powers of two.
    let from_float = || {
        whole_number(value)
            .filter(|f| *f >= -9_223_372_036_854_775_808.0 && *f < 9_223_372_036_854_775_808.0)
            .map(|f| f as i64)
    };
    value
        .as_i64()
        .or_else(from_float)
        .ok_or_else(|| FieldError::invalid(name, "must be an integer"))
}

fn number_field(name: &str, value: &Value) -> Result<f64, FieldError> {
    value
        .as_f64()
        .ok_or_else(|| FieldError::invalid(name, "must be a number"))
}

fn u64_field(name: &str, value: &Value) -> Result<u64, FieldError> {
    let from_float = || {
        whole_number(value)
            .filter(|f| *f >= 0.0 && *f < 18_446_744_073_709_551_616.0)
            .map(|f| f as u64)
    };
    value
        .as_u64()
        .or_else(from_float)
        .ok_or_else(|| FieldError::invalid(name, "must be a non-negative integer"))
}

/// `strength` where it is not taken (variations read theirs before the other fields).
fn not_here_strength() -> FieldError {
    FieldError::invalid(
        "strength",
        "taken by variations only (POST /v1/images/variations): edits repaint their mask in full",
    )
}

/// Field-by-field reading of the JSON body, so type errors name the field.
pub fn raw_from_json(body: &[u8]) -> Result<RawParams, FieldError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| FieldError::invalid("body", format!("not valid JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| FieldError::invalid("body", "must be a JSON object"))?;
    let mut raw = RawParams::default();
    for (key, v) in obj {
        if v.is_null() {
            continue;
        }
        let string = || {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| FieldError::invalid(key, "must be a string"))
        };
        match key.as_str() {
            "model" => raw.model = Some(string()?),
            "prompt" => raw.prompt = Some(string()?),
            "size" => raw.size = Some(string()?),
            "response_format" => raw.response_format = Some(string()?),
            "n" => raw.n = Some(int_field(key, v)?),
            "num_inference_steps" => raw.num_inference_steps = Some(int_field(key, v)?),
            "guidance_scale" => raw.guidance_scale = Some(number_field(key, v)?),
            "true_cfg_scale" => raw.true_cfg_scale = Some(number_field(key, v)?),
            "negative_prompt" => raw.negative_prompt = Some(string()?),
            "seed" => raw.seed = Some(u64_field(key, v)?),
            "cache_threshold" => raw.cache_threshold = Some(number_field(key, v)?),
            "cache_method" => raw.cache_method = Some(string()?),
            "loras" => raw.loras = Some(lora_params::from_json(v)?),
            "deadline_ms" => raw.deadline_ms = Some(int_field(key, v)?),
            "controlnet" => raw.controlnet = Some(crate::controlnet::from_json(v, key)?),
            "controlnets" => raw.controlnets = Some(crate::controlnet::list_from_json(v)?),
            "output_format" => raw.output_format = Some(string()?),
            "output_compression" => raw.output_compression = Some(int_field(key, v)?),
            "background" => raw.background = Some(string()?),
            "quality" => raw.quality = Some(string()?),
            "user" => raw.user = Some(string()?),
            "stream" => {
                raw.stream = Some(
                    v.as_bool()
                        .ok_or_else(|| FieldError::invalid(key, "must be true or false"))?,
                )
            }
            "partial_images" => raw.partial_images = Some(int_field(key, v)?),
            "preview_every" => raw.preview_every = Some(int_field(key, v)?),
            "callback_url" => raw.callback_url = Some(string()?),
            // Refused by name rather than answered without what it asks for.
            "input_fidelity" => return Err(FieldError::invalid(key, "not served yet")),
            "strength" => return Err(not_here_strength()),
            // Fields this server does not know (newer OpenAI ones): ignored, as OpenAI's SDK
            // sends only what the caller set.
            _ => {}
        }
    }
    Ok(raw)
}

/// Multipart text fields -> raw parameters.
pub fn raw_from_text(text: &HashMap<String, String>) -> Result<RawParams, FieldError> {
    fn parse<T: std::str::FromStr>(
        text: &HashMap<String, String>,
        name: &str,
        what: &str,
    ) -> Result<Option<T>, FieldError> {
        text.get(name)
            .map(|v| {
                v.trim()
                    .parse()
                    .map_err(|_| FieldError::invalid(name, format!("must be {what}, got {v:?}")))
            })
            .transpose()
    }
    if text.contains_key("input_fidelity") {
        return Err(FieldError::invalid("input_fidelity", "not served yet"));
    }
    if text.contains_key("strength") {
        return Err(not_here_strength());
    }
    if let Some(key) = ["controlnet", "controlnets"]
        .into_iter()
        .find(|k| text.contains_key(*k))
    {
        return Err(FieldError::invalid(
            key,
            "edits do not take a ControlNet (their unmasked pixels stay the image's); generations do",
        ));
    }
    Ok(RawParams {
        model: text.get("model").cloned(),
        prompt: text.get("prompt").cloned(),
        size: text.get("size").cloned(),
        response_format: text.get("response_format").cloned(),
        output_format: text.get("output_format").cloned(),
        output_compression: parse(text, "output_compression", "an integer")?,
        background: text.get("background").cloned(),
        quality: text.get("quality").cloned(),
        user: text.get("user").cloned(),
        n: parse(text, "n", "an integer")?,
        num_inference_steps: parse(text, "num_inference_steps", "an integer")?,
        guidance_scale: parse(text, "guidance_scale", "a number")?,
        true_cfg_scale: parse(text, "true_cfg_scale", "a number")?,
        negative_prompt: text.get("negative_prompt").cloned(),
        seed: parse(text, "seed", "a non-negative integer")?,
        cache_threshold: parse(text, "cache_threshold", "a number")?,
        cache_method: text.get("cache_method").cloned(),
        loras: match text.get("loras") {
            Some(json) => lora_params::from_text(json)?,
            None => None,
        },
        deadline_ms: parse(text, "deadline_ms", "an integer")?,
        controlnet: None,
        controlnets: None,
        stream: parse(text, "stream", "true or false")?,
        partial_images: parse(text, "partial_images", "an integer")?,
        preview_every: parse(text, "preview_every", "an integer")?,
        callback_url: text.get("callback_url").cloned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_type_errors_name_the_field() {
        assert_eq!(
            raw_from_json(br#"{"prompt": 3}"#).unwrap_err().field,
            "prompt"
        );
        assert_eq!(
            raw_from_json(br#"{"prompt": "x", "n": "two"}"#)
                .unwrap_err()
                .field,
            "n"
        );
        assert_eq!(raw_from_json(b"[1]").unwrap_err().field, "body");
        assert_eq!(raw_from_json(b"{").unwrap_err().field, "body");
        let raw = raw_from_json(br#"{"prompt": "x", "n": 2, "seed": 7, "model": "m"}"#).unwrap();
        assert_eq!((raw.n, raw.seed), (Some(2), Some(7)));
        assert_eq!(
            raw_from_json(br#"{"prompt": "x", "loras": [{"id": "a"}, {"scale": "big"}]}"#)
                .unwrap_err()
                .field,
            "loras[1].scale"
        );
        for (body, field) in [
            (&br#"{"prompt": "x", "stream": 1}"#[..], "stream"),
            (
                br#"{"prompt": "x", "partial_images": "2"}"#,
                "partial_images",
            ),
        ] {
            assert_eq!(raw_from_json(body).unwrap_err().field, field);
        }
        assert!(raw_from_json(br#"{"prompt": "x", "stream": false}"#).is_ok());
    }

    #[test]
    fn whole_floats_are_integers_and_fractions_are_not() {
        let raw =
            raw_from_json(br#"{"n": 2.0, "num_inference_steps": 4.0, "seed": 3149724.0}"#).unwrap();
        assert_eq!(
            (raw.n, raw.num_inference_steps, raw.seed),
            (Some(2), Some(4), Some(3149724))
        );
        for (body, field) in [
            (r#"{"n": 1.5}"#, "n"),
            (r#"{"num_inference_steps": 1e300}"#, "num_inference_steps"),
            (r#"{"seed": -1.0}"#, "seed"),
            (r#"{"seed": 1.8446744073709552e19}"#, "seed"),
        ] {
            assert_eq!(
                raw_from_json(body.as_bytes()).unwrap_err().field,
                field,
                "{body}"
            );
        }
    }

    #[test]
    fn text_fields_parse_with_field_errors() {
        let mut text = HashMap::new();
        text.insert("prompt".to_string(), "x".to_string());
        text.insert("num_inference_steps".to_string(), "ten".to_string());
        assert_eq!(
            raw_from_text(&text).unwrap_err().field,
            "num_inference_steps"
        );
        text.insert("num_inference_steps".to_string(), " 12 ".to_string());
        assert_eq!(raw_from_text(&text).unwrap().num_inference_steps, Some(12));
        text.insert("loras".to_string(), r#"{"id": "a"}"#.to_string());
        assert_eq!(raw_from_text(&text).unwrap_err().field, "loras");
        text.insert(
            "loras".to_string(),
            r#"[{"id": "a", "scale": 2}]"#.to_string(),
        );
        let loras = raw_from_text(&text).unwrap().loras.unwrap();
        assert_eq!(
            (loras[0].id.as_deref(), loras[0].scale),
            (Some("a"), Some(2.0))
        );
        text.insert("true_cfg_scale".to_string(), "strong".to_string());
        assert_eq!(raw_from_text(&text).unwrap_err().field, "true_cfg_scale");
        text.insert("true_cfg_scale".to_string(), "3.5".to_string());
        text.insert("negative_prompt".to_string(), "blurry".to_string());
        let raw = raw_from_text(&text).unwrap();
        assert_eq!(
            (raw.true_cfg_scale, raw.negative_prompt.as_deref()),
            (Some(3.5), Some("blurry"))
        );
    }

    #[test]
    fn true_cfg_fields_read_from_json_with_field_errors() {
        let raw = raw_from_json(br#"{"prompt": "x", "true_cfg_scale": 4, "negative_prompt": ""}"#)
            .unwrap();
        assert_eq!(
            (raw.true_cfg_scale, raw.negative_prompt.as_deref()),
            (Some(4.0), Some(""))
        );
        let raw = raw_from_json(br#"{"prompt": "x", "cache_threshold": 0.2}"#).unwrap();
        assert_eq!(raw.cache_threshold, Some(0.2));
        let text = HashMap::from([("cache_threshold".to_string(), "x".to_string())]);
        assert_eq!(raw_from_text(&text).unwrap_err().field, "cache_threshold");
        for (body, field) in [
            (r#"{"true_cfg_scale": "4"}"#, "true_cfg_scale"),
            (r#"{"negative_prompt": 3}"#, "negative_prompt"),
            (r#"{"cache_threshold": "0.1"}"#, "cache_threshold"),
        ] {
            assert_eq!(
                raw_from_json(body.as_bytes()).unwrap_err().field,
                field,
                "{body}"
            );
        }
    }
}
