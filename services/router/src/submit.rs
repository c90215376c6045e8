//! Submits: place a job on a denoiser now, or queue it in the bounded admission queue until a
//! denoiser has room. A submit the router cannot start within `--admission-wait` is answered
//! `Overloaded` at once (the gateway's 429), with the expected wait as its retry hint
//! (`wait_estimate`); so is one the queue has no room for, and one that waited out
//! `--admission-wait` after all. A dispatcher task places queued jobs in arrival order per
//! model as capacity frees up (a model whose denoisers are full does not hold up another's
//! jobs), and at shutdown every queued submit is answered (rejected with a retry hint, so the
//! gateway submits it again to a router that runs) and every held async job handed back.
use crate::admission::Waiting;
use crate::placement::EstimateWait;
use crate::service::{PlaceError, Router};
use crate::state::Decision;
use async_nats::Subscriber;
use diffmesh_shared::nats::serve::serve_subscription;
use diffmesh_shared::nats::{publish_msgpack, reply_msgpack, request_msgpack_job};
use diffmesh_shared::stores::job::now_ms;
use diffmesh_shared::wire::messages::{decode, CancelJob, DenoiseJob, SubmitReply};
use diffmesh_shared::{wire::subjects, MeshError};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Submit handlers in flight at once. Queued submits do not hold one (the queue holds them).
const SUBMITS_IN_FLIGHT: usize = 64;
/// How often the dispatcher looks at the queue without being woken (expiry, lost wake-ups).
const DISPATCH_TICK: Duration = Duration::from_millis(50);
/// Wait before trying again while no denoiser is live ([`Router::place_within`]).
const NO_WORKER_RETRY: Duration = Duration::from_millis(250);

impl Router {
    pub async fn submits(
        self: Arc<Self>,
        sub: Subscriber,
        shutdown: CancellationToken,
    ) -> Result<(), MeshError> {
        let limit = Arc::new(Semaphore::new(SUBMITS_IN_FLIGHT));
        // Submits already taken get their answer (or a place in the queue, answered by the
        // dispatcher or the shutdown drain) before this returns.
        serve_subscription(sub, shutdown, limit, |msg| {
            let this = self.clone();
            async move { this.handle_submit(msg).await }
        })
        .await;
        Ok(())
    }

    async fn handle_submit(&self, msg: async_nats::Message) {
        let started = Instant::now();
        let job = match decode::<DenoiseJob>(&msg.payload) {
            Ok(job) => job,
            Err(err) => {
                self.count_failure("bad_request");
                let reply = SubmitReply::Rejected {
                    reason: format!("undecodable DenoiseJob: {err}"),
                    retry_after_ms: 0,
                };
                self.reply(&msg, &reply, started).await;
                return;
            }
        };
        let span = tracing::info_span!(
            "place",
            job_id = %job.job_id,
            attempt = job.attempt,
            kind = ?job.kind,
            mask_ratio = job.inputs.mask_ratio,
            template = crate::worker_state::template_cache_key(&job).unwrap_or(""),
        );
        diffmesh_shared::nats::trace_context::set_parent_from(&span, msg.headers.as_ref());
        // Jobs of its model already waiting go first: a new one only skips the queue when none
        // of them waits.
        let model = job.params.model.clone();
        if self.admission().count_model(&model) == 0 {
            match self
                .place_once(&job, &[], Some(0))
                .instrument(span.clone())
                .await
            {
                Ok(worker_id) => {
                    self.metrics.placements.inc();
                    self.reply(&msg, &SubmitReply::Accepted { worker_id }, started)
                        .await;
                    return;
                }
                Err(PlaceError::NoCapacity) => {}
                Err(err) => {
                    self.count_failure(err.reason());
                    let reply = SubmitReply::Rejected {
                        reason: err.to_string(),
                        retry_after_ms: self.config.retry_after.as_millis() as u64,
                    };
                    self.reply(&msg, &reply, started).await;
                    return;
                }
            }
        }
        let ahead = self.admission().count_model(&model);
        let expected = self.ask(EstimateWait { model, ahead }).await;
        if let Some(wait) = expected.filter(|w| *w > self.config.admission_wait) {
            // It would not start within the admission wait: say so now, not after it.
            self.count_failure("expected_wait");
            let reply = SubmitReply::Overloaded {
                queue_depth: ahead as u32,
                retry_after_ms: self.retry_hint(wait),
            };
            span.in_scope(|| tracing::debug!(?wait, ahead, "refused: expected wait too long"));
            self.reply(&msg, &reply, started).await;
            return;
        }
        let waiting = Waiting {
            job,
            reply: msg.reply.clone(),
            headers: msg.headers.clone(),
            since: started,
            durable: None,
        };
        let queued = {
            let mut q = self.admission();
            let r = q.push(waiting);
            self.metrics.admission_waiting.set(q.len() as i64);
            r
        };
        match queued {
            Ok(position) => {
                span.in_scope(|| tracing::debug!(position, "waiting for a free denoiser"));
                self.capacity.notify_waiters();
            }
            Err(full) => {
                self.count_failure(PlaceError::QueueFull(full.depth).reason());
                let reply = SubmitReply::Overloaded {
                    queue_depth: full.depth as u32,
                    retry_after_ms: self.config.retry_after.as_millis() as u64,
                };
                self.reply(&msg, &reply, started).await;
            }
        }
    }

