//! `GET /v1/models`: the models the mesh serves now, in OpenAI's list shape, from the live
//! denoisers' heartbeats (`crate::directory`): each model with the denoisers that hold it and
//! what they announce of it (family, resolutions, features).
use actix_web::{web, HttpRequest, HttpResponse};
use diffmesh_shared::wire::messages::Heartbeat;
use diffmesh_shared::wire::models::{ModelCard, Resolution};
use serde::Serialize;
use std::collections::BTreeMap;
use utoipa::ToSchema;

use crate::controlnet_directory::taking_jobs;
use crate::error::{ApiError, ErrorBody};
use crate::state::ApiState;

/// One model the mesh serves (OpenAI's model object, plus who serves it).
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct ModelView {
    /// The id denoisers announce (`--model-id`, else their model folder's name).
    pub id: String,
    /// Always `model`.
    pub object: String,
    /// Unix seconds; 0: heartbeats carry no date for a model.
    pub created: i64,
    /// Always `diffmesh`.
    pub owned_by: String,
    /// Denoisers that hold it and take jobs, sorted.
    pub denoisers: Vec<String>,
    /// What its denoisers announce (absent from denoisers that announce only the id).
    #[serde(flatten)]
    pub card: Option<CardView>,
}

/// A model's announcement, as clients read it.
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct CardView {
    /// `flux.1`, `tiny`, `sd` (SD 1.x/2.x) or `sdxl`.
    pub family: String,
    /// The diffusers pipeline class (`FluxPipeline`, `FluxFillPipeline`, `StableDiffusionPipeline`, ...).
    pub pipeline: String,
    /// `fixed`: every image runs at `default_size` and is stretched back; `scaled`: at its own
    /// size in whole tokens, scaled down to at most `max_pixels`.
    pub resolution: String,
    /// `WxH` of a generation that names no `size` (unless the gateway's `--default-size`).
    pub default_size: String,
    /// Largest model resolution in pixels (`scaled` models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_pixels: Option<u64>,
    /// Pixels per image-token side: masks are followed at this granularity.
    pub token_pixels: u32,
    /// What it serves beyond text-to-image: `edit`, `fill`, `controlnet`, `lora`, `true_cfg`,
    /// `guidance` (guidance-distilled: `guidance_scale` steers it), `step_cache`
    /// (`cache_threshold`), `first_block_cache` (`cache_method: first_block`).
    pub features: Vec<String>,
    /// Longest prompt in text-encoder tokens.
    pub max_sequence_length: u32,
}

impl CardView {
    fn of(card: &ModelCard) -> Self {
        let (g, f) = (&card.geometry, &card.features);
        let (resolution, max_pixels) = match g.resolution {
            Resolution::Fixed { .. } => ("fixed", None),
            Resolution::Scaled { max_pixels } => ("scaled", Some(max_pixels)),
        };
        let features = [
            ("edit", f.edit),
            ("fill", f.fill),
            ("controlnet", f.controlnet),
            ("multi_controlnet", f.controlnet && f.multi_controlnet),
            ("lora", f.lora),
            ("true_cfg", f.true_cfg),
            ("guidance", f.guidance_embeds),
            ("step_cache", f.step_cache),
            ("first_block_cache", f.step_cache && f.first_block_cache),
        ]
        .into_iter()
        .filter(|(_, on)| *on)
        .map(|(name, _)| name.to_string())
        .collect();
        Self {
            family: card.family.clone(),
            pipeline: card.pipeline.clone(),
            resolution: resolution.into(),
            default_size: format!("{}x{}", g.default_width, g.default_height),
            max_pixels,
            token_pixels: g.token_pixels,
            features,
            max_sequence_length: f.max_sequence_length,
        }
    }
}

/// `GET /v1/models`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    /// Always `list`.
    pub object: String,
    /// Sorted by id; empty while no denoiser takes jobs.
    pub data: Vec<ModelView>,
}

