//! NATS plumbing every service uses: connecting with retry, MessagePack request/reply that
//! always has a deadline and carries trace headers, and the JetStream object store for blobs.
use std::time::Duration;

use async_nats::jetstream::{self, object_store};
use async_nats::{Client, HeaderMap, Message, RequestErrorKind};
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::AsyncReadExt;

use crate::error::MeshError;
use crate::jetstream_layout;
use crate::messages::{decode, encode};
use crate::metrics::NatsMetrics;
use crate::trace_context::headers_for;
use crate::transient;

/// Connect to NATS, retrying with capped exponential backoff for up to `give_up_after`
/// (services often start before the server in compose). `name` shows in `nats server report`.
pub async fn connect(url: &str, name: &str, give_up_after: Duration) -> Result<Client, MeshError> {
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
        let result = async_nats::ConnectOptions::new()
            .name(name)
            .connection_timeout(Duration::from_secs(2))
            .connect(servers.as_slice())
            .await;
        match result {
            Ok(client) => return Ok(client),
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

/// Send `req` as MessagePack on `subject` and decode the reply, failing after `timeout`.
/// The current span's trace context rides in the headers; the round trip is recorded in
/// `diffmesh_nats_request_duration_seconds{subject}` (`metrics::NatsMetrics`).
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
    let request = async_nats::Request::new()
        .payload(payload)
        .headers(headers)
        .timeout(Some(timeout));
    let started = std::time::Instant::now();
    let result = client
        .send_request(subject.to_string(), request)
        .await
        .map_err(|source| match source.kind() {
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
        })
        .and_then(|message| Ok(decode(&message.payload)?));
    record_round_trip(subject, started, result.as_ref().err());
    result
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
    let job_id = crate::trace_context::job_id_of(request.headers.as_ref());
    let payload = Bytes::from(encode(resp)?);
    client
        .publish_with_headers(reply, headers_for(job_id.as_deref()), payload)
        .await?;
    Ok(())
}

/// Bytes by key in a JetStream object store bucket (images, masks, prepared tensors, results).
#[derive(Clone)]
pub struct BlobStore {
    store: object_store::ObjectStore,
    bucket: String,
    stall_timeout: Duration,
    /// How long a failing put or delete is tried again (default [`transient::ELECTION_WINDOW`]).
    retry_window: Duration,
}

/// How long a blob read may go without receiving a byte before it fails. An object deleted
/// while it is being read (a template removed during an edit that reads its image) leaves the
/// chunk subscription waiting for chunks that never come; this turns that into an error.
pub const DEFAULT_BLOB_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long an attempt of a blob read waits for the first byte before the next attempt. A read
/// streams through a fresh ephemeral consumer; on a cluster that has just lost a node, the
/// consumer may be placed on the lost node and deliver nothing (on a three-node test cluster,
/// 9 of 21 attempts in the first seconds; async-nats gives up on them after 10 s, and a
/// request failed). A new consumer is placed afresh. A healthy first chunk takes milliseconds.
const BLOB_FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(1);
/// A read that fails before its first byte is tried again until this long after it started.
const BLOB_RETRY_WINDOW: Duration = Duration::from_secs(15);

/// Read `reader` to its end into `buf`, failing when no byte arrives for `first` (before the
/// first byte) or `stall` (after it; the object store's reader waits forever for chunks of an
/// object deleted mid-read).
async fn read_to_end_or_stall<R: tokio::io::AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    key: &str,
    first: Duration,
    stall: Duration,
) -> Result<(), MeshError> {
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let stall = if buf.is_empty() { first } else { stall };
        let n = tokio::time::timeout(stall, reader.read(&mut chunk))
            .await
            .map_err(|_| MeshError::BlobStalled {
                key: key.to_string(),
                after: stall,
                read: buf.len(),
            })??;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

impl BlobStore {
    /// Open `subjects::BLOB_BUCKET`, creating it when missing.
    pub async fn open(js: &jetstream::Context) -> Result<Self, MeshError> {
        Self::open_with(js, &jetstream_layout::BLOBS).await
    }

    /// Open (get, or create with one replica) the object store of `spec`. Creating races are
    /// harmless: if another service created it meanwhile, the existing bucket is used.
    pub async fn open_with(
        js: &jetstream::Context,
        spec: &jetstream_layout::Spec,
    ) -> Result<Self, MeshError> {
        spec.get_or_create(js).await?;
        let store = js.get_object_store(spec.name.as_ref()).await.map_err(|e| {
            MeshError::JetStreamLayout {
                name: spec.stream_name(),
                reason: format!("open object store: {e}"),
            }
        })?;
        Ok(Self {
            store,
            bucket: spec.name.to_string(),
            stall_timeout: DEFAULT_BLOB_STALL_TIMEOUT,
            retry_window: transient::ELECTION_WINDOW,
        })
    }

    /// Fail reads that receive nothing for `stall` (default [`DEFAULT_BLOB_STALL_TIMEOUT`]).
    pub fn with_stall_timeout(mut self, stall: Duration) -> Self {
        self.stall_timeout = stall;
        self
    }

    /// Try failing puts and deletes again for `window` instead of
    /// [`transient::ELECTION_WINDOW`].
    pub fn with_retry_window(mut self, window: Duration) -> Self {
        self.retry_window = window;
        self
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// Store `data` under `key` (keys use `[-/_=.a-zA-Z0-9]`), replacing any previous object.
    /// Tried again while the bucket has no leader ([`transient`]): a put that fails midway is
    /// repeated whole (the object store replaces a name's chunks on each put).
    pub async fn put(&self, key: &str, data: &[u8]) -> Result<(), MeshError> {
        let settled =
            |e: &object_store::PutError| e.kind() == object_store::PutErrorKind::InvalidName;
        transient::retried("blob.put", self.retry_window, settled, || async {
            let mut reader = data;
            self.store.put(key, &mut reader).await
        })
        .await?;
        Ok(())
    }

    /// Read the object under `key` whole.
    pub async fn get(&self, key: &str) -> Result<Vec<u8>, MeshError> {
        self.get_limited(key, usize::MAX).await
    }

    /// Read the object under `key`, refusing objects above `limit` bytes before reading them.
    /// A read that fails before its first byte is tried again (a fresh consumer; see
    /// [`BLOB_FIRST_BYTE_TIMEOUT`]). Fails with [`MeshError::BlobStalled`] when the object stops
    /// arriving (deleted mid-read).
    pub async fn get_limited(&self, key: &str, limit: usize) -> Result<Vec<u8>, MeshError> {
        let first = BLOB_FIRST_BYTE_TIMEOUT.min(self.stall_timeout);
        let settled = |err: &MeshError| !Self::retry_read(err);
        transient::retried("blob.get", BLOB_RETRY_WINDOW, settled, || {
            self.read_once(key, limit, first)
        })
        .await
    }

    /// Failures of a read that a fresh consumer may not repeat: nothing arrived, the client's
    /// reader gave up, or opening the object failed otherwise than "not found" (its info or
    /// consumer request timed out).
    fn retry_read(err: &MeshError) -> bool {
        matches!(
            err,
            MeshError::BlobStalled { read: 0, .. } | MeshError::Io(_) | MeshError::BlobGet(_)
        )
    }

    async fn read_once(
        &self,
        key: &str,
        limit: usize,
        first: Duration,
    ) -> Result<Vec<u8>, MeshError> {
        let stalled = |read| MeshError::BlobStalled {
            key: key.to_string(),
            after: self.stall_timeout,
            read,
        };
        let opened = tokio::time::timeout(self.stall_timeout, self.store.get(key))
            .await
            .map_err(|_| stalled(0))?;
        let mut object = opened.map_err(|err| {
            if err.kind() == object_store::GetErrorKind::NotFound {
                MeshError::BlobNotFound {
                    key: key.to_string(),
                }
            } else {
                MeshError::BlobGet(err)
            }
        })?;
        let size = object.info.size;
        if size > limit {
            return Err(MeshError::BlobTooLarge {
                key: key.to_string(),
                size,
                limit,
            });
        }
        let mut buf = Vec::with_capacity(size);
        read_to_end_or_stall(&mut object, &mut buf, key, first, self.stall_timeout).await?;
        Ok(buf)
    }

    /// Remove the object under `key`; removing a missing key is not an error.
    pub async fn delete(&self, key: &str) -> Result<(), MeshError> {
        let settled = |e: &object_store::DeleteError| {
            matches!(
                e.kind(),
                object_store::DeleteErrorKind::NotFound
                    | object_store::DeleteErrorKind::InvalidName
            )
        };
        let deleted = transient::retried("blob.delete", self.retry_window, settled, || {
            self.store.delete(key)
        })
        .await;
        match deleted {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == object_store::DeleteErrorKind::NotFound => Ok(()),
            Err(err) => Err(err.into()),
        }
    }
}

/// Object-store key of a blob belonging to one job (`<job_id>/<name>`), so one job's blobs
/// sort together and can be listed or cleaned up by prefix.
pub fn blob_key(job_id: &str, name: &str) -> String {
    format!("{job_id}/{name}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn a_read_that_stops_arriving_fails_instead_of_hanging() {
        let (mut writer, mut reader) = tokio::io::duplex(1024);
        writer.write_all(b"abc").await.unwrap();
        // The writer stays open: the reader gets 3 bytes and then nothing, like the chunk
        // subscription of an object deleted mid-read.
        let mut buf = Vec::new();
        let stall = Duration::from_millis(50);
        let err = read_to_end_or_stall(&mut reader, &mut buf, "t/image", stall, stall)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, MeshError::BlobStalled { key, read: 3, .. } if key == "t/image"),
            "{err}"
        );
        assert_eq!(err.reason(), "blob_stalled");
        drop(writer);
    }

    #[tokio::test]
    async fn a_complete_read_returns_every_byte() {
        let (mut writer, mut reader) = tokio::io::duplex(1 << 20);
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        writer.write_all(&data).await.unwrap();
        drop(writer);
        let mut buf = Vec::new();
        let five = Duration::from_secs(5);
        read_to_end_or_stall(&mut reader, &mut buf, "k", five, five)
            .await
            .unwrap();
        assert_eq!(buf, data);
    }

    #[tokio::test]
    async fn the_first_byte_has_its_own_deadline() {
        let (mut writer, mut reader) = tokio::io::duplex(1024);
        let (first, stall) = (Duration::from_millis(50), Duration::from_secs(5));
        // Nothing arrives: the short first-byte deadline ends the read.
        let mut buf = Vec::new();
        let err = read_to_end_or_stall(&mut reader, &mut buf, "k", first, stall)
            .await
            .unwrap_err();
        assert!(matches!(err, MeshError::BlobStalled { read: 0, after, .. } if after == first));
        assert!(BlobStore::retry_read(&err));
        // Once bytes flow, a pause longer than the first-byte deadline is no stall.
        let pauser = tokio::spawn(async move {
            writer.write_all(b"ab").await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            writer.write_all(b"cd").await.unwrap();
        });
        read_to_end_or_stall(&mut reader, &mut buf, "k", first, stall)
            .await
            .unwrap();
        pauser.await.unwrap();
        assert_eq!(buf, b"abcd");
        // A read that stalls after its first bytes is not read again (the object went away).
        let partial = MeshError::BlobStalled {
            key: "k".into(),
            after: stall,
            read: 2,
        };
        assert!(!BlobStore::retry_read(&partial));
    }
}
