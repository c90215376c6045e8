//! One job's path through the mesh, as the gateway drives it: store uploads -> job record ->
//! codec pre -> subscribe to job events -> router submit (bounded retry) -> await Done/Failed
//! -> fetch PNGs. The job record in KV follows every step.
use std::time::Duration;

use async_nats::Client;
use diffmesh_shared::job::{JobRecord, JobStore};
use diffmesh_shared::messages::{
    decode, error_types, CancelJob, DenoiseJob, JobEvent, JobKind, PreparedInputs, PreprocessReply,
    PreprocessRequest, SubmitReply,
};
use diffmesh_shared::nats::{blob_key, publish_msgpack, request_msgpack_job, BlobStore};
use diffmesh_shared::subjects::{job_events, CODEC_PRE, ROUTER_CANCEL, ROUTER_SUBMIT};
use diffmesh_shared::MeshError;
use futures::StreamExt;
use tokio::time::Instant;
use tracing::Instrument;

use crate::error::ApiError;
use crate::metrics::GatewayMetrics;
use crate::validate::ValidParams;

/// Deadlines of the mesh hops.
#[derive(Debug, Clone)]
pub struct FlowConfig {
    pub codec_timeout: Duration,
    /// Deadline of one router submit request (the router may hold it while it admits).
    pub router_timeout: Duration,
    /// How long to keep resubmitting while the router has no denoiser for the job.
    pub submit_wait: Duration,
    /// Whole-job deadline, from acceptance to the last PNG.
    pub job_timeout: Duration,
}

/// The gateway's handles on the mesh.
pub struct Mesh {
    pub client: Client,
    pub blobs: BlobStore,
    pub jobs: JobStore,
    pub flow: FlowConfig,
    pub metrics: GatewayMetrics,
}

/// A validated request ready to run.
pub struct JobInput {
    pub kind: JobKind,
    pub valid: ValidParams,
    pub image: Option<Vec<u8>>,
    pub mask: Option<Vec<u8>>,
}

/// Cancels the job in the mesh if the request is dropped (client went away) or times out
/// before the job finished.
struct CancelGuard {
    client: Client,
    job_id: String,
    armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let client = self.client.clone();
        let job_id = self.job_id.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let cancel = CancelJob {
                    job_id: job_id.clone(),
                };
                if let Err(err) =
                    publish_msgpack(&client, ROUTER_CANCEL, Some(&job_id), &cancel).await
                {
                    tracing::warn!(%job_id, error = %err, "could not send cancel");
                }
            });
        }
    }
}

impl Mesh {
    /// Run one job to completion; returns the PNG bytes, one per image.
    pub async fn run_job(&self, input: JobInput) -> Result<Vec<Vec<u8>>, ApiError> {
        let job_id = uuid::Uuid::new_v4().to_string();
        let span = tracing::info_span!("job", job_id = %job_id, kind = ?input.kind);
        async {
            let deadline = Instant::now() + self.flow.job_timeout;
            let record = JobRecord::new(job_id.clone(), input.kind);
            self.jobs.create(&record).await?;
            let result = self.drive(&job_id, input, deadline).await;
            if let Err(err) = &result {
                let (message, error_type) = (err.to_string(), err_type(err));
                // The record is bookkeeping: a failed update is logged, never the request's error.
                let written = self
                    .jobs
                    .update(&job_id, |r| {
                        r.mark_failed(message.clone(), error_type.clone())
                    })
                    .await;
                if let Err(err) = written {
                    tracing::warn!(error = %err, "could not record the job's failure");
                }
            }
            result
        }
        .instrument(span)
        .await
    }

