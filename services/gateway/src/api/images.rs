//! The image endpoints (`POST /v1/images/edits`, `POST /v1/images/generations`): authenticate,
//! apply the key's limits, read and validate the request, then either run the job and answer
//! with the images (`{"created", "data": [{"b64_json"}]}` or raw `image/png`) or, with
//! `Prefer: respond-async`, answer 202 with the job at once and run it in the background.
use actix_multipart::Multipart;
use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use base64::Engine;
use diffmesh_shared::stores::idempotency::{Claim, IdempotencyRecord};
use diffmesh_shared::stores::job::{now_ms, JobRecord, JobState};
use serde::Serialize;
use utoipa::ToSchema;

use crate::api::jobs::{job_path, JobView};
use crate::api::usage::ImageUsage;
use crate::api::{image_request, image_stream};
use crate::auth::Caller;
use crate::disconnect;
use crate::error::{ApiError, ErrorBody};
use crate::idempotency::{self, IdempotencyKey};
use crate::job_driver::ImageRequest;
use crate::job_driver::Mesh;
use crate::output_format::OutputFormat;
use crate::state::ApiState;
use crate::validate::{RawParams, ResponseFormat};
use diffmesh_shared::wire::messages::FieldError;

/// The OpenAI images response.
#[derive(Serialize, ToSchema)]
pub struct ImagesResponse {
    /// Unix seconds.
    pub created: u64,
    pub data: Vec<ImageData>,
    /// Tokens in and out (`api::usage`).
    pub usage: ImageUsage,
}

