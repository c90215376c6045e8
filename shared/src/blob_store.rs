//! Blobs (uploads, masks, prepared tensors, results, template images, activation caches) in
//! JetStream object stores, read and written so that a request survives a NATS node loss.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, object_store};
use base64::engine::general_purpose::URL_SAFE;
use base64::Engine;
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;

use crate::error::MeshError;
use crate::jetstream_layout;
use crate::transient;

/// Bytes by key in a JetStream object store bucket (images, masks, prepared tensors, results).
#[derive(Clone)]
pub struct BlobStore {
    store: object_store::ObjectStore,
    /// The stream behind `store`, for chunk reads by message get.
    stream: jetstream::stream::Stream,
    bucket: String,
    stall_timeout: Duration,
    /// How long a failing put or delete is tried again (default [`transient::ELECTION_WINDOW`]).
    retry_window: Duration,
    /// Until when reads go to the leader straight away (after a consumer read got nothing),
    /// shared by the clones of a store.
    leader_reads: LeaderReads,
}

/// Until when a store's reads skip the consumer, in ms since [`LeaderReads::origin`].
#[derive(Clone)]
struct LeaderReads {
    origin: Instant,
    until_ms: Arc<AtomicU64>,
}

impl LeaderReads {
    fn new() -> Self {
        Self {
            origin: Instant::now(),
            until_ms: Arc::new(AtomicU64::new(0)),
        }
    }

    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    fn active(&self) -> bool {
        self.now_ms() < self.until_ms.load(Ordering::Relaxed)
    }

    fn start(&self) {
        let until = self.now_ms() + LEADER_READS_AFTER_A_STALL.as_millis() as u64;
        self.until_ms.fetch_max(until, Ordering::Relaxed);
    }
}

/// How long a blob read may go without receiving a byte before it fails. An object deleted
/// while it is being read (a template removed during an edit that reads its image) leaves the
/// chunk subscription waiting for chunks that never come; this turns that into an error.
pub const DEFAULT_BLOB_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a read through a consumer waits for the first byte before it reads from the
/// stream leader instead. A consumer read streams through a fresh ephemeral consumer; on a
/// cluster that has just lost a node, the consumer may be placed on the lost node for as long
/// as the cluster still counts it (seen: 27 s on a three-node cluster) and deliver nothing. A
/// healthy first chunk takes milliseconds.
const BLOB_FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(1);
/// After a consumer read got nothing, this store reads from the leader straight away for this
/// long: the cluster may go on placing consumers on the lost node (27 s seen), and every read
/// would pay [`BLOB_FIRST_BYTE_TIMEOUT`] again (a request reads several blobs).
const LEADER_READS_AFTER_A_STALL: Duration = Duration::from_secs(30);
/// Reads from the leader are tried again until this long after they started (an election).
const BLOB_RETRY_WINDOW: Duration = Duration::from_secs(15);

