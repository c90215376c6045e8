//! A job's webhook (`callback_url` of an async request), kept on its record: where to post the
//! job's ending, and every delivery attempt so far. The record is the delivery's durable
//! state: whichever gateway sends an attempt reads it first and writes its outcome after, so
//! a gateway that dies mid-way leaves the next one what it needs (see the gateway's
//! `webhooks` module).
use serde::{Deserialize, Serialize};

use super::JobRecord;

/// The webhook of one job and how its delivery went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Webhook {
    /// Where the job's ending is posted (checked when the job was accepted).
    pub url: String,
    /// The stream sequence of the delivery message that owns the delivery: the first one a
    /// sender claimed. Another message for the same job (a relay's repeat) is dropped, so
    /// one ending makes one delivery, however many messages announce it.
    #[serde(default)]
    pub claimed_by: Option<u64>,
    /// Posts made so far.
    #[serde(default)]
    pub attempts: u32,
    /// The HTTP status of the last post, when it got one.
    #[serde(default)]
    pub last_status: Option<u16>,
    /// Why the last post failed (a status, a timeout, a refused address).
    #[serde(default)]
    pub last_error: Option<String>,
    /// When the receiver accepted it (a 2xx), Unix ms.
    #[serde(default)]
    pub delivered_at_ms: Option<u64>,
    /// When the next attempt is due after a failed one, Unix ms.
    #[serde(default)]
    pub next_attempt_at_ms: Option<u64>,
    /// Given up: no 2xx within the gateway's `--webhook-max-age` of the ending.
    #[serde(default)]
    pub gave_up: bool,
}

impl Webhook {
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            claimed_by: None,
            attempts: 0,
            last_status: None,
            last_error: None,
            delivered_at_ms: None,
            next_attempt_at_ms: None,
            gave_up: false,
        }
    }

    /// Nothing more to send: delivered or given up.
    pub fn settled(&self) -> bool {
        self.delivered_at_ms.is_some() || self.gave_up
    }

    /// Claim the delivery for the message at `sequence`: true when it is this message's
    /// (unclaimed until now, or claimed by it before a redelivery), false when another message
    /// owns it or it is settled.
    pub fn claim(&mut self, sequence: u64) -> bool {
        if self.settled() {
            return false;
        }
        match self.claimed_by {
            None => {
                self.claimed_by = Some(sequence);
                true
            }
            Some(owner) => owner == sequence,
        }
    }

    /// One post's outcome: `status` when the receiver answered, `error` when the post
    /// failed (a non-2xx status is an error too), the next attempt's time when there will be
    /// one, or given up when `next_attempt_at_ms` is `None` after a failure.
    pub fn record_attempt(
        &mut self,
        status: Option<u16>,
        error: Option<String>,
        now_ms: u64,
        next_attempt_at_ms: Option<u64>,
    ) {
        self.attempts += 1;
        self.last_status = status;
        self.next_attempt_at_ms = None;
        match error {
            None => {
                self.last_error = None;
                self.delivered_at_ms = Some(now_ms);
            }
            Some(error) => {
                self.last_error = Some(error);
                match next_attempt_at_ms {
                    Some(at) => self.next_attempt_at_ms = Some(at),
                    None => self.gave_up = true,
                }
            }
        }
    }
}

impl Webhook {
    /// Given up without a post: the delivery came after `--webhook-max-age` (the gateways were
    /// down, or the age was lowered). Not an attempt: `attempts` counts posts made.
    pub fn give_up(&mut self, why: String) {
        self.last_error = Some(why);
        self.next_attempt_at_ms = None;
        self.gave_up = true;
    }
}

impl JobRecord {
    /// Whether this version of the record calls for its webhook to be sent: the job went into
    /// the durable queue (`detached`), has ended, has a webhook, and no delivery has claimed it
    /// yet. Read by the relay on every record write; the claim, not this, keeps a job to one
    /// delivery.
    pub fn webhook_due(&self) -> bool {
        self.state.is_terminal()
            && self.detached
            && self
                .webhook
                .as_ref()
                .is_some_and(|w| w.claimed_by.is_none() && !w.settled())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::messages::JobKind;

    #[test]
    fn a_webhook_is_due_once_the_job_ended_until_claimed() {
        let mut r = JobRecord::new("j", JobKind::Generate);
        assert!(!r.webhook_due(), "no webhook");
        r.webhook = Some(Webhook::new("https://example.com/hook"));
        r.mark_running("d1");
        assert!(!r.webhook_due(), "still running");
        let mut refused = r.clone();
        refused.mark_failed("the queue is full", "rate_limited");
        assert!(
            !refused.webhook_due(),
            "never queued: its client had the error"
        );
        r.detached = true;
        r.mark_done(vec!["k".into()]);
        assert!(r.webhook_due());
        let hook = r.webhook.as_mut().unwrap();
        assert!(hook.claim(7));
        assert!(hook.claim(7), "a redelivery of the owner keeps it");
        assert!(!hook.claim(8), "another message for the same job does not");
        assert!(!r.webhook_due());
    }

    #[test]
    fn attempts_end_delivered_or_given_up() {
        let mut w = Webhook::new("https://example.com/hook");
        w.claim(1);
        w.record_attempt(Some(500), Some("status 500".into()), 10, Some(5_010));
        assert_eq!(
            (w.attempts, w.next_attempt_at_ms, w.settled()),
            (1, Some(5_010), false)
        );
        w.record_attempt(Some(204), None, 5_020, None);
        assert_eq!((w.attempts, w.delivered_at_ms), (2, Some(5_020)));
        assert!(
            w.settled() && !w.claim(1),
            "delivered: nothing more to send"
        );

        let mut never = Webhook::new("https://example.com/hook");
        never.record_attempt(None, Some("timed out".into()), 10, None);
        assert!(never.gave_up && never.settled());

        let mut late = Webhook::new("https://example.com/hook");
        late.give_up("too late".into());
        assert!(late.settled() && late.attempts == 0, "no post, no attempt");
    }

    #[test]
    fn records_without_a_webhook_load() {
        let old =
            r#"{"job_id":"j","kind":"Edit","state":"done","created_at_ms":1,"updated_at_ms":2}"#;
        let r: JobRecord = serde_json::from_str(old).unwrap();
        assert!(r.webhook.is_none() && !r.webhook_due());
    }
}
