//! The routers' side of the durable queue of async jobs (`shared::stores::async_queue`). Each
//! router takes a few jobs at a time from the queue's shared consumer into its admission line,
//! where they wait among the synchronous submits (so waiting clients are not queued behind the
//! whole async backlog, and the backlog is not starved by them); a job is acked in the queue
//! only once it is placed and its record says so, or once it ended (cancelled, past its
//! deadline). A router that dies holding jobs leaves them unacked: the server hands them to
//! another router after `ACK_WAIT`, and one that stops cleanly hands them back at once.
//!
//! A job taken again after its router died just after placing it is found placed in its record
//! and dropped; only a death between a denoiser accepting it and the record write (a few ms)
//! can run it twice.
use crate::admission::{Durable, Waiting};
use crate::service::Router;
use async_nats::jetstream::AckKind;
use diffmesh_shared::stores::async_queue::{QueuedJob, PROGRESS_EVERY};
use diffmesh_shared::stores::job::{now_ms, JobRecord};
use diffmesh_shared::wire::messages::{decode, error_types, JobEvent};
use futures::StreamExt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Async jobs one router holds in its admission line at once.
const HELD_AT_ONCE: usize = 4;
/// How often a router without room looks again without being woken, and the pause after a
/// failed pull.
const PULL_TICK: Duration = Duration::from_millis(100);
/// How long one pull waits at the server for a job.
const LONG_POLL: Duration = Duration::from_millis(500);
/// Wait before trying to open the consumer again.
const REOPEN_AFTER: Duration = Duration::from_secs(1);
/// Redelivery delay of a job whose record could not be read.
const READ_RETRY: Duration = Duration::from_secs(1);

