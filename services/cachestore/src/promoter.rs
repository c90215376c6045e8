//! Prefetches, run in the background by an actor that owns them: the keys waiting, the keys
//! being promoted (never one key twice at once: twenty edits of one template ask for the same
//! keys together), and how many run at once (`--prefetch-concurrency`). The waiting keys are
//! bounded ([`MAX_WAITING`]); a key beyond it is not queued (counted as `dropped`), its edit
//! reads it from a lower tier as it would without a prefetch.
//!
//! Promotions are I/O (the object store, the disk tier): they run on the service's tokio
//! runtime, and each tells the actor when it is done.
use crate::store::TieredStore;
use actix::{Actor, AsyncContext, Context, Handler, Message};
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use tracing::Instrument;

/// Keys waiting for a promotion slot, at most.
pub const MAX_WAITING: usize = 4096;

pub struct Promoter {
    store: Arc<TieredStore>,
    runtime: tokio::runtime::Handle,
    concurrency: usize,
    running: usize,
    waiting: VecDeque<String>,
    /// Keys waiting or running.
    known: HashSet<String>,
}

impl Actor for Promoter {
    type Context = Context<Self>;
}

impl Promoter {
    /// Start the actor; promotions run on the calling tokio runtime.
    pub fn start(store: Arc<TieredStore>, concurrency: usize) -> actix::Addr<Self> {
        let runtime = tokio::runtime::Handle::current();
        diffmesh_shared::process::actors::start(move |_| Promoter {
            store,
            runtime,
            concurrency: concurrency.max(1),
            running: 0,
            waiting: VecDeque::new(),
            known: HashSet::new(),
        })
    }

    /// Start waiting promotions while slots are free.
    fn start_waiting(&mut self, ctx: &mut Context<Self>) {
        while self.running < self.concurrency {
            let Some(key) = self.waiting.pop_front() else {
                return;
            };
            self.running += 1;
            let (store, me) = (self.store.clone(), ctx.address());
            let span = tracing::debug_span!("prefetch", %key);
            self.runtime.spawn(
                async move {
                    match store.promote(&key).await {
                        Ok(outcome) => {
                            tracing::debug!(%key, outcome = outcome.as_str(), "prefetched")
                        }
                        Err(err) => {
                            store.metrics().prefetched("failed");
                            store
                                .metrics()
                                .failures
                                .with_label_values(&[err.reason()])
                                .inc();
                            tracing::warn!(%key, error = %err, "prefetch failed");
                        }
                    }
                    me.do_send(Promoted(key));
                }
                .instrument(span),
            );
        }
    }
}

/// Queue keys for promotion into memory; answers how many were queued (the others are
/// waiting or being promoted already, or beyond [`MAX_WAITING`]).
pub struct Schedule(pub Vec<String>);

impl Message for Schedule {
    type Result = u32;
}

impl Handler<Schedule> for Promoter {
    type Result = u32;

    fn handle(&mut self, msg: Schedule, ctx: &mut Context<Self>) -> u32 {
        let mut queued = 0;
        for key in msg.0 {
            if self.known.contains(&key) {
                continue;
            }
            if self.waiting.len() >= MAX_WAITING {
                self.store.metrics().prefetched("dropped");
                continue;
            }
            self.known.insert(key.clone());
            self.waiting.push_back(key);
            queued += 1;
        }
        self.start_waiting(ctx);
        queued
    }
}

/// A promotion ended (either way).
struct Promoted(String);

impl Message for Promoted {
    type Result = ();
}

impl Handler<Promoted> for Promoter {
    type Result = ();

    fn handle(&mut self, msg: Promoted, ctx: &mut Context<Self>) {
        self.running -= 1;
        self.known.remove(&msg.0);
        self.start_waiting(ctx);
    }
}
