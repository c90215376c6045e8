//! LoRA adapters registered once and named in image requests, so the denoisers apply them on
//! the one base model they serve (many adapters, one model).
//!
//! `POST /v1/loras` checks the upload's header and stores its weights and record (`form`,
//! `store`), `GET /v1/loras[/{id}]` shows the records, `DELETE /v1/loras/{id}` removes the
//! record, then the weights. Image requests name LoRAs in `loras` (`params`: reading, checks,
//! and the lookup that each is registered). LoRAs are scoped per API key as templates are: the
//! record keeps the key that registered it, and another key neither sees nor uses it (404 on
//! `GET`/`DELETE`, 400 in a request, as for an id that names none); without API keys every
//! caller sees every LoRA.

use actix_multipart::Multipart;
use actix_web::{web, HttpRequest, HttpResponse};
use diffmesh_shared::wire::lora::LoraRecord;
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::quotas::{self, Adding};
use crate::state::ApiState;

/// A registered LoRA as clients see it: its record (`lora::LoraRecord`) and `object`.
#[derive(Debug, Serialize, ToSchema)]
pub struct LoraView {
    /// Name it in a request's `loras` (a UUID).
    pub id: String,
    /// Always `lora`.
    pub object: String,
    /// The label it was registered with (not unique).
    pub name: Option<String>,
    /// Size of the weights file.
    pub bytes: u64,
    /// Parameters in all its A and B matrices.
    pub parameters: u64,
    /// Adapted layers of its network.
    pub modules: u64,
    /// Largest rank among them.
    pub max_rank: u64,
    /// Storage dtype of the weights: `F32`, `F16` or `BF16`.
    pub dtype: String,
    /// SHA-256 of the weights file (hex).
    pub sha256: String,
    /// When it was registered (RFC 3339, UTC).
    pub created_at: String,
    /// The network it adapts: `transformer` (Flux models) or `unet` (SD 2.x, SDXL); a request
    /// naming it for a model of the other kind is a 400 naming `loras[i].id`.
    pub target: String,
    /// Text-encoder adapter keys in the file (kohya's `lora_te*`, diffusers' `text_encoder.`):
    /// UNet models with CLIP encoders patch them in for the request's prompts; Flux models and
    /// the tiny text encoder leave them out.
    pub text_encoder_keys: u64,
}

impl LoraView {
    pub fn of(r: &LoraRecord) -> Self {
        Self {
            id: r.id.clone(),
            object: "lora".into(),
            name: r.name.clone(),
            bytes: r.bytes,
            parameters: r.parameters,
            modules: r.modules as u64,
            max_rank: r.max_rank as u64,
            dtype: r.dtype.clone(),
            sha256: r.sha256.clone(),
            created_at: r.created_at.clone(),
            target: r.target.as_str().into(),
            text_encoder_keys: r.text_encoder_keys as u64,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LoraList {
    /// Always `list`.
    pub object: String,
    /// Oldest first.
    pub data: Vec<LoraView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LoraDeleted {
    pub id: String,
    /// Always `lora`.
    pub object: String,
    /// Always true: record and weights are gone.
    pub deleted: bool,
}

/// The multipart form of `POST /v1/loras` (documentation of what `form::read` reads).
#[derive(ToSchema)]
pub struct LoraFormDoc {
    /// The LoRA's `.safetensors` file as diffusers' `save_lora_weights` writes it (PEFT keys
    /// `transformer.<module>.lora_A.weight` / `.lora_B.weight`), at most `--max-lora-bytes`.
    #[schema(value_type = String, format = Binary)]
    pub weights: Vec<u8>,
    /// A label for it (at most 200 characters).
    #[schema(max_length = 200)]
    pub name: Option<String>,
}

/// The 404 for an id that names no LoRA (or another key's).
pub fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        field: "lora_id".into(),
        message: format!("no LoRA {id:?} is registered"),
    }
}

/// The caller's LoRA `id`: 404 naming `lora_id` when it does not exist or belongs to another
/// key (as templates answer).
async fn owned(state: &ApiState, caller: &Caller, id: &str) -> Result<LoraRecord, ApiError> {
    caller.owned(state.loras.get(id).await?, || not_found(id))
}

#[utoipa::path(
    post,
    path = "/v1/loras",
    tag = "loras",
    request_body(content = LoraFormDoc, content_type = "multipart/form-data"),
    responses(
        (status = 201, description = "Registered: the LoRA, ready to name in image requests",
            body = LoraView, headers(("Location" = String, description = "The LoRA's URL"))),
        (status = 400, description = "A field is missing or malformed; for `weights`, the \
            message names the tensor or metadata key at fault", body = ErrorBody),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 413, description = "The weights file (above `--max-lora-bytes`) or a text \
            field is too large, or the key's stored bytes would pass \
            `--max-stored-bytes-per-key`", body = ErrorBody),
        (status = 429, description = "Over the key's request rate (with Retry-After), the \
            gateway's LoRA uploads at once (with Retry-After), or `--max-loras-per-key` \
            (`quota_exceeded`)", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds"))),
    ),
    security((), ("api_key" = []))
)]
pub async fn create_lora(
    req: HttpRequest,
    state: web::Data<ApiState>,
    payload: Multipart,
) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(&req)?;
    state.key_limits.check_rate(caller.limit_key())?;
    // A key at its LoRA count (or bytes) is told so before it sends hundreds of MB.
    let usage = quotas::admit(&state, caller.owner(), Adding::Lora { bytes: 0 }).await?;
    // One key's uploads count among its requests in flight: it cannot take every reader.
    let _slot = state.key_limits.acquire(caller.limit_key())?;
    // Every upload read at once takes a spool file and a reader: their number is bounded.
    let _reading = state
        .lora_uploads
        .clone()
        .try_acquire_owned()
        .map_err(|_| ApiError::RateLimited {
            message: "as many LoRA uploads as this gateway reads at once are under way \
                      (--lora-uploads-at-once); send it again shortly"
                .into(),
            retry_after_s: 1,
        })?;
    // A client that sends slowly must not hold a reader for ever.
    let read = crate::loras::form::read(payload, state.max_lora_bytes, &state.upload_spool_dir);
    let upload = tokio::time::timeout(state.lora_upload_timeout, read)
        .await
        .map_err(|_| ApiError::Timeout {
            message: format!(
                "the LoRA upload did not arrive within {:?} (--lora-upload-timeout)",
                state.lora_upload_timeout
            ),
        })??;
    let bytes = upload.weights.len();
    // Its bytes against what the key held when the upload began (one read of the buckets).
    if let Some(usage) = usage {
        state.quotas.check(&usage, Adding::Lora { bytes })?;
    }
    let record = state.loras.register(upload, caller.owner()).await?;
    tracing::info!(
        lora_id = %record.id,
        bytes = record.bytes,
        modules = record.modules,
        "LoRA registered"
    );
    Ok(HttpResponse::Created()
        .insert_header(("Location", format!("/v1/loras/{}", record.id)))
        .json(LoraView::of(&record)))
}

