//! Capture broadcasts: the denoiser that stored a fresh template capture tells the others
//! (`subjects::TEMPLATES_CAPTURED`), and each of the same model and cache settings loads the
//! cache, and the template's pixels, into memory while its local tier has room. The first edit
//! of the template placed on it then starts at once instead of waiting for a whole-cache read
//! from the cachestore (at light load the router's prefetch has no queue wait to hide it in).
//! A lost broadcast costs only that wait; a warm-up never evicts a cache held for edits.
use crate::service::Service;
use crate::templates::{Fetched, TemplateEntry};
use diffmesh_shared::messages::{decode, DenoiseJob, TemplateCaptured};
use diffmesh_shared::nats::publish_msgpack;
use diffmesh_shared::serve::serve_subscription;
use diffmesh_shared::{subjects, MeshError};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// What a denoiser did with one capture broadcast; the label of
/// `diffmesh_denoiser_capture_warmups_total{outcome}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarmOutcome {
    /// Fetched into the local tier (or joined an edit's fetch of it).
    Loaded,
    /// Already held here.
    Held,
    /// Its own capture.
    Own,
    /// Another model or cache setting: this denoiser's edits would never read it.
    OtherSettings,
    /// It would not fit beside what the tier holds.
    NoRoom,
    /// Gone from the cachestore before it was read (deleted or evicted).
    Missing,
    Failed,
}

impl WarmOutcome {
    pub const ALL: [WarmOutcome; 7] = [
        WarmOutcome::Loaded,
        WarmOutcome::Held,
        WarmOutcome::Own,
        WarmOutcome::OtherSettings,
        WarmOutcome::NoRoom,
        WarmOutcome::Missing,
        WarmOutcome::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WarmOutcome::Loaded => "loaded",
            WarmOutcome::Held => "held",
            WarmOutcome::Own => "own",
            WarmOutcome::OtherSettings => "other_settings",
            WarmOutcome::NoRoom => "no_room",
            WarmOutcome::Missing => "missing",
            WarmOutcome::Failed => "failed",
        }
    }
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
            format: crate::cached_step::format_name(settings.format).into(),
            dtype: settings.dtype.as_str().into(),
            template_image_key: job.inputs.template_image_key.clone(),
        }
    }

    /// Tell every denoiser about a stored capture (fire and forget).
    pub(crate) async fn announce_capture(&self, job: &DenoiseJob, entry: &TemplateEntry) {
        let captured = self.capture_broadcast(job, entry);
        let subject = subjects::TEMPLATES_CAPTURED;
        if let Err(err) = publish_msgpack(&self.client, subject, Some(&job.job_id), &captured).await
        {
            tracing::warn!(cache_key = %captured.cache_key, error = %err, "capture broadcast not sent");
        }
    }

    /// Hear capture broadcasts and warm the local tier from them, one warm-up at a time
    /// (`serve_subscription` with one permit): the room check of one warm-up sees what the
    /// previous one admitted, and warm-ups (background work) never run several cache reads
    /// beside the edits' own. A warm-up running at shutdown is dropped, not waited for. Off
    /// with `--warm-on-capture false`.
    pub async fn capture_warmups(
        self: Arc<Self>,
        shutdown: CancellationToken,
    ) -> Result<(), MeshError> {
        if !self.config.warm_on_capture {
            return Ok(());
        }
        let sub = self.client.subscribe(subjects::TEMPLATES_CAPTURED).await?;
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
                    _ = service.warm(captured).instrument(span) => {}
                }
            }
        })
        .await;
        Ok(())
    }

    /// Warm the local tier (and the template's pixels) from one broadcast.
    pub async fn warm(&self, captured: TemplateCaptured) -> WarmOutcome {
        let outcome = match self.warm_skip(&captured) {
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
    fn warm_skip(&self, captured: &TemplateCaptured) -> Option<WarmOutcome> {
        let settings = &self.templates.settings;
        if captured.worker_id == self.worker_id {
            Some(WarmOutcome::Own)
        } else if captured.model != self.cache_model()
            || captured.format != crate::cached_step::format_name(settings.format)
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
