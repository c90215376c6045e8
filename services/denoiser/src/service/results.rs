//! Results out: the engine's events turned into job events, finished images handed to the
//! codec, captures stored, queued jobs handed back at shutdown, and the jobs an engine restart
//! cut off placed again.
use super::Service;
use crate::engine::{EngineEvent, EngineJobError};
use crate::sickness::Verdict;
use crate::templates::TemplateEntry;
use diffmesh_shared::nats::request_msgpack_job;
use diffmesh_shared::nats::unanswered::{resent_while_unanswered, AttemptDeadlines};
use diffmesh_shared::stores::blob_store::blob_key;
use diffmesh_shared::wire::messages::{
    error_types, DenoiseJob, JobEvent, PostprocessReply, PostprocessRequest, SubmitReply,
};
use diffmesh_shared::wire::templates::CacheQuality;
use diffmesh_shared::{wire::subjects, MeshError};
use std::sync::Arc;
use tokio::sync::mpsc;
use tracing::Instrument;

/// Placements a job gets in all when engine restarts cut it off (the router's default
/// `--max-attempts`): past them it fails, as a job that keeps crashing the engine must.
const PLACEMENTS_AFTER_RESTART: u32 = 3;

impl Service {
    /// Store a fresh capture (cachestore and local tier) and report it; then the job is done.
    async fn finish_capture(
        &self,
        job: DenoiseJob,
        entry: Arc<TemplateEntry>,
        seconds: f64,
        quality: Option<CacheQuality>,
    ) {
        let job_id = job.job_id.clone();
        self.metrics.capture_seconds.observe(seconds);
        if let Err(message) = self.templates.store.store(&entry).await {
            self.metrics
                .failures
                .with_label_values(&["cache_store"])
                .inc();
            self.publish_failed(&job_id, message, error_types::INTERNAL)
                .await;
            return;
        }
        self.templates.local.admit_off_runtime(entry.clone()).await;
        self.metrics
            .local_cache_bytes
            .set(self.templates.local.bytes() as i64);
        self.announce_capture(&job, &entry).await;
        let meta = &entry.meta;
        tracing::info!(%job_id, cache_key = %meta.cache_key, bytes = meta.bytes, seconds, "template captured");
        let event = JobEvent::Captured {
            cache_key: meta.cache_key.clone(),
            steps: meta.steps,
            blocks: meta.blocks,
            bytes: meta.bytes,
            quality,
        };
        self.publish_event(&job_id, &event).await;
        self.submitted_at.lock().map(|mut m| m.remove(&job_id)).ok();
        self.publish_event(
            &job_id,
            &JobEvent::Done {
                png_keys: Vec::new(),
            },
        )
        .await;
    }

