//! The capture announcements made before this denoiser started, read back from the stream
//! `subjects::TEMPLATE_CAPTURES_STREAM` (the last one per cache key), so a denoiser added to a
//! running mesh warms its local tier as if it had heard them.
use std::time::Duration;

use async_nats::jetstream::{consumer, stream};
use diffmesh_shared::wire::messages::{decode, TemplateCaptured};
use diffmesh_shared::wire::subjects::{TEMPLATES_CAPTURED_ALL, TEMPLATE_CAPTURES_STREAM};
use diffmesh_shared::MeshError;
use futures::StreamExt;

fn log_error(what: &str, err: impl std::fmt::Display) -> MeshError {
    MeshError::JetStreamLayout {
        name: TEMPLATE_CAPTURES_STREAM.to_string(),
        reason: format!("{what}: {err}"),
    }
}

/// Every announcement the stream holds, newest first (what a full local tier should keep
/// first). Undecodable ones are skipped. Gives up after `within`: announcements are a hint,
/// and a denoiser must not wait on them to serve.
pub async fn recent_captures(
    stream: &stream::Stream,
    client: &async_nats::Client,
    within: Duration,
) -> Result<Vec<TemplateCaptured>, MeshError> {
    let consumer = stream
        .create_consumer(consumer::push::OrderedConfig {
            deliver_subject: client.new_inbox(),
            description: Some("capture announcements at start".to_string()),
            filter_subject: TEMPLATES_CAPTURED_ALL.to_string(),
            deliver_policy: consumer::DeliverPolicy::LastPerSubject,
            replay_policy: consumer::ReplayPolicy::Instant,
            ..Default::default()
        })
        .await
        .map_err(|e| log_error("consumer", e))?;
    // Nothing to deliver: reading would only wait for the timeout.
    if consumer.cached_info().num_pending == 0 {
        return Ok(Vec::new());
    }
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| log_error("messages", e))?;
    let mut found = Vec::new();
    let read = async {
        while let Some(message) = messages.next().await {
            let message = message.map_err(|e| log_error("read", e))?;
            let info = message.info().map_err(|e| log_error("info", e))?;
            let (sequence, pending) = (info.stream_sequence, info.pending);
            match decode::<TemplateCaptured>(&message.payload) {
                Ok(captured) => found.push((sequence, captured)),
                Err(err) => tracing::warn!(error = %err, "undecodable capture announcement"),
            }
            if pending == 0 {
                break;
            }
        }
        Ok::<_, MeshError>(())
    };
    match tokio::time::timeout(within, read).await {
        Ok(result) => result?,
        Err(_) => tracing::warn!(
            read = found.len(),
            "capture announcements: stopped reading after {within:?}"
        ),
    }
    found.sort_by_key(|(sequence, _)| std::cmp::Reverse(*sequence));
    Ok(found.into_iter().map(|(_, captured)| captured).collect())
}
