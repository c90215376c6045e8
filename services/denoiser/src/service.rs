//! NATS side of the denoiser: submits and cancels in, heartbeats and job events out, finished
//! outputs written to the object store and handed to the codec for compositing and PNG encoding.
use crate::cached_step::{format_name, CacheSettings, TemplateSlot};
use crate::engine::{EngineEvent, EngineHandle, EngineJob, SubmitError};
use crate::lora::LoraStore;
use crate::metrics::DenoiserMetrics;
use crate::outcomes::RecentOutcomes;
use crate::templates::store::CacheClient;
use crate::templates::{CacheFetcher, Fetched, LocalTier, TemplateEntry, TemplatePixels};
use crate::DenoiserConfig;
use diffmesh_shared::nats::serve::serve_subscription;
use diffmesh_shared::nats::unanswered::{resent_while_unanswered, AttemptDeadlines};
use diffmesh_shared::nats::{publish_msgpack, reply_msgpack, request_msgpack_job};
use diffmesh_shared::stores::blob_store::{blob_key, BlobStore};
use diffmesh_shared::wire::messages::{
    decode, error_types, CancelJob, DenoiseJob, EvictTemplate, Heartbeat, JobEvent, JobKind,
    PostprocessReply, PostprocessRequest, SubmitReply,
};
use diffmesh_shared::wire::templates::{cache_key, CacheKeyParts};
use diffmesh_shared::{wire::subjects, MeshError};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Largest prepared input the denoiser reads from the object store (bytes).
pub const MAX_INPUT_BYTES: usize = 64 << 20;

pub struct Service {
    pub client: async_nats::Client,
    pub blobs: BlobStore,
    pub engine: EngineHandle,
    pub metrics: DenoiserMetrics,
    pub config: DenoiserConfig,
    pub worker_id: String,
    pub model_id: String,
    /// Set once shutdown begins: heartbeats say draining, so the router places nothing new here.
    pub draining: AtomicBool,
    submitted_at: Mutex<HashMap<String, Instant>>,
    pub templates: Templates,
    /// LoRA adapters in memory, fetched for the jobs that ask for them.
    pub loras: LoraStore,
    /// Ended jobs' terminal events and capture reports, for gateways whose copy was lost
    /// (`outcomes`).
    pub outcomes: RecentOutcomes,
    /// The ControlNet workers steered steps may run on (`--controlnet-remote`).
    pub controlnet_workers: Option<crate::controlnet_service::ControlNetWorkers>,
}

/// Template caches on this denoiser: the local tier, the cachestore client, the cache settings,
/// and the templates' own pixels.
pub struct Templates {
    pub local: LocalTier,
    pub store: CacheClient,
    /// Fills `local` from `store`, one fetch per cache key at a time.
    pub fetcher: CacheFetcher,
    pub settings: CacheSettings,
    /// Registered templates' model-resolution pixels (`inputs.template_image_key` in
    /// `subjects::TEMPLATE_BUCKET`), held for their next edits.
    pub pixels: TemplatePixels,
}

/// Sets a template slot to "unavailable" unless it was filled: a fetch that fails or panics
/// never leaves its edit waiting forever.
struct SlotGuard(TemplateSlot);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let _ = self.0.set(None);
    }
}