    /// Place queued submits in order whenever capacity may have freed up; answer those that
    /// waited longer than `--admission-wait`. Returns at shutdown (the queue is drained by
    /// [`Router::drain_admission`] once no submit handler runs any more).
    pub async fn dispatch(self: Arc<Self>, shutdown: CancellationToken) {
        let max_wait = self.config.admission_wait;
        loop {
            let woken = self.capacity.notified();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = woken => {}
                _ = tokio::time::sleep(DISPATCH_TICK) => {}
            }
            let expired = self
                .admission()
                .take_expired(Instant::now(), max_wait, now_ms());
            for w in expired {
                if let Some(durable) = &w.durable {
                    self.ended_async(durable, &w.job.job_id, true).await;
                    continue;
                }
                self.count_failure(PlaceError::NoCapacity.reason());
                // Load, not a fault: the gateway answers 429 with this hint, not 503.
                let ahead = self.admission().count_model(&w.job.params.model);
                let expected = self
                    .ask(EstimateWait {
                        model: w.job.params.model.clone(),
                        ahead,
                    })
                    .await;
                let reply = SubmitReply::Overloaded {
                    queue_depth: ahead as u32,
                    retry_after_ms: self.retry_hint(expected.unwrap_or_default()),
                };
                self.answer(&w, &reply).await;
            }
            self.place_queued().await;
            let depth = self.admission().len();
            self.metrics.admission_waiting.set(depth as i64);
        }
    }

    /// Place queued jobs in order, each model's in its own line: once a job finds no capacity
    /// (or, an async one, no denoiser of its model), the ones of its model behind it wait too,
    /// the others are still tried. An entry stays queued while it is being placed, so a cancel
    /// or a resubmission during the round trip finds it.
    async fn place_queued(&self) {
        // A policy may hold a job back while a worker would take it, but not for so long that
        // it expires unplaced: past half its allowed wait it goes where it can.
        let may_hold_for = self.config.admission_wait / 2;
        let lineup = self.admission().lineup();
        let total = lineup.len();
        let mut blocked: HashSet<String> = HashSet::new();
        for (i, (job_id, model)) in lineup.into_iter().enumerate() {
            if blocked.contains(&model) {
                continue;
            }
            let entry = self.admission().get(&job_id).map(|w| {
                let behind = (total - i - 1) as u32;
                let hold = (w.since.elapsed() < may_hold_for).then_some(behind);
                (w.job.clone(), w.headers.clone(), hold, w.durable.is_some())
            });
            let Some((job, headers, hold, durable)) = entry else {
                continue;
            };
            let span =
                tracing::info_span!("place_queued", job_id = %job.job_id, attempt = job.attempt);
            diffmesh_shared::nats::trace_context::set_parent_from(&span, headers.as_ref());
            let result = self.place_once(&job, &[], hold).instrument(span).await;
            let waits = match &result {
                Err(PlaceError::NoCapacity) => true,
                // An async job waits for its model's denoisers to come back, up to its deadline.
                Err(PlaceError::NoLiveWorker) => durable,
                _ => false,
            };
            if waits {
                blocked.insert(model);
                continue;
            }
            let taken = self.admission().remove(&job.job_id);
            match (result, taken) {
                (Ok(worker_id), Some(w)) => {
                    self.metrics.placements.inc();
                    self.metrics
                        .submit_seconds
                        .observe(w.since.elapsed().as_secs_f64());
                    match &w.durable {
                        Some(d) => self.placed_async(d, &job.job_id, &worker_id).await,
                        None => self.answer(&w, &SubmitReply::Accepted { worker_id }).await,
                    }
                }
                (Ok(worker_id), None) => {
                    // Cancelled while it was being placed: cancel it on its worker too.
                    tracing::info!(job_id = %job.job_id, %worker_id, "cancelled during placement");
                    let cancel = CancelJob {
                        job_id: job.job_id.clone(),
                    };
                    let subject = subjects::denoiser_cancel(&worker_id);
                    if let Err(err) =
                        publish_msgpack(&self.client, subject, Some(&job.job_id), &cancel).await
                    {
                        tracing::warn!(job_id = %job.job_id, error = %err, "could not forward cancel");
                    }
                }
                (Err(err), Some(w)) => {
                    self.count_failure(err.reason());
                    let reply = SubmitReply::Rejected {
                        reason: err.to_string(),
                        retry_after_ms: self.config.retry_after.as_millis() as u64,
                    };
                    self.answer(&w, &reply).await;
                }
                (Err(_), None) => {}
            }
        }
    }

    /// The retry hint of a submit refused for load: when the line ahead of it should have
    /// shrunk to what starts within the admission wait, at least `--retry-after`.
    pub(crate) fn retry_hint(&self, expected: Duration) -> u64 {
        let beyond = expected.saturating_sub(self.config.admission_wait);
        beyond.max(self.config.retry_after).as_millis() as u64
    }

    /// Answer every queued submit with `reason` and a retry hint (shutdown: the gateway submits
    /// them again, to this router's successor).
    pub async fn drain_admission(&self, reason: &str) {
        let waiting = self.admission().drain();
        self.metrics.admission_waiting.set(0);
        if !waiting.is_empty() {
            tracing::info!(jobs = waiting.len(), %reason, "answering queued submits");
        }
        for w in waiting {
            if let Some(durable) = &w.durable {
                self.release_async(durable, &w.job.job_id).await;
                continue;
            }
            let reply = SubmitReply::Rejected {
                reason: reason.to_string(),
                retry_after_ms: self.config.retry_after.as_millis() as u64,
            };
            self.answer(&w, &reply).await;
        }
    }

    /// Place a job the router holds itself (a lost worker's, an adopted one) within `wait`:
    /// waiting for a slot, and also for a denoiser to come back while none is live, without
    /// queueing behind new submits. Workers in `exclude` (the one the job was lost on) are the
    /// last resort: taken only when no other live worker can take the job now, as when the lost
    /// worker restarted in place and the others are full or gone.
    pub async fn place_within(
        &self,
        job: &DenoiseJob,
        exclude: &[String],
        wait: Duration,
    ) -> Result<String, PlaceError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.capacity.notified();
            let mut placed = self.place_once(job, exclude, None).await;
            if !exclude.is_empty()
                && matches!(
                    placed,
                    Err(PlaceError::NoCapacity | PlaceError::NoLiveWorker)
                )
            {
                placed = self.place_once(job, &[], None).await;
            }
            let now = tokio::time::Instant::now();
            match placed {
                Err(PlaceError::NoCapacity) if now < deadline => {
                    // Poll as well: a notification between our attempt and `notified()` is not
                    // lost for long.
                    let poll = now + Duration::from_millis(100);
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep_until(poll.min(deadline)) => {}
                    }
                }
                Err(PlaceError::NoLiveWorker) if now < deadline => {
                    tokio::time::sleep(NO_WORKER_RETRY.min(deadline - now)).await;
                }
                other => return other,
            }
        }
    }

    /// Try live workers in policy order until one accepts; refusals and timeouts move on.
    pub(crate) async fn place_once(
        &self,
        job: &DenoiseJob,
        exclude: &[String],
        waiting_behind: Option<u32>,
    ) -> Result<String, PlaceError> {
        let mut tried: Vec<String> = exclude.to_vec();
        loop {
            let place = crate::placement::Place {
                job: job.clone(),
                exclude: tried.clone(),
                waiting_behind,
            };
            let (decision, took) = self.ask(place).await;
            self.metrics.decision_seconds.observe(took.as_secs_f64());
            let worker = match decision {
                Decision::Chosen(w) => w,
                Decision::NoLiveWorker if tried.len() > exclude.len() => {
                    return Err(PlaceError::NoCapacity)
                }
                Decision::NoLiveWorker => return Err(PlaceError::NoLiveWorker),
                Decision::NoCapacity => return Err(PlaceError::NoCapacity),
            };
            let timeout = self.config.forward_timeout;
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
                    self.record_placement(&job.job_id, &worker);
                    crate::prefetch::prefetch_template_cache(&self.client, job).await;
                    return Ok(worker);
                }
                Ok(SubmitReply::Rejected { reason, .. }) => {
                    tracing::debug!(%worker, %reason, "denoiser refused the job");
                }
                Ok(SubmitReply::Overloaded { queue_depth, .. }) => {
                    tracing::debug!(%worker, queue_depth, "denoiser is overloaded");
                }
                Err(err) => {
                    self.count_failure(err.reason());
                    tracing::warn!(%worker, error = %err, "forwarding to denoiser failed");
                }
            }
            self.ask(crate::placement::Unplace(job.job_id.clone()))
                .await;
            tried.push(worker);
        }
    }

    pub(crate) fn count_failure(&self, reason: &str) {
        self.metrics.failures.with_label_values(&[reason]).inc();
    }

    /// Answer a submit message directly (not queued).
    async fn reply(&self, msg: &async_nats::Message, reply: &SubmitReply, started: Instant) {
        self.metrics
            .submit_seconds
            .observe(started.elapsed().as_secs_f64());
        if let Err(err) = reply_msgpack(&self.client, msg, reply).await {
            tracing::warn!(error = %err, "could not answer a submit");
        }
    }

    /// Answer a queued submit.
    pub(crate) async fn answer(&self, w: &Waiting, reply: &SubmitReply) {
        let Some(subject) = &w.reply else {
            return;
        };
        if let Err(err) = publish_msgpack(
            &self.client,
            subject.to_string(),
            Some(&w.job.job_id),
            reply,
        )
        .await
        {
            tracing::warn!(job_id = %w.job.job_id, error = %err, "could not answer a queued submit");
        }
    }
}
