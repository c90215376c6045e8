//! NATS plumbing every service uses: connecting with retry, and MessagePack request/reply
//! that always has a deadline and carries trace headers (here); noticing reconnects
//! ([`reconnects`]), serving a subscription ([`serve`]), trace context in headers
//! ([`trace_context`]), requests for work that must not be lost ([`unanswered`]) and payloads
//! larger than one message ([`chunked`]). Blobs: `stores::blob_store`.
pub mod auth;
pub mod chunked;
pub mod reconnects;
pub mod serve;
#[cfg(feature = "certs")]
pub mod tls;
pub mod trace_context;
pub mod unanswered;

use std::time::Duration;

use async_nats::{Client, HeaderMap, Message, RequestErrorKind};
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::MeshError;
use crate::nats::trace_context::headers_for;
use crate::process::metrics::NatsMetrics;
use crate::wire::messages::{decode, encode};
use crate::wire::subjects::ANSWER_WITHIN_HEADER;

/// Connect to NATS anonymously, without TLS: [`connect_as`] with no [`NatsSecurity`].
pub async fn connect(url: &str, name: &str, give_up_after: Duration) -> Result<Client, MeshError> {
    connect_as(url, name, give_up_after, NatsSecurity::default()).await
}

/// How a service proves who it is to NATS, and how it checks the server is the mesh's.
#[derive(Debug, Clone, Copy, Default)]
pub struct NatsSecurity<'a> {
    /// User and password (`auth`: one user per service kind); None: anonymously.
    pub credentials: Option<(&'a str, &'a str)>,
    /// CA certificate (PEM) the server's certificate must be signed by; set, the connection
    /// must be TLS (`tls://` or a server that requires it) and a server without that CA's
    /// signature is refused.
    pub ca_file: Option<&'a std::path::Path>,
}

