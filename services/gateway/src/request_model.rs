//! The model an image request runs on: the one it names, else `--default-model`, else the
//! mesh's only one (`model_catalogue`); the defaults that depend on it (a generation's size);
//! and the features the request uses, checked against what the model's denoisers announce.
use std::time::Duration;

use diffmesh_shared::wire::messages::{FieldError, GenerationParams, JobKind, StepCacheMethod};

use crate::error::ApiError;
use crate::model_catalogue::{NoModel, ResolvedModel};
use crate::request_limits::check_pixels;
use crate::state::ApiState;

/// How often a request that arrived before any denoiser announced its model looks again.
const POLL: Duration = Duration::from_millis(50);
/// How long after the gateway starts a request waits for the first announcements: a few
/// heartbeat periods, so a restarted gateway hears the running denoisers before it answers.
pub const HEAR_WITHIN: Duration = Duration::from_millis(1500);

/// Resolve the request's `model`. While no denoiser has announced any model (no denoiser runs
/// yet), the request goes on with the model it names (else the default; else any) and no
/// geometry: it is accepted and waits for placement like any job, and the codec prepares it at
/// its own flags.
pub async fn choose(state: &ApiState, requested: Option<&str>) -> Result<ResolvedModel, ApiError> {
    let requested = requested.map(str::trim).filter(|s| !s.is_empty());
    let default = state.default_model.as_deref();
    let listening_since = state.directory.since();
    loop {
        match state.directory.resolve_model(requested, default).await {
            Ok(model) => return Ok(model),
            Err(NoModel::Invalid(field)) => return Err(field.into()),
            Err(NoModel::NoneHeard) if listening_since.elapsed() < HEAR_WITHIN => {
                tokio::time::sleep(POLL).await
            }
            Err(NoModel::NoneHeard) => {
                return Ok(ResolvedModel {
                    id: requested.or(default).unwrap_or_default().to_string(),
                    card: None,
                })
            }
        }
    }
}

/// The size of a generation that names none: `--default-size` when set (already applied),
/// else the model's own default, checked against the pixel limit as a request's would be.
pub fn default_size(
    state: &ApiState,
    model: &ResolvedModel,
    params: &mut GenerationParams,
) -> Result<(), FieldError> {
    if let (None, Some(card)) = (state.default_size, &model.card) {
        let (w, h) = (card.geometry.default_width, card.geometry.default_height);
        check_pixels("size", w, h, &state.limits)?;
        (params.width, params.height) = (w, h);
    }
    Ok(())
}

