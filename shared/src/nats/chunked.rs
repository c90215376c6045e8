//! Payloads larger than one NATS message, sent as numbered chunks.
//!
//! A ControlNet step's inputs and residuals grow with the image (FLUX.1 at 1024x1024: about
//! 25 MB of residuals per ControlNet block in bf16), past the server's `max_payload`. Each chunk
//! carries [`CHUNK_HEADER`] = `i/n`; all chunks of one payload go to one subscriber (a worker's
//! own subject, or the caller's inbox), so an [`Assembler`] keyed by the reply subject puts them
//! back together. A payload that fits goes as one message with the header `0/1`.
use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::{Client, HeaderMap, Message, StatusCode, Subject};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;

use crate::error::MeshError;

/// `index/count` of a chunk (0-based index).
pub const CHUNK_HEADER: &str = "diffmesh-chunk";
/// Left of `max_payload` for headers and protocol framing.
const HEADROOM: usize = 16 << 10;
/// Incomplete payloads older than this are dropped (their sender gave up or died).
const PARTIAL_MAX_AGE: Duration = Duration::from_secs(60);

/// The largest chunk `client` may send.
pub fn chunk_bytes(client: &Client) -> usize {
    client
        .server_info()
        .max_payload
        .saturating_sub(HEADROOM)
        .max(4096)
}

/// Publish `payload` to `subject` in chunks of at most `chunk` bytes, each with `headers` and
/// [`CHUNK_HEADER`], and the reply subject when given.
pub async fn publish_chunked(
    client: &Client,
    subject: &str,
    reply: Option<&str>,
    headers: &HeaderMap,
    payload: Bytes,
    chunk: usize,
) -> Result<(), MeshError> {
    let chunk = chunk.max(1);
    let count = payload.len().div_ceil(chunk).max(1);
    for index in 0..count {
        let part = payload
            .slice((index * chunk).min(payload.len())..((index + 1) * chunk).min(payload.len()));
        let mut h = headers.clone();
        h.insert(CHUNK_HEADER, format!("{index}/{count}").as_str());
        match reply {
            Some(reply) => {
                client
                    .publish_with_reply_and_headers(subject.to_string(), reply.to_string(), h, part)
                    .await?
            }
            None => {
                client
                    .publish_with_headers(subject.to_string(), h, part)
                    .await?
            }
        }
    }
    Ok(())
}

/// A whole payload put back together.
#[derive(Debug)]
pub struct Complete {
    pub payload: Bytes,
    /// The headers of its first chunk.
    pub headers: Option<HeaderMap>,
    pub reply: Option<Subject>,
}

struct Partial {
    parts: Vec<Option<Bytes>>,
    got: usize,
    bytes: usize,
    started: Instant,
    headers: Option<HeaderMap>,
}

/// Puts chunked payloads back together, several in flight at once (keyed by the reply
/// subject, else the subject). A message without [`CHUNK_HEADER`] is a payload of its own.
pub struct Assembler {
    partial: HashMap<String, Partial>,
    max_bytes: usize,
}

impl Assembler {
    /// Payloads above `max_bytes` are refused.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            partial: HashMap::new(),
            max_bytes,
        }
    }

    /// Payloads still incomplete.
    pub fn pending(&self) -> usize {
        self.partial.len()
    }

    /// Take one message; the payload once its last chunk is in. An error names what was wrong
    /// with the message (its payload is dropped; the sender's request then times out).
    pub fn push(&mut self, msg: Message) -> Result<Option<Complete>, String> {
        let Some((index, count)) = chunk_of(msg.headers.as_ref())? else {
            return self.whole(msg).map(Some);
        };
        if count == 1 {
            return self.whole(msg).map(Some);
        }
        let key = msg
            .reply
            .as_ref()
            .map_or_else(|| msg.subject.to_string(), |r| r.to_string());
        self.partial
            .retain(|_, p| p.started.elapsed() < PARTIAL_MAX_AGE);
        let p = self.partial.entry(key.clone()).or_insert_with(|| Partial {
            parts: vec![None; count],
            got: 0,
            bytes: 0,
            started: Instant::now(),
            headers: None,
        });
        if p.parts.len() != count {
            let sent = p.parts.len();
            self.partial.remove(&key);
            return Err(format!(
                "chunk {index}/{count} of a payload sent in {sent} chunks"
            ));
        }
        if p.parts[index].is_none() {
            p.bytes += msg.payload.len();
            p.got += 1;
        }
        if p.bytes > self.max_bytes {
            self.partial.remove(&key);
            return Err(format!(
                "payload above the limit of {} bytes",
                self.max_bytes
            ));
        }
        if index == 0 {
            p.headers = msg.headers.clone();
        }
        p.parts[index] = Some(msg.payload);
        if p.got < count {
            return Ok(None);
        }
        let p = self.partial.remove(&key).expect("just filled");
        let mut out = BytesMut::with_capacity(p.bytes);
        for part in p.parts.into_iter().flatten() {
            out.extend_from_slice(&part);
        }
        Ok(Some(Complete {
            payload: out.freeze(),
            headers: p.headers,
            reply: msg.reply,
        }))
    }

    fn whole(&self, msg: Message) -> Result<Complete, String> {
        if msg.payload.len() > self.max_bytes {
            return Err(format!(
                "payload above the limit of {} bytes",
                self.max_bytes
            ));
        }
        Ok(Complete {
            payload: msg.payload,
            headers: msg.headers,
            reply: msg.reply,
        })
    }
}

