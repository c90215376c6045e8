//! One job's path through the mesh, as the gateway drives it: job record -> store uploads ->
//! codec pre (`prepare`, whose errors are the request's 4xx) -> subscribe to job events ->
//! router submit (bounded retry) -> await Done/Failed (`complete`). The job record in KV
//! follows every step, so `GET /v1/jobs/{id}` and the event stream can show it from any
//! gateway. A job cancelled in its record (`DELETE`) is stopped at the next check.
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use diffmesh_shared::nats::reconnects::Reconnects;
use diffmesh_shared::nats::unanswered::{resent_while_unanswered, AttemptDeadlines};
use diffmesh_shared::nats::{publish_msgpack, request_msgpack_job};
use diffmesh_shared::stores::async_queue::AsyncQueue;
use diffmesh_shared::stores::blob_store::{blob_key, BlobStore};
use diffmesh_shared::stores::idempotency::IdempotencyStore;
use diffmesh_shared::stores::job::{
    now_ms, JobRecord, JobState, JobStore, ProgressWrites, Webhook,
};
use diffmesh_shared::wire::messages::{
    decode, error_types, CancelJob, DenoiseJob, JobEvent, JobKind, PreparedInputs, PreprocessReply,
    PreprocessRequest, SubmitReply, TemplateImage, TemplateRef,
};
use diffmesh_shared::wire::models::ModelGeometry;
use diffmesh_shared::wire::subjects::{job_events, CODEC_PRE, ROUTER_CANCEL, ROUTER_SUBMIT};
use diffmesh_shared::MeshError;
use futures::StreamExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::error::ApiError;
use crate::lost_events;
use crate::metrics::GatewayMetrics;
use crate::templates::uses::TemplateUses;
use crate::validate::ValidParams;

/// Deadlines of the mesh hops.
#[derive(Debug, Clone)]
pub struct FlowConfig {
    pub codec_timeout: Duration,
    /// Deadline of the first preprocessing attempt (doubling per attempt up to `codec_timeout`).
    pub codec_first_attempt: Duration,
    /// Deadline of one router submit request (the router may hold it while it admits).
    pub router_timeout: Duration,
    /// How long to keep resubmitting while the router has no denoiser for the job, and to
    /// send pre-processing again while no codec takes it.
    pub submit_wait: Duration,
    /// Whole-job deadline, from acceptance to the last PNG.
    pub job_timeout: Duration,
}

/// The gateway's handles on the mesh.
#[derive(Clone)]
pub struct Mesh {
    pub client: Client,
    pub blobs: BlobStore,
    pub jobs: JobStore,
    pub idempotency: IdempotencyStore,
    pub flow: FlowConfig,
    pub metrics: GatewayMetrics,
    /// The runtime `start` ran on: async jobs and cancels run there, not on an HTTP worker's
    /// runtime (which ends with the worker).
    pub runtime: tokio::runtime::Handle,
    /// Async jobs and cancels in flight, awaited on shutdown.
    pub background: TaskTracker,
    /// Jobs this gateway is driving, so a cancel here stops the driver at once (a cancel on
    /// another gateway reaches it through the mesh's `Failed` event).
    pub driving: DrivingMap,
    /// Edits by template in flight, so a template is not deleted under them.
    pub template_uses: TemplateUses,
    /// The durable queue async jobs wait in (`async_jobs`).
    pub queue: AsyncQueue,
    /// Longest an async job waits in that queue (`--async-queue-time`).
    pub max_queue_time: Duration,
    /// Models the router refused for load moments ago (`overload_gate`).
    pub overload_gate: Arc<crate::overload_gate::OverloadGate>,
}

/// A validated request ready to run.
pub struct JobInput {
    pub kind: JobKind,
    pub valid: ValidParams,
    pub image: Option<InputImage>,
    pub mask: Option<Vec<u8>>,
    /// The registered template an edit reads or a capture records (`templates`).
    pub template: Option<TemplateRef>,
    /// A generation's control images (bytes as uploaded): `valid.params.controlnet`'s, then
    /// those of `extra_controlnets` in order.
    pub control_images: Vec<Vec<u8>>,
    /// The request gave its ControlNets as the list `controlnets` (errors name its items).
    pub controlnets_listed: bool,
    /// The geometry the model `valid.params.model` announced (`request_model`), which the codec
    /// prepares the inputs at; None: the codec's own.
    pub geometry: Option<ModelGeometry>,
}