fn check_size(key: &str, size: usize, limit: usize) -> Result<(), MeshError> {
    if size > limit {
        return Err(MeshError::BlobTooLarge {
            key: key.to_string(),
            size,
            limit,
        });
    }
    Ok(())
}

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
        let stream = spec.get_or_create(js).await?;
        let store = js.get_object_store(spec.name.as_ref()).await.map_err(|e| {
            MeshError::JetStreamLayout {
                name: spec.stream_name(),
                reason: format!("open object store: {e}"),
            }
        })?;
        Ok(Self {
            store,
            stream,
            bucket: spec.name.to_string(),
            stall_timeout: DEFAULT_BLOB_STALL_TIMEOUT,
            retry_window: transient::ELECTION_WINDOW,
            leader_reads: LeaderReads::new(),
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
    ///
    /// The read streams through a consumer (the fast path: 16 MiB in 40-50 ms against 90-110
    /// ms by message gets, one server). When that fails before its first byte, within
    /// [`BLOB_FIRST_BYTE_TIMEOUT`], the object is read again chunk by chunk with message gets
    /// the stream's leader answers ([`BlobStore::read_from_leader`]), which no consumer
    /// placement can strand, tried again while the stream elects a leader; so are this store's
    /// reads for the next [`LEADER_READS_AFTER_A_STALL`]. Fails with
    /// [`MeshError::BlobStalled`] when the object stops arriving mid-read (deleted).
    pub async fn get_limited(&self, key: &str, limit: usize) -> Result<Vec<u8>, MeshError> {
        if !self.leader_reads.active() {
            let first = BLOB_FIRST_BYTE_TIMEOUT.min(self.stall_timeout);
            match self.read_by_consumer(key, limit, first).await {
                Err(err) if Self::read_again(&err) => {
                    tracing::warn!(key, error = %err, "blob read failed; reading from the stream leader");
                    transient::count_retry("blob.get");
                    self.leader_reads.start();
                }
                done => return done,
            }
        }
        let settled = |err: &MeshError| !Self::read_again(err);
        transient::retried("blob.get_from_leader", BLOB_RETRY_WINDOW, settled, || {
            self.read_from_leader(key, limit)
        })
        .await
    }

    /// Failures a read from the leader may not repeat: nothing arrived, the client's reader
    /// gave up, opening the object failed otherwise than "not found" (its info or consumer
    /// request timed out), or a read from the leader failed (no leader yet, the object
    /// replaced mid-read).
    fn read_again(err: &MeshError) -> bool {
        matches!(
            err,
            MeshError::BlobStalled { read: 0, .. }
                | MeshError::Io(_)
                | MeshError::BlobGet(_)
                | MeshError::BlobRead { .. }
        )
    }

    async fn read_by_consumer(
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
        check_size(key, object.info.size, limit)?;
        let mut buf = Vec::with_capacity(object.info.size);
        read_to_end_or_stall(&mut object, &mut buf, key, first, self.stall_timeout).await?;
        Ok(buf)
    }

    /// Read `key` chunk by chunk with message gets (`$JS.API.STREAM.MSG.GET`, next message of
    /// the object's chunk subject from a sequence on), which only the stream's leader answers:
    /// no consumer, and every acknowledged chunk is there. The bytes are checked against the
    /// object's size and SHA-256 digest.
    pub async fn read_from_leader(&self, key: &str, limit: usize) -> Result<Vec<u8>, MeshError> {
        let failed = |reason: String| MeshError::BlobRead {
            key: key.to_string(),
            reason,
        };
        let not_found = || MeshError::BlobNotFound {
            key: key.to_string(),
        };
        let info = match self.store.info(key).await {
            Ok(info) if info.deleted => return Err(not_found()),
            Ok(info) => info,
            Err(err) if err.kind() == object_store::InfoErrorKind::NotFound => {
                return Err(not_found())
            }
            Err(err) => return Err(failed(format!("object info: {err}"))),
        };
        check_size(key, info.size, limit)?;
        let subject = format!("$O.{}.C.{}", self.bucket, info.nuid);
        let mut buf = Vec::with_capacity(info.size);
        let mut sequence = 1;
        for chunk in 0..info.chunks {
            let message = self
                .stream
                .get_first_raw_message_by_subject(&subject, sequence)
                .await
                .map_err(|err| failed(format!("chunk {chunk} of {}: {err}", info.chunks)))?;
            sequence = message.sequence + 1;
            buf.extend_from_slice(&message.payload);
        }
        if buf.len() != info.size {
            return Err(failed(format!(
                "{} bytes, expected {}",
                buf.len(),
                info.size
            )));
        }
        if let Some(expected) = &info.digest {
            let digest = format!("SHA-256={}", URL_SAFE.encode(Sha256::digest(&buf)));
            if digest != *expected {
                return Err(failed(format!("digest {digest}, expected {expected}")));
            }
        }
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
        assert!(BlobStore::read_again(&err));
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
        assert!(!BlobStore::read_again(&partial));
    }
}
