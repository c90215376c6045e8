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

use actix_web::http::header::CACHE_CONTROL;
use actix_web::{HttpResponse, ResponseError};
use base64::Engine;
use bytes::Bytes;
use diffmesh_shared::stores::job::now_ms;
use diffmesh_shared::wire::messages::{decode, JobEvent, JobKind};
use diffmesh_shared::wire::subjects::job_events;
use diffmesh_shared::MeshError;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::events::frame;
use crate::api::usage::ImageUsage;
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
/// the job ends.
pub async fn respond(
    mesh: Mesh,
    prepared: PreparedJob,
    hold: impl Send + 'static,
    request: StreamedRequest,
) -> Result<HttpResponse, ApiError> {
    // Subscribed before the job is submitted (`complete`), so no preview is missed.
    let previews = mesh
        .client
        .subscribe(job_events(prepared.job_id()))
        .await
        .map_err(MeshError::from)?;
    let (frames, body) = mpsc::channel::<Bytes>(FRAMES_BUFFERED);
    actix_web::rt::spawn(async move {
        run(mesh, prepared, previews, &frames, request).await;
        drop(hold);
    });
    let body = futures::stream::unfold(body, |mut rx| async move {
        rx.recv()
            .await
            .map(|frame| (Ok::<_, actix_web::Error>(frame), rx))
    });
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header((CACHE_CONTROL, "no-cache"))
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(body))
}

async fn run(
    mesh: Mesh,
    prepared: PreparedJob,
    mut previews: async_nats::Subscriber,
    frames: &mpsc::Sender<Bytes>,
    request: StreamedRequest,
) {
    let mut seq = 0u64;
    let mut next_frame = |event: &str, data: &Value| {
        seq += 1;
        frame(seq, event, data)
    };
    let mut partial_index = 0u32;
    let mut on_event = |payload: &[u8]| -> Result<bool, ()> {
        let (width, height, rgb) = match decode(payload) {
            Ok(JobEvent::Preview {
                width, height, rgb, ..
            }) => (width, height, rgb),
            Ok(JobEvent::Done { .. } | JobEvent::Failed { .. }) => return Ok(true),
            _ => return Ok(false),
        };
        let Ok(image) = request.output.encode_rgb(rgb, width, height) else {
            return Ok(false);
        };
        let extra = json!({"partial_image_index": partial_index});
        let (kind, data) = request.event("partial_image", &image, extra);
        // A full buffer skips the preview; a gone client ends the job.
        match frames.try_send(next_frame(&kind, &data)) {
            Ok(()) => partial_index += 1,
            Err(mpsc::error::TrySendError::Full(_)) => {}
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(()),
        }
        Ok(false)
    };
    let done = mesh.complete(prepared);
    tokio::pin!(done);
    // Leaving this loop drops the job's driver, which cancels the job in the mesh.
    let mut ending_seen = false;
    let ended = loop {
        tokio::select! {
            ended = &mut done => break ended,
            Some(msg) = previews.next() => match on_event(&msg.payload) {
                Ok(end) => ending_seen |= end,
                Err(()) => return,
            },
            () = frames.closed() => return,
        }
    };
    // The driver may hear the ending before this subscription has delivered the previews
    // published ahead of it: read on to the ending (briefly) so none is lost.
    let until = tokio::time::Instant::now() + PREVIEW_CATCH_UP;
    while !ending_seen {
        match tokio::time::timeout_at(until, previews.next()).await {
            Ok(Some(msg)) => match on_event(&msg.payload) {
                Ok(end) => ending_seen = end,
                Err(()) => return,
            },
            _ => break,
        }
    }
    let last = match finish(&mesh, ended, &request).await {
        Ok((kind, data)) => next_frame(&kind, &data),
        Err(err) => {
            let body = err.error_response().into_body();
            let data = actix_web::body::to_bytes(body)
                .await
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .unwrap_or_else(|| json!({"error": {"message": err.to_string()}}));
            next_frame("error", &data)
        }
    };
    let _ = tokio::time::timeout(FINAL_SEND_WAIT, frames.send(last)).await;
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
