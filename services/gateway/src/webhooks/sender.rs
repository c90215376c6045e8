//! The senders: this gateway's share of the queue of webhook deliveries. Each message names a
//! job; its sender claims the job's delivery in the record (the first message to do so owns
//! it: repeats are acked and dropped), posts the event, writes the attempt into the record,
//! and then acks (delivered, or given up past `--webhook-max-age`) or negative-acks with the
//! retry's delay, so the retry goes to whichever gateway pulls it then.
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{consumer, AckKind, Message};
use diffmesh_shared::stores::job::{now_ms, JobRecord, JobState, JobStore};
use diffmesh_shared::stores::webhook_queue::{WebhookQueue, PROGRESS_EVERY};
use diffmesh_shared::MeshError;
use futures::StreamExt;
use prometheus::IntCounterVec;
use rand::Rng;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::callback_url::{CallbackPolicy, PublicResolver};
use super::signing::SigningKeys;
use super::WebhookConfig;
use crate::api::jobs::JobView;
use crate::result_urls::ResultUrls;

/// Longest wait between two attempts.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(3600);
/// Redelivery delay when the job's record could not be read or written.
const STORE_RETRY: Duration = Duration::from_secs(2);
/// How long one pull waits at the server for a delivery.
const LONG_POLL: Duration = Duration::from_millis(500);
/// Wait before opening the consumer again, and after a failed pull.
const REOPEN_AFTER: Duration = Duration::from_secs(1);
/// The User-Agent of webhook posts.
const USER_AGENT: &str = concat!("diffmesh-webhooks/", env!("CARGO_PKG_VERSION"));

/// How results are linked in an event: signed URLs (readable without a key until they
/// expire), under `--public-url` when set.
#[derive(Clone)]
pub struct ResultLinks {
    pub urls: ResultUrls,
    pub public_url: Option<String>,
}

/// Posts due webhooks.
pub struct Sender {
    jobs: JobStore,
    http: reqwest::Client,
    keys: SigningKeys,
    policy: CallbackPolicy,
    max_age: Duration,
    retry_base: Duration,
    links: ResultLinks,
    /// `diffmesh_gateway_webhooks_total{outcome}`: delivered, failed_attempt, gave_up.
    outcomes: IntCounterVec,
}

/// What becomes of a delivery message.
#[derive(Debug, PartialEq)]
enum Next {
    /// Done with it: delivered, given up, or not this message's to send.
    Ack,
    /// Deliver again after this long.
    RetryIn(Duration),
}

/// A post that got no 2xx.
struct Failure {
    status: Option<u16>,
    error: String,
    /// The receiver's `Retry-After`, in seconds.
    retry_after: Option<u64>,
    /// Not worth trying again (the URL is refused by this gateway's policy).
    permanent: bool,
}

/// The body of a webhook post: an event in the shape of OpenAI's webhook events.
#[derive(Serialize)]
struct Event {
    /// The job's id (also the `webhook-id` header).
    id: String,
    object: &'static str,
    /// `job.done`, `job.failed` or `job.cancelled`.
    #[serde(rename = "type")]
    kind: String,
    /// When the job ended, Unix seconds.
    created_at: u64,
    /// The job as `GET /v1/jobs/{id}` shows it, with signed result URLs.
    data: JobView,
}

