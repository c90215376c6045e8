//! NATS side of the router: heartbeats in, submits placed on denoisers, job events watched,
//! lost workers' jobs placed again (or failed, so nothing hangs).
use crate::metrics::RouterMetrics;
use crate::state::{no_worker_message, Decision, Failover, RouterState};
use crate::RouterConfig;
use async_nats::Subscriber;
use diffmesh_shared::messages::{
    decode, error_types, CancelJob, DenoiseJob, Heartbeat, JobEvent, SubmitReply,
};
use diffmesh_shared::nats::{publish_msgpack, reply_msgpack, request_msgpack_job};
use diffmesh_shared::serve::serve_subscription;
use diffmesh_shared::{subjects, MeshError};
use futures::StreamExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Why a job could not be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    #[error("no denoiser is live")]
    NoLiveWorker,
    #[error("every live denoiser is full")]
    NoCapacity,
    #[error("the admission queue is full ({0} submits waiting)")]
    QueueFull(usize),
}

impl PlaceError {
    pub fn reason(&self) -> &'static str {
        match self {
            PlaceError::NoLiveWorker => "no_worker",
            PlaceError::NoCapacity => "no_capacity",
            PlaceError::QueueFull(_) => "admission_queue_full",
        }
    }
}

/// The router's subscriptions, made before any task runs (and flushed by `start`), so none of
/// them misses a message sent right after `start` returns.
pub struct Subscriptions {
    pub heartbeats: Subscriber,
    pub submits: Subscriber,
    pub cancels: Subscriber,
    pub job_events: Subscriber,
}

impl Subscriptions {
    pub async fn new(client: &async_nats::Client) -> Result<Self, MeshError> {
        Ok(Self {
            heartbeats: client.subscribe(subjects::DENOISER_HEARTBEAT).await?,
            submits: client
                .queue_subscribe(subjects::ROUTER_SUBMIT, "router".to_string())
                .await?,
            cancels: client.subscribe(subjects::ROUTER_CANCEL).await?,
            job_events: client.subscribe(subjects::job_events("*")).await?,
        })
    }
}

/// Submit handlers in flight beyond the admission queue (those answered without waiting).
const SUBMITS_BEYOND_QUEUE: usize = 64;

pub struct Router {
    pub client: async_nats::Client,
    pub state: Mutex<RouterState>,
    pub metrics: RouterMetrics,
    pub config: RouterConfig,
    /// Woken when capacity may have freed up (heartbeat, job finished).
    capacity: Notify,
    waiting: AtomicUsize,
}

impl Router {
    pub fn new(
        client: async_nats::Client,
        state: RouterState,
        metrics: RouterMetrics,
        config: RouterConfig,
    ) -> Self {
        Self {
            client,
            state: Mutex::new(state),
            metrics,
            config,
            capacity: Notify::new(),
            waiting: AtomicUsize::new(0),
        }
    }

