//! `POST /v1/templates`: the multipart form (`image`, optional `prompt`, `seed`,
//! `num_inference_steps`, `guidance_scale`) read and validated into what the capture runs with.
//! Errors name the field, with the same limits as the edit endpoint.
use std::collections::HashMap;

use actix_multipart::Multipart;
use diffmesh_shared::wire::messages::{FieldError, GenerationParams};

use crate::error::ApiError;
use crate::parse::raw_from_text;
use crate::request_limits::{check_pixels, in_range, rand_seed, Defaults, Limits};
use crate::upload::{image_size, read_limited, Parts, MAX_TEXT_FIELD_BYTES};
use crate::validate::RawParams;

/// A validated registration: the image and the capture's parameters (`n` = 1, output size =
/// the image's size).
#[derive(Debug)]
pub struct TemplateForm {
    pub image: Vec<u8>,
    pub params: GenerationParams,
    /// The `model` field as sent (`request_model::choose` resolves it).
    pub model: Option<String>,
}

/// Read the multipart body (all parts together at most `max_body_bytes`, 413 naming the part;
/// at most `MAX_PARTS` parts).
pub async fn read(
    payload: Multipart,
    max_body_bytes: usize,
    limits: &Limits,
    defaults: &Defaults,
) -> Result<TemplateForm, ApiError> {
    let mut parts = Parts::new(payload);
    let mut budget = max_body_bytes;
    let mut image = None;
    let mut text: HashMap<String, String> = HashMap::new();
    while let Some(field) = parts.next().await? {
        let name = field.name().unwrap_or_default().to_string();
        let bytes = read_limited(field, budget, &name).await?;
        budget -= bytes.len();
        match name.as_str() {
            "image" => image = Some(bytes),
            "mask" => {
                return Err(FieldError::invalid(
                    "mask",
                    "a template takes no mask; send the mask with each edit",
                )
                .into())
            }
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
    let model = raw.model.clone();
    let params = validate(raw, size, limits, defaults)?;
    Ok(TemplateForm {
        image,
        params,
        model,
    })
}

/// Check a registration's parameters. Unlike an edit the prompt may be empty (it is the text
/// the template's tokens attend to during capture); the seed defaults to a random one.
pub fn validate(
    raw: RawParams,
    image_size: (u32, u32),
    limits: &Limits,
    defaults: &Defaults,
) -> Result<GenerationParams, FieldError> {
    check_pixels("image", image_size.0, image_size.1, limits)?;
    if raw.loras.as_ref().is_some_and(|l| !l.is_empty()) {
        return Err(FieldError::invalid(
            "loras",
            "not supported for templates: a capture records the base model's activations",
        ));
    }
    for (field, given) in [
        ("true_cfg_scale", raw.true_cfg_scale.is_some()),
        ("negative_prompt", raw.negative_prompt.is_some()),
        ("cache_threshold", raw.cache_threshold.is_some()),
        ("cache_method", raw.cache_method.is_some()),
    ] {
        if given {
            return Err(FieldError::invalid(
                field,
                "not for templates: a capture follows the template's own trajectory, so \
                 guidance changes none of its activations; give it with each edit",
            ));
        }
    }
    let prompt = raw.prompt.unwrap_or_default();
    let chars = prompt.chars().count();
    if chars > limits.max_prompt_chars {
        return Err(FieldError::invalid(
            "prompt",
            format!(
                "is {chars} characters, above the limit of {}",
                limits.max_prompt_chars
            ),
        ));
    }
    let steps = in_range(
        "num_inference_steps",
        raw.num_inference_steps,
        defaults.steps,
        limits.min_steps,
        limits.max_steps,
    )?;
    let guidance = raw.guidance_scale.unwrap_or(f64::from(defaults.guidance));
    if !guidance.is_finite() || guidance < 0.0 || guidance > f64::from(limits.max_guidance) {
        return Err(FieldError::invalid(
            "guidance_scale",
            format!(
                "must be between 0 and {}, got {guidance}",
                limits.max_guidance
            ),
        ));
    }
    Ok(GenerationParams {
        model: String::new(),
        prompt,
        n: 1,
        num_inference_steps: steps,
        guidance_scale: guidance as f32,
        seed: raw.seed.unwrap_or_else(rand_seed),
        width: image_size.0,
        height: image_size.1,
        loras: Vec::new(),
        preview_steps: Vec::new(),
        strength: None,
        cache_threshold: None,
        cache_method: None,
        deadline_unix_ms: None,
        controlnet: None,
        extra_controlnets: Vec::new(),
        true_cfg: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_n: 4,
            min_steps: 1,
            max_steps: 50,
            max_guidance: 30.0,
            max_pixels: 1024 * 1024,
            max_prompt_chars: 10,
        }
    }

    fn defaults() -> Defaults {
        Defaults {
            steps: 20,
            guidance: 3.5,
            true_cfg: 1.0,
            width: 64,
            height: 64,
        }
    }

    #[test]
    fn defaults_fill_in_and_the_prompt_may_be_empty() {
        let p = validate(RawParams::default(), (30, 20), &limits(), &defaults()).unwrap();
        assert_eq!(p.prompt, "");
        assert_eq!((p.num_inference_steps, p.guidance_scale), (20, 3.5));
        assert_eq!((p.width, p.height, p.n), (30, 20, 1));
        let p = validate(
            RawParams {
                prompt: Some("blue".into()),
                seed: Some(9),
                num_inference_steps: Some(4),
                guidance_scale: Some(1.0),
                ..Default::default()
            },
            (30, 20),
            &limits(),
            &defaults(),
        )
        .unwrap();
        assert_eq!(
            (p.prompt.as_str(), p.seed, p.num_inference_steps),
            ("blue", 9, 4)
        );
        assert_eq!(p.guidance_scale, 1.0);
    }

    #[test]
    fn errors_name_the_field_and_limit() {
        let field = |raw: RawParams, size| {
            validate(raw, size, &limits(), &defaults())
                .unwrap_err()
                .field
        };
        assert_eq!(
            field(
                RawParams {
                    num_inference_steps: Some(51),
                    ..Default::default()
                },
                (8, 8)
            ),
            "num_inference_steps"
        );
        assert_eq!(
            field(
                RawParams {
                    num_inference_steps: Some(0),
                    ..Default::default()
                },
                (8, 8)
            ),
            "num_inference_steps"
        );
        assert_eq!(
            field(
                RawParams {
                    guidance_scale: Some(-1.0),
                    ..Default::default()
                },
                (8, 8)
            ),
            "guidance_scale"
        );
        assert_eq!(
            field(
                RawParams {
                    prompt: Some("x".repeat(11)),
                    ..Default::default()
                },
                (8, 8)
            ),
            "prompt"
        );
        let with_lora = RawParams {
            loras: Some(vec![Default::default()]),
            ..Default::default()
        };
        assert_eq!(field(with_lora, (8, 8)), "loras");
        let guided = RawParams {
            true_cfg_scale: Some(4.0),
            ..Default::default()
        };
        assert_eq!(field(guided, (8, 8)), "true_cfg_scale");
        let negative = RawParams {
            negative_prompt: Some(String::new()),
            ..Default::default()
        };
        assert_eq!(field(negative, (8, 8)), "negative_prompt");
        let e = validate(RawParams::default(), (2048, 2048), &limits(), &defaults()).unwrap_err();
        assert_eq!(e.field, "image");
        assert!(e.message.contains("1048576"), "{}", e.message);
    }
}