/// Connect to NATS as `security` says, retrying with capped exponential backoff for up to
/// `give_up_after` (services often start before the server in compose). `name` shows in
/// `nats server report`.
pub async fn connect_as(
    url: &str,
    name: &str,
    give_up_after: Duration,
    security: NatsSecurity<'_>,
) -> Result<Client, MeshError> {
    if let Some(ca) = security.ca_file {
        // A missing file is a configuration error: no retry makes it appear.
        if let Err(e) = std::fs::metadata(ca) {
            return Err(MeshError::Config(format!(
                "--nats-ca-file {}: {e}",
                ca.display()
            )));
        }
    }
    let start = tokio::time::Instant::now();
    let mut delay = Duration::from_millis(100);
    let mut attempts = 0u32;
    // A cluster is given as comma-separated URLs; async-nats parses a single `&str` as one URL.
    let servers: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    loop {
        attempts += 1;
        let first_connect = reconnects::FirstConnect::before_connecting();
        let mut options = match security.credentials {
            Some((user, password)) => {
                async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
            }
            None => async_nats::ConnectOptions::new(),
        };
        if let Some(ca) = security.ca_file {
            options = options
                .add_root_certificates(ca.to_path_buf())
                .require_tls(true);
        }
        let result = options
            .name(name)
            .connection_timeout(Duration::from_secs(2))
            // Calls in flight and watches try again once connected again (`reconnects`).
            .event_callback(|event| async move { on_connection_event(&event) })
            .connect(servers.as_slice())
            .await;
        match result {
            Ok(client) => {
                first_connect.counted().await;
                return Ok(client);
            }
            Err(source) if start.elapsed() + delay >= give_up_after => {
                return Err(MeshError::Connect {
                    url: url.to_string(),
                    attempts,
                    source,
                })
            }
            Err(err) => {
                tracing::warn!(%url, attempts, error = %err, "NATS not reachable yet; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Counts a client's connection event in `diffmesh_nats_connection_events_total{event}`,
/// logs it, and tells `reconnects` of every connect.
fn on_connection_event(event: &async_nats::Event) {
    use async_nats::Event;
    let label = connection_event_label(event);
    NatsMetrics::global()
        .connection_events
        .with_label_values(&[label])
        .inc();
    match event {
        Event::Connected => {
            reconnects::note_connect();
            tracing::info!("NATS connected");
        }
        Event::Draining | Event::Closed => tracing::info!(%event, "NATS connection event"),
        _ => tracing::warn!(%event, "NATS connection event"),
    }
}

/// The `event` label of a connection event (`metrics::NATS_CONNECTION_EVENTS`).
fn connection_event_label(event: &async_nats::Event) -> &'static str {
    use async_nats::Event;
    match event {
        Event::Connected => "connected",
        Event::Disconnected => "disconnected",
        Event::LameDuckMode => "lame_duck_mode",
        Event::Draining => "draining",
        Event::Closed => "closed",
        Event::SlowConsumer(_) => "slow_consumer",
        Event::ServerError(_) => "server_error",
        Event::ClientError(_) => "client_error",
    }
}

/// Send `req` as MessagePack on `subject` and decode the reply, failing after `timeout`.
/// The current span's trace context rides in the headers; the round trip is recorded in
/// `diffmesh_nats_request_duration_seconds{subject}` (`metrics::NatsMetrics`). A request in
/// flight when NATS reconnects is sent again within the same deadline, and one that finds no
/// responder is sent again for up to [`NO_RESPONDERS_GRACE`] (both counted in
/// `diffmesh_nats_request_resends_total{subject, reason}`), so every responder must allow a
/// request to arrive twice: ours are pure or deduplicate by job id.
pub async fn request_msgpack<Req, Resp>(
    client: &Client,
    subject: &str,
    req: &Req,
    timeout: Duration,
) -> Result<Resp, MeshError>
where
    Req: Serialize,
    Resp: DeserializeOwned,
{
    request_with_headers(client, subject, headers_for(None), req, timeout).await
}

/// [`request_msgpack`] that also sets the job id header (`subjects::JOB_ID_HEADER`).
pub async fn request_msgpack_job<Req, Resp>(
    client: &Client,
    subject: &str,
    job_id: &str,
    req: &Req,
    timeout: Duration,
) -> Result<Resp, MeshError>
where
    Req: Serialize,
    Resp: DeserializeOwned,
{
    request_with_headers(client, subject, headers_for(Some(job_id)), req, timeout).await
}

async fn request_with_headers<Req, Resp>(
    client: &Client,
    subject: &str,
    headers: HeaderMap,
    req: &Req,
    timeout: Duration,
) -> Result<Resp, MeshError>
where
    Req: Serialize,
    Resp: DeserializeOwned,
{
    let payload = Bytes::from(encode(req)?);
    let started = std::time::Instant::now();
    let deadline = tokio::time::Instant::now() + timeout;
    let grace_end = deadline.min(tokio::time::Instant::now() + NO_RESPONDERS_GRACE);
    // Taken up front so each subject's counters are exported at 0 before the first resend.
    let resends = |reason: &str| {
        NatsMetrics::global()
            .request_resends
            .with_label_values(&[subject, reason])
    };
    let (after_reconnect, after_no_responders) = (resends("reconnect"), resends("no_responders"));
    let result = loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let mut headers = headers.clone();
        headers.insert(ANSWER_WITHIN_HEADER, left.as_millis().to_string().as_str());
        let request = async_nats::Request::new()
            .payload(payload.clone())
            .headers(headers)
            .timeout(Some(left));
        match sent_until_reconnect(client, subject, request).await {
            Sent::Answered(result) => {
                let result = result.map_err(|source| request_error(subject, timeout, source));
                match result {
                    // Responders resubscribe after their own reconnect (a restarted server,
                    // a lost cluster node) or come up again: no responder for a moment is not
                    // yet a missing service (seen: edits failed on a server restart).
                    Err(MeshError::NoResponders { .. })
                        if tokio::time::Instant::now() + RESEND_DELAY < grace_end =>
                    {
                        after_no_responders.inc();
                        tokio::time::sleep(RESEND_DELAY).await;
                    }
                    done => break done.and_then(|message| Ok(decode(&message.payload)?)),
                }
            }
            // The request may have gone into the dropped connection, and its reply would then
            // never come: it waited out its whole timeout (seen in the node-crash runs).
            Sent::Reconnected if !left.is_zero() => {
                tracing::info!(
                    subject,
                    "NATS reconnected during the request; sending it again"
                );
                after_reconnect.inc();
            }
            Sent::Reconnected => {
                break Err(MeshError::Timeout {
                    subject: subject.to_string(),
                    timeout,
                })
            }
        }
    };
    record_round_trip(subject, started, result.as_ref().err());
    result
}

/// How long the caller of a request waits for its answer, as it said in
/// [`ANSWER_WITHIN_HEADER`]; `None` when it did not say (or said nonsense).
pub fn answer_within(headers: Option<&HeaderMap>) -> Option<Duration> {
    let ms = headers?.get(ANSWER_WITHIN_HEADER)?.as_str().parse().ok()?;
    Some(Duration::from_millis(ms))
}

/// How long a request that finds no responder is sent again (within its timeout) before
/// `NoResponders` is its answer: responders resubscribe within milliseconds of a reconnect.
pub const NO_RESPONDERS_GRACE: Duration = Duration::from_secs(2);

/// Pause before sending again a request that found no responders.
const RESEND_DELAY: Duration = Duration::from_millis(100);

/// How one send of a request ended.
enum Sent {
    Answered(Result<Message, async_nats::RequestError>),
    /// The client connected again while the request waited for its reply.
    Reconnected,
}

/// Send `request` and wait for its reply, or until a client of this process reconnects.
async fn sent_until_reconnect(
    client: &Client,
    subject: &str,
    request: async_nats::Request,
) -> Sent {
    let reconnects = reconnects::Reconnects::from_now();
    tokio::select! {
        result = client.send_request(subject.to_string(), request) => Sent::Answered(result),
        () = reconnects.next() => Sent::Reconnected,
    }
}

fn request_error(subject: &str, timeout: Duration, source: async_nats::RequestError) -> MeshError {
    match source.kind() {
        RequestErrorKind::TimedOut => MeshError::Timeout {
            subject: subject.to_string(),
            timeout,
        },
        RequestErrorKind::NoResponders => MeshError::NoResponders {
            subject: subject.to_string(),
        },
        _ => MeshError::Request {
            subject: subject.to_string(),
            source,
        },
    }
}

/// `diffmesh_nats_request_duration_seconds{subject}` for answered requests, or
/// `diffmesh_nats_request_failures_total{subject, reason}` for the others. Timeouts stay out
/// of the histogram: their duration is the deadline, not a round trip.
fn record_round_trip(subject: &str, started: std::time::Instant, error: Option<&MeshError>) {
    let metrics = NatsMetrics::global();
    match error {
        None => metrics
            .request_duration
            .with_label_values(&[subject])
            .observe(started.elapsed().as_secs_f64()),
        Some(err) => metrics
            .request_failures
            .with_label_values(&[subject, err.reason()])
            .inc(),
    }
}

/// Publish `msg` as MessagePack with trace headers (and the job id header when given).
pub async fn publish_msgpack<T: Serialize>(
    client: &Client,
    subject: impl Into<String>,
    job_id: Option<&str>,
    msg: &T,
) -> Result<(), MeshError> {
    let payload = Bytes::from(encode(msg)?);
    client
        .publish_with_headers(subject.into(), headers_for(job_id), payload)
        .await?;
    Ok(())
}

/// Answer a request message with `resp` (MessagePack). A message without a reply subject was
/// published fire-and-forget; answering it is a no-op.
pub async fn reply_msgpack<T: Serialize>(
    client: &Client,
    request: &Message,
    resp: &T,
) -> Result<(), MeshError> {
    let Some(reply) = request.reply.clone() else {
        return Ok(());
    };
    let job_id = crate::nats::trace_context::job_id_of(request.headers.as_ref());
    let payload = Bytes::from(encode(resp)?);
    client
        .publish_with_headers(reply, headers_for(job_id.as_deref()), payload)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::metrics::NATS_CONNECTION_EVENTS;

    #[tokio::test]
    async fn a_request_tells_its_responder_how_long_the_answer_is_awaited() {
        use futures::StreamExt;
        let server = crate::testing::NatsServer::start();
        // Not through `connect`, whose connects move the process's reconnect signal (the
        // `reconnects` test counts on being the only test that does).
        let client = async_nats::connect(server.url()).await.unwrap();
        let mut sub = client.subscribe("answer.within").await.unwrap();
        client.flush().await.unwrap();
        let responder = client.clone();
        tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                let waits = answer_within(msg.headers.as_ref()).map(|d| d.as_millis() as u64);
                reply_msgpack(&responder, &msg, &waits).await.unwrap();
            }
        });
        let waits: Option<u64> =
            request_msgpack(&client, "answer.within", &(), Duration::from_secs(7))
                .await
                .unwrap();
        let waits = waits.expect("the request said how long it waits");
        assert!((6_000..=7_000).contains(&waits), "{waits} ms");
        assert_eq!(answer_within(None), None);
    }

    #[test]
    fn every_connection_event_counts_under_its_own_label() {
        use async_nats::Event;
        let events = [
            Event::Connected,
            Event::Disconnected,
            Event::LameDuckMode,
            Event::Draining,
            Event::Closed,
            Event::SlowConsumer(7),
        ];
        let labels: Vec<_> = events.iter().map(connection_event_label).collect();
        for label in &labels {
            assert!(
                NATS_CONNECTION_EVENTS.contains(label),
                "{label} is not listed"
            );
        }
        let distinct: std::collections::BTreeSet<_> = labels.iter().collect();
        assert_eq!(distinct.len(), labels.len(), "two events share a label");

        // Not a connect: counting it must not move `reconnects` (the crate's connect test
        // relies on that). No test of this crate has a slow consumer.
        let counter = NatsMetrics::global()
            .connection_events
            .with_label_values(&["slow_consumer"]);
        let before = counter.get();
        on_connection_event(&Event::SlowConsumer(7));
        assert_eq!(counter.get(), before + 1);
    }
}
