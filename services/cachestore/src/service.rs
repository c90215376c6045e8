//! NATS side of the cachestore: get/put/delete/stats/locate/prefetch handlers over the tiered
//! store.
use crate::promoter::{Promoter, Schedule};
use crate::store::{StoreError, TieredStore};
use crate::transfers::Transfers;
use bytes::Bytes;
use diffmesh_shared::nats::reply_msgpack;
use diffmesh_shared::nats::serve::serve_subscription;
use diffmesh_shared::wire::cachestore::{
    CacheDelete, CacheDeleteReply, CacheGet, CacheGetReply, CacheLocate, CacheLocateReply,
    CachePrefetch, CachePrefetchReply, CachePut, CachePutReply, CacheRange, CACHESTORE_QUEUE,
    MAX_KEYS_PER_REQUEST, RANGE_GONE, RANGE_STATUS_HEADER,
};
use diffmesh_shared::wire::messages::decode;
use std::sync::Arc;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

#[derive(Clone, Copy, Debug)]
pub enum Op {
    Get,
    Put,
    Delete,
    Stats,
    Locate,
    Prefetch,
    /// A range of a transfer (this instance's own subject, no queue group).
    Range,
}

pub struct Handler {
    pub client: async_nats::Client,
    pub store: Arc<TieredStore>,
    pub inline_limit: usize,
    pub in_flight: Arc<Semaphore>,
    /// Background promotions (prefetches run after their request is answered).
    pub prefetch: actix::Addr<Promoter>,
    /// Large values being read in ranges.
    pub transfers: Transfers,
    /// This instance's range subject (`cachestore::range_subject`).
    pub range_subject: String,
}

impl Handler {
    /// Subscribe to one subject (in the queue group shared by cachestore replicas, except for
    /// this instance's own range subject). Done before serving starts, so the subscription
    /// reaches the server before `start` reports ready.
    pub async fn subscribe(
        &self,
        subject: &str,
        op: Op,
    ) -> Result<async_nats::Subscriber, async_nats::SubscribeError> {
        match op {
            Op::Range => self.client.subscribe(subject.to_string()).await,
            _ => {
                self.client
                    .queue_subscribe(subject.to_string(), CACHESTORE_QUEUE.to_string())
                    .await
            }
        }
    }

    /// Serve one subscription until `shutdown`; requests in flight finish before this returns.
    pub async fn serve(
        self: Arc<Self>,
        subject: String,
        sub: async_nats::Subscriber,
        op: Op,
        shutdown: CancellationToken,
    ) -> Result<(), async_nats::SubscribeError> {
        serve_subscription(sub, shutdown, self.in_flight.clone(), |msg| {
            let this = self.clone();
            async move { this.handle(op, msg).await }
        })
        .await;
        tracing::info!(%subject, "cachestore handler stopped");
        Ok(())
    }

    async fn handle(&self, op: Op, msg: async_nats::Message) {
        // A large read is many ranges: one span each would flood the traces (debug spans are
        // not exported), the get that offered them is traced.
        let span = match op {
            Op::Range => tracing::debug_span!("cachestore", op = ?op),
            _ => tracing::info_span!("cachestore", op = ?op),
        };
        diffmesh_shared::nats::trace_context::set_parent_from(&span, msg.headers.as_ref());
        self.handle_in_span(op, msg).instrument(span).await
    }

