//! `stream: true` on `POST /v1/images/generations` and `/v1/images/edits`: the answer as
//! Server-Sent Events in OpenAI's shapes, which the official SDK reads (`stream=True`).
//!
//! The job runs as a plain request's does (same driver, same cancel when the client leaves);
//! only the answer differs. Each preview the denoiser sends (`JobEvent::Preview`, at the steps
//! `partial_images` chose: the latents projected to RGB, not decoded) goes out as an
//! `image_generation.partial_image` event (`image_edit.` for edits) in the request's output
//! format, then the image as `.completed` with `usage`; a failure ends the stream with an
//! `error` event carrying the error body a plain request would have had.
use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, ResponseError};
use base64::Engine;
use bytes::Bytes;
use diffmesh_shared::stores::job::now_ms;
use diffmesh_shared::wire::messages::{decode, JobEvent, JobKind};
use diffmesh_shared::wire::subjects::job_updates;
use diffmesh_shared::MeshError;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use crate::api::events::{frame, sse_response};
use crate::api::usage::ImageUsage;
use crate::disconnect;
use crate::error::ApiError;
use crate::job_driver::{Mesh, PreparedJob};
use crate::output_format::OutputFormat;

/// One Server-Sent Event of a streamed answer, as the OpenAPI document describes it (each
/// event's fields; `data` is the JSON of OpenAI's event object).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct StreamEvent {
    /// Counts the events from 1.
    pub id: Option<String>,
    /// `image_generation.partial_image`, `image_generation.completed` (`image_edit.` for
    /// edits), or `error`.
    pub event: String,
    /// The event object as JSON: `type`, `b64_json`, `created_at`, `size`, `quality`,
    /// `background`, `output_format`, and `partial_image_index` or `usage`; for `error`, the
    /// error body.
    pub data: String,
}

/// Frames waiting for a slow client; a preview that finds the buffer full is skipped rather than
/// holding up the job (the image itself always waits for room).
const FRAMES_BUFFERED: usize = 4;
/// How long, after the job ended, previews still on their way are waited for.
const PREVIEW_CATCH_UP: Duration = Duration::from_secs(2);
/// A comment frame this often while nothing else is sent keeps proxies from closing the
/// connection and finds a client that left.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How long the image may wait for a client that reads nothing.
const FINAL_SEND_WAIT: Duration = Duration::from_secs(30);

/// What the events repeat of the request (OpenAI's fields).
pub struct StreamedRequest {
    pub kind: JobKind,
    pub output: OutputFormat,
    /// `WIDTHxHEIGHT`.
    pub size: String,
    pub quality: &'static str,
    pub background: &'static str,
    pub usage: ImageUsage,
    /// Partial images asked for (`partial_images`).
    pub partial_images: u32,
}

impl StreamedRequest {
    /// The events' `type` prefix.
    fn prefix(&self) -> &'static str {
        match self.kind {
            JobKind::Edit => "image_edit",
            _ => "image_generation",
        }
    }

    fn event(&self, suffix: &str, image: &[u8], extra: Value) -> (String, Value) {
        let engine = base64::engine::general_purpose::STANDARD;
        let kind = format!("{}.{suffix}", self.prefix());
        let mut data = json!({
            "type": kind,
            "b64_json": engine.encode(image),
            "created_at": now_ms() / 1000,
            "size": self.size,
            "quality": self.quality,
            "background": self.background,
            "output_format": self.output.name(),
        });
        if let (Some(data), Value::Object(extra)) = (data.as_object_mut(), extra) {
            data.extend(extra);
        }
        (kind, data)
    }
}