impl Sender {
    pub fn new(
        config: &WebhookConfig,
        keys: SigningKeys,
        jobs: JobStore,
        links: ResultLinks,
        outcomes: IntCounterVec,
    ) -> Result<Self, String> {
        let policy = config.policy();
        let http = reqwest::Client::builder()
            .user_agent(USER_AGENT)
            .timeout(config.webhook_timeout)
            // A redirect or a proxy would reach an address the policy did not check.
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(PublicResolver { policy }))
            .build()
            .map_err(|e| format!("webhook client: {e}"))?;
        Ok(Self {
            jobs,
            http,
            keys,
            policy,
            max_age: config.webhook_max_age,
            retry_base: config.webhook_retry_base,
            links,
            outcomes,
        })
    }

    /// Take deliveries from the queue, at most `concurrency` in flight (tracked by `posts`),
    /// until `shutdown`.
    pub async fn run(
        self: Arc<Self>,
        queue: WebhookQueue,
        concurrency: usize,
        posts: TaskTracker,
        shutdown: CancellationToken,
    ) {
        let slots = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
        loop {
            let consumer = match queue.senders().await {
                Ok(consumer) => consumer,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot open the webhook queue; trying again");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(REOPEN_AFTER) => continue,
                    }
                }
            };
            if let Err(err) = self.pull(&consumer, &slots, &posts, &shutdown).await {
                tracing::debug!(error = %err, "webhook queue pull failed");
                tokio::time::sleep(REOPEN_AFTER).await;
            }
            if shutdown.is_cancelled() {
                return;
            }
        }
    }

    /// Pull one delivery at a time while a slot is free, each posted by a task of its own.
    async fn pull(
        self: &Arc<Self>,
        consumer: &consumer::Consumer<consumer::pull::Config>,
        slots: &Arc<tokio::sync::Semaphore>,
        posts: &TaskTracker,
        shutdown: &CancellationToken,
    ) -> Result<(), String> {
        loop {
            let slot = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                slot = slots.clone().acquire_owned() => slot.map_err(|e| e.to_string())?,
            };
            // A long poll: the server answers as soon as a delivery is due.
            let batch = consumer
                .batch()
                .max_messages(1)
                .expires(LONG_POLL)
                .messages()
                .await
                .map_err(|e| e.to_string())?;
            let mut batch = std::pin::pin!(batch);
            let next = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                next = batch.next() => next,
            };
            match next {
                Some(Ok(message)) => {
                    let sender = self.clone();
                    posts.spawn(async move {
                        sender.handle(message).await;
                        drop(slot);
                    });
                }
                Some(Err(err)) => return Err(err.to_string()),
                None => {}
            }
        }
    }

    async fn handle(&self, message: Message) {
        let sequence = match message.info() {
            Ok(info) => info.stream_sequence,
            Err(err) => {
                tracing::warn!(error = %err, "webhook delivery without its stream info; dropped");
                let _ = message.ack_with(AckKind::Term).await;
                return;
            }
        };
        let Ok(job_id) = std::str::from_utf8(&message.payload).map(str::to_string) else {
            let _ = message.ack_with(AckKind::Term).await;
            return;
        };
        // The server hears from this sender while it works, however long the post and the
        // record's writes take: no other sender gets the message meanwhile.
        let work = self.deliver(&job_id, sequence);
        let mut work = std::pin::pin!(work);
        let mut progress =
            tokio::time::interval_at(tokio::time::Instant::now() + PROGRESS_EVERY, PROGRESS_EVERY);
        let delivered = loop {
            tokio::select! {
                done = &mut work => break done,
                _ = progress.tick() => {
                    if let Err(err) = message.ack_with(AckKind::Progress).await {
                        tracing::debug!(%job_id, error = %err, "webhook progress ack failed");
                    }
                }
            }
        };
        let next = match delivered {
            Ok(next) => next,
            Err(err) => {
                tracing::warn!(%job_id, error = %err, "webhook delivery could not use the job's record; later");
                Next::RetryIn(STORE_RETRY)
            }
        };
        let acked = match next {
            Next::Ack => message.ack().await,
            Next::RetryIn(delay) => message.ack_with(AckKind::Nak(Some(delay))).await,
        };
        if let Err(err) = acked {
            tracing::debug!(%job_id, error = %err, "webhook ack failed (the delivery comes again)");
        }
    }

    /// `job_id`'s record with its delivery claimed for the message at `sequence`; `None` when
    /// there is nothing for this message to send (no record, no webhook, settled, or another
    /// message's).
    async fn claimed(&self, job_id: &str, sequence: u64) -> Result<Option<JobRecord>, MeshError> {
        let Some(record) = self.jobs.get(job_id).await? else {
            return Ok(None); // Expired with its record.
        };
        let Some(hook) = record.webhook.as_ref() else {
            return Ok(None);
        };
        if !record.state.is_terminal() || hook.settled() {
            return Ok(None);
        }
        match hook.claimed_by {
            Some(owner) if owner != sequence => Ok(None),
            Some(_) => Ok(Some(record)),
            // Declined (None) when another message claimed it first.
            None => {
                self.jobs
                    .update_if(job_id, |r| {
                        r.webhook.as_mut().is_some_and(|w| w.claim(sequence))
                    })
                    .await
            }
        }
    }

    /// One attempt at `job_id`'s delivery for the message at `sequence`.
    async fn deliver(&self, job_id: &str, sequence: u64) -> Result<Next, MeshError> {
        let Some(record) = self.claimed(job_id, sequence).await? else {
            return Ok(Next::Ack);
        };
        let Some(hook) = record.webhook.clone() else {
            return Ok(Next::Ack);
        };
        let now = now_ms();
        if let Some(at) = hook.next_attempt_at_ms.filter(|at| *at > now + 100) {
            // Redelivered early (a sender died holding it): wait out the retry's delay.
            return Ok(Next::RetryIn(Duration::from_millis(at - now)));
        }
        let ended_at = record.finished_at_ms.unwrap_or(record.updated_at_ms);
        let give_up_at = ended_at + self.max_age.as_millis() as u64;
        // A retry is scheduled by the deadline at the latest: only a delivery that comes later
        // (gateways down that long) is given up unsent.
        if hook.next_attempt_at_ms.unwrap_or(now).max(now) > give_up_at + 1_000 {
            let why = format!(
                "not sent within --webhook-max-age ({}s) of the job's ending",
                self.max_age.as_secs()
            );
            return self.settle_unsent(job_id, sequence, why).await;
        }
        let outcome = self.post(&record, &hook.url).await;
        let attempted_at = now_ms();
        let (status, error, next) = match outcome {
            Ok(status) => (Some(status), None, Next::Ack),
            Err(failure) => {
                let delay = match failure.retry_after {
                    Some(s) => Duration::from_secs(s)
                        .max(self.retry_base)
                        .min(MAX_RETRY_DELAY),
                    None => backoff(self.retry_base, hook.attempts + 1),
                };
                // The last retry comes at the deadline, not before it with time to spare.
                let left = Duration::from_millis(give_up_at.saturating_sub(attempted_at));
                let next = match failure.permanent || left.is_zero() {
                    true => Next::Ack,
                    false => Next::RetryIn(delay.min(left)),
                };
                (failure.status, Some(failure.error), next)
            }
        };
        let next_attempt = match &next {
            Next::RetryIn(delay) => Some(attempted_at + delay.as_millis() as u64),
            Next::Ack => None,
        };
        let outcome = match (&error, &next) {
            (None, _) => "delivered",
            (Some(_), Next::RetryIn(_)) => "failed_attempt",
            (Some(_), Next::Ack) => "gave_up",
        };
        tracing::info!(%job_id, outcome, status = ?status, error = ?error, "webhook attempt");
        let written = self
            .jobs
            .update_if(job_id, |r| match r.webhook.as_mut() {
                Some(w) if w.claimed_by == Some(sequence) && !w.settled() => {
                    w.record_attempt(status, error.clone(), attempted_at, next_attempt);
                    true
                }
                _ => false,
            })
            .await;
        match written {
            Ok(Some(_)) => self.outcomes.with_label_values(&[outcome]).inc(),
            Ok(None) => {}
            // Delivered, or given up, but not written: tried again later (a repeat post is
            // at least once: `webhook-id` tells the receiver). Failed: the retry keeps its
            // delay all the same.
            Err(err) if matches!(next, Next::Ack) => return Err(err),
            Err(err) => {
                tracing::warn!(%job_id, error = %err, "webhook attempt not recorded");
            }
        }
        Ok(next)
    }

    /// Give the delivery up without a post.
    async fn settle_unsent(
        &self,
        job_id: &str,
        sequence: u64,
        why: String,
    ) -> Result<Next, MeshError> {
        let written = self
            .jobs
            .update_if(job_id, |r| match r.webhook.as_mut() {
                Some(w) if w.claimed_by == Some(sequence) && !w.settled() => {
                    w.give_up(why.clone());
                    true
                }
                _ => false,
            })
            .await?;
        if written.is_some() {
            self.outcomes.with_label_values(&["gave_up"]).inc();
            tracing::info!(%job_id, why, "webhook given up unsent");
        }
        Ok(Next::Ack)
    }

    /// Post `record`'s event to `url`: the 2xx status, or why not.
    async fn post(&self, record: &JobRecord, url: &str) -> Result<u16, Failure> {
        let refused = |error: String| Failure {
            status: None,
            error,
            retry_after: None,
            permanent: true,
        };
        // Checked again: the gateway's policy may be stricter than the one that took it.
        let url = self
            .policy
            .check(url)
            .map_err(|e| refused(format!("callback_url refused: {}", e.message)))?;
        let timestamp = now_ms() / 1000;
        let body = serde_json::to_vec(&self.event(record, timestamp))
            .map_err(|e| refused(format!("event: {e}")))?;
        let signature = self.keys.sign(&record.job_id, timestamp, &body);
        let answer = self
            .http
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header("webhook-id", &record.job_id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(body)
            .send()
            .await;
        match answer {
            Ok(answer) if answer.status().is_success() => Ok(answer.status().as_u16()),
            Ok(answer) => Err(Failure {
                status: Some(answer.status().as_u16()),
                error: format!("the receiver answered {}", answer.status()),
                retry_after: answer
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse().ok()),
                permanent: false,
            }),
            Err(err) => Err(Failure {
                status: None,
                error: describe(&err),
                retry_after: None,
                permanent: false,
            }),
        }
    }

    /// The event posted for `record`'s ending.
    fn event(&self, record: &JobRecord, now_s: u64) -> Event {
        let mut data = JobView::of(record);
        data.webhook = None;
        let base = self.links.public_url.as_deref().unwrap_or("");
        for link in &mut data.results {
            link.url = format!(
                "{base}{}",
                self.links.urls.path(&record.job_id, link.index, now_s)
            );
        }
        let kind = match record.state {
            JobState::Done => "job.done",
            JobState::Failed => "job.failed",
            JobState::Cancelled => "job.cancelled",
            // Not sent before the job ends (`deliver`).
            JobState::Queued | JobState::Running => "job.updated",
        };
        Event {
            id: record.job_id.clone(),
            object: "event",
            kind: kind.to_string(),
            created_at: record.finished_at_ms.unwrap_or(record.updated_at_ms) / 1000,
            data,
        }
    }
}