#[derive(Serialize, ToSchema)]
pub struct ImageData {
    /// The image in `output_format` (PNG by default), base64-encoded (`b64_json`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub b64_json: Option<String>,
    /// A signed URL of the PNG, readable without an API key until it expires (`url`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// The multipart form of `POST /v1/images/edits` (documentation of what `image_request::read_edit`
/// reads; text fields are those of the JSON generation request).
#[derive(ToSchema)]
pub struct EditForm {
    /// The template: PNG, JPEG or WebP. Its transparent pixels are the region to repaint when
    /// no mask is given. Required unless `template_id` is given (exactly one of the two).
    #[schema(value_type = Option<String>, format = Binary)]
    pub image: Option<Vec<u8>>,
    /// A registered template (`POST /v1/templates`) instead of `image`: the edit reads its
    /// activation cache and computes only the masked tokens; 404 if unknown, 409 if not ready.
    pub template_id: Option<String>,
    /// The region to repaint, same size as `image`: alpha < 128 repaints (RGBA masks, OpenAI's
    /// convention), otherwise luma >= 128 repaints.
    #[schema(value_type = Option<String>, format = Binary)]
    pub mask: Option<Vec<u8>>,
    #[schema(min_length = 1)]
    pub prompt: String,
    #[schema(minimum = 1)]
    pub n: Option<i64>,
    /// Accepted for OpenAI compatibility; edits come back at the image's size.
    pub size: Option<String>,
    /// `b64_json` (default) or `png` (the raw image in `output_format`, n = 1 only).
    pub response_format: Option<String>,
    /// `png` (default), `jpeg` or `webp` (lossless); png only for async jobs.
    pub output_format: Option<String>,
    /// JPEG quality in percent, 0 to 100 (default 100); `jpeg` only.
    #[schema(minimum = 0, maximum = 100)]
    pub output_compression: Option<i64>,
    /// `auto` or `opaque` (`transparent` is refused: no alpha channel).
    pub background: Option<String>,
    /// `low`, `auto`/`standard`/`medium` or `high`/`hd`: half, the default or twice the
    /// default steps, when `num_inference_steps` is absent.
    pub quality: Option<String>,
    /// The end user (at most 256 characters; accepted, not stored).
    pub user: Option<String>,
    #[schema(minimum = 1)]
    pub num_inference_steps: Option<i64>,
    #[schema(minimum = 0.0)]
    pub guidance_scale: Option<f64>,
    /// True classifier-free guidance, 1 (off, the default) to `--max-guidance`: each step also
    /// runs with `negative_prompt` and steers away from it, at a second batch row per image.
    #[schema(minimum = 1.0)]
    pub true_cfg_scale: Option<f64>,
    /// What true CFG steers away from (default: the empty prompt); only with `true_cfg_scale`
    /// above 1.
    pub negative_prompt: Option<String>,
    #[schema(minimum = 0)]
    pub seed: Option<u64>,
    /// Step caching (TeaCache), 0 to 1, as in generations; combines with mask-aware edits.
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub cache_threshold: Option<f64>,
    /// `teacache` (default) or `first_block`, as in generations; `first_block` not with
    /// `template_id` (400 naming `cache_method`).
    pub cache_method: Option<String>,
    /// Registered LoRAs to apply: the JSON text of the generation body's `loras` array, e.g.
    /// `[{"id": "<LoRA id>", "scale": 1.0}]`. Not with `template_id` (400 naming `loras`).
    pub loras: Option<String>,
    /// Milliseconds after acceptance the result is wanted by, 1 to 86400000; changes no pixel
    /// (denoisers with `--queue-order edf` serve the earliest deadline first).
    #[schema(minimum = 1, maximum = 86_400_000)]
    pub deadline_ms: Option<i64>,
    /// `true`: answer with Server-Sent Events (`image_edit.partial_image`, then
    /// `image_edit.completed`), as in generations.
    pub stream: Option<bool>,
    /// With `stream`: previews before the image, 0 to 3.
    #[schema(minimum = 0, maximum = 3)]
    pub partial_images: Option<i64>,
    /// A preview every this many steps on the job's event stream (1 to the step count).
    #[schema(minimum = 1)]
    pub preview_every: Option<i64>,
    /// Where the job's ending is posted (async jobs only), as in generations.
    pub callback_url: Option<String>,
}

#[utoipa::path(
    post,
    path = "/v1/images/edits",
    tag = "images",
    request_body(content = EditForm, content_type = "multipart/form-data"),
    params(
        ("Prefer" = Option<String>, Header,
            description = "`respond-async`: answer 202 with the job at once"),
        ("Idempotency-Key" = Option<String>, Header,
            description = "A repeat with the same key (per API key, for a day) returns the same job"),
    ),
    responses(
        (status = 200, description = "The edited image(s), at the input's size", content(
            (ImagesResponse = "application/json"),
            ([u8] = "image/png"),
            ([u8] = "image/jpeg"),
            ([u8] = "image/webp"),
            (image_stream::StreamEvent = "text/event-stream"),
        )),
        (status = 202, description = "Accepted (`Prefer: respond-async`): the job",
            body = JobView, headers(("Location" = String, description = "The job's URL"))),
        (status = 400, description = "A field is missing, malformed or out of range", body = ErrorBody),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 404, description = "No such template (`template_id`) for this API key", body = ErrorBody),
        (status = 409, description = "The job was cancelled, or the template is not ready", body = ErrorBody),
        (status = 413, description = "The body or a part is too large", body = ErrorBody),
        (status = 422, description = "Idempotency-Key reused for another request", body = ErrorBody),
        (status = 429, description = "Over the key's limits or the mesh's admission queue",
            body = ErrorBody, headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 500, description = "Internal error", body = ErrorBody),
        (status = 503, description = "No denoiser could take the job", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 504, description = "The job did not finish in time", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn edits(
    req: HttpRequest,
    state: web::Data<ApiState>,
    payload: Multipart,
) -> Result<HttpResponse, ApiError> {
    let caller = admit(&req, &state)?;
    // Boxed, both: their states would otherwise sit in the handler's future, which the actix
    // worker's 2 MiB stack holds (a debug build overflowed it).
    let request = Box::pin(image_request::read_edit(&state, &caller, payload)).await?;
    Box::pin(serve(&req, &state, caller, request)).await
}

#[utoipa::path(
    post,
    path = "/v1/images/generations",
    tag = "images",
    request_body(content = RawParams, content_type = "application/json"),
    params(
        ("Prefer" = Option<String>, Header,
            description = "`respond-async`: answer 202 with the job at once"),
        ("Idempotency-Key" = Option<String>, Header,
            description = "A repeat with the same key (per API key, for a day) returns the same job"),
    ),
    responses(
        (status = 200, description = "The generated image(s)", content(
            (ImagesResponse = "application/json"),
            ([u8] = "image/png"),
            ([u8] = "image/jpeg"),
            ([u8] = "image/webp"),
            (image_stream::StreamEvent = "text/event-stream"),
        )),
        (status = 202, description = "Accepted (`Prefer: respond-async`): the job",
            body = JobView, headers(("Location" = String, description = "The job's URL"))),
        (status = 400, description = "A field is missing, malformed or out of range", body = ErrorBody),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 409, description = "The job was cancelled", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 422, description = "Idempotency-Key reused for another request", body = ErrorBody),
        (status = 429, description = "Over the key's limits or the mesh's admission queue",
            body = ErrorBody, headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 500, description = "Internal error", body = ErrorBody),
        (status = 503, description = "No denoiser could take the job", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 504, description = "The job did not finish in time", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn generations(
    req: HttpRequest,
    state: web::Data<ApiState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let caller = admit(&req, &state)?;
    // Boxed, both (see `edits`).
    let request = Box::pin(image_request::read_generation(&state, &caller, payload)).await?;
    Box::pin(serve(&req, &state, caller, request)).await
}

#[utoipa::path(
    post,
    path = "/v1/images/variations",
    tag = "images",
    request_body(content = super::variations::VariationForm, content_type = "multipart/form-data"),
    params(
        ("Prefer" = Option<String>, Header,
            description = "`respond-async`: answer 202 with the job at once"),
        ("Idempotency-Key" = Option<String>, Header,
            description = "A repeat with the same key (per API key, for a day) returns the same job"),
    ),
    responses(
        (status = 200, description = "The variations, at the image's size", content(
            (ImagesResponse = "application/json"),
            ([u8] = "image/png"),
            ([u8] = "image/jpeg"),
            ([u8] = "image/webp"),
        )),
        (status = 202, description = "Accepted (`Prefer: respond-async`): the job",
            body = JobView, headers(("Location" = String, description = "The job's URL"))),
        (status = 400, description = "A field is missing, malformed or out of range", body = ErrorBody),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 409, description = "The job was cancelled", body = ErrorBody),
        (status = 413, description = "The body or a part is too large", body = ErrorBody),
        (status = 422, description = "Idempotency-Key reused for another request", body = ErrorBody),
        (status = 429, description = "Over the key's limits or the mesh's admission queue",
            body = ErrorBody, headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 500, description = "Internal error", body = ErrorBody),
        (status = 503, description = "No denoiser could take the job", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 504, description = "The job did not finish in time", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
/// OpenAI's `images.create_variation`: the image redrawn at `strength` (`variations`).
pub async fn variations(
    req: HttpRequest,
    state: web::Data<ApiState>,
    payload: Multipart,
) -> Result<HttpResponse, ApiError> {
    let caller = admit(&req, &state)?;
    // Boxed, both (see `edits`).
    let request = Box::pin(super::variations::read_variation(&state, &caller, payload)).await?;
    Box::pin(serve(&req, &state, caller, request)).await
}

/// Authenticate and take one request from the key's rate budget (before reading the body).
fn admit(req: &HttpRequest, state: &ApiState) -> Result<Caller, ApiError> {
    let caller = state.caller(req)?;
    state.key_limits.check_rate(caller.limit_key())?;
    Ok(caller)
}

/// `Prefer: respond-async` (RFC 7240; other preferences may ride along).
fn prefers_async(req: &HttpRequest) -> bool {
    req.headers()
        .get_all("prefer")
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|pref| pref.split([';', '=']).next().unwrap_or("").trim())
        .any(|token| token.eq_ignore_ascii_case("respond-async"))
}

async fn serve(
    req: &HttpRequest,
    state: &web::Data<ApiState>,
    caller: Caller,
    mut request: ImageRequest,
) -> Result<HttpResponse, ApiError> {
    let respond_async = prefers_async(req);
    let format = Answer {
        response: request.input.valid.response_format,
        output: request.input.valid.output,
        usage: ImageUsage::of(&request),
    };
    let streamed = request
        .input
        .valid
        .stream
        .then(|| streamed_request(&request));
    if streamed.is_some() && respond_async {
        return Err(FieldError::invalid(
            "stream",
            "a stream is the answer itself: not with Prefer: respond-async",
        )
        .into());
    }
    if respond_async && format.output != OutputFormat::Png {
        // An async job's results are the stored PNGs (`/v1/jobs/{id}/result/{i}`).
        return Err(FieldError::invalid(
            "output_format",
            "async jobs (Prefer: respond-async) return PNG: png only",
        )
        .into());
    }
    // Kept on the job's record from its creation (`Mesh::prepare`), as checked.
    let checked = state
        .webhooks
        .accept(request.input.valid.callback_url.as_deref(), respond_async)?;
    request.input.valid.callback_url = checked;
    let idem = idempotency::from_request(req, &caller, request.fingerprint)?;
    if streamed.is_some() && idem.is_some() {
        return Err(FieldError::invalid(
            "stream",
            "a stream cannot be replayed: not with an Idempotency-Key",
        )
        .into());
    }
    if let Some(key) = &idem {
        if let Some(existing) = state.mesh.idempotency.get(&key.store_key).await? {
            return replay(req, state, key, existing, respond_async, format).await;
        }
    }
    if !respond_async {
        // Refused for load moments ago: refused now, before any work (async jobs queue).
        state
            .mesh
            .overload_gate
            .check(&request.input.valid.params.model)?;
    }
    let slot = state.key_limits.acquire(caller.limit_key())?;
    let mut prepared = Box::pin(state.mesh.prepare(request.input, caller.owner())).await?;
    let job_id = prepared.job_id().to_string();
    if let Some(key) = &idem {
        let mine = IdempotencyRecord {
            job_id: job_id.clone(),
            fingerprint: key.fingerprint.clone(),
            created_at_ms: now_ms(),
        };
        if let Claim::Existing(first) = state.mesh.idempotency.claim(&key.store_key, &mine).await? {
            // A concurrent request with the same key got in first: answer with its job.
            let reason = format!("superseded by job {} (same Idempotency-Key)", first.job_id);
            state.mesh.discard(prepared, &reason).await;
            return replay(req, state, key, first, respond_async, format).await;
        }
    }
    if respond_async {
        // From the durable queue's 202 on, its per-key bound holds the key's async jobs.
        drop(slot);
        let record = state
            .mesh
            .enqueue_detached(prepared, caller.owner())
            .await?;
        return Ok(accepted(&record, false));
    }
    if let Some(streamed) = streamed {
        let mesh = state.mesh.clone();
        // Boxed: its state would otherwise grow every request's handler future.
        let stream = image_stream::respond(req.clone(), mesh, prepared, slot, streamed);
        return Box::pin(stream).await;
    }
    if idem.is_some() {
        prepared.make_resumable();
    }
    // Dropping the job's driver when the client leaves cancels the job (see `job_driver`).
    let png_keys = tokio::select! {
        done = Box::pin(state.mesh.complete(prepared)) => done?,
        _ = disconnect::closed(req) => return Err(ApiError::ClientGone),
    };
    drop(slot);
    if format.response == ResponseFormat::Url {
        return Ok(respond_urls(
            req,
            state,
            &job_id,
            png_keys.len(),
            &format.usage,
        ));
    }
    let pngs = state.mesh.fetch_pngs(&png_keys).await?;
    respond(pngs, format).await
}

/// What a streamed answer repeats of `request` (`image_stream`).
fn streamed_request(request: &ImageRequest) -> image_stream::StreamedRequest {
    let input = &request.input;
    let p = &input.valid.params;
    image_stream::StreamedRequest {
        kind: input.kind,
        output: input.valid.output,
        size: format!("{}x{}", p.width, p.height),
        quality: "auto",
        background: "opaque",
        usage: ImageUsage::of(request),
        partial_images: p.preview_steps.len() as u32,
    }
}

/// 202 with the job, its URL in `Location`.
fn accepted(record: &JobRecord, replayed: bool) -> HttpResponse {
    let mut response = HttpResponse::Accepted();
    response
        .insert_header((header::LOCATION, job_path(&record.job_id)))
        .insert_header(("Preference-Applied", "respond-async"));
    if replayed {
        response.insert_header(("Idempotent-Replayed", "true"));
    }
    response.json(JobView::of(record))
}

/// Answer a repeated `Idempotency-Key` with the job it created: at once when async, else once
/// the job has ended, as the first request was (or would have been) answered.
async fn replay(
    req: &HttpRequest,
    state: &ApiState,
    key: &IdempotencyKey,
    first: IdempotencyRecord,
    respond_async: bool,
    format: Answer,
) -> Result<HttpResponse, ApiError> {
    if first.fingerprint != key.fingerprint {
        return Err(idempotency::mismatch(&first.job_id));
    }
    let job_id = first.job_id;
    if respond_async {
        let record = state.mesh.jobs.get(&job_id).await?.ok_or_else(|| {
            ApiError::Internal(format!("job {job_id} of this Idempotency-Key is gone"))
        })?;
        return Ok(accepted(&record, true));
    }
    let record = tokio::select! {
        ended = wait_for_ending(&state.mesh, &job_id) => ended?,
        _ = disconnect::closed(req) => return Err(ApiError::ClientGone),
    };
    let mut response = match record.state {
        JobState::Done if format.response == ResponseFormat::Url => {
            respond_urls(req, state, &job_id, record.result_keys.len(), &format.usage)
        }
        JobState::Done => {
            respond(state.mesh.fetch_pngs(&record.result_keys).await?, format).await?
        }
        JobState::Cancelled => {
            return Err(ApiError::Cancelled {
                message: format!("job {job_id} was cancelled"),
            })
        }
        _ => {
            let (message, error_type) = record
                .error
                .map(|e| (e.message, e.error_type))
                .unwrap_or_else(|| ("the job failed".into(), "internal_error".into()));
            return Err(ApiError::JobFailed {
                message,
                error_type,
            });
        }
    };
    response.headers_mut().insert(
        header::HeaderName::from_static("idempotent-replayed"),
        header::HeaderValue::from_static("true"),
    );
    Ok(response)
}

/// The job's record once it has ended (504 after the job deadline).
async fn wait_for_ending(mesh: &Mesh, job_id: &str) -> Result<JobRecord, ApiError> {
    use futures::StreamExt;
    let mut records = mesh.jobs.watch(job_id).await?;
    let deadline = tokio::time::Instant::now() + mesh.flow.job_timeout;
    loop {
        match tokio::time::timeout_at(deadline, records.next()).await {
            Ok(Some(Ok(r))) if r.state.is_terminal() => return Ok(r),
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(err))) => return Err(err.into()),
            Ok(None) => return Err(ApiError::Internal("the job record watch ended".into())),
            Err(_) => {
                return Err(ApiError::Timeout {
                    message: format!("job {job_id} did not finish in time"),
                })
            }
        }
    }
}

/// How a request wants its images answered, and its `usage`.
struct Answer {
    response: ResponseFormat,
    output: OutputFormat,
    usage: ImageUsage,
}

/// The answer with signed URLs of a job's `count` results.
fn respond_urls(
    req: &HttpRequest,
    state: &ApiState,
    job_id: &str,
    count: usize,
    usage: &ImageUsage,
) -> HttpResponse {
    let (base, now_s) = (state.base_url(req), now_ms() / 1000);
    HttpResponse::Ok().json(ImagesResponse {
        created: now_s,
        data: (0..count)
            .map(|i| ImageData {
                b64_json: None,
                url: Some(format!(
                    "{base}{}",
                    state.result_urls.path(job_id, i, now_s)
                )),
            })
            .collect(),
        usage: usage.clone(),
    })
}

/// The answer with a job's images, re-encoded in the asked format (off the runtime).
async fn respond(
    pngs: Vec<Vec<u8>>,
    Answer {
        response: format,
        output,
        usage,
    }: Answer,
) -> Result<HttpResponse, ApiError> {
    let images = tokio::task::spawn_blocking(move || {
        pngs.iter()
            .map(|png| output.encode(png))
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| ApiError::Internal(format!("encoding the results: {e}")))?
    .map_err(ApiError::Internal)?;
    Ok(match format {
        ResponseFormat::Png => match images.into_iter().next() {
            Some(image) => HttpResponse::Ok()
                .content_type(output.content_type())
                .body(image),
            None => ApiError::Internal("the job returned no image".into()).error_response(),
        },
        ResponseFormat::B64Json | ResponseFormat::Url => {
            let engine = base64::engine::general_purpose::STANDARD;
            HttpResponse::Ok().json(ImagesResponse {
                created: now_ms() / 1000,
                data: images
                    .iter()
                    .map(|image| ImageData {
                        b64_json: Some(engine.encode(image)),
                        url: None,
                    })
                    .collect(),
                usage,
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    #[test]
    fn prefer_header_is_parsed_per_rfc_7240() {
        let with = |v: &str| {
            TestRequest::default()
                .insert_header(("Prefer", v))
                .to_http_request()
        };
        assert!(prefers_async(&with("respond-async")));
        assert!(prefers_async(&with("wait=10, Respond-Async")));
        assert!(prefers_async(&with("respond-async; foo=bar")));
        assert!(!prefers_async(&with("return=minimal")));
        assert!(!prefers_async(&TestRequest::default().to_http_request()));
    }
}
