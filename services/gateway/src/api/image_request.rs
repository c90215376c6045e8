//! Reading the image requests: the JSON body of generations and the multipart form of edits
//! (an uploaded image, or a registered template's by `template_id`), each capped in size (413
//! naming the part) and validated; the result is the job and the fingerprint an
//! `Idempotency-Key` binds to.
use std::collections::HashMap;

use actix_multipart::Multipart;
use actix_web::web;
use diffmesh_shared::wire::messages::{FieldError, JobKind};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::idempotency;
use crate::job_driver::{ImageRequest, InputImage, JobInput};
use crate::loras::params as lora_params;
use crate::parse::{raw_from_json, raw_from_text};
use crate::request_model;
use crate::state::ApiState;
use crate::upload::{image_size, read_limited, Parts, MAX_TEXT_FIELD_BYTES};
use crate::validate::{self, Prompt};

/// `POST /v1/images/generations`: a JSON body.
pub async fn read_generation(
    state: &ApiState,
    caller: &Caller,
    payload: web::Payload,
) -> Result<ImageRequest, ApiError> {
    let body = read_limited(payload, state.max_body_bytes, "body").await?;
    let raw = raw_from_json(&body)?;
    let fingerprint = idempotency::fingerprint("generations", &raw, None, None);
    let controls = read_controlnets(&raw, state)?;
    let listed = raw.controlnets.is_some();
    let (requested, size_given) = (raw.model.clone(), raw.size_given());
    let mut valid = validate::validate_generation(raw, &state.limits, &state.defaults)?;
    // The model is resolved after the fields are checked, so a bad field is named first.
    let model = request_model::choose(state, requested.as_deref()).await?;
    if !size_given {
        request_model::default_size(state, &model, &mut valid.params)?;
    }
    if !controls.is_empty() {
        let wanted = controls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let at = match listed {
                    true => format!("controlnets[{i}].name"),
                    false => "controlnet.name".to_string(),
                };
                (c.reference.name.clone(), at)
            })
            .collect();
        state.directory.check_offered(wanted, &model.id).await?;
    }
    let loras = lora_params::check_registered(&state.loras, caller, &valid.params.loras).await?;
    let mut control_images = Vec::with_capacity(controls.len());
    for c in controls {
        match valid.params.controlnet {
            None => valid.params.controlnet = Some(c.reference),
            Some(_) => valid.params.extra_controlnets.push(c.reference),
        }
        control_images.push(c.image);
    }
    valid.params.model = model.id.clone();
    request_model::check_features(&model, JobKind::Generate, &valid.params)?;
    lora_params::check_targets(&model.id, model.family(), &loras)?;
    Ok(ImageRequest {
        input: JobInput {
            kind: JobKind::Generate,
            valid,
            image: None,
            mask: None,
            template: None,
            control_images,
            controlnets_listed: listed,
            geometry: model.card.map(|c| c.geometry),
        },
        fingerprint,
    })
}

/// The checked ControlNets of a generation: its `controlnet`, or its `controlnets` list.
fn read_controlnets(
    raw: &validate::RawParams,
    state: &ApiState,
) -> Result<Vec<crate::controlnet::ValidControlNet>, ApiError> {
    let check = |c, at: &str| crate::controlnet::validate(c, &state.limits, at);
    Ok(match (&raw.controlnet, &raw.controlnets) {
        (Some(_), Some(_)) => {
            return Err(FieldError::invalid(
                "controlnets",
                "give one ControlNet in `controlnet` or several in `controlnets`, not both",
            )
            .into())
        }
        (Some(c), None) => vec![check(c, "controlnet")?],
        (None, Some(list)) => list
            .iter()
            .enumerate()
            .map(|(i, c)| check(c, &format!("controlnets[{i}]")))
            .collect::<Result<_, _>>()?,
        (None, None) => Vec::new(),
    })
}

/// An edit's form as sent: the uploads and the text fields, not yet validated.
#[derive(Debug, Default)]
pub struct EditBody {
    pub image: Option<Vec<u8>>,
    pub mask: Option<Vec<u8>>,
    pub text: HashMap<String, String>,
}

