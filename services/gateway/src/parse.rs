//! Reading the image requests: the JSON body of generations and the multipart form of edits,
//! each capped in size (413 naming the part) and read field by field so every type error names
//! its field. The result is a validated job plus the fingerprint `Idempotency-Key` binds to.
use std::collections::HashMap;
use std::io::Cursor;

use actix_multipart::Multipart;
use actix_web::web;
use bytes::BytesMut;
use diffmesh_shared::messages::{FieldError, JobKind};
use futures::{Stream, StreamExt, TryStreamExt};
use image::{ImageFormat, ImageReader};
use serde_json::Value;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::idempotency;
use crate::loras::params as lora_params;
use crate::pipeline::{InputImage, JobInput};
use crate::state::ApiState;
use crate::validate::{self, RawParams};

/// Text fields are small; this caps each one independently of the body limit.
pub(crate) const MAX_TEXT_FIELD_BYTES: usize = 64 * 1024;

/// A validated image request.
pub struct ImageRequest {
    pub input: JobInput,
    /// Hash of the request (`idempotency::fingerprint`).
    pub fingerprint: String,
}

/// `POST /v1/images/generations`: a JSON body.
pub async fn read_generation(
    state: &ApiState,
    caller: &Caller,
    payload: web::Payload,
) -> Result<ImageRequest, ApiError> {
    let body = read_limited(payload, state.max_body_bytes, "body").await?;
    let raw = raw_from_json(&body)?;
    let fingerprint = idempotency::fingerprint("generations", &raw, None, None);
    let control = raw
        .controlnet
        .as_ref()
        .map(|c| crate::controlnet::validate(c, &state.limits))
        .transpose()?;
    let mut valid = validate::validate_generation(raw, &state.limits, &state.defaults)?;
    if let Some(c) = &control {
        state.controlnets.check_offered(&c.reference.name)?;
    }
    lora_params::check_registered(&state.loras, caller, &valid.params.loras).await?;
    let control_image = control.map(|c| {
        valid.params.controlnet = Some(c.reference);
        c.image
    });
    Ok(ImageRequest {
        input: JobInput {
            kind: JobKind::Generate,
            valid,
            image: None,
            mask: None,
            template: None,
            control_image,
        },
        fingerprint,
    })
}

/// `POST /v1/images/edits`: a multipart form with `image`, optional `mask` and text fields.
pub async fn read_edit(
    state: &ApiState,
    caller: &Caller,
    mut payload: Multipart,
) -> Result<ImageRequest, ApiError> {
    let mut budget = state.max_body_bytes;
    let mut image = None;
    let mut mask = None;
    let mut text: HashMap<String, String> = HashMap::new();
    while let Some(field) = payload
        .try_next()
        .await
        .map_err(|e| FieldError::invalid("body", format!("malformed multipart body: {e}")))?
    {
        let name = field.name().unwrap_or_default().to_string();
        let bytes = read_limited(field, budget, &name).await?;
        budget -= bytes.len();
        match name.as_str() {
            "image" => image = Some(bytes),
            "mask" => mask = Some(bytes),
            _ if bytes.len() <= MAX_TEXT_FIELD_BYTES => {
                let value = String::from_utf8(bytes)
                    .map_err(|_| FieldError::invalid(&name, "must be UTF-8 text"))?;
                text.insert(name, value);
            }
            _ => {
                return Err(ApiError::TooLarge {
                    field: name,
                    limit: MAX_TEXT_FIELD_BYTES,
                })
            }
        }
    }
    if let Some(template_id) = text.get("template_id") {
        return crate::templates::edit::read(state, caller, template_id, image, mask, &text).await;
    }
    let image = image.ok_or_else(|| {
        FieldError::invalid(
            "image",
            "required (multipart file field) unless `template_id` names a registered template",
        )
    })?;
    let size = image_size(&image, "image")?;
    let raw = raw_from_text(&text)?;
    let fingerprint = idempotency::fingerprint("edits", &raw, Some(&image), mask.as_deref());
    let valid = validate::validate_edit(raw, size, &state.limits, &state.defaults)?;
    lora_params::check_registered(&state.loras, caller, &valid.params.loras).await?;
    Ok(ImageRequest {
        input: JobInput {
            kind: JobKind::Edit,
            valid,
            image: Some(InputImage::Upload(image)),
            mask,
            template: None,
            control_image: None,
        },
        fingerprint,
    })
}