/// `(index, count)` from [`CHUNK_HEADER`]; `None` when the message has none.
fn chunk_of(headers: Option<&HeaderMap>) -> Result<Option<(usize, usize)>, String> {
    let Some(value) = headers.and_then(|h| h.get(CHUNK_HEADER)) else {
        return Ok(None);
    };
    let bad = || format!("bad {CHUNK_HEADER} header `{}`", value.as_str());
    let (i, n) = value.as_str().split_once('/').ok_or_else(bad)?;
    let (i, n): (usize, usize) = (i.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?);
    if n == 0 || i >= n {
        return Err(bad());
    }
    Ok(Some((i, n)))
}

/// Send `payload` to `subject` (chunked as needed) and wait up to `timeout` for the whole
/// answer (which the responder sends with [`publish_chunked`] to the reply subject).
pub async fn request_chunked(
    client: &Client,
    subject: &str,
    headers: &HeaderMap,
    payload: Bytes,
    timeout: Duration,
    max_reply_bytes: usize,
) -> Result<Bytes, MeshError> {
    let chunk = chunk_bytes(client);
    request_in_chunks(
        client,
        subject,
        headers,
        payload,
        timeout,
        max_reply_bytes,
        chunk,
    )
    .await
}

/// [`request_chunked`] with chunks of at most `chunk` bytes.
pub async fn request_in_chunks(
    client: &Client,
    subject: &str,
    headers: &HeaderMap,
    payload: Bytes,
    timeout: Duration,
    max_reply_bytes: usize,
    chunk: usize,
) -> Result<Bytes, MeshError> {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await?;
    let deadline = tokio::time::Instant::now() + timeout;
    let timed_out = || MeshError::Timeout {
        subject: subject.to_string(),
        timeout,
    };
    tokio::time::timeout_at(
        deadline,
        publish_chunked(client, subject, Some(&inbox), headers, payload, chunk),
    )
    .await
    .map_err(|_| timed_out())??;
    let mut assembler = Assembler::new(max_reply_bytes);
    loop {
        let msg = match tokio::time::timeout_at(deadline, sub.next()).await {
            Ok(Some(msg)) => msg,
            Ok(None) => return Err(timed_out()),
            Err(_) => return Err(timed_out()),
        };
        if msg.status == Some(StatusCode::NO_RESPONDERS) {
            return Err(MeshError::NoResponders {
                subject: subject.to_string(),
            });
        }
        match assembler.push(msg) {
            Ok(Some(done)) => return Ok(done.payload),
            Ok(None) => {}
            Err(reason) => {
                return Err(MeshError::BlobRead {
                    key: subject.to_string(),
                    reason,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::NatsServer;

    #[test]
    fn chunk_headers_are_checked() {
        let mut h = HeaderMap::new();
        assert_eq!(chunk_of(Some(&h)).unwrap(), None);
        h.insert(CHUNK_HEADER, "2/3");
        assert_eq!(chunk_of(Some(&h)).unwrap(), Some((2, 3)));
        for bad in ["3/3", "1", "a/2", "0/0"] {
            h.insert(CHUNK_HEADER, bad);
            assert!(chunk_of(Some(&h)).is_err(), "{bad} accepted");
        }
    }

    /// A payload of many chunks goes out and its echo comes back whole, with two requests
    /// interleaved at the responder; one above the limit is refused.
    #[tokio::test]
    async fn payloads_larger_than_a_message_round_trip() {
        let server = NatsServer::start();
        let client = async_nats::connect(server.url()).await.unwrap();
        let mut sub = client.subscribe("echo").await.unwrap();
        let responder = client.clone();
        tokio::spawn(async move {
            let mut assembler = Assembler::new(1 << 20);
            while let Some(msg) = sub.next().await {
                if let Ok(Some(done)) = assembler.push(msg) {
                    let reply = done.reply.unwrap().to_string();
                    publish_chunked(
                        &responder,
                        &reply,
                        None,
                        &HeaderMap::new(),
                        done.payload,
                        1000,
                    )
                    .await
                    .unwrap();
                }
            }
        });
        client.flush().await.unwrap();
        let h = HeaderMap::new();
        let payload =
            |seed: u8| Bytes::from((0..5000u32).map(|i| (i as u8) ^ seed).collect::<Vec<_>>());
        let (a, b) = tokio::join!(
            request_in_chunks(
                &client,
                "echo",
                &h,
                payload(1),
                Duration::from_secs(5),
                1 << 20,
                700
            ),
            request_in_chunks(
                &client,
                "echo",
                &h,
                payload(2),
                Duration::from_secs(5),
                1 << 20,
                700
            ),
        );
        assert_eq!(a.unwrap(), payload(1));
        assert_eq!(b.unwrap(), payload(2));
        let small = request_chunked(&client, "echo", &h, payload(3), Duration::from_secs(5), 100);
        assert!(small.await.is_err());
        let none = request_chunked(
            &client,
            "nobody",
            &h,
            payload(4),
            Duration::from_secs(5),
            1 << 20,
        );
        assert!(matches!(none.await, Err(MeshError::NoResponders { .. })));
    }
}