impl Service {
    // One argument per part the service is built from, each built by `lib::run`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: async_nats::Client,
        blobs: BlobStore,
        engine: EngineHandle,
        metrics: DenoiserMetrics,
        config: DenoiserConfig,
        worker_id: String,
        model_id: String,
        templates: Templates,
        loras: LoraStore,
    ) -> Self {
        Self {
            client,
            blobs,
            engine,
            metrics,
            config,
            worker_id,
            model_id,
            draining: AtomicBool::new(false),
            submitted_at: Mutex::new(HashMap::new()),
            templates,
            loras,
            outcomes: RecentOutcomes::default(),
            controlnet_workers: None,
        }
    }

    /// The ControlNets steered generations here may name: this denoiser's own and those its
    /// ControlNet workers serve.
    pub fn controlnets_served(&self) -> Vec<String> {
        let mut names =
            diffmesh_shared::wire::controlnet::served(self.config.controlnet_dir.as_deref());
        if let Some(workers) = &self.controlnet_workers {
            names.extend(workers.served());
            names.sort();
            names.dedup();
        }
        names
    }

    /// The cache key of a template job on this denoiser: its model (and compute dtype), the
    /// prepared template's content hash, resolution, the template's parameters and our cache
    /// format and dtype. `None` for jobs without a template.
    pub fn template_cache_key(&self, job: &DenoiseJob) -> Option<String> {
        let t = job.template.as_ref()?;
        let model = self.cache_model();
        let content = job.inputs.template_id.as_deref().unwrap_or("");
        let settings = &self.templates.settings;
        Some(cache_key(&CacheKeyParts::new(
            &model,
            content,
            job.inputs.model_width,
            job.inputs.model_height,
            t,
            format_name(settings.format),
            settings.dtype.as_str(),
        )))
    }

    /// The model part of this denoiser's cache keys: model id and compute dtype.
    pub fn cache_model(&self) -> String {
        format!("{}/{}", self.model_id, self.config.dtype)
    }

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
                        tracing::warn!(%key, "template cache not in the cachestore; full compute");
                        metrics.local_cache_lookups.with_label_values(&["unavailable"]).inc();
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

    /// Store a fresh capture (cachestore and local tier) and report it; then the job is done.
    async fn finish_capture(&self, job: DenoiseJob, entry: Arc<TemplateEntry>, seconds: f64) {
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

    async fn publish_event(&self, job_id: &str, event: &JobEvent) {
        self.outcomes.note(job_id, event);
        if let Err(err) = publish_msgpack(
            &self.client,
            subjects::job_events(job_id),
            Some(job_id),
            event,
        )
        .await
        {
            tracing::warn!(%job_id, error = %err, "could not publish job event");
        }
    }

    async fn publish_failed(&self, job_id: &str, message: String, error_type: &str) {
        self.submitted_at.lock().map(|mut m| m.remove(job_id)).ok();
        let event = JobEvent::Failed {
            message,
            error_type: error_type.to_string(),
        };
        self.publish_event(job_id, &event).await;
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
        let span = tracing::info_span!("denoise_job", job_id = %job.job_id, attempt = job.attempt, worker = %self.worker_id);
        diffmesh_shared::nats::trace_context::set_parent_from(&span, msg.headers.as_ref());
        async {
            let job_id = job.job_id.clone();
            // Inputs are read before acceptance so a job whose blobs are missing fails with a
            // clear error instead of occupying a batch slot.
            let inputs = match self.fetch_edit_inputs(&job).await {
                Ok(edit) => self.fetch_control_image(&job).await.map(|c| (edit, c)),
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
            let engine_job = EngineJob {
                job,
                edit,
                template,
                capture_key,
                lora,
                control_rgb,
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

    pub fn heartbeat(&self) -> Heartbeat {
        let status = self.engine.status();
        Heartbeat {
            worker_id: self.worker_id.clone(),
            running: status.running,
            queued: status.queued,
            waiting: status.waiting,
            max_batch: self.config.max_batch as u32,
            model: self.model_id.clone(),
            draining: status.draining || self.draining.load(Ordering::SeqCst),
            queue_capacity: self.config.max_queue as u32,
            cached_templates: self.templates.local.keys(),
            cached_loras: self.loras.ids(),
            controlnets: self.controlnets_served(),
            recent_steps: self.engine.take_step_samples(),
            controlnet_step_s: status.controlnet_step_s,
            interval_ms: self
                .config
                .heartbeat_interval
                .as_millis()
                .min(u32::MAX.into()) as u32,
        }
    }

    pub async fn send_heartbeat(&self) {
        if let Err(err) = publish_msgpack(
            &self.client,
            subjects::DENOISER_HEARTBEAT,
            None,
            &self.heartbeat(),
        )
        .await
        {
            tracing::warn!(error = %err, "could not publish heartbeat");
        }
    }

    pub async fn heartbeats(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), MeshError> {
        let mut tick = tokio::time::interval(
            self.config
                .heartbeat_interval
                .max(Duration::from_millis(10)),
        );
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => self.send_heartbeat().await,
            }
        }
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
                } => {
                    self.publish_event(&job_id, &JobEvent::Step { step, total })
                        .await;
                }
                EngineEvent::Captured {
                    job,
                    entry,
                    seconds,
                    span,
                } => {
                    let this = self.clone();
                    post.spawn(
                        async move { this.finish_capture(job, entry, seconds).await }
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
                    let this = self.clone();
                    post.spawn(
                        async move { this.postprocess(job, images, width, height).await }
                            .instrument(span),
                    );
                }
                EngineEvent::Failed { job, error, span } => {
                    let error_type = match error {
                        crate::engine::EngineJobError::Input(_) => error_types::INVALID_REQUEST,
                        _ => error_types::INTERNAL,
                    };
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

    /// Give queued jobs that never started back to the router, which places them elsewhere.
    pub async fn hand_back(&self, jobs: Vec<DenoiseJob>) {
        let timeout = self.config.handback_timeout;
        for job in jobs {
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
                    tracing::info!(%job_id, to = %worker_id, "queued job handed back and placed again");
                }
                Ok(SubmitReply::Rejected { reason, .. }) => {
                    let message = format!(
                        "denoiser {} shut down before starting the job; {reason}",
                        self.worker_id
                    );
                    self.publish_failed(&job_id, message, error_types::UNAVAILABLE)
                        .await;
                }
                Ok(SubmitReply::Overloaded { queue_depth, .. }) => {
                    let message = format!(
                        "denoiser {} shut down before starting the job; the mesh is at capacity ({queue_depth} waiting)",
                        self.worker_id
                    );
                    self.publish_failed(&job_id, message, error_types::UNAVAILABLE)
                        .await;
                }
                Err(err) => {
                    let message =
                        format!("denoiser {} shut down before starting the job; handing it back failed: {err}", self.worker_id);
                    self.publish_failed(&job_id, message, error_types::UNAVAILABLE)
                        .await;
                }
            }
        }
    }
}
