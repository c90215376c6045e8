//! Reading one cachestore value as a client: inline in the get's reply when small; when large,
//! in ranges straight from the cachestore instance that holds it (several ranges in flight),
//! and through the JetStream object store only when that instance cannot serve ranges or a
//! ranged read fails. Ranges skip the object store's write and read on the NATS server's disk:
//! a large value held in a cachestore's memory or disk tier comes from there.
use std::time::Duration;

use futures::StreamExt;

use crate::nats::request_msgpack;
use crate::stores::blob_store::BlobStore;
use crate::wire::cachestore::{
    get_subject, CacheGet, CacheGetReply, CacheRange, RANGE_GONE, RANGE_STATUS_HEADER,
};
use crate::wire::messages::encode;

/// Ranges of one value in flight at once: enough to keep the server and both ends busy.
pub const RANGE_CONCURRENCY: usize = 4;
/// The largest range asked for (each is one message, below the server's `max_payload`).
const MAX_RANGE_BYTES: u64 = 4 << 20;
/// Left of `max_payload` for the reply's headers and framing.
const RANGE_HEADROOM: u64 = 16 << 10;

/// How one value was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPath {
    Inline,
    Ranged,
    ObjectStore,
}

impl ReadPath {
    pub fn as_str(self) -> &'static str {
        match self {
            ReadPath::Inline => "inline",
            ReadPath::Ranged => "ranged",
            ReadPath::ObjectStore => "object_store",
        }
    }
}

/// Where a client reads cachestore values from.
#[derive(Clone)]
pub struct CacheReader {
    pub client: async_nats::Client,
    /// The object store bucket of large values ([`crate::wire::cachestore::CACHE_BUCKET`]).
    pub bucket: BlobStore,
    /// Per request to the cachestore (a get, or one range).
    pub timeout: Duration,
    /// Values above this are refused (`Err`) before they are read.
    pub max_bytes: usize,
}

impl CacheReader {
    /// The value under `key` and how it came; `Ok(None)` when no tier holds it.
    pub async fn read(&self, key: &str) -> Result<Option<(Vec<u8>, ReadPath)>, String> {
        match self.get(key, true).await? {
            CacheGetReply::Ranged {
                size,
                subject,
                transfer,
                ..
            } => {
                self.check_size(key, size)?;
                match self.read_ranges(&subject, &transfer, size).await {
                    Ok(value) => return Ok(Some((value, ReadPath::Ranged))),
                    // The instance stopped or the transfer expired: the object store still
                    // has it (a get without ranges puts it there).
                    Err(err) => {
                        tracing::warn!(%key, error = %err, "ranged read failed; reading through the object store")
                    }
                }
                self.read_unranged(key).await
            }
            reply => self.finish(key, reply).await,
        }
    }

    /// The value under `key` as a client without ranges reads it: inline, or through the
    /// object store (which the get fills when it lacks the value).
    pub async fn read_unranged(&self, key: &str) -> Result<Option<(Vec<u8>, ReadPath)>, String> {
        let reply = self.get(key, false).await?;
        self.finish(key, reply).await
    }

    async fn get(&self, key: &str, ranged: bool) -> Result<CacheGetReply, String> {
        let req = CacheGet {
            key: key.to_string(),
            ranged,
        };
        request_msgpack(&self.client, &get_subject(), &req, self.timeout)
            .await
            .map_err(|e| format!("cachestore get {key}: {e}"))
    }

    /// A reply that is not `Ranged`, read to its end.
    async fn finish(
        &self,
        key: &str,
        reply: CacheGetReply,
    ) -> Result<Option<(Vec<u8>, ReadPath)>, String> {
        match reply {
            CacheGetReply::Inline { value, .. } => Ok(Some((value, ReadPath::Inline))),
            CacheGetReply::InObjectStore { size, .. } => {
                self.check_size(key, size)?;
                self.bucket
                    .get_limited(key, self.max_bytes)
                    .await
                    .map(|v| Some((v, ReadPath::ObjectStore)))
                    .map_err(|e| format!("reading {key} from the cache bucket: {e}"))
            }
            CacheGetReply::Missing => Ok(None),
            CacheGetReply::Failed { message } => Err(format!("cachestore get {key}: {message}")),
            CacheGetReply::Ranged { .. } => Err(format!(
                "cachestore get {key}: ranges offered to a get without them"
            )),
        }
    }

    fn check_size(&self, key: &str, size: u64) -> Result<(), String> {
        if size > self.max_bytes as u64 {
            return Err(format!(
                "{key} is {size} bytes, above the limit of {}",
                self.max_bytes
            ));
        }
        Ok(())
    }

    /// Every range of a transfer of `size` bytes, in order, several in flight.
    async fn read_ranges(
        &self,
        subject: &str,
        transfer: &str,
        size: u64,
    ) -> Result<Vec<u8>, String> {
        let chunk = range_bytes(self.client.server_info().max_payload as u64);
        let mut value = Vec::with_capacity(size as usize);
        let mut ranges = futures::stream::iter((0..size).step_by(chunk as usize))
            .map(|offset| {
                let range = CacheRange {
                    transfer: transfer.to_string(),
                    offset,
                    len: chunk.min(size - offset),
                };
                self.read_range(subject, range)
            })
            .buffered(RANGE_CONCURRENCY);
        while let Some(bytes) = ranges.next().await {
            value.extend_from_slice(&bytes?);
        }
        if value.len() as u64 != size {
            return Err(format!("read {} bytes of {size}", value.len()));
        }
        Ok(value)
    }

    async fn read_range(&self, subject: &str, range: CacheRange) -> Result<bytes::Bytes, String> {
        let payload = encode(&range).map_err(|e| e.to_string())?;
        let asked = self.client.request(subject.to_string(), payload.into());
        let msg = match tokio::time::timeout(self.timeout, asked).await {
            Ok(Ok(msg)) => msg,
            Ok(Err(e)) => return Err(format!("range at {}: {e}", range.offset)),
            Err(_) => {
                return Err(format!(
                    "range at {}: no answer within {:?}",
                    range.offset, self.timeout
                ))
            }
        };
        if let Some(status) = msg
            .headers
            .as_ref()
            .and_then(|h| h.get(RANGE_STATUS_HEADER))
        {
            return Err(match status.as_str() {
                RANGE_GONE => "the transfer expired".to_string(),
                other => other.to_string(),
            });
        }
        if msg.payload.len() as u64 != range.len {
            return Err(format!(
                "range at {} came with {} bytes, not {}",
                range.offset,
                msg.payload.len(),
                range.len
            ));
        }
        Ok(msg.payload)
    }
}

/// The range size for a server whose messages may carry `max_payload` bytes.
pub fn range_bytes(max_payload: u64) -> u64 {
    max_payload
        .saturating_sub(RANGE_HEADROOM)
        .clamp(4 << 10, MAX_RANGE_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_fit_the_servers_payload_limit() {
        // The default 1 MiB limit, the compose file's 8 MB, and an absurdly small one.
        assert_eq!(range_bytes(1 << 20), (1 << 20) - RANGE_HEADROOM);
        assert_eq!(range_bytes(8 << 20), MAX_RANGE_BYTES);
        assert_eq!(range_bytes(10 << 10), 4 << 10);
    }
}