impl Router {
    /// Take async jobs from the durable queue as this router has room for them, and keep the
    /// server told that the held ones are being worked on; until shutdown.
    pub async fn pull_async_jobs(self: Arc<Self>, shutdown: CancellationToken) {
        let consumer = loop {
            match self.queue.consumer().await {
                Ok(consumer) => break consumer,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot open the async job queue; trying again");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(REOPEN_AFTER) => continue,
                    }
                }
            }
        };
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            self.report_progress().await;
            if !self.wants_async_job() {
                let woken = self.capacity.notified();
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = woken => {}
                    _ = tokio::time::sleep(PULL_TICK) => {}
                }
                continue;
            }
            // A long poll: the server answers as soon as a job is queued (or after LONG_POLL
            // with none), so a queued job reaches a router with room within milliseconds.
            let batch = consumer
                .batch()
                .max_messages(1)
                .expires(LONG_POLL)
                .messages()
                .await;
            let batch = match batch {
                Ok(batch) => batch,
                Err(err) => {
                    tracing::debug!(error = %err, "async job queue pull failed");
                    tokio::time::sleep(PULL_TICK).await;
                    continue;
                }
            };
            let mut batch = std::pin::pin!(batch);
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = batch.next() => next,
            };
            match next {
                Some(Ok(message)) => self.take_async(message).await,
                Some(Err(err)) => {
                    tracing::debug!(error = %err, "async job queue pull failed");
                    tokio::time::sleep(PULL_TICK).await;
                }
                None => {}
            }
        }
    }

    fn wants_async_job(&self) -> bool {
        let q = self.admission();
        q.durable_count() < HELD_AT_ONCE && q.len() < q.capacity()
    }

    /// Hold one queued job in the admission line, unless it ended or was placed already.
    async fn take_async(&self, message: async_nats::jetstream::Message) {
        let queued: QueuedJob = match decode(&message.payload) {
            Ok(q) => q,
            Err(err) => {
                tracing::warn!(error = %err, "undecodable job in the async queue; dropped");
                let _ = message.ack_with(AckKind::Term).await;
                return;
            }
        };
        let job_id = queued.job.job_id.clone();
        match self.jobs.get(&job_id).await {
            Ok(Some(r)) if r.state.is_terminal() || r.worker_id.is_some() => {
                tracing::debug!(%job_id, state = ?r.state, "queued job already placed or ended");
                let _ = message.ack().await;
                return;
            }
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(%job_id, error = %err, "cannot read a queued job's record; later");
                let _ = message.ack_with(AckKind::Nak(Some(READ_RETRY))).await;
                return;
            }
        }
        // Followed before it is placed: its first events may come before the placement returns.
        self.adopted.follow(&job_id);
        let waiting = Waiting {
            job: queued.job,
            reply: None,
            headers: message.headers.clone(),
            since: Instant::now(),
            durable: Some(Durable {
                message,
                place_by_ms: queued.place_by_ms,
                last_progress: Instant::now(),
            }),
        };
        let pushed = {
            let mut q = self.admission();
            let r = q.push(waiting);
            self.metrics.admission_waiting.set(q.len() as i64);
            r
        };
        match pushed {
            Ok(_) => {
                tracing::debug!(%job_id, "async job taken from the queue");
                self.metrics.async_taken.inc();
                self.capacity.notify_waiters();
            }
            // Not expected (room was checked); the entry was dropped unacked and comes back.
            Err(full) => tracing::warn!(%job_id, depth = full.depth, "admission line full"),
        }
    }

    /// Tell the server the held jobs are still being worked on, so none goes to another router.
    async fn report_progress(&self) {
        let due = Instant::now().checked_sub(PROGRESS_EVERY);
        let Some(due) = due else { return };
        let messages = self.admission().progress_due(due);
        for message in messages {
            if let Err(err) = message.ack_with(AckKind::Progress).await {
                tracing::debug!(error = %err, "progress ack failed");
            }
        }
    }

    /// A held async job was placed on `worker`: its record says so, then the queue lets it go.
    pub(crate) async fn placed_async(&self, durable: &Durable, job_id: &str, worker: &str) {
        // Detached again: the gateway that queued it may have died before its own write said so.
        let placed = |r: &mut JobRecord| {
            // An ended record stays as it is (its ending has no webhook if it was never queued).
            if !r.state.is_terminal() {
                r.mark_placed(worker);
                r.detached = true;
            }
        };
        if let Err(err) = self.jobs.update(job_id, placed).await {
            tracing::warn!(%job_id, error = %err, "could not record the placement");
        }
        if let Err(err) = durable.message.double_ack().await {
            tracing::warn!(%job_id, error = %err, "could not ack a placed async job");
        }
    }

    /// A held async job ended without a placement (cancelled, or past its deadline: then it is
    /// failed here); the queue lets it go.
    pub(crate) async fn ended_async(&self, durable: &Durable, job_id: &str, past_deadline: bool) {
        self.adopted.forget(job_id);
        // It was queued, so its webhook is due at this ending (see `placed_async`).
        let queued = |r: &mut JobRecord| r.detached |= !r.state.is_terminal();
        if let Err(err) = self.jobs.update(job_id, queued).await {
            tracing::warn!(%job_id, error = %err, "could not mark a queued job detached");
        }
        if past_deadline {
            let waited_s = now_ms().saturating_sub(durable.place_by_ms) / 1000;
            let event = JobEvent::Failed {
                message: format!(
                    "no denoiser took the job before its deadline (it waited in the queue until \
                     {waited_s}s past it)"
                ),
                error_type: error_types::TIMEOUT.to_string(),
            };
            self.count_failure("queue_deadline");
            self.publish_event(job_id, &event).await;
            self.record_outcome(job_id, event);
        }
        if let Err(err) = durable.message.ack().await {
            tracing::warn!(%job_id, error = %err, "could not ack an ended async job");
        }
    }

    /// Hand a held async job back to the queue at once (shutdown).
    pub(crate) async fn release_async(&self, durable: &Durable, job_id: &str) {
        self.adopted.forget(job_id);
        if let Err(err) = durable.message.ack_with(AckKind::Nak(None)).await {
            tracing::warn!(%job_id, error = %err, "could not hand an async job back");
        }
    }
}
