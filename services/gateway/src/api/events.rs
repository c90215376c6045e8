//! `GET /v1/jobs/{id}/events`: a job's progress as Server-Sent Events. Live progress
//! (`queued` with the queue position, `started`, `step` k of N, `retrying`, `preview` images
//! when the job asked for them with `preview_every`) comes from the job's
//! NATS event subject; the ending (`done` with the result links, `failed` with the error,
//! `cancelled`) comes from the job record, which the driving gateway writes, so the links work
//! the moment the client sees them. The first event describes the job as it is when the stream
//! opens; a stream of a finished job carries just its ending.
use std::collections::VecDeque;
use std::time::Duration;

use actix_web::http::header::CACHE_CONTROL;
use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;
use diffmesh_shared::stores::job::{now_ms, JobRecord, JobState};
use diffmesh_shared::wire::messages::{decode, error_types, JobEvent};
use diffmesh_shared::wire::subjects::job_updates;
use diffmesh_shared::MeshError;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use serde_json::{json, Value};

use crate::api::jobs::{owned_record, JobView};
use crate::error::{ApiError, ErrorBody};
use crate::output_format::OutputFormat;
use crate::state::ApiState;
use base64::Engine;

/// A comment line this often keeps idle connections (and proxies) open.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// One Server-Sent Event of a job's stream, as the OpenAPI document describes it (each event's
/// fields).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct JobStreamEvent {
    /// Counts the events from 1.
    pub id: Option<String>,
    /// `queued`, `started`, `step`, `retrying`, `captured`, `preview`, then `done`, `failed`,
    /// `cancelled` or `error`.
    pub event: String,
    /// The event's object as JSON (the job itself for the endings).
    pub data: String,
}

/// Beyond the job deadline, how long to wait for the driving gateway to record the ending.
const ENDING_GRACE: Duration = Duration::from_secs(30);

#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/events",
    tag = "jobs",
    params(("id" = String, Path, description = "Job id (UUID)")),
    responses(
        (status = 200, description = "Server-Sent Events. `event:` is one of `queued` \
            (`{position, worker_id}`), `started` (`{worker_id}`), `step` (`{step, total}`), \
            `retrying` (`{attempt, reason}`), `captured` (template registrations), `preview` \
            (`{step, total, width, height, b64_png}`, when the job asked `preview_every`), then one ending with the job (a JobView) as data: \
            `done` (with `results` links), `failed` (with `error`) or `cancelled`; or `error` \
            (`{error}`) when the job's ending could not be learned. The stream closes after the \
            ending.", content_type = "text/event-stream", body = JobStreamEvent),
        (status = 400, description = "Malformed job id", body = ErrorBody),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn job_event_stream(
    req: HttpRequest,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    open(&req, &state, &id).await
}

async fn open(req: &HttpRequest, state: &ApiState, id: &str) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(req)?;
    let record = owned_record(state, &caller, id).await?;
    let job_id = record.job_id.clone();
    // Subscribe before reading the record's current state, so no event falls in between.
    let live = state
        .mesh
        .client
        .subscribe(job_updates(&job_id))
        .await
        .map_err(MeshError::from)?;
    let records = state.mesh.jobs.watch(&job_id).await?;
    let ends_by_ms =
        record.created_at_ms + (state.mesh.flow.job_timeout + ENDING_GRACE).as_millis() as u64;
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(ends_by_ms.saturating_sub(now_ms()));
    let stream = EventStream {
        live,
        live_open: true,
        records,
        frames: VecDeque::new(),
        seq: 0,
        seen_record: false,
        ended: false,
        deadline,
    };
    let body = futures::stream::unfold(stream, |mut s| async move {
        s.next_frame()
            .await
            .map(|frame| (Ok::<_, actix_web::Error>(frame), s))
    });
    Ok(sse_response(body))
}

/// A 200 answering Server-Sent Events from `frames`, neither cached nor buffered by proxies.
pub(crate) fn sse_response<S>(frames: S) -> HttpResponse
where
    S: futures::Stream<Item = Result<Bytes, actix_web::Error>> + 'static,
{
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header((CACHE_CONTROL, "no-cache"))
        // Tell nginx-style proxies not to buffer the stream.
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(frames)
}

struct EventStream {
    live: async_nats::Subscriber,
    live_open: bool,
    records: BoxStream<'static, Result<JobRecord, MeshError>>,
    frames: VecDeque<Bytes>,
    seq: u64,
    seen_record: bool,
    ended: bool,
    deadline: tokio::time::Instant,
}

