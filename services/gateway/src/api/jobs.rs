//! The job resource: `GET /v1/jobs/{id}` (state, queue position, step k of N, timings, result
//! links), `GET /v1/jobs/{id}/result/{n}` (the n-th PNG: the owner's key, or a signed URL's
//! query, `result_urls`) and `DELETE /v1/jobs/{id}` (cancel).
//! A job belongs to the API key that created it: any other key gets 404, exactly as for a job
//! that does not exist, so job ids of other keys cannot even be confirmed.

use actix_web::{web, HttpRequest, HttpResponse};
use diffmesh_shared::stores::job::{now_ms, JobRecord, JobState};
use diffmesh_shared::wire::messages::{FieldError, JobKind};
use diffmesh_shared::MeshError;
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::result_urls::Signed;
use crate::state::ApiState;

/// A job as clients see it.
#[derive(Debug, Serialize, ToSchema)]
pub struct JobView {
    pub id: String,
    /// Always `job`.
    pub object: String,
    /// `edit`, `generation` or `capture` (a template registration).
    pub kind: String,
    pub status: JobStatus,
    /// Jobs ahead of this one in its denoiser's queue when it was queued there (0 = next);
    /// null while the router is still placing it and once it runs.
    pub queue_position: Option<u32>,
    pub progress: JobProgress,
    /// Placements so far (a job placed again after losing its denoiser counts each).
    pub attempt: u32,
    pub worker_id: Option<String>,
    pub timings: JobTimings,
    /// One link per result image, once the job is done.
    pub results: Vec<ResultLink>,
    /// Why the job failed or was cancelled.
    pub error: Option<JobError>,
    pub links: JobLinks,
    /// The job's `callback_url` and its delivery; absent for jobs without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookView>,
}

/// Where a job's ending is posted and how that went so far.
#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookView {
    pub url: String,
    /// `pending` (not yet sent, or to be tried again), `delivered` (a 2xx), `failed` (no 2xx
    /// within the gateway's `--webhook-max-age`) or `not_sent` (the job ended before it was
    /// queued: its request was refused).
    pub status: String,
    pub attempts: u32,
    /// The receiver's HTTP status at the last attempt.
    pub last_status: Option<u16>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    pub delivered_at_ms: Option<u64>,
    /// When the next attempt is due (Unix ms), after a failed one.
    pub next_attempt_at_ms: Option<u64>,
}

impl WebhookView {
    fn of(r: &JobRecord, w: &diffmesh_shared::stores::job::Webhook) -> Self {
        let status = match (w.delivered_at_ms, w.gave_up) {
            (Some(_), _) => "delivered",
            (None, true) => "failed",
            (None, false) if r.state.is_terminal() && !r.detached => "not_sent",
            (None, false) => "pending",
        };
        Self {
            url: w.url.clone(),
            status: status.into(),
            attempts: w.attempts,
            last_status: w.last_status,
            last_error: w.last_error.clone(),
            delivered_at_ms: w.delivered_at_ms,
            next_attempt_at_ms: w.next_attempt_at_ms,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    Queued,
    Running,
    Done,
    Failed,
    Cancelled,
}

impl JobStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Done => "done",
            JobStatus::Failed => "failed",
            JobStatus::Cancelled => "cancelled",
        }
    }
}

impl From<JobState> for JobStatus {
    fn from(s: JobState) -> Self {
        match s {
            JobState::Queued => JobStatus::Queued,
            JobState::Running => JobStatus::Running,
            JobState::Done => JobStatus::Done,
            JobState::Failed => JobStatus::Failed,
            JobState::Cancelled => JobStatus::Cancelled,
        }
    }
}

/// Denoising steps done (`step`) of `total`.
#[derive(Debug, Serialize, ToSchema)]
pub struct JobProgress {
    pub step: u32,
    pub total: u32,
}