/// A validated image request.
pub struct ImageRequest {
    pub input: JobInput,
    /// Hash of the request (`idempotency::fingerprint`).
    pub fingerprint: String,
}

/// Where an edit's or a capture's image is.
pub enum InputImage {
    /// Uploaded with the request: stored as the job's blob.
    Upload(Vec<u8>),
    /// A registered template's: it stays in the template bucket, the job names it.
    Template(TemplateImage),
}

/// A job whose record exists and whose inputs the codec prepared: ready to submit.
pub struct PreparedJob {
    pub job: DenoiseJob,
    deadline: Instant,
    span: tracing::Span,
    guard: AbandonGuard,
    /// Recorded with the submission: see `JobRecord::resumable`.
    resumable: bool,
}

impl PreparedJob {
    pub fn job_id(&self) -> &str {
        &self.job.job_id
    }

    /// The client sent an `Idempotency-Key` and waits on its connection: should this gateway
    /// die before placing the job, a router places it for the client's repeat to find.
    pub fn make_resumable(&mut self) {
        self.resumable = true;
    }

    /// Stop guarding the job: the durable queue holds it now, and no connection's end
    /// cancels it (`async_jobs`).
    pub(crate) fn release(&mut self) {
        self.guard.disarm();
    }
}

/// Cancels a job whose driver is dropped before it finished (a synchronous client went away):
/// the record becomes `cancelled` and, once submitted, the mesh is told to drop it.
struct AbandonGuard {
    mesh: Mesh,
    job_id: String,
    /// The template an edit reads, whose use ends with the job (`TemplateUses`), abandoned
    /// or not.
    template_use: Option<String>,
    submitted: bool,
    armed: bool,
}

impl AbandonGuard {
    /// Stop guarding; returns whether the job was submitted.
    fn disarm(&mut self) -> bool {
        self.armed = false;
        self.submitted
    }
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mesh = self.mesh.clone();
        let job_id = self.job_id.clone();
        let template_use = self.template_use.clone();
        let submitted = self.submitted;
        tracing::info!(%job_id, "client went away; cancelling the job");
        self.mesh.spawn_background(async move {
            let message = "the client closed the connection before the job finished";
            if let Err(err) = mesh
                .jobs
                .update(&job_id, |r| r.mark_cancelled(message))
                .await
            {
                tracing::warn!(%job_id, error = %err, "could not record the cancel");
            }
            if submitted {
                mesh.cancel_in_mesh(&job_id, mesh.placement_window()).await;
            }
            // After the record ended: a delete counting uses meanwhile waits for this job.
            if let Some(template_id) = template_use {
                mesh.template_uses.end(&template_id, &job_id).await;
            }
        });
    }
}

/// The jobs this gateway drives, by job id: written as each job starts and ends, read by every
/// cancel (a concurrent map: no lock shared by all jobs).
type DrivingMap = Arc<dashmap::DashMap<String, CancellationToken>>;

/// A job this gateway drives; dropping it (the driver ended or was dropped) forgets it.
struct Driving {
    driving: DrivingMap,
    job_id: String,
    token: CancellationToken,
}

impl Drop for Driving {
    fn drop(&mut self) {
        self.driving.remove(&self.job_id);
    }
}

fn cancelled_error(job_id: &str) -> ApiError {
    ApiError::Cancelled {
        message: format!("job {job_id} was cancelled"),
    }
}

impl Mesh {
    /// Run one job to completion; returns the job id and the PNG bytes, one per image.
    pub async fn run_job(
        &self,
        input: JobInput,
        owner: Option<&str>,
    ) -> Result<(String, Vec<Vec<u8>>), ApiError> {
        let prepared = self.prepare(input, owner).await?;
        let job_id = prepared.job_id().to_string();
        let png_keys = self.complete(prepared).await?;
        Ok((job_id, self.fetch_pngs(&png_keys).await?))
    }