/// Read a body or multipart part, failing with 413 naming `field` above `limit` bytes.
pub(crate) async fn read_limited<S, E>(
    mut stream: S,
    limit: usize,
    field: &str,
) -> Result<Vec<u8>, ApiError>
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let mut buf = BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk
            .map_err(|e| FieldError::invalid(field, format!("reading the upload failed: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::TooLarge {
                field: field.to_string(),
                limit,
            });
        }
        buf.extend_from_slice(&chunk);
    }
    // Without a copy: a LoRA upload may be hundreds of MB.
    Ok(buf.into())
}

/// Image dimensions from the header only (no decode): the edit's output size and the pixel
/// limit check. Full decoding and validation happen in the codec.
pub(crate) fn image_size(bytes: &[u8], field: &str) -> Result<(u32, u32), FieldError> {
    let not_image = || FieldError::invalid(field, "not a PNG, JPEG or WebP image");
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|_| not_image())?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP) => {}
        _ => return Err(not_image()),
    }
    reader
        .into_dimensions()
        .map_err(|e| FieldError::invalid(field, format!("unreadable image header: {e}")))
}

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
            "prompt" => raw.prompt = Some(string()?),
            "size" => raw.size = Some(string()?),
            "response_format" => raw.response_format = Some(string()?),
            "n" => raw.n = Some(int_field(key, v)?),
            "num_inference_steps" => raw.num_inference_steps = Some(int_field(key, v)?),
            "guidance_scale" => raw.guidance_scale = Some(number_field(key, v)?),
            "true_cfg_scale" => raw.true_cfg_scale = Some(number_field(key, v)?),
            "negative_prompt" => raw.negative_prompt = Some(string()?),
            "seed" => raw.seed = Some(u64_field(key, v)?),
            "loras" => raw.loras = Some(lora_params::from_json(v)?),
            "deadline_ms" => raw.deadline_ms = Some(int_field(key, v)?),
            "controlnet" => raw.controlnet = Some(crate::controlnet::from_json(v)?),
            // OpenAI fields that do not change what this server does (model, user, quality...).
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
    if text.contains_key("controlnet") {
        return Err(FieldError::invalid(
            "controlnet",
            "edits do not take a ControlNet (their unmasked pixels stay the image's); generations do",
        ));
    }
    Ok(RawParams {
        prompt: text.get("prompt").cloned(),
        size: text.get("size").cloned(),
        response_format: text.get("response_format").cloned(),
        n: parse(text, "n", "an integer")?,
        num_inference_steps: parse(text, "num_inference_steps", "an integer")?,
        guidance_scale: parse(text, "guidance_scale", "a number")?,
        true_cfg_scale: parse(text, "true_cfg_scale", "a number")?,
        negative_prompt: text.get("negative_prompt").cloned(),
        seed: parse(text, "seed", "a non-negative integer")?,
        loras: match text.get("loras") {
            Some(json) => lora_params::from_text(json)?,
            None => None,
        },
        deadline_ms: parse(text, "deadline_ms", "an integer")?,
        controlnet: None,
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
        for (body, field) in [
            (r#"{"true_cfg_scale": "4"}"#, "true_cfg_scale"),
            (r#"{"negative_prompt": 3}"#, "negative_prompt"),
        ] {
            assert_eq!(
                raw_from_json(body.as_bytes()).unwrap_err().field,
                field,
                "{body}"
            );
        }
    }

    #[test]
    fn image_size_reads_the_header_only() {
        assert_eq!(
            image_size(b"GIF89a....", "image").unwrap_err().field,
            "image"
        );
        let img = image::DynamicImage::ImageRgb8(image::RgbImage::new(7, 3));
        let mut png = Cursor::new(Vec::new());
        img.write_to(&mut png, ImageFormat::Png).unwrap();
        assert_eq!(image_size(png.get_ref(), "image").unwrap(), (7, 3));
    }
}