/// The wait before attempt `attempt + 1` after `attempt` failures: `base` doubled for each
/// failure after the first, at most [`MAX_RETRY_DELAY`], give or take a fifth (so receivers
/// that failed together are not retried together).
fn backoff(base: Duration, attempts: u32) -> Duration {
    let doublings = attempts.saturating_sub(1).min(20);
    let wait = base.saturating_mul(1 << doublings).min(MAX_RETRY_DELAY);
    wait.mul_f64(rand::rng().random_range(0.8..1.2))
}

/// A failed request's error with its root cause (reqwest's own text names only the URL).
fn describe(err: &reqwest::Error) -> String {
    let mut text = if err.is_timeout() {
        "timed out".to_string()
    } else if err.is_connect() {
        "could not connect".to_string()
    } else {
        "request failed".to_string()
    };
    let mut source = std::error::Error::source(err);
    let mut root = None;
    while let Some(s) = source {
        root = Some(s.to_string());
        source = s.source();
    }
    if let Some(root) = root {
        text.push_str(": ");
        text.push_str(&root);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_exponentially_with_jitter_up_to_an_hour() {
        let base = Duration::from_secs(5);
        for (attempts, nominal) in [(1, 5.0), (2, 10.0), (3, 20.0), (12, 3600.0), (99, 3600.0)] {
            let wait = backoff(base, attempts).as_secs_f64();
            assert!(
                wait >= nominal * 0.8 && wait <= nominal * 1.2,
                "attempt {attempts}: {wait}"
            );
        }
    }
}