/// One SSE frame.
pub(crate) fn frame(seq: u64, event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("id: {seq}\nevent: {event}\ndata: {data}\n\n"))
}

impl EventStream {
    fn push(&mut self, event: &str, data: Value) {
        self.seq += 1;
        self.frames.push_back(frame(self.seq, event, &data));
    }

    async fn next_frame(&mut self) -> Option<Bytes> {
        loop {
            if let Some(f) = self.frames.pop_front() {
                return Some(f);
            }
            if self.ended {
                return None;
            }
            tokio::select! {
                record = self.records.next() => match record {
                    Some(Ok(r)) => self.on_record(r),
                    Some(Err(err)) => self.fail(
                        error_types::INTERNAL,
                        format!("reading the job record failed: {err}"),
                    ),
                    None => self.fail(error_types::INTERNAL, "the job record watch ended".into()),
                },
                msg = self.live.next(), if self.live_open => match msg {
                    Some(m) => self.on_event(&m.payload),
                    None => self.live_open = false,
                },
                _ = tokio::time::sleep(KEEP_ALIVE) => {
                    self.frames.push_back(Bytes::from_static(b": keep-alive\n\n"));
                }
                _ = tokio::time::sleep_until(self.deadline) => {
                    self.fail(
                        error_types::TIMEOUT,
                        "the job's ending was not recorded by its deadline".into(),
                    );
                }
            }
        }
    }

    /// Give up: an `error` event and close.
    fn fail(&mut self, error_type: &str, message: String) {
        self.push(
            "error",
            json!({"error": {"message": message, "error_type": error_type, "field": null}}),
        );
        self.ended = true;
    }

    fn on_record(&mut self, r: JobRecord) {
        let first = !self.seen_record;
        self.seen_record = true;
        if r.state.is_terminal() {
            // Live events published before the ending go out first.
            while let Some(Some(msg)) = self.live.next().now_or_never() {
                self.on_event(&msg.payload);
            }
            let event = match r.state {
                JobState::Done => "done",
                JobState::Cancelled => "cancelled",
                _ => "failed",
            };
            let view = serde_json::to_value(JobView::of(&r)).unwrap_or(Value::Null);
            self.push(event, view);
            self.ended = true;
            return;
        }
        // Later non-terminal versions repeat what the live events already said.
        if !first {
            return;
        }
        match r.state {
            JobState::Running => {
                self.push("started", json!({"worker_id": r.worker_id}));
                if r.step > 0 {
                    self.push("step", json!({"step": r.step, "total": r.steps_total}));
                }
            }
            _ => self.push(
                "queued",
                json!({"position": r.queue_position, "worker_id": r.worker_id}),
            ),
        }
    }

    fn on_event(&mut self, payload: &[u8]) {
        match decode::<JobEvent>(payload) {
            Ok(JobEvent::Queued {
                worker_id,
                position,
            }) => self.push(
                "queued",
                json!({"position": position, "worker_id": worker_id}),
            ),
            Ok(JobEvent::Started { worker_id }) => {
                self.push("started", json!({"worker_id": worker_id}))
            }
            Ok(JobEvent::Step { step, total, ranks }) => {
                let mut data = json!({"step": step, "total": total});
                if let Some(ranks) = ranks {
                    data["ranks"] = json!(ranks);
                }
                self.push("step", data)
            }
            Ok(JobEvent::Retrying { attempt, reason }) => {
                self.push("retrying", json!({"attempt": attempt, "reason": reason}))
            }
            // The ending is told from the record (see the module doc).
            Ok(JobEvent::Done { .. } | JobEvent::Failed { .. }) => {}
            Ok(JobEvent::Captured {
                cache_key, bytes, ..
            }) => self.push("captured", json!({"cache_key": cache_key, "bytes": bytes})),
            Ok(JobEvent::Preview {
                step,
                total,
                width,
                height,
                rgb,
            }) => match OutputFormat::Png.encode_rgb(rgb, width, height) {
                Ok(png) => {
                    let engine = base64::engine::general_purpose::STANDARD;
                    self.push(
                        "preview",
                        json!({"step": step, "total": total, "width": width, "height": height,
                            "b64_png": engine.encode(png)}),
                    )
                }
                Err(err) => tracing::debug!(error = %err, "unusable preview"),
            },
            Err(err) => tracing::debug!(error = %err, "undecodable job event"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_follow_the_sse_format() {
        let f = frame(3, "step", &json!({"step": 1, "total": 4}));
        assert_eq!(
            std::str::from_utf8(&f).unwrap(),
            "id: 3\nevent: step\ndata: {\"step\":1,\"total\":4}\n\n"
        );
    }
}