    /// Create the job record (owned by `owner`), store the uploads and have the codec prepare
    /// the inputs. Errors here (bad image or mask) are the request's own.
    pub async fn prepare(
        &self,
        input: JobInput,
        owner: Option<&str>,
    ) -> Result<PreparedJob, ApiError> {
        let job_id = uuid::Uuid::new_v4().to_string();
        let span = tracing::info_span!("job", job_id = %job_id, kind = ?input.kind);
        let deadline = Instant::now() + self.flow.job_timeout;
        let mut record = JobRecord::new(job_id.clone(), input.kind);
        record.owner = owner.map(str::to_string);
        // In the first write, so no ending can be recorded without it (it is due only once the
        // job is in the durable queue: `JobRecord::webhook_due`).
        record.webhook = input.valid.callback_url.as_deref().map(Webhook::new);
        // Should this gateway die before the job is prepared, a router ends the record after
        // the job's deadline instead of leaving it queued for good.
        record.place_by_ms = Some(record.created_at_ms + self.flow.job_timeout.as_millis() as u64);
        self.jobs.create(&record).instrument(span.clone()).await?;
        // An edit's template must outlive the job: note the use before anything reads it.
        let template_use = match (&input.kind, &input.template) {
            (JobKind::Edit, Some(t)) => Some(t.template_id.clone()),
            _ => None,
        };
        let mut guard = AbandonGuard {
            mesh: self.clone(),
            job_id: job_id.clone(),
            template_use: template_use.clone(),
            submitted: false,
            armed: true,
        };
        let prepared = async {
            if let Some(template_id) = &template_use {
                self.template_uses.begin(template_id, &job_id).await?;
            }
            self.preprocess(&job_id, input).await
        }
        .instrument(span.clone())
        .await;
        match prepared {
            Ok(job) => Ok(PreparedJob {
                job,
                deadline,
                span,
                guard,
                resumable: false,
            }),
            Err(err) => {
                guard.disarm();
                self.record_failure(&job_id, &err).instrument(span).await;
                if let Some(template_id) = &template_use {
                    self.template_uses.end(template_id, &job_id).await;
                }
                Err(err)
            }
        }
    }

    /// The job's record has ended: it reads its template no more.
    async fn end_template_use(&self, prepared: &PreparedJob) {
        if let Some(template_id) = &prepared.guard.template_use {
            self.template_uses.end(template_id, prepared.job_id()).await;
        }
    }

    async fn preprocess(&self, job_id: &str, input: JobInput) -> Result<DenoiseJob, ApiError> {
        let t = Instant::now();
        let (image_key, template_image) = match input.image {
            Some(InputImage::Upload(bytes)) => {
                (Some(self.put(job_id, "image", &bytes).await?), None)
            }
            Some(InputImage::Template(t)) => (None, Some(t)),
            None => (None, None),
        };
        let mask_key = match &input.mask {
            Some(bytes) => Some(self.put(job_id, "mask", bytes).await?),
            None => None,
        };
        let mut control_keys = Vec::with_capacity(input.control_images.len());
        for (i, bytes) in input.control_images.iter().enumerate() {
            let name = match i {
                0 => "control".to_string(),
                i => format!("control-{i}"),
            };
            control_keys.push(self.put(job_id, &name, bytes).await?);
        }
        let mut control_keys = control_keys.into_iter();
        let control_image_key = control_keys.next();
        self.stage("store", t);

        let t = Instant::now();
        let params = input.valid.params;
        let pre = PreprocessRequest {
            job_id: job_id.to_string(),
            kind: input.kind,
            image_key: image_key.clone(),
            mask_key: mask_key.clone(),
            params: params.clone(),
            template_image,
            control_image_key,
            extra_control_image_keys: control_keys.collect(),
            controlnets_listed: input.controlnets_listed,
            geometry: input.geometry,
        };
        // No codec for a moment (restarting) is waited out as a missing router is; one killed
        // while it held the request costs the first attempt's deadline.
        let mut deadlines =
            AttemptDeadlines::new(self.flow.codec_first_attempt, self.flow.codec_timeout);
        let reply: PreprocessReply =
            resent_while_unanswered(CODEC_PRE, self.flow.submit_wait, || {
                request_msgpack_job(
                    &self.client,
                    CODEC_PRE,
                    job_id,
                    &pre,
                    deadlines.next_deadline(),
                )
            })
            .await?;
        let inputs: PreparedInputs = match reply {
            PreprocessReply::Prepared(p) => p,
            PreprocessReply::Invalid(field) => return Err(ApiError::Invalid(field)),
            PreprocessReply::Failed { message } => {
                return Err(ApiError::Internal(format!(
                    "preprocessing failed: {message}"
                )))
            }
        };
        self.stage("codec_pre", t);
        Ok(DenoiseJob {
            job_id: job_id.to_string(),
            kind: input.kind,
            params,
            inputs,
            raw_image_key: image_key,
            raw_mask_key: mask_key,
            attempt: 0,
            template: input.template,
        })
    }