/// Read an edit's multipart body: all parts together at most `max_body_bytes` (413 naming the
/// part), each text part at most `MAX_TEXT_FIELD_BYTES`, at most `MAX_PARTS` parts.
pub async fn read_edit_form(
    payload: Multipart,
    max_body_bytes: usize,
) -> Result<EditBody, ApiError> {
    let mut parts = Parts::new(payload);
    let mut budget = max_body_bytes;
    let mut form = EditBody::default();
    while let Some(field) = parts.next().await? {
        let name = field.name().unwrap_or_default().to_string();
        let bytes = read_limited(field, budget, &name).await?;
        budget -= bytes.len();
        match name.as_str() {
            // `image[]`: the OpenAI SDK's name for a list of images (one, for these models).
            "image" | "image[]" if form.image.is_some() => {
                return Err(FieldError::invalid(
                    "image",
                    "one image per edit: these models take no second input image",
                )
                .into())
            }
            "image" | "image[]" => form.image = Some(bytes),
            "mask" => form.mask = Some(bytes),
            _ if bytes.len() <= MAX_TEXT_FIELD_BYTES => {
                let value = String::from_utf8(bytes)
                    .map_err(|_| FieldError::invalid(&name, "must be UTF-8 text"))?;
                form.text.insert(name, value);
            }
            _ => {
                return Err(ApiError::TooLarge {
                    field: name,
                    limit: MAX_TEXT_FIELD_BYTES,
                })
            }
        }
    }
    Ok(form)
}

/// `POST /v1/images/edits`: a multipart form with `image` (or `image[]`), optional `mask` and
/// text fields.
pub async fn read_edit(
    state: &ApiState,
    caller: &Caller,
    payload: Multipart,
) -> Result<ImageRequest, ApiError> {
    let EditBody { image, mask, text } = read_edit_form(payload, state.max_body_bytes).await?;
    if let Some(template_id) = text.get("template_id") {
        return crate::templates::edit::read(state, caller, template_id, image, mask, &text).await;
    }
    let image = image.ok_or_else(|| {
        FieldError::invalid(
            "image",
            "required (multipart file field) unless `template_id` names a registered template",
        )
    })?;
    upload_edit(
        state,
        caller,
        image,
        mask,
        &text,
        "edits",
        Prompt::Required,
        None,
    )
    .await
}

/// An edit of an uploaded `image` where `mask` says (or its transparent pixels), with the text
/// fields `text`, at `strength` (a variation's; `None`: 1); `endpoint` keys its idempotency
/// fingerprint.
#[allow(clippy::too_many_arguments)]
pub async fn upload_edit(
    state: &ApiState,
    caller: &Caller,
    image: Vec<u8>,
    mask: Option<Vec<u8>>,
    text: &HashMap<String, String>,
    endpoint: &str,
    prompt_rule: Prompt,
    strength: Option<f32>,
) -> Result<ImageRequest, ApiError> {
    let size = image_size(&image, "image")?;
    let raw = raw_from_text(text)?;
    let fingerprint = idempotency::fingerprint(endpoint, &raw, Some(&image), mask.as_deref());
    let requested = raw.model.clone();
    let mut valid =
        validate::validate_edit(raw, size, &state.limits, &state.defaults, prompt_rule)?;
    let loras = lora_params::check_registered(&state.loras, caller, &valid.params.loras).await?;
    let model = request_model::choose(state, requested.as_deref()).await?;
    valid.params.model = model.id.clone();
    valid.params.strength = strength;
    request_model::check_features(&model, JobKind::Edit, &valid.params)?;
    lora_params::check_targets(&model.id, model.family(), &loras)?;
    Ok(ImageRequest {
        input: JobInput {
            kind: JobKind::Edit,
            valid,
            image: Some(InputImage::Upload(image)),
            mask,
            template: None,
            control_images: Vec::new(),
            controlnets_listed: false,
            geometry: model.card.map(|c| c.geometry),
        },
        fingerprint,
    })
}