    async fn drive(
        &self,
        job_id: &str,
        input: JobInput,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, ApiError> {
        let stage = |name: &str, start: Instant| {
            self.metrics
                .stage_duration
                .with_label_values(&[name])
                .observe(start.elapsed().as_secs_f64());
        };
        let t = Instant::now();
        let image_key = match &input.image {
            Some(bytes) => Some(self.put(job_id, "image", bytes).await?),
            None => None,
        };
        let mask_key = match &input.mask {
            Some(bytes) => Some(self.put(job_id, "mask", bytes).await?),
            None => None,
        };
        stage("store", t);

        let t = Instant::now();
        let params = input.valid.params;
        let pre = PreprocessRequest {
            job_id: job_id.to_string(),
            kind: input.kind,
            image_key: image_key.clone(),
            mask_key: mask_key.clone(),
            params: params.clone(),
        };
        let reply: PreprocessReply = request_msgpack_job(
            &self.client,
            CODEC_PRE,
            job_id,
            &pre,
            self.flow.codec_timeout,
        )
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
        stage("codec_pre", t);

        // Subscribe before submitting so no event can be missed.
        let mut events = self
            .client
            .subscribe(job_events(job_id))
            .await
            .map_err(MeshError::from)?;
        let job = DenoiseJob {
            job_id: job_id.to_string(),
            kind: input.kind,
            params,
            inputs,
            raw_image_key: image_key,
            raw_mask_key: mask_key,
            attempt: 0,
        };
        let submitted = job.clone();
        if let Err(err) = self
            .jobs
            .update(job_id, |r| r.submitted = Some(submitted.clone()))
            .await
        {
            tracing::warn!(error = %err, "could not record the submitted job");
        }

        let t = Instant::now();
        let mut guard = CancelGuard {
            client: self.client.clone(),
            job_id: job_id.to_string(),
            armed: true,
        };
        let worker = self.submit(&job, deadline).await?;
        stage("submit", t);
        if let Err(err) = self.jobs.update(job_id, |r| r.mark_running(&worker)).await {
            tracing::warn!(error = %err, "could not mark the job running");
        }

        let t = Instant::now();
        let png_keys = self.await_result(job_id, &mut events, deadline).await?;
        guard.armed = false;
        stage("denoise", t);

        let t = Instant::now();
        let mut pngs = Vec::with_capacity(png_keys.len());
        for key in &png_keys {
            pngs.push(self.blobs.get(key).await?);
        }
        if let Err(err) = self
            .jobs
            .update(job_id, |r| r.mark_done(png_keys.clone()))
            .await
        {
            tracing::warn!(error = %err, "could not mark the job done");
        }
        stage("fetch", t);
        Ok(pngs)
    }

    async fn put(&self, job_id: &str, name: &str, bytes: &[u8]) -> Result<String, ApiError> {
        let key = blob_key(job_id, name);
        self.blobs.put(&key, bytes).await?;
        Ok(key)
    }

    /// Submit to the router, retrying while it has no denoiser for the job, for at most
    /// `submit_wait` (and never past the job deadline).
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
        }
    }

    /// Wait for the job's terminal event, keeping the job record in step.
    async fn await_result(
        &self,
        job_id: &str,
        events: &mut async_nats::Subscriber,
        deadline: Instant,
    ) -> Result<Vec<String>, ApiError> {
        loop {
            let msg = match tokio::time::timeout_at(deadline, events.next()).await {
                Err(_) => {
                    return Err(ApiError::Timeout {
                        message: format!(
                            "job {job_id} did not finish within {}s; it was cancelled",
                            self.flow.job_timeout.as_secs()
                        ),
                    })
                }
                Ok(None) => return Err(ApiError::Internal("job event subscription closed".into())),
                Ok(Some(msg)) => msg,
            };
            match decode::<JobEvent>(&msg.payload) {
                Ok(JobEvent::Done { png_keys }) => return Ok(png_keys),
                Ok(JobEvent::Failed {
                    message,
                    error_type,
                }) => {
                    return Err(ApiError::JobFailed {
                        message,
                        error_type,
                    })
                }
                Ok(JobEvent::Retrying { attempt, reason }) => {
                    tracing::info!(attempt, %reason, "job placed again");
                    let _ = self.jobs.update(job_id, |r| r.attempt = attempt).await;
                }
                Ok(JobEvent::Started { worker_id }) => {
                    let _ = self
                        .jobs
                        .update(job_id, |r| r.mark_running(&worker_id))
                        .await;
                }
                Ok(JobEvent::Queued { .. }) | Ok(JobEvent::Step { .. }) => {}
                Err(err) => tracing::warn!(error = %err, "undecodable job event"),
            }
        }
    }
}

/// The `error_type` recorded for a failed job.
fn err_type(err: &ApiError) -> String {
    match err {
        ApiError::Invalid(f) => f.error_type.clone(),
        ApiError::TooLarge { .. } => error_types::TOO_LARGE.into(),
        ApiError::Unavailable { .. } => error_types::UNAVAILABLE.into(),
        ApiError::Timeout { .. } => error_types::TIMEOUT.into(),
        ApiError::JobFailed { error_type, .. } => error_type.clone(),
        ApiError::Mesh(_) | ApiError::Internal(_) => error_types::INTERNAL.into(),
    }
}