    /// Run `task` on the gateway's runtime; shutdown waits for it (up to the job deadline).
    pub fn spawn_background<F>(&self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.runtime.spawn(self.background.track_future(task));
    }

    /// Drop a prepared job that is not needed after all (another request with the same
    /// `Idempotency-Key` got in first); its record says why.
    pub async fn discard(&self, mut prepared: PreparedJob, reason: &str) {
        prepared.guard.disarm();
        let job_id = prepared.job_id().to_string();
        if let Err(err) = self
            .jobs
            .update(&job_id, |r| r.mark_cancelled(reason))
            .await
        {
            tracing::warn!(%job_id, error = %err, "could not record the discarded job");
        }
        self.end_template_use(&prepared).await;
    }

    /// End a prepared job that was refused (the async queue is full): its record says why.
    pub(crate) async fn refuse(&self, mut prepared: PreparedJob, err: &ApiError) {
        prepared.guard.disarm();
        self.record_failure(prepared.job_id(), err).await;
        self.end_template_use(&prepared).await;
    }

    /// Unix ms by which a job submitted now has been placed or given up by its driver.
    fn place_by_ms(&self) -> u64 {
        now_ms() + self.placement_window().as_millis() as u64
    }

    /// Submit a prepared job and wait for its end; returns the result PNGs' blob keys. The
    /// record ends `done`, `failed` or `cancelled`.
    pub async fn complete(&self, mut prepared: PreparedJob) -> Result<Vec<String>, ApiError> {
        let span = prepared.span.clone();
        async {
            let job_id = prepared.job_id().to_string();
            let driving = self.register_driving(&job_id);
            let result = tokio::select! {
                r = self.submit_and_wait(&mut prepared) => r,
                _ = driving.token.cancelled() => Err(cancelled_error(&job_id)),
            };
            drop(driving);
            let submitted = prepared.guard.disarm();
            let ended = match result {
                Ok(png_keys) => {
                    let written = self
                        .jobs
                        .update(&job_id, |r| r.mark_done(png_keys.clone()))
                        .await;
                    match written {
                        // Cancelled just before it finished: the cancel stands.
                        Ok(r) if r.state == JobState::Cancelled => Err(cancelled_error(&job_id)),
                        Ok(_) => Ok(png_keys),
                        Err(err) => {
                            tracing::warn!(error = %err, "could not mark the job done");
                            Ok(png_keys)
                        }
                    }
                }
                Err(err) => {
                    // The mesh ended the job itself when it reported a failure; otherwise
                    // (deadline, cancel seen here) tell it to stop.
                    if submitted && !matches!(err, ApiError::JobFailed { .. }) {
                        self.cancel_in_mesh(&job_id, Duration::ZERO).await;
                    }
                    self.record_failure(&job_id, &err).await;
                    Err(err)
                }
            };
            self.end_template_use(&prepared).await;
            self.count_deadline(prepared.job.params.deadline_unix_ms, &ended);
            ended
        }
        .instrument(span)
        .await
    }