    async fn handle_in_span(&self, op: Op, msg: async_nats::Message) {
        let result = match op {
            Op::Get => match decode::<CacheGet>(&msg.payload) {
                Ok(req) => {
                    let reply = self.get(&req.key, req.ranged).await;
                    reply_msgpack(&self.client, &msg, &reply).await
                }
                Err(e) => self.reply_bad(&msg, op, e.to_string()).await,
            },
            Op::Range => match decode::<CacheRange>(&msg.payload) {
                Ok(req) => self.reply_range(&msg, self.range(&req)).await,
                Err(e) => self.reply_bad(&msg, op, e.to_string()).await,
            },
            Op::Put => match decode::<CachePut>(&msg.payload) {
                Ok(req) => {
                    let reply = self.put(req).await;
                    reply_msgpack(&self.client, &msg, &reply).await
                }
                Err(e) => self.reply_bad(&msg, op, e.to_string()).await,
            },
            Op::Delete => match decode::<CacheDelete>(&msg.payload) {
                Ok(req) => {
                    let reply = match self.store.delete(&req.key).await {
                        Ok(existed) => CacheDeleteReply::Deleted { existed },
                        Err(e) => CacheDeleteReply::Failed {
                            message: self.fail(e),
                        },
                    };
                    reply_msgpack(&self.client, &msg, &reply).await
                }
                Err(e) => self.reply_bad(&msg, op, e.to_string()).await,
            },
            Op::Stats => reply_msgpack(&self.client, &msg, &self.store.stats()).await,
            Op::Locate => match decode::<CacheLocate>(&msg.payload) {
                Ok(req) => {
                    let reply = self.locate(req).await;
                    reply_msgpack(&self.client, &msg, &reply).await
                }
                Err(e) => self.reply_bad(&msg, op, e.to_string()).await,
            },
            Op::Prefetch => match decode::<CachePrefetch>(&msg.payload) {
                Ok(req) => {
                    let reply = self.prefetch(req).await;
                    reply_msgpack(&self.client, &msg, &reply).await
                }
                Err(e) => self.reply_bad(&msg, op, e.to_string()).await,
            },
        };
        if let Err(err) = result {
            tracing::warn!(error = %err, "could not send cachestore reply");
        }
    }

    fn fail(&self, err: StoreError) -> String {
        self.store_metrics_failure(err.reason());
        err.to_string()
    }

    fn store_metrics_failure(&self, reason: &str) {
        self.store
            .metrics()
            .failures
            .with_label_values(&[reason])
            .inc();
    }

    async fn reply_bad(
        &self,
        msg: &async_nats::Message,
        op: Op,
        err: String,
    ) -> Result<(), diffmesh_shared::MeshError> {
        self.store_metrics_failure("bad_request");
        let message = format!("undecodable {op:?} request: {err}");
        match op {
            Op::Get => reply_msgpack(&self.client, msg, &CacheGetReply::Failed { message }).await,
            Op::Put => reply_msgpack(&self.client, msg, &CachePutReply::Failed { message }).await,
            Op::Delete | Op::Stats => {
                reply_msgpack(&self.client, msg, &CacheDeleteReply::Failed { message }).await
            }
            Op::Locate => {
                reply_msgpack(&self.client, msg, &CacheLocateReply::Failed { message }).await
            }
            Op::Prefetch => {
                reply_msgpack(&self.client, msg, &CachePrefetchReply::Failed { message }).await
            }
            Op::Range => {
                self.reply_range(msg, Err(format!("failed: {message}")))
                    .await
            }
        }
    }

    /// The bytes of a range, or the status that refuses it.
    fn range(&self, req: &CacheRange) -> Result<Bytes, String> {
        let max_payload = self.client.server_info().max_payload as u64;
        let found = if req.len > max_payload {
            Err(Some(format!(
                "`len` {} is above the server's max_payload {max_payload}",
                req.len
            )))
        } else {
            self.transfers.range(&req.transfer, req.offset, req.len)
        };
        match found {
            Ok(bytes) => {
                self.store.metrics().ranged(bytes.len());
                Ok(bytes)
            }
            Err(None) => Err(RANGE_GONE.to_string()),
            Err(Some(why)) => {
                self.store_metrics_failure("bad_range");
                Err(format!("failed: {why}"))
            }
        }
    }

    /// Answer a range request: the bytes as the payload, or the status header and no payload.
    async fn reply_range(
        &self,
        msg: &async_nats::Message,
        answer: Result<Bytes, String>,
    ) -> Result<(), diffmesh_shared::MeshError> {
        let Some(reply) = msg.reply.clone() else {
            return Ok(());
        };
        let sent = match answer {
            Ok(bytes) => self.client.publish(reply, bytes).await,
            Err(status) => {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(RANGE_STATUS_HEADER, status.as_str());
                self.client
                    .publish_with_headers(reply, headers, Bytes::new())
                    .await
            }
        };
        sent.map_err(diffmesh_shared::MeshError::from)
    }

    /// Refuse requests naming too many keys (they would hold a handler slot for long).
    fn too_many_keys(&self, keys: &[String]) -> Option<String> {
        (keys.len() > MAX_KEYS_PER_REQUEST).then(|| {
            self.store_metrics_failure("too_many_keys");
            format!(
                "`keys` names {} keys, above the limit of {MAX_KEYS_PER_REQUEST}",
                keys.len()
            )
        })
    }

