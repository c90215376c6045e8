//! Capture broadcasts: the denoiser that stored a fresh template capture tells the others
//! (`subjects::TEMPLATES_CAPTURED`), and each of the same model and cache settings loads the
//! cache, and the template's pixels, into memory while its local tier has room. The first edit
//! of the template placed on it then starts at once instead of waiting for a whole-cache read
//! from the cachestore (at light load the router's prefetch has no queue wait to hide it in).
//! A lost broadcast costs only that wait; a warm-up never evicts a cache held for edits.
//!
//! The stream `subjects::TEMPLATE_CAPTURES_STREAM` keeps the last announcement per cache, so a
//! denoiser that starts later (scaled out, restarted) first replays them, newest first, while
//! its tier has room.
use crate::capture_log::recent_captures;
use crate::service::Service;
use crate::templates::{Fetched, TemplateEntry};
use async_nats::jetstream::stream;
use diffmesh_shared::nats::publish_msgpack;
use diffmesh_shared::nats::serve::serve_subscription;
use diffmesh_shared::wire::messages::{decode, DenoiseJob, TemplateCaptured};
use diffmesh_shared::{wire::subjects, MeshError};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How long a starting denoiser reads earlier announcements before it stops (they are a hint).
const CATCH_UP_READ_TIMEOUT: Duration = Duration::from_secs(10);

pub use crate::labels::WarmOutcome;

/// How an announcement reached this denoiser.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heard {
    /// Broadcast while it runs.
    Live,
    /// Read back from the stream at start.
    Replayed,
}

impl Service {
    /// The capture broadcast of a fresh, stored capture of `job`'s template.
    pub(crate) fn capture_broadcast(
        &self,
        job: &DenoiseJob,
        entry: &TemplateEntry,
    ) -> TemplateCaptured {
        let settings = &self.templates.settings;
        TemplateCaptured {
            worker_id: self.worker_id.clone(),
            cache_key: entry.meta.cache_key.clone(),
            bytes: entry.bytes(),
            model: self.cache_model(),
            format: settings.layout.as_str().into(),
            dtype: settings.dtype.as_str().into(),
            template_image_key: job.inputs.template_image_key.clone(),
        }
    }

    /// Tell every denoiser about a stored capture (fire and forget).
    pub(crate) async fn announce_capture(&self, job: &DenoiseJob, entry: &TemplateEntry) {
        let captured = self.capture_broadcast(job, entry);
        let subject = subjects::template_captured(&captured.cache_key);
        if let Err(err) =
            publish_msgpack(&self.client, &subject, Some(&job.job_id), &captured).await
        {
            tracing::warn!(cache_key = %captured.cache_key, error = %err, "capture broadcast not sent");
        }
    }

    /// Replay the announcements in `captures` made before this start, then hear capture
    /// broadcasts and warm the local tier from them, one warm-up at a time
    /// (`serve_subscription` with one permit): the room check of one warm-up sees what the
    /// previous one admitted, and warm-ups (background work) never run several cache reads
    /// beside the edits' own. A warm-up running at shutdown is dropped, not waited for. Off
    /// with `--warm-on-capture false`.
    pub async fn capture_warmups(
        self: Arc<Self>,
        captures: stream::Stream,
        shutdown: CancellationToken,
    ) -> Result<(), MeshError> {
        if !self.config.warm_on_capture {
            return Ok(());
        }
        // Subscribed first, so an announcement made during the replay waits here; one heard
        // both ways finds the cache held.
        let sub = self
            .client
            .subscribe(subjects::TEMPLATES_CAPTURED_ALL)
            .await?;
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = self.catch_up(&captures) => {}
        }
        let one_at_a_time = Arc::new(tokio::sync::Semaphore::new(1));
        let stop = shutdown.clone();
        serve_subscription(sub, shutdown, one_at_a_time, |msg| {
            let (service, stop) = (self.clone(), stop.clone());
            async move {
                let captured = match decode::<TemplateCaptured>(&msg.payload) {
                    Ok(c) => c,
                    Err(err) => {
                        tracing::warn!(error = %err, "undecodable capture broadcast");
                        return;
                    }
                };
                let span = tracing::info_span!("capture_warmup", cache_key = %captured.cache_key);
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = service.warm(captured, Heard::Live).instrument(span) => {}
                }
            }
        })
        .await;
        Ok(())
    }

    /// Warm the local tier from the announcements made before this denoiser started, newest
    /// first. A failed read of them costs only the warm-ups.
    async fn catch_up(&self, captures: &stream::Stream) {
        let recent = match recent_captures(captures, &self.client, CATCH_UP_READ_TIMEOUT).await {
            Ok(recent) => recent,
            Err(error) => {
                tracing::warn!(%error, "earlier capture announcements not read");
                return;
            }
        };
        let mut outcomes = BTreeMap::new();
        for captured in &recent {
            let span = tracing::info_span!("capture_catch_up", cache_key = %captured.cache_key);
            let outcome = self
                .warm(captured.clone(), Heard::Replayed)
                .instrument(span)
                .await;
            *outcomes.entry(outcome.as_str()).or_insert(0u32) += 1;
        }
        if !recent.is_empty() {
            tracing::info!(
                announced = recent.len(),
                ?outcomes,
                "caught up on earlier captures"
            );
        }
    }

    /// Warm the local tier (and the template's pixels) from one announcement.
    pub async fn warm(&self, captured: TemplateCaptured, heard: Heard) -> WarmOutcome {
        let outcome = match self.warm_skip(&captured, heard) {
            Some(skip) => skip,
            None => {
                let (fetched, joined) = self.templates.fetcher.fetch(&captured.cache_key).await;
                match fetched {
                    Fetched::Entry(_) => {
                        self.metrics
                            .local_cache_bytes
                            .set(self.templates.local.bytes() as i64);
                        tracing::info!(bytes = captured.bytes, joined, "template cache warmed");
                        WarmOutcome::Loaded
                    }
                    Fetched::Missing => WarmOutcome::Missing,
                    Fetched::Failed(error) => {
                        tracing::warn!(%error, "template cache warm-up failed");
                        WarmOutcome::Failed
                    }
                }
            }
        };
        if outcome == WarmOutcome::Loaded {
            if let Some(key) = &captured.template_image_key {
                // The pixels are read before the edit is queued: hold them too.
                if let Err(error) = self.templates.pixels.get(key).await {
                    tracing::warn!(%error, "template pixels not warmed");
                }
            }
        }
        self.metrics
            .capture_warmups
            .with_label_values(&[outcome.as_str()])
            .inc();
        outcome
    }

    /// Why this denoiser should not load a broadcast capture, if it should not.
    fn warm_skip(&self, captured: &TemplateCaptured, heard: Heard) -> Option<WarmOutcome> {
        let settings = &self.templates.settings;
        // A replayed capture of this worker id was made before a restart emptied the tier.
        if captured.worker_id == self.worker_id && heard == Heard::Live {
            Some(WarmOutcome::Own)
        } else if captured.model != self.cache_model()
            || captured.format != settings.layout.as_str()
            || captured.dtype != settings.dtype.as_str()
        {
            Some(WarmOutcome::OtherSettings)
        } else if self.templates.local.contains(&captured.cache_key) {
            Some(WarmOutcome::Held)
        } else if !self.templates.local.has_room_for(captured.bytes) {
            Some(WarmOutcome::NoRoom)
        } else {
            None
        }
    }
}