    /// Turn engine events into job events; post-process finished jobs. Ends when the engine
    /// thread has exited and every post-processing task is done.
    pub async fn pump(
        self: Arc<Self>,
        mut events: mpsc::Receiver<EngineEvent>,
    ) -> Result<(), MeshError> {
        let mut post = tokio::task::JoinSet::new();
        while let Some(event) = events.recv().await {
            match event {
                EngineEvent::Started { job_id } => {
                    let accepted = self
                        .submitted_at
                        .lock()
                        .ok()
                        .and_then(|m| m.get(&job_id).copied());
                    if let Some(t) = accepted {
                        self.metrics
                            .queue_wait_seconds
                            .observe(t.elapsed().as_secs_f64());
                    }
                    let event = JobEvent::Started {
                        worker_id: self.worker_id.clone(),
                    };
                    self.publish_event(&job_id, &event).await;
                }
                EngineEvent::Step {
                    job_id,
                    step,
                    total,
                    ranks,
                } => {
                    self.publish_event(&job_id, &JobEvent::Step { step, total, ranks })
                        .await;
                }
                EngineEvent::Preview {
                    job_id,
                    step,
                    total,
                    width,
                    height,
                    rgb,
                } => {
                    let event = JobEvent::Preview {
                        step,
                        total,
                        width,
                        height,
                        rgb,
                    };
                    self.publish_event(&job_id, &event).await;
                }
                EngineEvent::Captured {
                    job,
                    entry,
                    seconds,
                    quality,
                    span,
                } => {
                    self.sickness.succeeded();
                    let this = self.clone();
                    post.spawn(
                        async move { this.finish_capture(job, entry, seconds, quality).await }
                            .instrument(span),
                    );
                }
                EngineEvent::Finished {
                    job,
                    images,
                    width,
                    height,
                    span,
                } => {
                    self.sickness.succeeded();
                    let this = self.clone();
                    post.spawn(
                        async move { this.postprocess(job, images, width, height).await }
                            .instrument(span),
                    );
                }
                EngineEvent::Failed {
                    job,
                    error: EngineJobError::Restarted(panic),
                    span,
                } if job.attempt + 1 < PLACEMENTS_AFTER_RESTART => {
                    self.note_failure(&job.job_id, Some(&panic));
                    // Not the job's fault: it goes back to the router (off this loop, which
                    // must not wait for the router), as a lost denoiser's jobs do.
                    let this = self.clone();
                    post.spawn(async move { this.place_again(job, panic).await }.instrument(span));
                }
                EngineEvent::Failed { job, error, span } => {
                    let error_type = error.error_type();
                    if error_type != error_types::INVALID_REQUEST {
                        // Only the model's own errors can tell of this device's fault: a
                        // ControlNet worker's or a LoRA store's are about someone else.
                        let own = matches!(
                            error,
                            crate::engine::EngineJobError::Model(_)
                                | crate::engine::EngineJobError::Panic(_)
                                | crate::engine::EngineJobError::Restarted(_)
                        );
                        let text = error.to_string();
                        self.note_failure(&job.job_id, own.then_some(text.as_str()));
                    }
                    self.publish_failed(&job.job_id, error.to_string(), error_type)
                        .instrument(span)
                        .await;
                }
                EngineEvent::Cancelled { job_id } => {
                    self.publish_failed(&job_id, "job cancelled".into(), "cancelled")
                        .await;
                }
            }
            while post.try_join_next().is_some() {}
        }
        while post.join_next().await.is_some() {}
        Ok(())
    }

    /// A job failed for a reason that was not its input: count it towards sickness. `error`:
    /// the text of a failure of this denoiser's own model, which may tell of a device fault.
    fn note_failure(&self, job_id: &str, error: Option<&str>) {
        let error = error.unwrap_or_default();
        match self.sickness.failed(std::time::Instant::now(), error) {
            Verdict::FellSick => {
                self.metrics.sick_episodes.inc();
                tracing::error!(%job_id, failures = self.config.sick_after_failures,
                    cooldown = ?self.config.sick_cooldown,
                    "jobs keep failing: this denoiser takes no work (unready, draining) for the cooldown");
            }
            Verdict::DeviceFault => {
                self.metrics.sick_episodes.inc();
                tracing::error!(%job_id, %error,
                    "the device failed: this denoiser drains and exits, to be restarted");
            }
            Verdict::Healthy | Verdict::StillSick => {}
        }
    }

