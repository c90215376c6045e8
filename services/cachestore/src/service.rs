//! NATS side of the cachestore: get/put/delete/stats request handlers over the tiered store.
use crate::store::{StoreError, TieredStore};
use bytes::Bytes;
use diffmesh_shared::cachestore::{
    CacheDelete, CacheDeleteReply, CacheGet, CacheGetReply, CachePut, CachePutReply,
    CACHESTORE_QUEUE,
};
use diffmesh_shared::messages::decode;
use diffmesh_shared::nats::reply_msgpack;
use diffmesh_shared::serve::serve_subscription;
use std::sync::Arc;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Copy, Debug)]
pub enum Op {
    Get,
    Put,
    Delete,
    Stats,
}

pub struct Handler {
    pub client: async_nats::Client,
    pub store: Arc<TieredStore>,
    pub inline_limit: usize,
    pub in_flight: Arc<Semaphore>,
}

impl Handler {
    /// Subscribe to one subject (in the queue group shared by cachestore replicas). Done before
    /// serving starts, so the subscription reaches the server before `start` reports ready.
    pub async fn subscribe(
        &self,
        subject: &str,
    ) -> Result<async_nats::Subscriber, async_nats::SubscribeError> {
        self.client
            .queue_subscribe(subject.to_string(), CACHESTORE_QUEUE.to_string())
            .await
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
        let span = tracing::info_span!("cachestore", op = ?op);
        diffmesh_shared::trace_context::set_parent_from(&span, msg.headers.as_ref());
        let _e = span.enter();
        let result = match op {
            Op::Get => match decode::<CacheGet>(&msg.payload) {
                Ok(req) => {
                    let reply = self.get(&req.key).await;
                    reply_msgpack(&self.client, &msg, &reply).await
                }
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
        }
    }

    async fn get(&self, key: &str) -> CacheGetReply {
        match self.store.get(key).await {
            Ok(None) => CacheGetReply::Missing,
            Ok(Some((tier, value))) if value.len() <= self.inline_limit => CacheGetReply::Inline {
                tier,
                value: value.to_vec(),
            },
            Ok(Some((tier, value))) => match self.store.ensure_in_cluster(key, &value).await {
                Ok(()) => CacheGetReply::InObjectStore {
                    tier,
                    size: value.len() as u64,
                },
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