#[utoipa::path(
    get,
    path = "/v1/loras",
    tag = "loras",
    responses(
        (status = 200, description = "The caller's LoRAs, oldest first", body = LoraList),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn list_loras(
    req: HttpRequest,
    state: web::Data<ApiState>,
) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(&req)?;
    let data = state
        .loras
        .list()
        .await?
        .iter()
        .filter(|r| caller.sees(*r))
        .map(LoraView::of)
        .collect();
    Ok(HttpResponse::Ok().json(LoraList {
        object: "list".into(),
        data,
    }))
}

#[utoipa::path(
    get,
    path = "/v1/loras/{id}",
    tag = "loras",
    params(("id" = String, Path, description = "LoRA id (UUID)")),
    responses(
        (status = 200, description = "The LoRA", body = LoraView),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 404, description = "No such LoRA for this API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn get_lora(
    req: HttpRequest,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(&req)?;
    let record = owned(&state, &caller, &id).await?;
    Ok(HttpResponse::Ok().json(LoraView::of(&record)))
}

#[utoipa::path(
    delete,
    path = "/v1/loras/{id}",
    tag = "loras",
    params(("id" = String, Path, description = "LoRA id (UUID)")),
    responses(
        (status = 200, description = "Deleted: requests naming it are refused from now on \
            (jobs already accepted may still read it)", body = LoraDeleted),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 404, description = "No such LoRA for this API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn delete_lora(
    req: HttpRequest,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(&req)?;
    owned(&state, &caller, &id).await?;
    if !state.loras.remove(&id).await? {
        return Err(not_found(&id));
    }
    tracing::info!(lora_id = %id, "LoRA deleted");
    Ok(HttpResponse::Ok().json(LoraDeleted {
        id: id.into_inner(),
        object: "lora".into(),
        deleted: true,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_is_the_record_plus_its_object() {
        let record = LoraRecord {
            id: "3f2b8c1e-5d4a-4e6f-9a0b-1c2d3e4f5a6b".into(),
            name: Some("ink".into()),
            owner: Some("alice".into()),
            bytes: 12_352,
            parameters: 1536,
            modules: 1,
            max_rank: 4,
            dtype: "F32".into(),
            sha256: "ab".repeat(32),
            created_at: "2025-01-01T00:00:00.000Z".into(),
            target: diffmesh_shared::wire::lora::LoraTarget::Unet,
            text_encoder_keys: 2,
        };
        let stored = serde_json::to_value(&record).unwrap();
        let mut shown = serde_json::to_value(LoraView::of(&record)).unwrap();
        assert_eq!(shown["object"], "lora");
        shown.as_object_mut().unwrap().remove("object");
        // The owner is the one stored field not shown (as templates do not show theirs).
        let mut stored = stored;
        stored.as_object_mut().unwrap().remove("owner");
        assert_eq!(shown, stored, "every record field but the owner, as stored");
        match not_found("x") {
            ApiError::NotFound { field, .. } => assert_eq!(field, "lora_id"),
            other => panic!("{other}"),
        }
    }
}