    async fn submit_and_wait(&self, prepared: &mut PreparedJob) -> Result<Vec<String>, ApiError> {
        let job = prepared.job.clone();
        let job_id = job.job_id.as_str();
        let deadline = prepared.deadline;
        // Subscribe before submitting so no event can be missed.
        let mut events = self
            .client
            .subscribe(job_events(job_id))
            .await
            .map_err(MeshError::from)?;
        let place_by = self.place_by_ms();
        let resumable = prepared.resumable;
        let recorded = self
            .jobs
            .update(job_id, |r| {
                r.record_submission(&job, place_by);
                r.resumable |= resumable;
            })
            .await;
        match recorded {
            Ok(r) if r.state == JobState::Cancelled => return Err(cancelled_error(job_id)),
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "could not record the submitted job"),
        }

        let t = Instant::now();
        // From here a dropped driver must also cancel in the mesh: the router may place the
        // job even if its answer never arrives.
        prepared.guard.submitted = true;
        let worker = self.submit(&job, deadline).await?;
        self.stage("submit", t);
        // A cancel that arrived while the router held the job could not reach a denoiser yet.
        match self.jobs.update(job_id, |r| r.mark_placed(&worker)).await {
            Ok(r) if r.state == JobState::Cancelled => return Err(cancelled_error(job_id)),
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "could not record the placement"),
        }

        let t = Instant::now();
        let png_keys = self.await_result(job_id, &mut events, deadline).await?;
        self.stage("denoise", t);
        Ok(png_keys)
    }

    /// Fetch result PNGs from the object store.
    pub async fn fetch_pngs(&self, png_keys: &[String]) -> Result<Vec<Vec<u8>>, ApiError> {
        let t = Instant::now();
        let mut pngs = Vec::with_capacity(png_keys.len());
        for key in png_keys {
            pngs.push(self.blobs.get(key).await?);
        }
        self.stage("fetch", t);
        Ok(pngs)
    }

    /// Record why a job ended without a result (bookkeeping: a failed write is only logged).
    async fn record_failure(&self, job_id: &str, err: &ApiError) {
        let message = err.to_string();
        let error_type = err.error_type().to_string();
        let written = self
            .jobs
            .update(job_id, |r| {
                if error_type == error_types::CANCELLED {
                    r.mark_cancelled(message.clone())
                } else {
                    r.mark_failed(message.clone(), error_type.clone())
                }
            })
            .await;
        if let Err(err) = written {
            tracing::warn!(error = %err, "could not record the job's failure");
        }
    }

    /// Tell the router to drop `job_id`. The router only knows jobs it has placed, so for
    /// `chase` afterwards (a job the router may still be admitting) the cancel is sent again
    /// as soon as the job shows up on a denoiser.
    pub async fn cancel_in_mesh(&self, job_id: &str, chase: Duration) {
        let events = if chase.is_zero() {
            None
        } else {
            self.client.subscribe(job_events(job_id)).await.ok()
        };
        self.publish_cancel(job_id).await;
        let Some(mut events) = events else { return };
        let until = Instant::now() + chase;
        while let Ok(Some(msg)) = tokio::time::timeout_at(until, events.next()).await {
            match decode::<JobEvent>(&msg.payload) {
                Ok(JobEvent::Queued { .. } | JobEvent::Started { .. } | JobEvent::Step { .. }) => {
                    self.publish_cancel(job_id).await;
                    return;
                }
                Ok(JobEvent::Done { .. } | JobEvent::Failed { .. }) => return,
                _ => {}
            }
        }
    }

    async fn publish_cancel(&self, job_id: &str) {
        let cancel = CancelJob {
            job_id: job_id.to_string(),
        };
        if let Err(err) = publish_msgpack(&self.client, ROUTER_CANCEL, Some(job_id), &cancel).await
        {
            tracing::warn!(%job_id, error = %err, "could not send cancel");
        }
    }

    /// Note that this gateway drives `job_id` until the returned entry is dropped.
    fn register_driving(&self, job_id: &str) -> Driving {
        let token = CancellationToken::new();
        self.driving.insert(job_id.to_string(), token.clone());
        Driving {
            driving: self.driving.clone(),
            job_id: job_id.to_string(),
            token,
        }
    }

    /// Stop this gateway's driver of `job_id`, if it has one (after its record was cancelled).
    pub fn stop_driving(&self, job_id: &str) {
        if let Some(token) = self.driving.get(job_id) {
            token.cancel();
        }
    }

    /// The longest a submitted job can take to reach a denoiser.
    pub fn placement_window(&self) -> Duration {
        self.flow.router_timeout + self.flow.submit_wait
    }

    async fn is_cancelled(&self, job_id: &str) -> bool {
        matches!(
            self.jobs.get(job_id).await,
            Ok(Some(r)) if r.state == JobState::Cancelled
        )
    }

    /// Counts a job that gave a deadline by how it ended against it (a cancel is not counted).
    fn count_deadline(&self, deadline_unix_ms: Option<u64>, ended: &Result<Vec<String>, ApiError>) {
        let Some(deadline) = deadline_unix_ms else {
            return;
        };
        let outcome = match ended {
            Ok(_) if now_ms() <= deadline => "met",
            Ok(_) => "late",
            Err(ApiError::Cancelled { .. }) => return,
            Err(_) => "failed",
        };
        self.metrics.deadlines.with_label_values(&[outcome]).inc();
    }

    fn stage(&self, name: &str, start: Instant) {
        self.metrics
            .stage_duration
            .with_label_values(&[name])
            .observe(start.elapsed().as_secs_f64());
    }

    async fn put(&self, job_id: &str, name: &str, bytes: &[u8]) -> Result<String, ApiError> {
        let key = blob_key(job_id, name);
        self.blobs.put(&key, bytes).await?;
        Ok(key)
    }

    /// Submit to the router, retrying while it has no denoiser for the job, for at most
    /// `submit_wait` (and never past the job deadline or a cancel).
    async fn submit(&self, job: &DenoiseJob, deadline: Instant) -> Result<String, ApiError> {
        let wait = self.flow.submit_wait;
        let give_up = (Instant::now() + wait).min(deadline);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let reply = request_msgpack_job::<_, SubmitReply>(
                &self.client,
                ROUTER_SUBMIT,
                &job.job_id,
                job,
                self.flow.router_timeout,
            )
            .await;
            let (reason, delay) = match reply {
                Ok(SubmitReply::Accepted { worker_id }) => return Ok(worker_id),
                Ok(SubmitReply::Overloaded {
                    queue_depth,
                    retry_after_ms,
                }) => {
                    self.overload_gate
                        .refused(&job.params.model, Duration::from_millis(retry_after_ms));
                    return Err(ApiError::Overloaded {
                        message: format!(
                            "the mesh is at capacity ({queue_depth} jobs waiting); retry later"
                        ),
                        retry_after_s: retry_after_ms.div_ceil(1000).max(1),
                    });
                }
                Ok(SubmitReply::Rejected {
                    reason,
                    retry_after_ms: 0,
                }) => {
                    return Err(ApiError::Internal(format!(
                        "the router refused the job: {reason}"
                    )))
                }
                Ok(SubmitReply::Rejected {
                    reason,
                    retry_after_ms,
                }) => (
                    reason,
                    Duration::from_millis(retry_after_ms.clamp(50, 2000)),
                ),
                Err(MeshError::NoResponders { .. }) => (
                    "no router is running".to_string(),
                    Duration::from_millis(250),
                ),
                Err(MeshError::Timeout { .. }) => (
                    "the router did not answer in time".to_string(),
                    Duration::from_millis(50),
                ),
                Err(err) => return Err(err.into()),
            };
            if Instant::now() + delay >= give_up {
                self.metrics.failures.inc("no_denoiser");
                return Err(ApiError::Unavailable {
                    message: format!(
                        "no denoiser could take the job within {:.1}s ({attempts} attempts): {reason}",
                        wait.as_secs_f64()
                    ),
                    retry_after_s: delay.as_secs().max(1),
                });
            }
            tracing::debug!(%reason, attempts, "submit rejected; retrying");
            tokio::time::sleep(delay).await;
            if self.is_cancelled(&job.job_id).await {
                return Err(cancelled_error(&job.job_id));
            }
        }
    }

    /// Wait for the job's terminal event, keeping the job record in step (queue position,
    /// started, step k of N at most every `PROGRESS_WRITE_INTERVAL`, retries: `ProgressWrites`).
    async fn await_result(
        &self,
        job_id: &str,
        events: &mut async_nats::Subscriber,
        deadline: Instant,
    ) -> Result<Vec<String>, ApiError> {
        let mut progress = ProgressWrites::default();
        let mut reconnects = Reconnects::from_now();
        // An outcome query in flight; events are still read meanwhile.
        let mut asking: Option<Pin<Box<dyn Future<Output = Option<JobEvent>> + Send + '_>>> = None;
        loop {
            // Heard nothing for a while, or NATS reconnected: the job's terminal event may
            // have been published while the subscription was away (`lost_events`).
            let ask_by = deadline.min(Instant::now() + lost_events::ASK_AFTER_SILENCE);
            let next = tokio::select! {
                next = tokio::time::timeout_at(ask_by, events.next()) => match next {
                    Ok(event) => Waited::Event(event),
                    Err(_) => Waited::Silence,
                },
                () = reconnects.next() => Waited::Reconnected,
                ended = async { asking.as_mut().expect("guarded").await }, if asking.is_some() => {
                    Waited::Asked(ended)
                }
            };
            let msg = match next {
                Waited::Silence if Instant::now() >= deadline => {
                    return Err(ApiError::Timeout {
                        message: format!(
                            "job {job_id} did not finish within {}s; it was cancelled",
                            self.flow.job_timeout.as_secs()
                        ),
                    })
                }
                Waited::Silence | Waited::Reconnected => {
                    reconnects.mark_seen();
                    if asking.is_none() {
                        asking = Some(Box::pin(lost_events::ended_as(&self.client, job_id)));
                    }
                    continue;
                }
                Waited::Asked(ended) => {
                    if let Some(Ok(outcome)) = ended.map(job_ended) {
                        tracing::warn!(%job_id, "the job's terminal event was lost; learned from its denoiser");
                        let label = if outcome.is_ok() { "done" } else { "failed" };
                        self.metrics
                            .recovered_outcomes
                            .with_label_values(&[label])
                            .inc();
                        return outcome;
                    }
                    asking = None;
                    continue;
                }
                Waited::Event(None) => {
                    return Err(ApiError::Internal("job event subscription closed".into()))
                }
                Waited::Event(Some(msg)) => msg,
            };
            let event = match decode::<JobEvent>(&msg.payload).map(job_ended) {
                Ok(Ok(outcome)) => return outcome,
                Ok(Err(event)) => event,
                Err(err) => {
                    tracing::warn!(error = %err, "undecodable job event");
                    continue;
                }
            };
            if let JobEvent::Retrying { attempt, reason } = &event {
                tracing::info!(attempt, %reason, "job placed again");
            }
            // A capture's cache report and a step too soon after the last change nothing.
            let Some(change) = progress.change_for(&event, std::time::Instant::now()) else {
                continue;
            };
            if let Err(err) = self.jobs.update(job_id, |r| change(r)).await {
                tracing::warn!(error = %err, "could not record job progress");
            }
        }
    }
}

/// The request's answer if `event` ends the job (`Done`, `Failed`), else the event back.
fn job_ended(event: JobEvent) -> Result<Result<Vec<String>, ApiError>, JobEvent> {
    match event {
        JobEvent::Done { png_keys } => Ok(Ok(png_keys)),
        JobEvent::Failed {
            message,
            error_type,
        } => Ok(Err(ApiError::JobFailed {
            message,
            error_type,
        })),
        other => Err(other),
    }
}

/// What a job's wait for its next event ended with (`Mesh::await_result`).
enum Waited {
    Event(Option<async_nats::Message>),
    /// Nothing within `lost_events::ASK_AFTER_SILENCE`, or the deadline passed.
    Silence,
    Reconnected,
    /// An outcome query's answer.
    Asked(Option<JobEvent>),
}
