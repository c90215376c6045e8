//! Webhooks: an async job's ending posted to the `callback_url` its request gave, signed as
//! Standard Webhooks define ([`signing`]), retried with backoff until the receiver answers
//! 2xx or `--webhook-max-age` passed, never in the job's way.
//!
//! How one ending becomes one delivery, whichever service wrote it and whichever gateway dies:
//! - the request's URL is checked ([`callback_url`]) and kept on the job's record when the job
//!   is queued;
//! - every gateway runs the relay ([`relay`]): a share of a durable consumer of the job
//!   records' writes, which appends each record whose webhook became due to the queue of
//!   deliveries (`shared::stores::webhook_queue`);
//! - every gateway runs senders ([`sender`]): a share of that queue's durable consumer. The
//!   first message of a job claims its delivery in the record (compare-and-set), so repeats
//!   are dropped; each attempt is written to the record (`GET /v1/jobs/{id}` shows it), and a
//!   failed one is retried by a delayed negative ack, by whichever gateway gets it.
//!
//! Delivery is at least once: a sender that dies after the receiver's 2xx but before writing
//! it leaves a repeat with the same `webhook-id`, which receivers de-duplicate on.
pub mod callback_url;
pub mod relay;
pub mod sender;
pub mod signing;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use diffmesh_shared::process::config::duration;
use diffmesh_shared::stores::webhook_queue::{WebhookQueue, MAX_WEBHOOK_AGE};
use tokio_util::sync::CancellationToken;

use crate::job_driver::Mesh;
use crate::{GatewayConfig, GatewayError};

use callback_url::CallbackPolicy;
use signing::SigningKeys;

/// Webhook flags.
#[derive(Debug, Clone, clap::Args)]
pub struct WebhookConfig {
    /// Keys webhooks are signed with, comma-separated, each `whsec_` and 24 to 64 bytes in
    /// base64 (Standard Webhooks' form: receivers' libraries take it as it is); every key
    /// signs, so receivers can move to a new one. Unset: this gateway refuses `callback_url`
    /// and sends no webhooks.
    #[arg(long, env = "GATEWAY_WEBHOOK_SIGNING_KEY", hide_env_values = true)]
    pub webhook_signing_key: Option<String>,
    /// Post webhooks to plain http URLs too.
    #[arg(long, env = "GATEWAY_WEBHOOK_ALLOW_HTTP", default_value_t = false, action = clap::ArgAction::Set)]
    pub webhook_allow_http: bool,
    /// Post webhooks to addresses that are not public too (loopback, private, link-local):
    /// for receivers inside the deployment; off, a caller cannot make the gateway reach them.
    #[arg(long, env = "GATEWAY_WEBHOOK_ALLOW_PRIVATE_ADDRESSES", default_value_t = false, action = clap::ArgAction::Set)]
    pub webhook_allow_private_addresses: bool,
    /// How long after a job's ending its webhook is retried before it is given up (at most
    /// 3 days).
    #[arg(long, env = "GATEWAY_WEBHOOK_MAX_AGE", default_value = "24h", value_parser = duration)]
    pub webhook_max_age: Duration,
    /// Deadline of one post (connect, send, answer).
    #[arg(long, env = "GATEWAY_WEBHOOK_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub webhook_timeout: Duration,
    /// Wait before the first retry; each later one waits twice the one before (up to an hour,
    /// with a fifth of jitter), or what the receiver's `Retry-After` says.
    #[arg(long, env = "GATEWAY_WEBHOOK_RETRY_BASE", default_value = "5s", value_parser = duration)]
    pub webhook_retry_base: Duration,
    /// Posts this gateway has in flight at most.
    #[arg(long, env = "GATEWAY_WEBHOOK_SENDERS", default_value_t = 16)]
    pub webhook_senders: usize,
}

impl WebhookConfig {
    /// Webhooks off, strict addresses, short waits: the in-process tests' config.
    pub fn for_tests() -> Self {
        Self {
            webhook_signing_key: None,
            webhook_allow_http: false,
            webhook_allow_private_addresses: false,
            webhook_max_age: Duration::from_secs(3600),
            webhook_timeout: Duration::from_secs(5),
            webhook_retry_base: Duration::from_millis(200),
            webhook_senders: 4,
        }
    }

    pub fn policy(&self) -> CallbackPolicy {
        CallbackPolicy {
            allow_http: self.webhook_allow_http,
            allow_private_addresses: self.webhook_allow_private_addresses,
        }
    }

    /// The signing keys, when webhooks are on; errors name the flag.
    pub fn keys(&self) -> Result<Option<SigningKeys>, String> {
        if self.webhook_max_age.is_zero() || self.webhook_max_age > MAX_WEBHOOK_AGE {
            return Err(format!(
                "--webhook-max-age must be longer than 0 and at most {}h",
                MAX_WEBHOOK_AGE.as_secs() / 3600
            ));
        }
        if self.webhook_timeout.is_zero() || self.webhook_retry_base.is_zero() {
            return Err("--webhook-timeout and --webhook-retry-base must be longer than 0".into());
        }
        if self.webhook_retry_base > Duration::from_secs(3600) {
            return Err("--webhook-retry-base must be at most 1h (the longest wait)".into());
        }
        if self.webhook_senders == 0 {
            return Err("--webhook-senders must be at least 1".into());
        }
        self.webhook_signing_key
            .as_deref()
            .map(SigningKeys::parse)
            .transpose()
            .map_err(|e| format!("--webhook-signing-key: {e}"))
    }
}

/// Open the queue of deliveries and run this gateway's relay and senders until `stop`; the
/// posts in flight are tracked by the mesh's background tasks (a shutdown waits for them).
pub async fn start(
    js: &jetstream::Context,
    config: &GatewayConfig,
    keys: SigningKeys,
    mesh: &Mesh,
    links: sender::ResultLinks,
    stop: CancellationToken,
) -> Result<(), GatewayError> {
    let hooks = &config.webhooks;
    let queue = WebhookQueue::open(js, usize::from(config.common.js_replicas)).await?;
    // Both consumers exist before the first `callback_url` is taken, so no ending is missed.
    queue.relay().await?;
    queue.senders().await?;
    let sender = sender::Sender::new(
        hooks,
        keys,
        mesh.jobs.clone(),
        links,
        mesh.metrics.webhooks.clone(),
    )
    .map_err(GatewayError::Config)?;
    tokio::spawn(relay::run(queue.clone(), stop.clone()));
    tokio::spawn(Arc::new(sender).run(queue, hooks.webhook_senders, mesh.background.clone(), stop));
    if config.public_url.is_none() {
        tracing::warn!(
            "webhooks on without --public-url: their result links are paths, which receivers \
             must join to this gateway's address themselves"
        );
    }
    tracing::info!(
        http = hooks.webhook_allow_http,
        private_addresses = hooks.webhook_allow_private_addresses,
        "webhooks on"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_out_of_range_are_refused_by_name() {
        let mut config = WebhookConfig::for_tests();
        assert!(config.keys().unwrap().is_none());
        config.webhook_signing_key = Some("whsec_c2hvcnQ=".into());
        assert!(config.keys().unwrap_err().contains("--webhook-signing-key"));
        config.webhook_signing_key = Some("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into());
        assert!(config.keys().unwrap().is_some());
        config.webhook_retry_base = Duration::from_secs(7200);
        assert!(config.keys().unwrap_err().contains("--webhook-retry-base"));
        config.webhook_retry_base = Duration::from_secs(5);
        config.webhook_max_age = Duration::from_secs(4 * 24 * 3600);
        assert!(config.keys().unwrap_err().contains("--webhook-max-age"));
    }
}