/// When things happened (Unix ms) and how long each phase took (ms; running phases count up
/// to now).
#[derive(Debug, Serialize, ToSchema)]
pub struct JobTimings {
    pub created_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub finished_at_ms: Option<u64>,
    /// From acceptance until a denoiser started it (or until it ended without starting).
    pub queued_ms: u64,
    /// On the denoiser, until it ended.
    pub running_ms: Option<u64>,
    pub total_ms: u64,
    /// When the client wanted the result by (Unix ms; the request's `deadline_ms` after
    /// acceptance), once the job is submitted; absent for best-effort jobs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_at_ms: Option<u64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ResultLink {
    pub index: usize,
    /// `GET` this for the PNG.
    pub url: String,
    pub content_type: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct JobError {
    pub message: String,
    pub error_type: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct JobLinks {
    /// This job (`GET`; `DELETE` cancels it).
    #[serde(rename = "self")]
    pub self_: String,
    /// Server-Sent Events of the job's progress.
    pub events: String,
}

pub fn job_path(id: &str) -> String {
    format!("/v1/jobs/{id}")
}

impl JobView {
    pub fn of(record: &JobRecord) -> Self {
        Self::at(record, now_ms())
    }

    fn at(r: &JobRecord, now: u64) -> Self {
        let since = |from: u64, to: Option<u64>| to.unwrap_or(now).saturating_sub(from);
        let path = job_path(&r.job_id);
        let results = if r.state == JobState::Done {
            (0..r.result_keys.len())
                .map(|index| ResultLink {
                    index,
                    url: format!("{path}/result/{index}"),
                    content_type: "image/png".into(),
                })
                .collect()
        } else {
            Vec::new()
        };
        JobView {
            id: r.job_id.clone(),
            object: "job".into(),
            kind: match r.kind {
                JobKind::Edit => "edit".into(),
                JobKind::Generate => "generation".into(),
                JobKind::Capture => "capture".into(),
            },
            status: r.state.into(),
            queue_position: r.queue_position.filter(|_| r.state == JobState::Queued),
            progress: JobProgress {
                step: r.step,
                total: r.steps_total,
            },
            attempt: r.attempt,
            worker_id: r.worker_id.clone(),
            timings: JobTimings {
                created_at_ms: r.created_at_ms,
                started_at_ms: r.started_at_ms,
                finished_at_ms: r.finished_at_ms,
                queued_ms: since(r.created_at_ms, r.started_at_ms.or(r.finished_at_ms)),
                running_ms: r.started_at_ms.map(|s| since(s, r.finished_at_ms)),
                total_ms: since(r.created_at_ms, r.finished_at_ms),
                deadline_at_ms: r.submitted.as_ref().and_then(|j| j.params.deadline_unix_ms),
            },
            results,
            error: r.error.as_ref().map(|e| JobError {
                message: e.message.clone(),
                error_type: e.error_type.clone(),
            }),
            links: JobLinks {
                events: format!("{path}/events"),
                self_: path,
            },
            webhook: r.webhook.as_ref().map(|w| WebhookView::of(r, w)),
        }
    }
}

/// A job id from the path: job ids are UUIDs (which also keeps the KV key well-formed).
pub fn parse_job_id(id: &str) -> Result<String, ApiError> {
    uuid::Uuid::parse_str(id)
        .map(|u| u.to_string())
        .map_err(|_| FieldError::invalid("id", format!("{id:?} is not a job id (a UUID)")).into())
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        field: "id".into(),
        message: format!("no job {id} for this API key"),
    }
}

/// The caller's job `id`: 404 when it does not exist or belongs to another key.
pub async fn owned_record(
    state: &ApiState,
    caller: &Caller,
    id: &str,
) -> Result<JobRecord, ApiError> {
    let id = parse_job_id(id)?;
    caller.owned(state.mesh.jobs.get(&id).await?, || not_found(&id))
}

#[utoipa::path(
    get,
    path = "/v1/jobs/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "Job id (UUID)")),
    responses(
        (status = 200, description = "The job", body = JobView),
        (status = 400, description = "Malformed job id", body = ErrorBody),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn get_job(
    req: HttpRequest,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(&req)?;
    let record = owned_record(&state, &caller, &id).await?;
    let mut view = JobView::of(&record);
    if view.status == JobStatus::Queued && view.queue_position.is_none() {
        view.queue_position = state.mesh.queue_position(&record).await;
    }
    Ok(HttpResponse::Ok().json(view))
}

#[utoipa::path(
    delete,
    path = "/v1/jobs/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "Job id (UUID)")),
    responses(
        (status = 200, description = "Cancelled (also when it already was); the denoiser drops \
            it at its next step boundary", body = JobView),
        (status = 400, description = "Malformed job id", body = ErrorBody),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this API key", body = ErrorBody),
        (status = 409, description = "The job already finished or failed", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn cancel_job(
    req: HttpRequest,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(&req)?;
    cancel(&state, &caller, &id).await
}

async fn cancel(state: &ApiState, caller: &Caller, id: &str) -> Result<HttpResponse, ApiError> {
    let record = owned_record(state, caller, id).await?;
    let job_id = record.job_id.clone();
    let record = if record.state.is_terminal() {
        record
    } else {
        state
            .mesh
            .jobs
            .update(&job_id, |r| r.mark_cancelled("cancelled by its owner"))
            .await?
    };
    match record.state {
        JobState::Cancelled => {}
        other => {
            return Err(ApiError::Conflict {
                message: format!(
                    "job {job_id} is already {}; there is nothing to cancel",
                    JobStatus::from(other).as_str()
                ),
            })
        }
    }
    // The job's driver stops now if it runs here (else on its next check or the mesh's event);
    // the mesh is told to drop the job.
    state.mesh.stop_driving(&job_id);
    state.mesh.unqueue(&record).await;
    let mesh = state.mesh.clone();
    let window = mesh.placement_window();
    let cancelled_id = job_id.clone();
    mesh.clone().spawn_background(async move {
        mesh.cancel_in_mesh(&cancelled_id, window).await;
    });
    tracing::info!(%job_id, "job cancelled by its owner");
    Ok(HttpResponse::Ok().json(JobView::of(&record)))
}

#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/result/{n}",
    tag = "jobs",
    params(
        ("id" = String, Path, description = "Job id (UUID)"),
        ("n" = usize, Path, description = "Result index, from 0"),
        ("expires" = Option<u64>, Query, description = "A signed result URL's expiry (Unix s)"),
        ("signature" = Option<String>, Query,
            description = "A signed result URL's signature: with `expires`, no API key is needed"),
    ),
    responses(
        (status = 200, description = "The n-th result image", content_type = "image/png", body = [u8]),
        (status = 400, description = "Malformed job id or index", body = ErrorBody),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this key, no such result, or it expired",
            body = ErrorBody),
        (status = 409, description = "The job is not done", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn get_result(
    req: HttpRequest,
    state: web::Data<ApiState>,
    path: web::Path<(String, String)>,
    signed: Option<web::Query<Signed>>,
) -> Result<HttpResponse, ApiError> {
    let (id, n) = path.into_inner();
    let index: usize = n
        .parse()
        .map_err(|_| FieldError::invalid("n", format!("must be a result index, got {n:?}")))?;
    let record = match signed {
        // A signed result URL opens this one result to anyone holding it.
        Some(signed) => {
            let id = parse_job_id(&id)?;
            state
                .result_urls
                .check(&id, index, &signed, now_ms() / 1000)?;
            state
                .mesh
                .jobs
                .get(&id)
                .await?
                .ok_or_else(|| not_found(&id))?
        }
        None => owned_record(&state, &state.caller(&req)?, &id).await?,
    };
    result_png(&state, record, index).await
}

async fn result_png(
    state: &ApiState,
    record: JobRecord,
    index: usize,
) -> Result<HttpResponse, ApiError> {
    if record.state != JobState::Done {
        return Err(ApiError::Conflict {
            message: format!(
                "job {} has no results: it is {}, not done",
                record.job_id,
                JobStatus::from(record.state).as_str()
            ),
        });
    }
    let key = record
        .result_keys
        .get(index)
        .ok_or_else(|| ApiError::NotFound {
            field: "n".into(),
            message: format!(
                "job {} has {} result(s); there is no result {index}",
                record.job_id,
                record.result_keys.len()
            ),
        })?;
    match state.mesh.blobs.get(key).await {
        Ok(png) => Ok(HttpResponse::Ok().content_type("image/png").body(png)),
        Err(MeshError::BlobNotFound { .. }) => Err(ApiError::NotFound {
            field: "n".into(),
            message: format!("result {index} of job {} has expired", record.job_id),
        }),
        Err(err) => Err(err.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_show_progress_timings_and_results() {
        let mut r = JobRecord::new("0b6f8f0e-9d1e-4c39-8d67-6a1f0c3b1f10", JobKind::Edit);
        r.created_at_ms = 1_000;
        r.mark_queued_on("w1", 2);
        let v = JobView::at(&r, 1_500);
        assert_eq!(v.status, JobStatus::Queued);
        assert_eq!(v.queue_position, Some(2));
        assert_eq!((v.timings.queued_ms, v.timings.total_ms), (500, 500));
        assert!(v.results.is_empty());

        r.mark_running("w1");
        r.started_at_ms = Some(2_000);
        r.mark_step(3, 8);
        let v = JobView::at(&r, 2_600);
        assert_eq!(v.queue_position, None);
        assert_eq!((v.progress.step, v.progress.total), (3, 8));
        assert_eq!(v.timings.running_ms, Some(600));

        r.mark_done(vec!["k0".into(), "k1".into()]);
        r.finished_at_ms = Some(3_000);
        let v = JobView::at(&r, 9_999);
        assert_eq!(v.progress.step, 8);
        assert_eq!(v.timings.total_ms, 2_000);
        assert_eq!(v.results.len(), 2);
        assert_eq!(v.results[1].url, format!("/v1/jobs/{}/result/1", r.job_id));
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["status"], "done");
        assert_eq!(json["links"]["self"], format!("/v1/jobs/{}", r.job_id));
        assert_eq!(json["kind"], "edit");
        assert!(json["timings"].get("deadline_at_ms").is_none(), "{json}");

        // A submitted job with a deadline shows it.
        let mut job = diffmesh_shared::testing::generation_job(&r.job_id, "x", 1, 8);
        job.params.deadline_unix_ms = Some(4_000);
        r.submitted = Some(job);
        let json = serde_json::to_value(JobView::at(&r, 9_999)).unwrap();
        assert_eq!(json["timings"]["deadline_at_ms"], 4_000);
    }

    #[test]
    fn job_ids_must_be_uuids() {
        assert!(parse_job_id("0b6f8f0e-9d1e-4c39-8d67-6a1f0c3b1f10").is_ok());
        for bad in ["", "abc", "a.>", "*"] {
            match parse_job_id(bad).unwrap_err() {
                ApiError::Invalid(e) => assert_eq!(e.field, "id"),
                other => panic!("{other:?}"),
            }
        }
    }
}
