//! The template endpoints: `POST /v1/templates` registers one and waits for its capture,
//! `GET /v1/templates[/{id}]` shows the records (and, for one, where its cache is),
//! `DELETE /v1/templates/{id}` removes it once no accepted edit reads it (`crate::templates`).
use actix_multipart::Multipart;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::Serialize;
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorBody};
use crate::request_model;
use crate::state::ApiState;
use crate::templates::cache_view::{self, CacheView};
use crate::templates::delete::Outcome;
use crate::templates::record::{TemplateRecord, TemplateState};
use crate::templates::{capture, form};
use diffmesh_shared::wire::messages::JobKind;

/// A template as clients see it.
#[derive(Debug, Serialize, ToSchema)]
pub struct TemplateView {
    pub id: String,
    /// Always `template`.
    pub object: String,
    pub status: TemplateState,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    /// What the capture ran with; edits use the same steps (and, by default, guidance).
    pub prompt: String,
    pub seed: u64,
    pub num_inference_steps: u32,
    pub guidance_scale: f32,
    /// The model it was captured with; its edits run on it (empty: the default model).
    pub model: String,
    /// The image's size: every edit of the template comes back at this size.
    pub width: u32,
    pub height: u32,
    /// SHA-256 of the template at the model resolution.
    pub content_hash: Option<String>,
    /// The capture job (`/v1/jobs/{id}`).
    pub capture_job_id: Option<String>,
    pub cache_key: Option<String>,
    /// Bytes of the stored cache and the number of transformer blocks it covers.
    pub cache_bytes: u64,
    pub blocks: u32,
    /// The capture's quality guard, where the denoiser ran one (`--cache-quality-floor`).
    pub cache_quality: Option<CacheQualityView>,
    /// Why the capture failed.
    pub error: Option<String>,
    /// Where the cache is now (single-template reads only).
    pub cache: Option<CacheView>,
}

impl TemplateView {
    pub fn of(r: &TemplateRecord, cache: Option<CacheView>) -> Self {
        Self {
            id: r.id.clone(),
            object: "template".into(),
            status: r.state,
            created_at_ms: r.created_at_ms,
            updated_at_ms: r.updated_at_ms,
            prompt: r.prompt.clone(),
            seed: r.seed,
            num_inference_steps: r.steps,
            guidance_scale: r.guidance_scale,
            model: r.model.clone(),
            width: r.width,
            height: r.height,
            content_hash: r.content_hash.clone(),
            capture_job_id: r.capture_job_id.clone(),
            cache_key: r.cache_key.clone(),
            cache_bytes: r.cache_bytes,
            blocks: r.blocks,
            cache_quality: r.cache_quality.map(|q| CacheQualityView {
                box_ssim: q.box_ssim,
                floor: q.floor,
                full_compute: q.full_compute,
            }),
            error: r.error.clone(),
            cache,
        }
    }
}

