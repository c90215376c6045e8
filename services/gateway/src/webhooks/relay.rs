//! The relay: this gateway's share of the durable consumer of job record writes. A record
//! whose webhook became due (ended, with a webhook no delivery claimed) has its job appended
//! to the queue of deliveries; a write is acked only after that append, so a relay that dies
//! mid-way leaves the write to another gateway's relay. Every other write is acked at once.
use std::time::Duration;

use async_nats::jetstream::{consumer, AckKind, Message};
use diffmesh_shared::stores::job::JobRecord;
use diffmesh_shared::stores::webhook_queue::WebhookQueue;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

/// Wait before opening the consumer again after it failed or its stream ended.
const REOPEN_AFTER: Duration = Duration::from_secs(1);
/// Redelivery delay of a write whose append failed.
const APPEND_RETRY: Duration = Duration::from_secs(1);
/// Writes pulled at once (each is a job record, a few KiB).
const BATCH: usize = 64;

/// Relay due webhooks until `shutdown`.
pub async fn run(queue: WebhookQueue, shutdown: CancellationToken) {
    loop {
        let opened = match queue.relay().await {
            Ok(consumer) => relay_from(&queue, consumer, &shutdown).await,
            Err(err) => Err(err.to_string()),
        };
        if let Err(err) = opened {
            tracing::warn!(error = %err, "webhook relay stopped; opening it again");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(REOPEN_AFTER) => {}
        }
    }
}

async fn relay_from(
    queue: &WebhookQueue,
    consumer: consumer::Consumer<consumer::pull::Config>,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let messages = consumer
        .stream()
        .max_messages_per_batch(BATCH)
        .messages()
        .await
        .map_err(|e| e.to_string())?;
    let mut messages = std::pin::pin!(messages);
    loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            next = messages.next() => next,
        };
        match next {
            Some(Ok(message)) => relay_one(queue, message).await,
            Some(Err(err)) => return Err(err.to_string()),
            None => return Err("the consumer's stream ended".into()),
        }
    }
}

async fn relay_one(queue: &WebhookQueue, message: Message) {
    let due = due_job(&message.payload);
    if let Some(job_id) = due {
        if let Err(err) = queue.announce(&job_id).await {
            tracing::warn!(%job_id, error = %err, "could not queue a webhook; trying again");
            let _ = message.ack_with(AckKind::Nak(Some(APPEND_RETRY))).await;
            return;
        }
        tracing::debug!(%job_id, "webhook due");
    }
    if let Err(err) = message.ack().await {
        tracing::debug!(error = %err, "relay ack failed (the write comes again)");
    }
}

/// The job whose webhook this record write makes due, if any (a deletion marker, or a record
/// this build cannot read, makes none).
fn due_job(payload: &[u8]) -> Option<String> {
    if payload.is_empty() {
        return None;
    }
    match serde_json::from_slice::<JobRecord>(payload) {
        Ok(record) if record.webhook_due() => Some(record.job_id),
        Ok(_) => None,
        Err(err) => {
            tracing::warn!(error = %err, "unreadable job record; no webhook from it");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffmesh_shared::stores::job::Webhook;
    use diffmesh_shared::wire::messages::JobKind;

    #[test]
    fn only_ended_records_with_an_unclaimed_webhook_are_due() {
        let mut r = JobRecord::new("j1", JobKind::Generate);
        let json = |r: &JobRecord| serde_json::to_vec(r).unwrap();
        assert_eq!(due_job(&json(&r)), None);
        r.webhook = Some(Webhook::new("https://example.com/h"));
        r.detached = true;
        assert_eq!(due_job(&json(&r)), None, "not ended");
        r.mark_failed("boom", "internal_error");
        assert_eq!(due_job(&json(&r)).as_deref(), Some("j1"));
        r.webhook.as_mut().unwrap().claim(3);
        assert_eq!(due_job(&json(&r)), None, "claimed");
        assert_eq!(due_job(b""), None);
        assert_eq!(due_job(b"not json"), None);
    }
}
