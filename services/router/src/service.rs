//! NATS side of the router: heartbeats in, job events watched, cancels forwarded (or taken out
//! of the admission queue), lost workers' jobs placed again (or failed, so nothing hangs).
//! Submits and the admission queue are in [`crate::submit`].
use crate::admission::AdmissionQueue;
use crate::metrics::RouterMetrics;
use crate::placement::{self, Placement};
use crate::state::{no_worker_message, Failover, RouterState};
use crate::RouterConfig;
use actix::Addr;
use async_nats::Subscriber;
use diffmesh_sched::SchedError;
use diffmesh_shared::nats::publish_msgpack;
use diffmesh_shared::stores::job::{CaptureReport, JobStore};
use diffmesh_shared::wire::messages::{
    decode, error_types, CancelJob, Heartbeat, JobEvent, SubmitReply,
};
use diffmesh_shared::{wire::subjects, MeshError};
use futures::StreamExt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How often silent workers are looked for: well under the shortest expiry (a few missed
/// heartbeats of 100 ms in tests, 500 ms by default).
const EXPIRY_CHECK: Duration = Duration::from_millis(50);
/// How long a router leaves the ending of a job another router placed to that router.
const OTHERS_OUTCOME_DELAY: Duration = Duration::from_secs(1);

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

pub struct Router {
    pub client: async_nats::Client,
    /// The decision state's owner (registry, policy, cost models): see [`crate::placement`].
    pub placement: Addr<Placement>,
    pub metrics: RouterMetrics,
    pub config: RouterConfig,
    /// Woken when capacity may have freed up (heartbeat, job finished) or a submit queued.
    pub(crate) capacity: Notify,
    /// Submits waiting for capacity, oldest first.
    pub(crate) admission: Mutex<AdmissionQueue>,
    /// Job records: the router writes the ending of every job it placed, so a job accepted
    /// asynchronously still ends `done`/`failed` when the gateway driving it has gone.
    pub(crate) jobs: JobStore,
    /// Adopted jobs whose progress this router writes into their records.
    pub(crate) adopted: crate::adopted_progress::AdoptedProgress,
    /// The durable queue of async jobs this router places from (`async_jobs`).
    pub(crate) queue: diffmesh_shared::stores::async_queue::AsyncQueue,
}

impl Router {
    pub fn new(
        client: async_nats::Client,
        state: RouterState,
        metrics: RouterMetrics,
        config: RouterConfig,
        jobs: JobStore,
        queue: diffmesh_shared::stores::async_queue::AsyncQueue,
    ) -> Self {
        metrics.set_policy(state.policy_name());
        let admission = Mutex::new(AdmissionQueue::new(config.max_queue));
        Self {
            client,
            placement: Placement::start(state),
            metrics,
            config,
            capacity: Notify::new(),
            admission,
            jobs,
            adopted: Default::default(),
            queue,
        }
    }

    /// Ask the placement actor. It lives as long as the process: should it have died (a bug
    /// in a policy), this task ends here and `/readyz` says the router must be restarted.
    pub(crate) async fn ask<M>(&self, msg: M) -> M::Result
    where
        M: actix::Message + Send + 'static,
        M::Result: Send,
        Placement: actix::Handler<M>,
    {
        match self.placement.send(msg).await {
            Ok(answer) => answer,
            Err(e) => panic!("the placement actor is gone ({e}); the router is unready"),
        }
    }

    /// The admission queue; like the state lock, never held across an await.
    pub(crate) fn admission(&self) -> MutexGuard<'_, AdmissionQueue> {
        self.admission.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Switch the placement policy now (the admin endpoint); returns the previous one's name.
    pub async fn switch_policy(&self, name: &str) -> Result<String, SchedError> {
        let previous = self.ask(placement::SetPolicy(name.to_string())).await?;
        self.metrics.set_policy(name);
        tracing::info!(policy = name, %previous, "placement policy switched");
        Ok(previous)
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
                    let placement::Observed { new, costs, live } =
                        self.ask(placement::Observe(hb)).await;
                    if new {
                        tracing::info!(%worker, "denoiser joined");
                    }
                    for ratio in &costs.ratios {
                        self.metrics.step_prediction_ratio.observe(*ratio);
                    }
                    self.metrics
                        .step_time_factor
                        .with_label_values(&[worker.as_str()])
                        .set(costs.factor);
                    if let Some(ratio) = costs.warn {
                        tracing::warn!(%worker, ratio = format!("{ratio:.2}"),
                            "this denoiser's steps take {ratio:.2}x what the router's cost model \
                             predicts: its profile was measured on other hardware, for another \
                             model or without the load this worker shares its device with; \
                             placement scales this worker's forecasts by the measured factor, \
                             but how cost grows with masks and batches may differ too: measure \
                             a profile here (cargo xtask profile) and start the router with \
                             ROUTER_PROFILE");
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

    /// Expire silent workers (each by the heartbeat period it announces) and fail their jobs
    /// over; checked every [`EXPIRY_CHECK`].
    pub async fn expiry(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(EXPIRY_CHECK);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let placement::Expired { lost, live } = self.ask(placement::Expire).await;
            self.metrics.live_workers.set(live as i64);
            for (worker, plans) in lost {
                // A lost worker's factor is not exported on (a new id comes back, not this one).
                let _ = self
                    .metrics
                    .step_time_factor
                    .remove_label_values(&[worker.worker_id.as_str()]);
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
                let wait = self.config.failover_wait;
                // Another denoiser first; the lost one (back in place) when none other can take it.
                let exclude = [lost.to_string()];
                match self
                    .place_within(&job, &exclude, wait)
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
                            PlaceError::NoLiveWorker => no_worker_message(lost, wait),
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
        self.record_outcome(job_id, event);
    }

    /// Write a job's ending, or a capture's stored cache, into its record, in the background
    /// (a CAS write; the gateway driving the job writes the same ending, and whichever comes
    /// second changes nothing, as a record that has ended keeps its first ending, a cancel
    /// included). Cancelled jobs are left to the gateway that asked for the cancel: it knows
    /// why (owner's DELETE, deadline, client gone) and writes that. The capture report is
    /// written here only: the registering gateway reads it from the event, and the record
    /// keeps it for when that gateway stopped before recording the template.
    pub(crate) fn record_outcome(&self, job_id: &str, event: JobEvent) {
        self.record_outcome_after(job_id, event, Duration::ZERO);
    }

    /// [`Self::record_outcome`] after `delay`: for a job another router placed, whose router
    /// writes it first unless it died meanwhile (then the job's ending is still written: an
    /// async job from the durable queue has no gateway to write it). A record that already
    /// ended is read, not written again.
    pub(crate) fn record_outcome_after(&self, job_id: &str, event: JobEvent, delay: Duration) {
        if matches!(&event, JobEvent::Failed { error_type, .. } if error_type == error_types::CANCELLED)
        {
            return;
        }
        let (jobs, job_id) = (self.jobs.clone(), job_id.to_string());
        tokio::spawn(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let written = match event {
                JobEvent::Done { png_keys } => {
                    jobs.update(&job_id, |r| r.mark_done(png_keys.clone()))
                        .await
                }
                JobEvent::Failed {
                    message,
                    error_type,
                } => {
                    jobs.update(&job_id, |r| r.mark_failed(&message, &error_type))
                        .await
                }
                captured @ JobEvent::Captured { .. } => {
                    let Some(report) = CaptureReport::from_event(&captured) else {
                        return;
                    };
                    jobs.update(&job_id, |r| r.mark_captured(report.clone()))
                        .await
                }
                _ => return,
            };
            match written {
                Ok(_) => {}
                // Submitted straight over NATS, without a gateway's record.
                Err(MeshError::JobNotFound { .. }) => {
                    tracing::debug!(%job_id, "no job record to write to")
                }
                Err(err) => {
                    tracing::warn!(%job_id, error = %err, "could not record the job's outcome")
                }
            }
        });
    }

    /// Write a placement into the job's record, in the background: with it the record shows
    /// the job placed even if the gateway that submitted it dies before writing the same, so
    /// no router adopts a job that was placed (see [`crate::adopt`]).
    pub(crate) fn record_placement(&self, job_id: &str, worker_id: &str) {
        let (jobs, job_id, worker_id) =
            (self.jobs.clone(), job_id.to_string(), worker_id.to_string());
        tokio::spawn(async move {
            match jobs.update(&job_id, |r| r.mark_placed(&worker_id)).await {
                Ok(_) => {}
                Err(MeshError::JobNotFound { .. }) => {
                    tracing::debug!(%job_id, "no job record to mark placed")
                }
                Err(err) => {
                    tracing::warn!(%job_id, error = %err, "could not record the placement")
                }
            }
        });
    }

    pub(crate) async fn publish_event(&self, job_id: &str, event: &JobEvent) {
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
            // Still waiting for admission: take it out and answer its submit (no retry: the
            // sender asked for the cancel).
            let waiting = self.admission().remove(&cancel.job_id);
            if let Some(w) = waiting {
                self.metrics
                    .admission_waiting
                    .set(self.admission().len() as i64);
                tracing::info!(job_id = %cancel.job_id, "cancelled while waiting for admission");
                if let Some(durable) = &w.durable {
                    // Its owner cancelled it: the record says so already.
                    self.ended_async(durable, &cancel.job_id, false).await;
                    continue;
                }
                let reason = "cancelled while waiting for a denoiser";
                let reply = SubmitReply::Rejected {
                    reason: reason.into(),
                    retry_after_ms: 0,
                };
                self.answer(&w, &reply).await;
                // The job ended here: whoever follows its events learns it (a gateway whose
                // client went away chases the job with its cancel until it shows up or ends,
                // and holds the edit's template use until then).
                let ended = JobEvent::Failed {
                    message: reason.into(),
                    error_type: error_types::CANCELLED.to_string(),
                };
                self.publish_event(&cancel.job_id, &ended).await;
                continue;
            }
            let owner = self.ask(placement::Owner(cancel.job_id.clone())).await;
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
                Ok(event @ (JobEvent::Done { .. } | JobEvent::Failed { .. })) => {
                    self.adopted.forget(job_id);
                    let placed_here = self.ask(placement::Finish(job_id.to_string())).await;
                    if placed_here {
                        self.capacity.notify_waiters();
                        self.record_outcome(job_id, event);
                    } else {
                        self.record_outcome_after(job_id, event, OTHERS_OUTCOME_DELAY);
                    }
                }
                Ok(event @ JobEvent::Captured { .. }) => {
                    if self
                        .ask(placement::Owner(job_id.to_string()))
                        .await
                        .is_some()
                    {
                        self.record_outcome(job_id, event);
                    }
                }
                Ok(event) => self.adopted.on_event(&self.jobs, job_id, &event),
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
