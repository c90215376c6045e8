//! Work in: submits (their inputs fetched, their template cache and LoRAs loaded beside the
//! engine), cancels, and template evictions.
use super::{Service, SlotGuard};
use crate::cached_step::TemplateSlot;
use crate::engine::{EngineJob, SubmitError};
use crate::model::job_prompts;
use crate::prompt_stage::PromptSlot;
use crate::templates::Fetched;
use diffmesh_shared::nats::reply_msgpack;
use diffmesh_shared::nats::serve::serve_subscription;
use diffmesh_shared::wire::messages::{
    decode, error_types, CancelJob, DenoiseJob, EvictTemplate, JobEvent, JobKind, SubmitReply,
};
use diffmesh_shared::{wire::subjects, MeshError};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

impl Service {
    /// Start fetching an edit's template cache (local tier, else the cachestore); the slot is
    /// filled when done, `None` when no usable cache exists (the edit then runs in full).
    fn template_slot(&self, job: &DenoiseJob) -> Option<TemplateSlot> {
        if job.kind != JobKind::Edit {
            return None;
        }
        let key = self.template_cache_key(job)?;
        let slot: TemplateSlot = Default::default();
        let captured = job
            .template
            .as_ref()
            .map(|t| t.cache_key.as_str())
            .unwrap_or("");
        let metrics = self.metrics.clone();
        if captured != key {
            // Captured under another model or cache setting (or never): nothing to read.
            tracing::info!(%key, %captured, "no matching template cache; full compute");
            metrics
                .local_cache_lookups
                .with_label_values(&["unavailable"])
                .inc();
            let _ = slot.set(None);
            return Some(slot);
        }
        if let Some(entry) = self.templates.local.get(&key) {
            metrics
                .local_cache_lookups
                .with_label_values(&["hit"])
                .inc();
            let _ = slot.set(Some(entry));
            return Some(slot);
        }
        let guard = SlotGuard(slot.clone());
        let (fetcher, local) = (self.templates.fetcher.clone(), self.templates.local.clone());
        let (recaptures, edit) = (self.recaptures.clone(), job.clone());
        tokio::spawn(
            async move {
                let (fetched, joined) = fetcher.fetch(&key).await;
                let entry = match fetched {
                    Fetched::Entry(entry) => {
                        metrics.local_cache_bytes.set(local.bytes() as i64);
                        metrics.local_cache_lookups.with_label_values(&["miss"]).inc();
                        tracing::debug!(%key, joined, "template cache fetched");
                        Some(entry)
                    }
                    Fetched::Missing => {
                        tracing::warn!(%key, "template cache in no tier; full compute, and the template is captured again");
                        metrics.local_cache_lookups.with_label_values(&["unavailable"]).inc();
                        if !recaptures.request(&edit) {
                            metrics.recaptures.with_label_values(&["busy"]).inc();
                        }
                        None
                    }
                    Fetched::Failed(err) => {
                        tracing::warn!(%key, error = %err, "template cache fetch failed; full compute");
                        metrics.local_cache_lookups.with_label_values(&["unavailable"]).inc();
                        None
                    }
                };
                let _ = guard.0.set(entry);
            }
            .instrument(tracing::Span::current()),
        );
        Some(slot)
    }

    /// Subscribe to this worker's submit subject. Done before any heartbeat goes out, so the
    /// router never places a job on a worker whose subscription has not reached the server.
    pub async fn subscribe_submits(&self) -> Result<async_nats::Subscriber, MeshError> {
        Ok(self
            .client
            .subscribe(subjects::denoiser_submit(&self.worker_id))
            .await?)
    }

    /// Serve the submit subscription until `intake` is cancelled; answers every taken submit.
    pub async fn submits(
        self: Arc<Self>,
        sub: async_nats::Subscriber,
        intake: CancellationToken,
    ) -> Result<(), MeshError> {
        // Each submit ends in a command to the engine, so its channel size bounds them too.
        let limit = Arc::new(Semaphore::new(self.config.command_capacity.max(1)));
        serve_subscription(sub, intake, limit, |msg| {
            let this = self.clone();
            async move { this.handle_submit(msg).await }
        })
        .await;
        Ok(())
    }