    /// Write the RGB outputs, ask the codec for PNGs, publish Done (or Failed).
    async fn postprocess(&self, job: DenoiseJob, images: Vec<Vec<u8>>, width: u32, height: u32) {
        let job_id = job.job_id.clone();
        let mut output_keys = Vec::with_capacity(images.len());
        for (i, rgb) in images.iter().enumerate() {
            let key = blob_key(&job_id, &format!("output-{i}.rgb"));
            if let Err(err) = self.blobs.put(&key, rgb).await {
                self.metrics
                    .failures
                    .with_label_values(&[err.reason()])
                    .inc();
                self.publish_failed(
                    &job_id,
                    format!("writing output {key}: {err}"),
                    error_types::INTERNAL,
                )
                .await;
                return;
            }
            output_keys.push(key);
        }
        let request = PostprocessRequest {
            job,
            output_keys,
            model_width: width,
            model_height: height,
        };
        let mut deadlines =
            AttemptDeadlines::new(self.config.codec_first_attempt, self.config.codec_timeout);
        let window = self.config.post_retry_window;
        // The outputs are stored: wait out a codec restart rather than lose the job's steps.
        let reply = resent_while_unanswered(subjects::CODEC_POST, window, || {
            request_msgpack_job::<_, PostprocessReply>(
                &self.client,
                subjects::CODEC_POST,
                &job_id,
                &request,
                deadlines.next_deadline(),
            )
        })
        .await;
        match reply {
            Ok(PostprocessReply::Done { png_keys }) => {
                let started = self
                    .submitted_at
                    .lock()
                    .ok()
                    .and_then(|mut m| m.remove(&job_id));
                if let Some(t) = started {
                    self.metrics.job_seconds.observe(t.elapsed().as_secs_f64());
                }
                tracing::info!(%job_id, images = png_keys.len(), "job done");
                self.publish_event(&job_id, &JobEvent::Done { png_keys })
                    .await;
            }
            Ok(PostprocessReply::Failed { message }) => {
                self.metrics
                    .failures
                    .with_label_values(&["codec_post"])
                    .inc();
                self.publish_failed(
                    &job_id,
                    format!("post-processing failed: {message}"),
                    error_types::INTERNAL,
                )
                .await;
            }
            Err(err) => {
                self.metrics
                    .failures
                    .with_label_values(&[err.reason()])
                    .inc();
                self.publish_failed(
                    &job_id,
                    format!("post-processing request failed: {err}"),
                    error_types::INTERNAL,
                )
                .await;
            }
        }
    }

    /// A job the engine was running when it panicked and restarted: its next attempt goes to
    /// the router (a `Retrying` event first, as for a lost denoiser's jobs), which places it,
    /// here again or elsewhere.
    async fn place_again(&self, mut job: DenoiseJob, panic: String) {
        job.attempt += 1;
        let reason = format!(
            "the engine of denoiser {} restarted after a panic ({panic})",
            self.worker_id
        );
        tracing::warn!(job_id = %job.job_id, attempt = job.attempt, %reason, "placing the job again");
        let event = JobEvent::Retrying {
            attempt: job.attempt,
            reason,
        };
        self.publish_event(&job.job_id, &event).await;
        self.hand_back_one(job, "restarted its engine while the job ran")
            .await;
    }

    /// Give queued jobs that never started back to the router, which places them elsewhere.
    pub async fn hand_back(&self, jobs: Vec<DenoiseJob>) {
        for job in jobs {
            self.hand_back_one(job, "shut down before starting the job")
                .await;
        }
    }

    /// Submit `job` to the router again; `why` this denoiser gives it up goes into the
    /// failure should the router not take it.
    async fn hand_back_one(&self, job: DenoiseJob, why: &str) {
        if super::recapture::is_recapture(&job.job_id) {
            // Internal: the template's next edit asks for it again wherever it runs.
            tracing::info!(job_id = %job.job_id, why, "re-capture dropped");
            return;
        }
        let timeout = self.config.handback_timeout;
        let job_id = job.job_id.clone();
        let reply = request_msgpack_job::<_, SubmitReply>(
            &self.client,
            subjects::ROUTER_SUBMIT,
            &job_id,
            &job,
            timeout,
        )
        .await;
        match reply {
            Ok(SubmitReply::Accepted { worker_id }) => {
                tracing::info!(%job_id, to = %worker_id, "job handed back and placed again");
            }
            Ok(SubmitReply::Rejected { reason, .. }) => {
                let message = format!("denoiser {} {why}; {reason}", self.worker_id);
                self.publish_failed(&job_id, message, error_types::UNAVAILABLE)
                    .await;
            }
            Ok(SubmitReply::Overloaded { queue_depth, .. }) => {
                let message = format!(
                    "denoiser {} {why}; the mesh is at capacity ({queue_depth} waiting)",
                    self.worker_id
                );
                self.publish_failed(&job_id, message, error_types::UNAVAILABLE)
                    .await;
            }
            Err(err) => {
                let message = format!(
                    "denoiser {} {why}; handing it back failed: {err}",
                    self.worker_id
                );
                self.publish_failed(&job_id, message, error_types::UNAVAILABLE)
                    .await;
            }
        }
    }
}