    /// The state lock is only held for synchronous bookkeeping, never across an await.
    pub fn state(&self) -> MutexGuard<'_, RouterState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub async fn heartbeats(
        self: Arc<Self>,
        mut sub: Subscriber,
        shutdown: CancellationToken,
    ) -> Result<(), MeshError> {
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                msg = sub.next() => match msg { Some(m) => m, None => return Ok(()) },
            };
            match decode::<Heartbeat>(&msg.payload) {
                Ok(hb) => {
                    let worker = hb.worker_id.clone();
                    let (new, live) = {
                        let mut state = self.state();
                        let new = state.observe(hb, Instant::now());
                        (new, state.registry.live_workers())
                    };
                    if new {
                        tracing::info!(%worker, "denoiser joined");
                    }
                    self.metrics.live_workers.set(live as i64);
                    self.capacity.notify_waiters();
                }
                Err(err) => {
                    self.metrics
                        .failures
                        .with_label_values(&["bad_heartbeat"])
                        .inc();
                    tracing::warn!(error = %err, "undecodable heartbeat");
                }
            }
        }
    }

    /// Expire silent workers every half heartbeat interval and fail their jobs over.
    pub async fn expiry(self: Arc<Self>, shutdown: CancellationToken) {
        let period = (Duration::from_millis(self.config.heartbeat_interval_ms) / 2)
            .max(Duration::from_millis(10));
        let mut tick = tokio::time::interval(period);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let (lost, live) = {
                let mut state = self.state();
                let lost = state.expire(Instant::now());
                (lost, state.registry.live_workers())
            };
            self.metrics.live_workers.set(live as i64);
            for (worker, plans) in lost {
                tracing::warn!(worker = %worker.worker_id, jobs = worker.jobs.len(), "denoiser lost (missed heartbeats)");
                for plan in plans {
                    let this = self.clone();
                    let lost_id = worker.worker_id.clone();
                    tokio::spawn(async move { this.fail_over(&lost_id, plan).await });
                }
            }
        }
    }

    async fn fail_over(&self, lost: &str, plan: Failover) {
        match plan {
            Failover::Fail { job_id, message } => {
                self.metrics
                    .failures
                    .with_label_values(&["max_attempts"])
                    .inc();
                self.publish_failed(&job_id, message).await;
            }
            Failover::Retry(job) => {
                let span = tracing::info_span!("replace", job_id = %job.job_id, attempt = job.attempt, lost = %lost);
                let event = JobEvent::Retrying {
                    attempt: job.attempt,
                    reason: format!("denoiser {lost} lost"),
                };
                self.publish_event(&job.job_id, &event).await;
                let wait = Duration::from_millis(self.config.admission_wait_ms);
                let exclude = [lost.to_string()];
                match self
                    .place_with_wait(&job, &exclude, wait)
                    .instrument(span)
                    .await
                {
                    Ok(worker) => {
                        self.metrics.replacements.inc();
                        tracing::info!(%worker, "job placed again");
                    }
                    Err(err) => {
                        self.metrics
                            .failures
                            .with_label_values(&[err.reason()])
                            .inc();
                        let message = match err {
                            PlaceError::NoLiveWorker => no_worker_message(lost),
                            other => format!("denoiser {lost} lost; {other} (waited {wait:?})"),
                        };
                        self.publish_failed(&job.job_id, message).await;
                    }
                }
            }
        }
    }

    async fn publish_failed(&self, job_id: &str, message: String) {
        tracing::warn!(%job_id, %message, "job failed by the router");
        let event = JobEvent::Failed {
            message,
            error_type: error_types::WORKER_LOST.to_string(),
        };
        self.publish_event(job_id, &event).await;
    }

    async fn publish_event(&self, job_id: &str, event: &JobEvent) {
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

    pub async fn submits(
        self: Arc<Self>,
        sub: Subscriber,
        shutdown: CancellationToken,
    ) -> Result<(), MeshError> {
        // Room for a full admission queue plus submits that are answered at once (placed or
        // rejected), so a full queue still gets its rejections out promptly.
        let limit = Arc::new(Semaphore::new(
            self.config.admission_queue + SUBMITS_BEYOND_QUEUE,
        ));
        // Submits already taken get their answer before the router stops.
        serve_subscription(sub, shutdown, limit, |msg| {
            let this = self.clone();
            async move { this.handle_submit(msg).await }
        })
        .await;
        Ok(())
    }

    async fn handle_submit(&self, msg: async_nats::Message) {
        let started = Instant::now();
        let reply = match decode::<DenoiseJob>(&msg.payload) {
            Ok(job) => {
                let span =
                    tracing::info_span!("place", job_id = %job.job_id, attempt = job.attempt);
                diffmesh_shared::trace_context::set_parent_from(&span, msg.headers.as_ref());
                let wait = Duration::from_millis(self.config.admission_wait_ms);
                let result = self.place_with_wait(&job, &[], wait).instrument(span).await;
                match result {
                    Ok(worker_id) => {
                        self.metrics.placements.inc();
                        SubmitReply::Accepted { worker_id }
                    }
                    Err(err) => {
                        self.metrics
                            .failures
                            .with_label_values(&[err.reason()])
                            .inc();
                        SubmitReply::Rejected {
                            reason: err.to_string(),
                            retry_after_ms: self.config.retry_after_ms,
                        }
                    }
                }
            }
            Err(err) => {
                self.metrics
                    .failures
                    .with_label_values(&["bad_request"])
                    .inc();
                SubmitReply::Rejected {
                    reason: format!("undecodable DenoiseJob: {err}"),
                    retry_after_ms: 0,
                }
            }
        };
        self.metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        if let Err(err) = reply_msgpack(&self.client, &msg, &reply).await {
            tracing::warn!(error = %err, "could not answer a submit");
        }
    }

    /// Place now, or wait (bounded: at most `admission_queue` waiters, each at most `wait`) for
    /// a worker to free a slot. Fails at once when no worker is live at all.
    pub async fn place_with_wait(
        &self,
        job: &DenoiseJob,
        exclude: &[String],
        wait: Duration,
    ) -> Result<String, PlaceError> {
        match self.place_once(job, exclude).await {
            Err(PlaceError::NoCapacity) => {}
            other => return other,
        }
        let limit = self.config.admission_queue;
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= limit {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(PlaceError::QueueFull(limit));
        }
        self.metrics.admission_waiting.inc();
        let deadline = tokio::time::Instant::now() + wait;
        let result = loop {
            let notified = self.capacity.notified();
            // Poll as well: a notification between our attempt and `notified()` is not lost for long.
            let poll = tokio::time::Instant::now() + Duration::from_millis(100);
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep_until(poll.min(deadline)) => {}
            }
            match self.place_once(job, exclude).await {
                Err(PlaceError::NoCapacity) if tokio::time::Instant::now() < deadline => continue,
                other => break other,
            }
        };
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.metrics.admission_waiting.dec();
        result
    }

    /// Try live workers in policy order until one accepts; refusals and timeouts move on.
    async fn place_once(&self, job: &DenoiseJob, exclude: &[String]) -> Result<String, PlaceError> {
        let mut tried: Vec<String> = exclude.to_vec();
        loop {
            let decision = self.state().place(job, &tried);
            let worker = match decision {
                Decision::Chosen(w) => w,
                Decision::NoLiveWorker if tried.len() > exclude.len() => {
                    return Err(PlaceError::NoCapacity)
                }
                Decision::NoLiveWorker => return Err(PlaceError::NoLiveWorker),
                Decision::NoCapacity => return Err(PlaceError::NoCapacity),
            };
            let timeout = Duration::from_millis(self.config.forward_timeout_ms);
            let subject = subjects::denoiser_submit(&worker);
            match request_msgpack_job::<_, SubmitReply>(
                &self.client,
                &subject,
                &job.job_id,
                job,
                timeout,
            )
            .await
            {
                Ok(SubmitReply::Accepted { .. }) => {
                    tracing::info!(%worker, "job placed");
                    return Ok(worker);
                }
                Ok(SubmitReply::Rejected { reason, .. }) => {
                    tracing::debug!(%worker, %reason, "denoiser refused the job");
                }
                Err(err) => {
                    self.metrics
                        .failures
                        .with_label_values(&[err.reason()])
                        .inc();
                    tracing::warn!(%worker, error = %err, "forwarding to denoiser failed");
                }
            }
            self.state().unplace(&job.job_id);
            tried.push(worker);
        }
    }

    pub async fn cancels(
        self: Arc<Self>,
        mut sub: Subscriber,
        shutdown: CancellationToken,
    ) -> Result<(), MeshError> {
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                msg = sub.next() => match msg { Some(m) => m, None => return Ok(()) },
            };
            let cancel = match decode::<CancelJob>(&msg.payload) {
                Ok(c) => c,
                Err(err) => {
                    tracing::warn!(error = %err, "undecodable cancel");
                    continue;
                }
            };
            let owner = self
                .state()
                .registry
                .owner(&cancel.job_id)
                .map(str::to_string);
            match owner {
                Some(worker) => {
                    let subject = subjects::denoiser_cancel(&worker);
                    if let Err(err) =
                        publish_msgpack(&self.client, subject, Some(&cancel.job_id), &cancel).await
                    {
                        tracing::warn!(job_id = %cancel.job_id, error = %err, "could not forward cancel");
                    }
                }
                None => {
                    tracing::info!(job_id = %cancel.job_id, "cancel for a job not placed by this router")
                }
            }
        }
    }

    /// Watch every job's events to learn when placed jobs finish.
    pub async fn job_events(
        self: Arc<Self>,
        mut sub: Subscriber,
        shutdown: CancellationToken,
    ) -> Result<(), MeshError> {
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                msg = sub.next() => match msg { Some(m) => m, None => return Ok(()) },
            };
            let Some(job_id) = job_id_of_subject(&msg.subject) else {
                continue;
            };
            match decode::<JobEvent>(&msg.payload) {
                Ok(JobEvent::Done { .. }) | Ok(JobEvent::Failed { .. }) => {
                    if self.state().registry.finish(job_id).is_some() {
                        self.capacity.notify_waiters();
                    }
                }
                Ok(_) => {}
                Err(err) => tracing::debug!(%job_id, error = %err, "undecodable job event"),
            }
        }
    }
}

/// `diffmesh.job.<id>.events` -> `<id>`.
pub fn job_id_of_subject(subject: &str) -> Option<&str> {
    subject
        .strip_prefix("diffmesh.job.")?
        .strip_suffix(".events")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_id_from_subject() {
        assert_eq!(
            job_id_of_subject(&subjects::job_events("abc-1")),
            Some("abc-1")
        );
        assert_eq!(job_id_of_subject("diffmesh.other"), None);
    }
}
