//! `GET /v1/models`: the models the mesh serves now, in OpenAI's list shape, from the live
//! denoisers' heartbeats (`crate::directory`): each model with the denoisers that hold it.
use actix_web::{web, HttpRequest, HttpResponse};
use diffmesh_shared::wire::messages::Heartbeat;
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
}

/// `GET /v1/models`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    /// Always `list`.
    pub object: String,
    /// Sorted by id; empty while no denoiser takes jobs.
    pub data: Vec<ModelView>,
}

/// The models of the denoisers that take jobs (a draining one takes none).
pub fn model_list(heartbeats: &[Heartbeat]) -> ModelList {
    let mut by_id: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for hb in taking_jobs(&mut heartbeats.iter()) {
        by_id
            .entry(hb.model.as_str())
            .or_default()
            .push(hb.worker_id.clone());
    }
    ModelList {
        object: "list".into(),
        data: by_id
            .into_iter()
            .map(|(id, mut denoisers)| {
                denoisers.sort();
                ModelView {
                    id: id.to_string(),
                    object: "model".into(),
                    created: 0,
                    owned_by: "diffmesh".into(),
                    denoisers,
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
}
