//! HTTP handlers: parse the OpenAI-style requests, validate them, run the job, shape the
//! response (`{"created", "data": [{"b64_json"}]}` or raw `image/png`).
use std::collections::HashMap;
use std::io::Cursor;
use std::time::Instant;

use actix_multipart::Multipart;
use actix_web::{web, HttpResponse, ResponseError};
use base64::Engine;
use bytes::BytesMut;
use diffmesh_shared::messages::{FieldError, JobKind};
use futures::{Stream, StreamExt, TryStreamExt};
use image::{ImageFormat, ImageReader};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::pipeline::{JobInput, Mesh};
use crate::validate::{self, Defaults, Limits, RawParams, ResponseFormat};

/// Shared state of the API handlers.
pub struct ApiState {
    pub mesh: Mesh,
    pub limits: Limits,
    pub defaults: Defaults,
    /// Largest request body (all multipart parts together), bytes.
    pub max_body_bytes: usize,
}

/// Text fields are small; this caps each one independently of the body limit.
const MAX_TEXT_FIELD_BYTES: usize = 64 * 1024;

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/images/edits", web::post().to(edits))
        .route("/v1/images/generations", web::post().to(generations));
}

async fn edits(state: web::Data<ApiState>, payload: Multipart) -> HttpResponse {
    let start = Instant::now();
    let result = edit(&state, payload).await;
    finish(&state, "edits", start, result)
}

async fn generations(state: web::Data<ApiState>, payload: web::Payload) -> HttpResponse {
    let start = Instant::now();
    let result = generation(&state, payload).await;
    finish(&state, "generations", start, result)
}

/// Record metrics and turn the result into the response (errors via `ApiError`'s one mapping).
fn finish(
    state: &ApiState,
    endpoint: &str,
    start: Instant,
    result: Result<HttpResponse, ApiError>,
) -> HttpResponse {
    let metrics = &state.mesh.metrics;
    let response = match result {
        Ok(r) => r,
        Err(err) => {
            metrics.failures.inc(err.reason());
            if err.status_code().is_server_error() {
                tracing::warn!(endpoint, error = %err, "request failed");
            } else {
                tracing::info!(endpoint, error = %err, "request rejected");
            }
            err.error_response()
        }
    };
    metrics
        .requests
        .with_label_values(&[endpoint, response.status().as_str()])
        .inc();
    metrics
        .request_duration
        .with_label_values(&[endpoint])
        .observe(start.elapsed().as_secs_f64());
    response
}

async fn generation(state: &ApiState, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let body = read_limited(payload, state.max_body_bytes, "body").await?;
    let raw = raw_from_json(&body)?;
    let valid = validate::validate_generation(raw, &state.limits, &state.defaults)?;
    let format = valid.response_format;
    let pngs = state
        .mesh
        .run_job(JobInput {
            kind: JobKind::Generate,
            valid,
            image: None,
            mask: None,
        })
        .await?;
    Ok(respond(pngs, format))
}

async fn edit(state: &ApiState, mut payload: Multipart) -> Result<HttpResponse, ApiError> {
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
    let image =
        image.ok_or_else(|| FieldError::invalid("image", "required (multipart file field)"))?;
    let size = image_size(&image, "image")?;
    let raw = raw_from_text(&text)?;
    let valid = validate::validate_edit(raw, size, &state.limits, &state.defaults)?;
    let format = valid.response_format;
    let pngs = state
        .mesh
        .run_job(JobInput {
            kind: JobKind::Edit,
            valid,
            image: Some(image),
            mask,
        })
        .await?;
    Ok(respond(pngs, format))
}

fn respond(pngs: Vec<Vec<u8>>, format: ResponseFormat) -> HttpResponse {
    match format {
        ResponseFormat::Png => match pngs.into_iter().next() {
            Some(png) => HttpResponse::Ok().content_type("image/png").body(png),
            None => ApiError::Internal("the job returned no image".into()).error_response(),
        },
        ResponseFormat::B64Json => {
            let engine = base64::engine::general_purpose::STANDARD;
            let data: Vec<Value> = pngs
                .iter()
                .map(|png| json!({ "b64_json": engine.encode(png) }))
                .collect();
            HttpResponse::Ok().json(json!({
                "created": diffmesh_shared::job::now_ms() / 1000,
                "data": data,
            }))
        }
    }
}

/// Read a body or multipart part, failing with 413 naming `field` above `limit` bytes.
async fn read_limited<S, E>(mut stream: S, limit: usize, field: &str) -> Result<Vec<u8>, ApiError>
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
    Ok(buf.to_vec())
}

/// Image dimensions from the header only (no decode): the edit's output size and the pixel
/// limit check. Full decoding and validation happen in the codec.
fn image_size(bytes: &[u8], field: &str) -> Result<(u32, u32), FieldError> {
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

fn int_field(name: &str, value: &Value) -> Result<i64, FieldError> {
    value
        .as_i64()
        .ok_or_else(|| FieldError::invalid(name, "must be an integer"))
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
            "guidance_scale" => {
                raw.guidance_scale = Some(
                    v.as_f64()
                        .ok_or_else(|| FieldError::invalid(key, "must be a number"))?,
                )
            }
            "seed" => {
                raw.seed =
                    Some(v.as_u64().ok_or_else(|| {
                        FieldError::invalid(key, "must be a non-negative integer")
                    })?)
            }
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
    Ok(RawParams {
        prompt: text.get("prompt").cloned(),
        size: text.get("size").cloned(),
        response_format: text.get("response_format").cloned(),
        n: parse(text, "n", "an integer")?,
        num_inference_steps: parse(text, "num_inference_steps", "an integer")?,
        guidance_scale: parse(text, "guidance_scale", "a number")?,
        seed: parse(text, "seed", "a non-negative integer")?,
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