    async fn locate(&self, req: CacheLocate) -> CacheLocateReply {
        if let Some(message) = self.too_many_keys(&req.keys) {
            return CacheLocateReply::Failed { message };
        }
        let mut keys = Vec::with_capacity(req.keys.len());
        for key in &req.keys {
            match self.store.locate(key).await {
                Ok(location) => keys.push(location),
                Err(e) => {
                    return CacheLocateReply::Failed {
                        message: self.fail(e),
                    }
                }
            }
        }
        CacheLocateReply::Located { keys }
    }

    async fn prefetch(&self, req: CachePrefetch) -> CachePrefetchReply {
        if let Some(message) = self.too_many_keys(&req.keys) {
            return CachePrefetchReply::Failed { message };
        }
        // Check every key before scheduling any, so a bad request changes nothing.
        if let Some(err) = req
            .keys
            .iter()
            .find_map(|k| crate::store::validate_key(k).err())
        {
            return CachePrefetchReply::Failed {
                message: self.fail(err),
            };
        }
        match self.prefetch.send(Schedule(req.keys)).await {
            Ok(keys) => CachePrefetchReply::Scheduled { keys },
            Err(e) => CachePrefetchReply::Failed {
                message: format!("prefetches are not taken now: {e}"),
            },
        }
    }

    /// A value, inline when small; when large, as a transfer to read in ranges from this
    /// instance (when the caller can: `ranged`), else through the object store.
    async fn get(&self, key: &str, ranged: bool) -> CacheGetReply {
        let metrics = self.store.metrics();
        match self.store.get(key).await {
            Ok(None) => CacheGetReply::Missing,
            Ok(Some((tier, value))) if value.len() <= self.inline_limit => {
                metrics.served("inline");
                CacheGetReply::Inline {
                    tier,
                    value: value.to_vec(),
                }
            }
            Ok(Some((tier, value))) if ranged && self.transfers.fits(value.len()) => {
                let size = value.len() as u64;
                metrics.served("ranged");
                CacheGetReply::Ranged {
                    tier,
                    size,
                    subject: self.range_subject.clone(),
                    transfer: self.transfers.begin(value),
                }
            }
            Ok(Some((tier, value))) => match self.store.ensure_in_cluster(key, &value).await {
                Ok(()) => {
                    metrics.served("object_store");
                    CacheGetReply::InObjectStore {
                        tier,
                        size: value.len() as u64,
                    }
                }
                Err(e) => CacheGetReply::Failed {
                    message: self.fail(e),
                },
            },
            Err(e) => CacheGetReply::Failed {
                message: self.fail(e),
            },
        }
    }

    async fn put(&self, req: CachePut) -> CachePutReply {
        let result = match req.value {
            Some(v) if v.len() > self.inline_limit => {
                self.store_metrics_failure("too_large_inline");
                return CachePutReply::Failed {
                    message: format!(
                        "inline `value` is {} bytes, above the inline limit of {}; write it to the object store",
                        v.len(),
                        self.inline_limit
                    ),
                };
            }
            Some(v) => self.store.put(&req.key, Bytes::from(v), false).await,
            None => self.store.put_from_cluster(&req.key).await,
        };
        match result {
            Ok(size) => CachePutReply::Stored { size },
            Err(e) => CachePutReply::Failed {
                message: self.fail(e),
            },
        }
    }
}

/// Drop this instance's memory and disk copies of deleted templates' caches (every replica
/// hears `subjects::TEMPLATES_EVICT`; the `CacheDelete`s that precede it reach only one replica
/// and the shared cluster tier).
pub async fn serve_evictions(
    store: Arc<TieredStore>,
    mut sub: async_nats::Subscriber,
    shutdown: CancellationToken,
) -> Result<(), async_nats::SubscribeError> {
    use futures::StreamExt;
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            msg = sub.next() => match msg { Some(m) => m, None => return Ok(()) },
        };
        match decode::<diffmesh_shared::wire::messages::EvictTemplate>(&msg.payload) {
            Ok(evict) if !evict.cache_key.is_empty() => {
                match store.drop_local(&format!("{}/", evict.cache_key)) {
                    Ok(dropped) => {
                        tracing::info!(cache_key = %evict.cache_key, dropped, "template evicted")
                    }
                    Err(err) => {
                        store
                            .metrics()
                            .failures
                            .with_label_values(&[err.reason()])
                            .inc();
                        tracing::warn!(cache_key = %evict.cache_key, error = %err, "eviction failed");
                    }
                }
            }
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "undecodable template eviction"),
        }
    }
}
