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
use crate::nats::reconnects::Reconnects;
use crate::stores::jetstream_layout;
use crate::stores::transient;

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
    /// Objects of at most this many chunks are read by message gets (default
    /// [`SMALL_BLOB_CHUNKS`]).
    small_blob_chunks: usize,
    /// The bucket refuses new writes when full (`Spec::discard_old` false): puts check room
    /// first.
    refuses_when_full: bool,
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
/// Objects of at most this many chunks (128 KiB each, the object store's default) are read
/// by message gets, larger ones through a consumer. A message get answers in JSON with the
/// payload in base64, so its cost grows with the chunk: one 4 KiB object by message gets
/// took 0.43 ms and 0.35 ms of server CPU against 1.14 ms and 1.70 ms through a consumer; at
/// one full chunk both took 1.55 ms (server 1.30 against 2.20 ms); at four chunks the
/// consumer wins (docs/BENCHMARKS.md).
pub const SMALL_BLOB_CHUNKS: usize = 1;
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
            small_blob_chunks: SMALL_BLOB_CHUNKS,
            refuses_when_full: !spec.discard_old,
        })
    }

    /// Fail reads that receive nothing for `stall` (default [`DEFAULT_BLOB_STALL_TIMEOUT`]).
    pub fn with_stall_timeout(mut self, stall: Duration) -> Self {
        self.stall_timeout = stall;
        self
    }

    /// Read objects of at most `chunks` chunks by message gets, larger ones through a consumer
    /// (0: every object through a consumer), instead of [`SMALL_BLOB_CHUNKS`].
    pub fn with_small_blob_chunks(mut self, chunks: usize) -> Self {
        self.small_blob_chunks = chunks;
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
        self.check_room(data.len()).await?;
        let settled =
            |e: &object_store::PutError| e.kind() == object_store::PutErrorKind::InvalidName;
        transient::retried("blob.put", self.retry_window, settled, || async {
            let mut reader = data;
            self.store.put(key, &mut reader).await
        })
        .await?;
        Ok(())
    }

    /// Store the file at `path` (`len` bytes) under `key`, read from disk as it is sent: an
    /// upload spooled to a file is never held whole in memory. Tried again from the file's
    /// start as [`BlobStore::put`] is.
    pub async fn put_file(
        &self,
        key: &str,
        path: &std::path::Path,
        len: u64,
    ) -> Result<(), MeshError> {
        self.check_room(usize::try_from(len).unwrap_or(usize::MAX))
            .await?;
        let settled =
            |e: &object_store::PutError| e.kind() == object_store::PutErrorKind::InvalidName;
        transient::retried("blob.put_file", self.retry_window, settled, || async {
            let mut file = tokio::fs::File::open(path).await.map_err(|e| {
                object_store::PutError::with_source(object_store::PutErrorKind::ReadChunks, e)
            })?;
            self.store.put(key, &mut file).await
        })
        .await?;
        Ok(())
    }

    /// In a bucket that refuses writes when full, refuse an object that would not fit before
    /// a chunk of it is written: a put refused midway leaves the chunks it wrote behind,
    /// unreferenced, for good. (Two puts at once may both pass; the server still refuses the
    /// second's overflow.) When the stream cannot be read the put goes ahead.
    async fn check_room(&self, len: usize) -> Result<(), MeshError> {
        if !self.refuses_when_full {
            return Ok(());
        }
        let mut stream = self.stream.clone();
        let Ok(info) = stream.info().await else {
            return Ok(());
        };
        let Ok(bound) = u64::try_from(info.config.max_bytes) else {
            return Ok(()); // -1: unbounded
        };
        // Each chunk is a message with its subject and headers: about 1% more than the data.
        let needed = len as u64 + len as u64 / 100 + 1024;
        if info.state.bytes.saturating_add(needed) > bound {
            return Err(MeshError::StoreFull {
                bucket: self.bucket.clone(),
                stored: info.state.bytes,
                bound,
                needed,
            });
        }
        Ok(())
    }

    /// Read the object under `key` whole.
    pub async fn get(&self, key: &str) -> Result<Vec<u8>, MeshError> {
        self.get_limited(key, usize::MAX).await
    }

    /// Read the object under `key`, refusing objects above `limit` bytes before reading them.
    ///
    /// An object of at most [`SMALL_BLOB_CHUNKS`] chunks (masks, prepared inputs and results
    /// of small images) is read with message gets from the stream's leader; a larger one
    /// streams through a consumer (16 MiB in 49 ms against 149 ms by message gets, one
    /// server), which costs the server a set-up and a deletion once idle that a small object
    /// does not repay. When a read fails before its first byte, within
    /// [`BLOB_FIRST_BYTE_TIMEOUT`], the object is read again chunk by chunk with message gets
    /// the stream's leader answers ([`BlobStore::read_from_leader`]), which no consumer
    /// placement can strand, tried again while the stream elects a leader; so are this store's
    /// reads for the next [`LEADER_READS_AFTER_A_STALL`]; and so is a read that NATS
    /// reconnects under, since its request may have gone into the dropped connection. Fails with
    /// [`MeshError::BlobStalled`] when the object stops arriving mid-read (deleted).
    pub async fn get_limited(&self, key: &str, limit: usize) -> Result<Vec<u8>, MeshError> {
        if !self.leader_reads.active() {
            let first = BLOB_FIRST_BYTE_TIMEOUT.min(self.stall_timeout);
            // A message get or consumer request written into a dropped connection is never
            // answered: on a reconnect the read goes on from the leader, which the retries
            // below start over on every reconnect (seen: a 10 s edit on a server restart).
            let reconnects = Reconnects::from_now();
            let read = tokio::select! {
                read = self.read_small_or_by_consumer(key, limit, first) => read,
                () = reconnects.next() => Err(MeshError::BlobRead {
                    key: key.to_string(),
                    reason: "NATS reconnected during the read".to_string(),
                }),
            };
            match read {
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

    /// Reads `key` by message gets when it is small (`small_blob_chunks`), else through a
    /// consumer. Failures that may be read again are those of [`BlobStore::read_again`].
    async fn read_small_or_by_consumer(
        &self,
        key: &str,
        limit: usize,
        first: Duration,
    ) -> Result<Vec<u8>, MeshError> {
        let info = tokio::time::timeout(self.stall_timeout, self.info_of(key))
            .await
            .map_err(|_| MeshError::BlobStalled {
                key: key.to_string(),
                after: self.stall_timeout,
                read: 0,
            })??;
        if info.chunks > self.small_blob_chunks {
            // The object store reads the info again (async-nats builds an `Object` only from
            // its own lookup): one message get more on a read of several chunks.
            return self.read_by_consumer(key, limit, first).await;
        }
        check_size(key, info.size, limit)?;
        self.read_chunks(key, &info).await
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
        let info = self.info_of(key).await?;
        check_size(key, info.size, limit)?;
        self.read_chunks(key, &info).await
    }

    /// The object's info (read from the stream leader); [`MeshError::BlobNotFound`] when it
    /// is missing or deleted, [`MeshError::BlobRead`] when the info could not be read.
    async fn info_of(&self, key: &str) -> Result<object_store::ObjectInfo, MeshError> {
        match self.store.info(key).await {
            Ok(info) if info.deleted => Err(MeshError::BlobNotFound {
                key: key.to_string(),
            }),
            Ok(info) => Ok(info),
            Err(err) if err.kind() == object_store::InfoErrorKind::NotFound => {
                Err(MeshError::BlobNotFound {
                    key: key.to_string(),
                })
            }
            Err(err) => Err(MeshError::BlobRead {
                key: key.to_string(),
                reason: format!("object info: {err}"),
            }),
        }
    }

    /// The chunks of the object `info` describes, by message gets (`$JS.API.STREAM.MSG.GET`,
    /// next message of its chunk subject from a sequence on), checked against its size and
    /// SHA-256 digest.
    async fn read_chunks(
        &self,
        key: &str,
        info: &object_store::ObjectInfo,
    ) -> Result<Vec<u8>, MeshError> {
        let failed = |reason: String| MeshError::BlobRead {
            key: key.to_string(),
            reason,
        };
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

    /// Every object in the bucket as `(key, size, written at in ns since the epoch)`: what an
    /// owner of the bucket's lifetimes (the cachestore's LRU) learns at start.
    pub async fn list(&self) -> Result<Vec<(String, u64, i128)>, String> {
        use futures::StreamExt;
        let mut listing = self
            .store
            .list()
            .await
            .map_err(|e| format!("listing bucket {}: {e}", self.bucket))?;
        let mut out = Vec::new();
        while let Some(info) = listing.next().await {
            let info = info.map_err(|e| format!("listing bucket {}: {e}", self.bucket))?;
            if info.deleted {
                continue;
            }
            let written = info.modified.map_or(0, |t| t.unix_timestamp_nanos());
            out.push((info.name, info.size as u64, written));
        }
        Ok(out)
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