/// What the capture's quality guard measured: a typical edit of the template (a centred box of
/// a fifth of the image repainted under another seed toward the empty prompt) read from the
/// cache against the same edit in full compute.
#[derive(Debug, Serialize, ToSchema)]
pub struct CacheQualityView {
    /// SSIM over the mask's box, grown by 8 pixels.
    pub box_ssim: f64,
    /// The denoiser's floor.
    pub floor: f64,
    /// Below the floor: the cache holds no steps and every edit of the template computes in
    /// full.
    pub full_compute: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TemplateList {
    /// Always `list`.
    pub object: String,
    pub data: Vec<TemplateView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TemplateDeleted {
    pub id: String,
    /// Always `template`.
    pub object: String,
    /// `deleted` (200: everything is gone) or `deleting` (202: edits of the template are
    /// still running; its objects go when they end, and `GET` shows it until then).
    pub status: String,
    /// Whether everything is gone already (`status` is `deleted`).
    pub deleted: bool,
    /// Cachestore entries that existed and were removed (0 while `deleting`).
    pub cache_entries_deleted: u32,
    /// Accepted edits of the template that had not ended (0 when `deleted`).
    pub edits_in_flight: u32,
}

/// The multipart form of `POST /v1/templates` (documentation of what `form::read` reads).
#[derive(ToSchema)]
pub struct TemplateFormDoc {
    /// The template: PNG, JPEG or WebP, at most `--max-pixels`.
    #[schema(value_type = String, format = Binary)]
    pub image: Vec<u8>,
    /// Text the template's tokens attend to during capture (default empty).
    pub prompt: Option<String>,
    /// Noise seed of the capture; edits reuse it for their unmasked tokens (default random).
    #[schema(minimum = 0)]
    pub seed: Option<u64>,
    /// 1 to `--max-steps` (default `--default-steps`); every edit of the template uses it.
    #[schema(minimum = 1)]
    pub num_inference_steps: Option<i64>,
    #[schema(minimum = 0.0)]
    pub guidance_scale: Option<f64>,
}

/// The caller's template `id`: 404 naming `template_id` when it does not exist or belongs to
/// another key.
async fn owned(state: &ApiState, req: &HttpRequest, id: &str) -> Result<TemplateRecord, ApiError> {
    let caller = state.caller(req)?;
    let found = state.templates.store.get(id).await?;
    let record = caller.owned(found, || crate::templates::record::not_found(id))?;
    state.templates.settle(&state.mesh, record).await
}

#[utoipa::path(
    post,
    path = "/v1/templates",
    tag = "templates",
    request_body(content = TemplateFormDoc, content_type = "multipart/form-data"),
    responses(
        (status = 201, description = "Registered and captured: the template, ready for edits",
            body = TemplateView, headers(("Location" = String, description = "The template's URL"))),
        (status = 400, description = "A field is missing, malformed or out of range", body = ErrorBody),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 413, description = "The body or a part is too large, or the key's stored \
            bytes would pass `--max-stored-bytes-per-key`", body = ErrorBody),
        (status = 429, description = "Over the key's limits (with Retry-After), \
            `--max-templates-per-key` (`quota_exceeded`), or the mesh's admission queue",
            body = ErrorBody, headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 500, description = "The capture failed (the template is kept as `failed`)",
            body = ErrorBody),
        (status = 503, description = "No denoiser could take the capture", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 504, description = "The capture did not finish in time", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn create_template(
    req: HttpRequest,
    state: web::Data<ApiState>,
    payload: Multipart,
) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(&req)?;
    state.key_limits.check_rate(caller.limit_key())?;
    let mut form = form::read(
        payload,
        state.max_body_bytes,
        &state.limits,
        &state.defaults,
    )
    .await?;
    let model = request_model::choose(&state, form.model.as_deref()).await?;
    form.params.model = model.id.clone();
    request_model::check_features(&model, JobKind::Capture, &form.params)?;
    let bytes = form.image.len() as u64;
    crate::quotas::admit(
        &state,
        caller.owner(),
        crate::quotas::Adding::Template { bytes },
    )
    .await?;
    let _slot = state.key_limits.acquire(caller.limit_key())?;
    let geometry = model.card.map(|c| c.geometry);
    let record = capture::register(&state.mesh, &state.templates, &caller, form, geometry).await?;
    Ok(HttpResponse::Created()
        .insert_header(("Location", format!("/v1/templates/{}", record.id)))
        .json(TemplateView::of(&record, None)))
}

#[utoipa::path(
    get,
    path = "/v1/templates",
    tag = "templates",
    responses(
        (status = 200, description = "The caller's templates, oldest first", body = TemplateList),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn list_templates(
    req: HttpRequest,
    state: web::Data<ApiState>,
) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(&req)?;
    let mut data = Vec::new();
    for record in state.templates.store.list().await? {
        if caller.sees(&record) {
            data.push(TemplateView::of(
                &state.templates.settle(&state.mesh, record).await?,
                None,
            ));
        }
    }
    Ok(HttpResponse::Ok().json(TemplateList {
        object: "list".into(),
        data,
    }))
}

#[utoipa::path(
    get,
    path = "/v1/templates/{id}",
    tag = "templates",
    params(("id" = String, Path, description = "Template id (UUID)")),
    responses(
        (status = 200, description = "The template and where its cache is: cachestore tiers per \
            entry, denoisers holding it in their local tier", body = TemplateView),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 404, description = "No such template for this API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn get_template(
    req: HttpRequest,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let record = owned(&state, &req, &id).await?;
    let cache = match &record.cache_key {
        Some(key) => {
            let t = &state.templates;
            let located = cache_view::locate(
                &state.mesh.client,
                key,
                record.cached_steps(),
                t.cachestore_timeout,
            )
            .await;
            Some(cache_view::view_of(
                record.cached_steps() + 1,
                located,
                cache_view::holders(&state.directory.denoisers().await, key),
            ))
        }
        None => None,
    };
    Ok(HttpResponse::Ok().json(TemplateView::of(&record, cache)))
}

#[utoipa::path(
    delete,
    path = "/v1/templates/{id}",
    tag = "templates",
    params(("id" = String, Path, description = "Template id (UUID)")),
    responses(
        (status = 200, description = "Deleted: record, image and every cache entry; denoisers \
            are told to drop their local copies", body = TemplateDeleted),
        (status = 202, description = "Being deleted: new edits get 409; edits already accepted \
            run to their end, then everything goes as for 200", body = TemplateDeleted),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 404, description = "No such template for this API key", body = ErrorBody),
        (status = 503, description = "No cachestore is running; the template stays `deleting` \
            (no new edits) and the gateway retries in the background (so does a repeated DELETE)",
            body = ErrorBody, headers(("Retry-After" = u64, description = "Seconds"))),
    ),
    security((), ("api_key" = []))
)]
pub async fn delete_template(
    req: HttpRequest,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let record = owned(&state, &req, &id).await?;
    let outcome = state
        .templates
        .deleter
        .delete(&state.mesh, &record.id)
        .await?
        .ok_or_else(|| crate::templates::record::not_found(&record.id))?;
    let (mut response, deleted) = match outcome {
        Outcome::Deleted {
            cache_entries_deleted,
        } => (
            HttpResponse::Ok(),
            TemplateDeleted {
                id: record.id,
                object: "template".into(),
                status: "deleted".into(),
                deleted: true,
                cache_entries_deleted,
                edits_in_flight: 0,
            },
        ),
        Outcome::Pending { edits_in_flight } => (
            HttpResponse::Accepted(),
            TemplateDeleted {
                id: record.id,
                object: "template".into(),
                status: "deleting".into(),
                deleted: false,
                cache_entries_deleted: 0,
                edits_in_flight,
            },
        ),
    };
    Ok(response.json(deleted))
}
