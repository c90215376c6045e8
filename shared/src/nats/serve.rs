//! Serving a NATS subscription: one task per message, bounded concurrency, graceful stop.
use std::future::Future;
use std::sync::Arc;

use async_nats::{Message, Subscriber};
use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Run `handle` on every message of `sub`, each in its own task, with at most as many in flight
/// as `limit` has permits (share one semaphore between subscriptions to bound them together).
/// Stops taking messages when `stop` is cancelled or the subscription ends, unsubscribes, and
/// waits for the tasks already started, so every request taken gets its answer.
pub async fn serve_subscription<F, Fut>(
    mut sub: Subscriber,
    stop: CancellationToken,
    limit: Arc<Semaphore>,
    handle: F,
) where
    F: Fn(Message) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut tasks = JoinSet::new();
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => break,
            msg = sub.next() => match msg { Some(m) => m, None => break },
        };
        // Wait for a slot before taking more work off the subscription; the message is already
        // taken, so it is handled even if a stop arrives meanwhile (running tasks free slots).
        let Ok(permit) = limit.clone().acquire_owned().await else {
            break;
        };
        let work = handle(msg);
        tasks.spawn(async move {
            work.await;
            drop(permit);
        });
        while tasks.try_join_next().is_some() {}
    }
    let _ = sub.unsubscribe().await;
    while tasks.join_next().await.is_some() {}
}