    async fn handle_submit(&self, msg: async_nats::Message) {
        let job = match decode::<DenoiseJob>(&msg.payload) {
            Ok(job) => job,
            Err(err) => {
                self.metrics
                    .failures
                    .with_label_values(&["bad_request"])
                    .inc();
                let reply = SubmitReply::Rejected {
                    reason: format!("undecodable DenoiseJob: {err}"),
                    retry_after_ms: 0,
                };
                let _ = reply_msgpack(&self.client, &msg, &reply).await;
                return;
            }
        };
        if !job.params.model.is_empty() && job.params.model != self.model_id {
            // The router places by model; a job for another is someone's mistake, refused
            // before it takes a slot (the router places it again elsewhere).
            let reply = SubmitReply::Rejected {
                reason: format!(
                    "denoiser {} holds model {:?}, not {:?}",
                    self.worker_id, self.model_id, job.params.model
                ),
                retry_after_ms: 0,
            };
            let _ = reply_msgpack(&self.client, &msg, &reply).await;
            return;
        }
        let span = tracing::info_span!("denoise_job", job_id = %job.job_id, attempt = job.attempt, worker = %self.worker_id);
        diffmesh_shared::nats::trace_context::set_parent_from(&span, msg.headers.as_ref());
        async {
            let job_id = job.job_id.clone();
            // Inputs are read before acceptance so a job whose blobs are missing fails with a
            // clear error instead of occupying a batch slot.
            let inputs = match self.fetch_edit_inputs(&job).await {
                Ok(edit) => self.fetch_control_images(&job).await.map(|c| (edit, c)),
                Err(e) => Err(e),
            };
            let (edit, control_rgb) = match inputs {
                Ok(inputs) => inputs,
                Err(message) => {
                    let reply = SubmitReply::Accepted {
                        worker_id: self.worker_id.clone(),
                    };
                    let _ = reply_msgpack(&self.client, &msg, &reply).await;
                    self.metrics
                        .failures
                        .with_label_values(&["input_fetch"])
                        .inc();
                    self.publish_failed(&job_id, message, error_types::INVALID_REQUEST)
                        .await;
                    return;
                }
            };
            let capture_key = match job.kind {
                JobKind::Capture => match self.template_cache_key(&job) {
                    Some(key) => Some(key),
                    None => {
                        let reply = SubmitReply::Accepted {
                            worker_id: self.worker_id.clone(),
                        };
                        let _ = reply_msgpack(&self.client, &msg, &reply).await;
                        let message = "a capture job needs `template`".to_string();
                        self.publish_failed(&job_id, message, error_types::INVALID_REQUEST)
                            .await;
                        return;
                    }
                },
                _ => None,
            };
            if job.template.is_some() && !job.params.loras.is_empty() {
                // The template's cache holds the base model's activations.
                let reply = SubmitReply::Accepted {
                    worker_id: self.worker_id.clone(),
                };
                let _ = reply_msgpack(&self.client, &msg, &reply).await;
                let message = "loras: not supported with a template's activation cache".into();
                self.publish_failed(&job_id, message, error_types::INVALID_REQUEST)
                    .await;
                return;
            }
            let template = self.template_slot(&job);
            let lora = self.loras.slot(&job.params.loras).await;
            // Encoded by the prompt stage once the engine has taken the job.
            let prompts = self
                .prompt_stage
                .as_ref()
                .map(|stage| (stage, job_prompts(&job), PromptSlot::default()));
            let engine_job = EngineJob {
                job,
                edit,
                template,
                capture_key,
                lora,
                control_rgb,
                prompts: prompts.as_ref().map(|(_, _, slot)| slot.clone()),
            };
            let result = self
                .engine
                .submit(engine_job, tracing::Span::current())
                .await;
            let reply = match &result {
                Ok(_) | Err(SubmitError::Duplicate(_)) => SubmitReply::Accepted {
                    worker_id: self.worker_id.clone(),
                },
                Err(err) => {
                    self.metrics.failures.with_label_values(&["busy"]).inc();
                    SubmitReply::Rejected {
                        reason: err.to_string(),
                        retry_after_ms: self.config.retry_after.as_millis() as u64,
                    }
                }
            };
            if let Ok(position) = result {
                if let Some((stage, texts, slot)) = prompts {
                    stage.encode(texts, slot);
                }
                self.submitted_at
                    .lock()
                    .map(|mut m| m.insert(job_id.clone(), Instant::now()))
                    .ok();
                let event = JobEvent::Queued {
                    worker_id: self.worker_id.clone(),
                    position,
                };
                self.publish_event(&job_id, &event).await;
            }
            if let Err(err) = reply_msgpack(&self.client, &msg, &reply).await {
                tracing::warn!(error = %err, "could not answer a submit");
            }
        }
        .instrument(span)
        .await
    }

    /// Forward cancels from `denoiser_cancel(worker_id)` to the engine.
    pub async fn cancels(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), MeshError> {
        let mut sub = self
            .client
            .subscribe(subjects::denoiser_cancel(&self.worker_id))
            .await?;
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                msg = sub.next() => match msg { Some(m) => m, None => return Ok(()) },
            };
            match decode::<CancelJob>(&msg.payload) {
                Ok(c) => {
                    let span = tracing::info_span!("cancel", job_id = %c.job_id);
                    diffmesh_shared::nats::trace_context::set_parent_from(
                        &span,
                        msg.headers.as_ref(),
                    );
                    self.engine.cancel(c.job_id, span).await;
                }
                Err(err) => tracing::warn!(error = %err, "undecodable cancel"),
            }
        }
    }

    /// Drop deleted templates from the local tier.
    pub async fn evictions(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), MeshError> {
        let mut sub = self.client.subscribe(subjects::TEMPLATES_EVICT).await?;
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                msg = sub.next() => match msg { Some(m) => m, None => return Ok(()) },
            };
            match decode::<EvictTemplate>(&msg.payload) {
                Ok(e) => {
                    self.templates.local.remove(&e.cache_key);
                    self.templates.pixels.evict(&e.template_id).await;
                    self.metrics
                        .local_cache_bytes
                        .set(self.templates.local.bytes() as i64);
                    tracing::info!(template_id = %e.template_id, cache_key = %e.cache_key, "template evicted");
                }
                Err(err) => tracing::warn!(error = %err, "undecodable eviction"),
            }
        }
    }
}