/// Run `prepared` and answer with its events; `hold` (the key's in-flight slot) is kept until
/// the job ends. The answer's headers go out once the job is on a denoiser (its first event):
/// a job refused or failed before that (the mesh overloaded, no denoiser, a bad input) answers
/// with the plain request's HTTP error, `Retry-After` included.
pub async fn respond(
    req: HttpRequest,
    mesh: Mesh,
    prepared: PreparedJob,
    hold: impl Send + 'static,
    request: StreamedRequest,
) -> Result<HttpResponse, ApiError> {
    // Subscribed before the job is submitted (`complete`), so no preview is missed; events and
    // previews on one subscription, so they keep their order.
    let updates = match mesh.client.subscribe(job_updates(prepared.job_id())).await {
        Ok(updates) => updates,
        Err(err) => {
            let err = ApiError::from(MeshError::from(err));
            mesh.refuse(prepared, &err).await;
            return Err(err);
        }
    };
    let (frames, body) = mpsc::channel::<Bytes>(FRAMES_BUFFERED);
    let (committed, answer) = oneshot::channel();
    actix_web::rt::spawn(async move {
        let run = Run {
            frames,
            committed: Some(committed),
            request,
            seq: 0,
            partials: 0,
        };
        run.drive(&req, mesh, prepared, updates).await;
        drop(hold);
    });
    match answer.await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => return Err(err),
        Err(_) => return Err(ApiError::ClientGone),
    }
    let body = futures::stream::unfold(body, |mut rx| async move {
        rx.recv()
            .await
            .map(|frame| (Ok::<_, actix_web::Error>(frame), rx))
    });
    Ok(sse_response(body))
}

/// One streamed answer in progress.
struct Run {
    frames: mpsc::Sender<Bytes>,
    /// Told once whether the answer is a stream (the job reached a denoiser) or an error.
    committed: Option<oneshot::Sender<Result<(), ApiError>>>,
    request: StreamedRequest,
    seq: u64,
    /// Partial images sent.
    partials: u32,
}

/// What one message on the job's subjects asks of the stream.
enum Update {
    Nothing,
    Ended,
    ClientGone,
}

impl Run {
    fn frame(&mut self, event: &str, data: &Value) -> Bytes {
        self.seq += 1;
        frame(self.seq, event, data)
    }

    fn commit(&mut self, answer: Result<(), ApiError>) {
        if let Some(tx) = self.committed.take() {
            let _ = tx.send(answer);
        }
    }

    /// Drive the job to its end, streaming what it sends. Returning drops the job's driver
    /// (`complete`), which cancels the job in the mesh when it has not ended.
    async fn drive(
        mut self,
        req: &HttpRequest,
        mesh: Mesh,
        prepared: PreparedJob,
        mut updates: async_nats::Subscriber,
    ) {
        let done = mesh.complete(prepared);
        tokio::pin!(done);
        let gone = disconnect::closed(req);
        tokio::pin!(gone);
        let mut keep_alive = tokio::time::interval(KEEP_ALIVE);
        keep_alive.tick().await;
        let mut ending_seen = false;
        let ended = loop {
            tokio::select! {
                ended = &mut done => break ended,
                Some(msg) = updates.next() => match self.on_update(&msg.payload) {
                    Update::Nothing => {}
                    Update::Ended => ending_seen = true,
                    Update::ClientGone => return,
                },
                _ = keep_alive.tick(), if self.committed.is_none() => {
                    if let Err(mpsc::error::TrySendError::Closed(_)) =
                        self.frames.try_send(Bytes::from_static(b": keep-alive\n\n"))
                    {
                        return;
                    }
                }
                () = self.frames.closed() => return,
                () = &mut gone => return,
            }
        };
        let ended = match ended {
            // Nothing was streamed yet: the request answers with its HTTP error instead.
            Err(err) if self.committed.is_some() => return self.commit(Err(err)),
            ended => ended,
        };
        self.commit(Ok(()));
        // The driver may hear the ending before this subscription has delivered the previews
        // published ahead of it: read on to the ending (briefly) so none is lost. An ending
        // the gateway decided (deadline, cancel) has no event to wait for.
        if matches!(&ended, Ok(_) | Err(ApiError::JobFailed { .. })) {
            let until = tokio::time::Instant::now() + PREVIEW_CATCH_UP;
            while !ending_seen {
                match tokio::time::timeout_at(until, updates.next()).await {
                    Ok(Some(msg)) => match self.on_update(&msg.payload) {
                        Update::Nothing => {}
                        Update::Ended => ending_seen = true,
                        Update::ClientGone => return,
                    },
                    _ => break,
                }
            }
        }
        let last = match finish(&mesh, ended, &self.request).await {
            Ok((kind, data)) => self.frame(&kind, &data),
            Err(err) => {
                let body = err.error_response().into_body();
                let data = actix_web::body::to_bytes(body)
                    .await
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                    .unwrap_or_else(|| json!({"error": {"message": err.to_string()}}));
                self.frame("error", &data)
            }
        };
        tokio::select! {
            _ = tokio::time::timeout(FINAL_SEND_WAIT, self.frames.send(last)) => {}
            () = &mut gone => {}
        }
    }