/// Refuse what the model's denoisers announce they do not serve, naming the field that asks
/// for it. A model announced without a card (an older denoiser) is not checked.
pub fn check_features(
    model: &ResolvedModel,
    kind: JobKind,
    params: &GenerationParams,
) -> Result<(), FieldError> {
    let Some(card) = &model.card else {
        return Ok(());
    };
    let (id, f) = (&model.id, &card.features);
    let refuse = |field: &str, what: &str| {
        Err(FieldError::invalid(
            field,
            format!("model {id:?} ({}) does not serve {what}", card.pipeline),
        ))
    };
    match kind {
        JobKind::Edit | JobKind::Capture if !f.edit => return refuse("model", "edits"),
        JobKind::Generate if f.fill => {
            return refuse(
                "model",
                "text-to-image: a Fill model repaints a masked image (/v1/images/edits)",
            )
        }
        _ => {}
    }
    // The UNet engine starts a late schedule from noise, not from the image noised to it: a
    // variation there would keep nothing of its image.
    if params.strength.is_some_and(|s| s < 1.0) && !card.pipeline.starts_with("Flux") {
        return refuse(
            "strength",
            "variations (a strength below 1) yet: Flux models do",
        );
    }
    if params.true_cfg.is_some() && !f.true_cfg {
        return refuse("true_cfg_scale", "true classifier-free guidance");
    }
    if params.controlnet.is_some() && !f.controlnet {
        let field = match params.extra_controlnets.is_empty() {
            true => "controlnet.name",
            false => "controlnets",
        };
        return refuse(field, "ControlNets");
    }
    if !params.extra_controlnets.is_empty() && !f.multi_controlnet {
        return refuse(
            "controlnets",
            "several ControlNets per request (one goes in `controlnet`)",
        );
    }
    if !params.loras.is_empty() && !f.lora {
        return refuse("loras", "LoRAs");
    }
    if params.cache_threshold.is_some() && !f.step_cache {
        return refuse("cache_threshold", "step caching");
    }
    if params.cache_method == Some(StepCacheMethod::FirstBlock) && !f.first_block_cache {
        return refuse("cache_method", "first-block step caching");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffmesh_shared::wire::messages::TrueCfg;
    use diffmesh_shared::wire::models::{ModelCard, ModelFeatures, ModelGeometry, Resolution};

    fn model(features: ModelFeatures) -> ResolvedModel {
        ResolvedModel {
            id: "flux-fill".into(),
            card: Some(ModelCard {
                id: "flux-fill".into(),
                family: "flux.1".into(),
                pipeline: "FluxFillPipeline".into(),
                geometry: ModelGeometry {
                    token_pixels: 16,
                    resolution: Resolution::Scaled {
                        max_pixels: 1 << 20,
                    },
                    default_width: 1024,
                    default_height: 1024,
                },
                features,
            }),
        }
    }

    fn params() -> GenerationParams {
        GenerationParams {
            model: "flux-fill".into(),
            prompt: "p".into(),
            n: 1,
            num_inference_steps: 4,
            guidance_scale: 3.5,
            seed: 1,
            width: 64,
            height: 64,
            loras: vec![],
            preview_steps: Vec::new(),
            strength: None,
            cache_threshold: None,
            cache_method: None,
            deadline_unix_ms: None,
            controlnet: None,
            extra_controlnets: Vec::new(),
            true_cfg: None,
        }
    }

    #[test]
    fn what_the_card_leaves_out_is_refused_naming_the_field() {
        let bare = model(ModelFeatures::default());
        let e = check_features(&bare, JobKind::Edit, &params()).unwrap_err();
        assert_eq!(e.field, "model");
        assert!(e.message.contains("does not serve edits"), "{}", e.message);
        let mut guided = params();
        guided.true_cfg = Some(TrueCfg {
            scale: 4.0,
            negative_prompt: String::new(),
        });
        let e = check_features(&bare, JobKind::Generate, &guided).unwrap_err();
        assert_eq!(e.field, "true_cfg_scale");
        assert!(check_features(&bare, JobKind::Generate, &params()).is_ok());
        let full = model(ModelFeatures {
            edit: true,
            true_cfg: true,
            ..ModelFeatures::default()
        });
        assert!(check_features(&full, JobKind::Edit, &guided).is_ok());
        let fill = model(ModelFeatures {
            edit: true,
            fill: true,
            ..ModelFeatures::default()
        });
        let e = check_features(&fill, JobKind::Generate, &params()).unwrap_err();
        assert_eq!(e.field, "model");
        assert!(e.message.contains("/v1/images/edits"), "{}", e.message);
        assert!(check_features(&fill, JobKind::Capture, &params()).is_ok());
        let legacy = ResolvedModel {
            id: "tiny".into(),
            card: None,
        };
        assert!(check_features(&legacy, JobKind::Edit, &guided).is_ok());
    }

    #[test]
    fn only_flux_models_take_a_strength_below_1() {
        let features = ModelFeatures {
            edit: true,
            ..ModelFeatures::default()
        };
        let mut variation = params();
        variation.strength = Some(0.6);
        let flux = model(features);
        assert!(check_features(&flux, JobKind::Edit, &variation).is_ok());
        let mut sdxl = model(features);
        if let Some(card) = sdxl.card.as_mut() {
            card.pipeline = "StableDiffusionXLInpaintPipeline".into();
        }
        let e = check_features(&sdxl, JobKind::Edit, &variation).unwrap_err();
        assert_eq!(e.field, "strength");
        variation.strength = Some(1.0);
        assert!(check_features(&sdxl, JobKind::Edit, &variation).is_ok());
    }

    #[test]
    fn several_controlnets_need_a_model_that_sums_them() {
        use diffmesh_shared::wire::controlnet::ControlNetRef;
        let steer = |name: &str| ControlNetRef {
            name: name.into(),
            scale: 1.0,
        };
        let mut two = params();
        two.controlnet = Some(steer("edges"));
        two.extra_controlnets = vec![steer("depth")];
        let one_only = model(ModelFeatures {
            controlnet: true,
            ..ModelFeatures::default()
        });
        let e = check_features(&one_only, JobKind::Generate, &two).unwrap_err();
        assert_eq!(e.field, "controlnets");
        let sums = model(ModelFeatures {
            controlnet: true,
            multi_controlnet: true,
            ..ModelFeatures::default()
        });
        assert!(check_features(&sums, JobKind::Generate, &two).is_ok());
    }

    #[test]
    fn step_caching_needs_a_model_that_serves_it() {
        let mut cached = params();
        cached.cache_threshold = Some(0.1);
        let unet = model(ModelFeatures::default());
        let e = check_features(&unet, JobKind::Generate, &cached).unwrap_err();
        assert_eq!(e.field, "cache_threshold");
        let flux = model(ModelFeatures {
            step_cache: true,
            first_block_cache: true,
            ..ModelFeatures::default()
        });
        assert!(check_features(&flux, JobKind::Generate, &cached).is_ok());
        // A denoiser from before first-block caching would run the threshold as TeaCache's.
        cached.cache_method = Some(StepCacheMethod::FirstBlock);
        let older = model(ModelFeatures {
            step_cache: true,
            ..ModelFeatures::default()
        });
        let e = check_features(&older, JobKind::Generate, &cached).unwrap_err();
        assert_eq!(e.field, "cache_method");
        assert!(check_features(&flux, JobKind::Generate, &cached).is_ok());
    }
}
