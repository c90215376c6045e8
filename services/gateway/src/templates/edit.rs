//! An edit that names a registered template (`template_id`) instead of uploading the image:
//! the job names the template's image (and the model-resolution pixels its capture kept) where
//! they are stored, so no copy is made per edit; the codec reads them there, and the denoise
//! job carries the template's `TemplateRef`, so the denoiser reads its activation cache and
//! computes only the masked tokens.
use std::collections::HashMap;

use diffmesh_shared::wire::messages::{FieldError, JobKind};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::idempotency;
use crate::job_driver::ImageRequest;
use crate::job_driver::{InputImage, JobInput};
use crate::loras::params::refuse_for_template;
use crate::model_catalogue::ResolvedModel;
use crate::parse::raw_from_text;
use crate::request_limits::{Defaults, Limits};
use crate::request_model;
use crate::state::ApiState;
use crate::templates::record::{not_found, ready, TemplateRecord};
use crate::validate::{self, RawParams, ValidParams};

/// Build the job of an edit by template from the form's parts: `template_id` (a text field),
/// no `image`, an optional `mask` and the usual text fields.
pub async fn read(
    state: &ApiState,
    caller: &Caller,
    template_id: &str,
    image: Option<Vec<u8>>,
    mask: Option<Vec<u8>>,
    text: &HashMap<String, String>,
) -> Result<ImageRequest, ApiError> {
    if image.is_some() {
        return Err(FieldError::invalid(
            "template_id",
            "give either `image` or `template_id`, not both",
        )
        .into());
    }
    let raw = raw_from_text(text)?;
    // Checked before the lookup: no template could take LoRAs.
    refuse_for_template(raw.loras.as_deref())?;
    validate::refuse_first_block_for_template(raw.cache_method.as_deref())?;
    let template_id = template_id.trim();
    let found = state.templates.store.get(template_id).await?;
    let record = caller.owned(found, || not_found(template_id))?;
    let record = state.templates.settle(&state.mesh, record).await?;
    ready(&record)?;
    // The template's id stands for its image in the fingerprint: a repeat names the same one.
    let named = format!("template:{template_id}");
    let fingerprint =
        idempotency::fingerprint("edits", &raw, Some(named.as_bytes()), mask.as_deref());
    let requested = raw.model.clone();
    let mut valid = validate(raw, &record, &state.limits, &state.defaults)?;
    let model = template_model(state, requested.as_deref(), &record).await?;
    valid.params.model = model.id.clone();
    request_model::check_features(&model, JobKind::Edit, &valid.params)?;
    Ok(ImageRequest {
        input: JobInput {
            kind: JobKind::Edit,
            control_images: Vec::new(),
            controlnets_listed: false,
            valid,
            image: Some(InputImage::Template(record.template_image())),
            mask,
            template: Some(record.template_ref()),
            geometry: model.card.map(|c| c.geometry),
        },
        fingerprint,
    })
}

/// The template's model: its cache holds that model's activations, so an edit that names
/// another is refused.
async fn template_model(
    state: &ApiState,
    requested: Option<&str>,
    record: &TemplateRecord,
) -> Result<ResolvedModel, ApiError> {
    let requested = requested.map(str::trim).filter(|m| !m.is_empty());
    if record.model.is_empty() {
        return request_model::choose(state, requested).await;
    }
    if let Some(other) = requested.filter(|m| *m != record.model) {
        return Err(FieldError::invalid(
            "model",
            format!(
                "template {} was captured with model {:?}, not {other:?}; its edits run on it",
                record.id, record.model
            ),
        )
        .into());
    }
    request_model::choose(state, Some(&record.model)).await
}

/// Validate as an edit of the template's image (its size is the output size), with the
/// template's step count and guidance as defaults. The step count cannot differ: the cache has
/// one entry per step of the template's schedule.
pub fn validate(
    raw: RawParams,
    record: &TemplateRecord,
    limits: &Limits,
    defaults: &Defaults,
) -> Result<ValidParams, FieldError> {
    let defaults = Defaults {
        steps: record.steps,
        guidance: record.guidance_scale,
        ..defaults.clone()
    };
    let valid = validate::validate_edit(
        raw,
        (record.width, record.height),
        limits,
        &defaults,
        validate::Prompt::Required,
    )?;
    if valid.params.num_inference_steps != record.steps {
        return Err(FieldError::invalid(
            "num_inference_steps",
            format!(
                "must be {} (the template's: its cache holds one entry per step), got {}",
                record.steps, valid.params.num_inference_steps
            ),
        ));
    }
    Ok(valid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::templates::record::TemplateState;
    use diffmesh_shared::wire::messages::TemplateRef;

    fn record(state: TemplateState) -> TemplateRecord {
        let t = TemplateRef {
            template_id: "t".into(),
            prompt: String::new(),
            seed: 5,
            steps: 4,
            guidance_scale: 1.0,
            cache_key: "tpl-k".into(),
        };
        let mut r = TemplateRecord::new("t".into(), None, &t);
        r.state = state;
        (r.width, r.height) = (100, 60);
        r
    }

    fn limits() -> Limits {
        Limits {
            max_n: 4,
            min_steps: 1,
            max_steps: 100,
            max_guidance: 30.0,
            max_pixels: 1 << 20,
            max_prompt_chars: 100,
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

    fn raw(steps: Option<i64>) -> RawParams {
        RawParams {
            prompt: Some("a red square".into()),
            num_inference_steps: steps,
            ..Default::default()
        }
    }

    #[test]
    fn steps_and_guidance_default_to_the_templates_and_size_is_its_size() {
        let v = validate(
            raw(None),
            &record(TemplateState::Ready),
            &limits(),
            &defaults(),
        )
        .unwrap();
        assert_eq!(v.params.num_inference_steps, 4);
        assert_eq!(v.params.guidance_scale, 1.0);
        assert_eq!((v.params.width, v.params.height), (100, 60));
        assert!(validate(
            raw(Some(4)),
            &record(TemplateState::Ready),
            &limits(),
            &defaults()
        )
        .is_ok());
    }

    #[test]
    fn other_step_counts_and_missing_prompts_name_the_field() {
        let r = record(TemplateState::Ready);
        let e = validate(raw(Some(8)), &r, &limits(), &defaults()).unwrap_err();
        assert_eq!(e.field, "num_inference_steps");
        assert!(e.message.contains("must be 4"), "{}", e.message);
        let e = validate(RawParams::default(), &r, &limits(), &defaults()).unwrap_err();
        assert_eq!(e.field, "prompt");
    }

    #[test]
    fn only_ready_templates_take_edits() {
        assert!(ready(&record(TemplateState::Ready)).is_ok());
        for state in [
            TemplateState::Capturing,
            TemplateState::Failed,
            TemplateState::Deleting,
        ] {
            let err = ready(&record(state)).unwrap_err();
            assert!(matches!(err, ApiError::Conflict { .. }), "{err}");
        }
        match not_found("x") {
            ApiError::NotFound { field, .. } => assert_eq!(field, "template_id"),
            other => panic!("{other}"),
        }
    }
}