/// The models of the denoisers that take jobs (a draining one takes none). A model's card is
/// the first one heard among its denoisers (they load the same directory).
pub fn model_list(heartbeats: &[Heartbeat]) -> ModelList {
    let mut by_id: BTreeMap<&str, (Vec<String>, Option<CardView>)> = BTreeMap::new();
    for hb in taking_jobs(&mut heartbeats.iter()) {
        let (denoisers, card) = by_id.entry(hb.model.as_str()).or_default();
        denoisers.push(hb.worker_id.clone());
        if card.is_none() {
            *card = hb.model_card().map(CardView::of);
        }
    }
    ModelList {
        object: "list".into(),
        data: by_id
            .into_iter()
            .map(|(id, (mut denoisers, card))| {
                denoisers.sort();
                ModelView {
                    id: id.to_string(),
                    object: "model".into(),
                    created: 0,
                    owned_by: "diffmesh".into(),
                    denoisers,
                    card,
                }
            })
            .collect(),
    }
}

#[utoipa::path(
    get,
    path = "/v1/models",
    tag = "images",
    responses(
        (status = 200, description = "The models live denoisers serve now, with the denoisers \
            that hold each", body = ModelList),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn list_models(
    req: HttpRequest,
    state: web::Data<ApiState>,
) -> Result<HttpResponse, ApiError> {
    state.caller(&req)?;
    Ok(HttpResponse::Ok().json(model_list(&state.directory.denoisers().await)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::directory::heartbeat;

    #[test]
    fn models_are_listed_once_each_with_the_denoisers_taking_jobs() {
        let mut flux = heartbeat("d-3", &[], &[], false);
        flux.model = "flux-dev".into();
        let beats = [
            heartbeat("d-2", &[], &[], false),
            heartbeat("d-1", &[], &[], false),
            flux,
            heartbeat("d-4", &[], &[], true),
        ];
        let list = model_list(&beats);
        assert_eq!(list.object, "list");
        let ids: Vec<(&str, &[String])> = list
            .data
            .iter()
            .map(|m| (m.id.as_str(), m.denoisers.as_slice()))
            .collect();
        assert_eq!(
            ids,
            [
                ("flux-dev", &["d-3".to_string()][..]),
                ("tiny", &["d-1".to_string(), "d-2".to_string()][..]),
            ]
        );
        assert!(list
            .data
            .iter()
            .all(|m| m.object == "model" && m.owned_by == "diffmesh"));
        assert!(model_list(&[heartbeat("d-9", &[], &[], true)])
            .data
            .is_empty());
    }

    #[test]
    fn a_models_announcement_is_shown_with_it() {
        use diffmesh_shared::wire::models::{ModelFeatures, ModelGeometry};
        let mut flux = heartbeat("d-1", &[], &[], false);
        flux.model = "flux-dev".into();
        flux.card = Some(ModelCard {
            id: "flux-dev".into(),
            family: "flux.1".into(),
            pipeline: "FluxPipeline".into(),
            geometry: ModelGeometry {
                token_pixels: 16,
                resolution: Resolution::Scaled {
                    max_pixels: 1 << 22,
                },
                default_width: 1024,
                default_height: 1024,
            },
            features: ModelFeatures {
                edit: true,
                lora: true,
                guidance_embeds: true,
                max_sequence_length: 512,
                multi_controlnet: false,
                step_cache: true,
                first_block_cache: true,
                ..ModelFeatures::default()
            },
        });
        let list = model_list(&[flux, heartbeat("d-2", &[], &[], false)]);
        let json = serde_json::to_value(&list).unwrap();
        let flux = &json["data"][0];
        assert_eq!(flux["family"], "flux.1");
        assert_eq!(flux["resolution"], "scaled");
        assert_eq!(flux["default_size"], "1024x1024");
        assert_eq!(flux["max_pixels"], 1 << 22);
        assert_eq!(
            flux["features"],
            serde_json::json!([
                "edit",
                "lora",
                "guidance",
                "step_cache",
                "first_block_cache"
            ])
        );
        assert_eq!(flux["max_sequence_length"], 512);
        // A denoiser that announced only the id: the id alone.
        assert!(json["data"][1].get("family").is_none(), "{json}");
    }
}