    /// One message of the job's subjects: a preview goes out as a partial image (up to the
    /// request's `partial_images`; skipped, not queued, when the client's buffer is full).
    fn on_update(&mut self, payload: &[u8]) -> Update {
        let (width, height, rgb) = match decode(payload) {
            Ok(JobEvent::Preview {
                width, height, rgb, ..
            }) => (width, height, rgb),
            Ok(JobEvent::Done { .. } | JobEvent::Failed { .. }) => return Update::Ended,
            // The job reached a denoiser: from here the answer is a stream.
            Ok(_) => {
                self.commit(Ok(()));
                return Update::Nothing;
            }
            Err(_) => return Update::Nothing,
        };
        self.commit(Ok(()));
        // A job placed again previews its steps again: the count stays the request's.
        if self.partials >= self.request.partial_images {
            return Update::Nothing;
        }
        let Ok(image) = self.request.output.encode_rgb(rgb, width, height) else {
            return Update::Nothing;
        };
        let extra = json!({"partial_image_index": self.partials});
        let (kind, data) = self.request.event("partial_image", &image, extra);
        let frame = self.frame(&kind, &data);
        match self.frames.try_send(frame) {
            Ok(()) => self.partials += 1,
            Err(mpsc::error::TrySendError::Full(_)) => {}
            Err(mpsc::error::TrySendError::Closed(_)) => return Update::ClientGone,
        }
        Update::Nothing
    }
}

/// The `.completed` event of a job that ended `ended`.
async fn finish(
    mesh: &Mesh,
    ended: Result<Vec<String>, ApiError>,
    request: &StreamedRequest,
) -> Result<(String, Value), ApiError> {
    let pngs = mesh.fetch_pngs(&ended?).await?;
    let png = pngs
        .into_iter()
        .next()
        .ok_or_else(|| ApiError::Internal("the job returned no image".into()))?;
    let output = request.output;
    let image = tokio::task::spawn_blocking(move || output.encode(&png))
        .await
        .map_err(|e| ApiError::Internal(format!("encoding the result: {e}")))?
        .map_err(ApiError::Internal)?;
    Ok(request.event("completed", &image, json!({"usage": request.usage})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_carry_openais_fields() {
        let request = StreamedRequest {
            kind: JobKind::Edit,
            output: OutputFormat::Png,
            size: "64x48".into(),
            quality: "auto",
            background: "opaque",
            usage: ImageUsage::new("a red  circle", 12, 12),
            partial_images: 1,
        };
        let (kind, data) =
            request.event("partial_image", b"png", json!({"partial_image_index": 1}));
        assert_eq!(kind, "image_edit.partial_image");
        assert_eq!(data["type"], "image_edit.partial_image");
        assert_eq!(data["b64_json"], "cG5n");
        assert_eq!(data["partial_image_index"], 1);
        assert_eq!(data["size"], "64x48");
        assert_eq!(data["output_format"], "png");
    }
}
