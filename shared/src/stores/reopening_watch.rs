//! A watch of JetStream records that outlives the consumer behind it. A KV watch streams
//! through an ephemeral consumer; when the server restarts or the stream's leader moves, that
//! consumer stops (async-nats ends the watch with "missed idle heartbeat"). Whoever waits on a
//! job's record (the SSE events, an idempotent replay waiting for the ending) would then fail
//! although the job goes on. [`reopening`] opens the watch again instead, and also as soon as
//! NATS connects again ([`Reconnects`]): async-nats notices a consumer lost to a server
//! restart only after 10 s without heartbeats, which stalled every watch for that long.
use std::future::Future;
use std::time::Duration;

use futures::stream::{self, BoxStream};
use futures::{FutureExt, StreamExt};
use tokio::time::Instant;

use crate::error::MeshError;
use crate::nats::reconnects::Reconnects;
use crate::stores::transient;

/// How long a failed watch is opened again before its failure is passed on: longer than an
/// election or a restart, shorter than a job's deadline.
pub const WATCH_REOPEN_WINDOW: Duration = Duration::from_secs(60);

/// Failures of the watch itself (its consumer), which opening it again can mend; a record
/// that does not decode is passed on instead.
fn watch_failed(err: &MeshError) -> bool {
    matches!(
        err,
        MeshError::RecordWatch(_) | MeshError::KvWatch(_) | MeshError::KvWatcher(_)
    )
}

struct State<T> {
    open: Box<dyn FnMut() -> futures::future::BoxFuture<'static, Opened<T>> + Send>,
    current: Option<BoxStream<'static, Result<T, MeshError>>>,
    last: Option<T>,
    /// Since when no value has arrived after a failure.
    down_since: Option<Instant>,
    window: Duration,
    call: &'static str,
    given_up: bool,
    reconnects: Reconnects,
}

type Opened<T> = Result<BoxStream<'static, Result<T, MeshError>>, MeshError>;

/// `first`, and after it fails or ends or NATS reconnects (`reconnects`, taken before
/// `first` was opened), the watch `open` gives, again and again: values as they arrive, less
/// one equal to the last passed on (a reopened watch starts with the current value). A
/// failure is passed on (and the stream ends) only once opening has failed for `window`; each
/// reopening counts in `diffmesh_jetstream_retries_total{call}`.
pub fn reopening<T, F, Fut>(
    call: &'static str,
    window: Duration,
    reconnects: Reconnects,
    first: BoxStream<'static, Result<T, MeshError>>,
    mut open: F,
) -> BoxStream<'static, Result<T, MeshError>>
where
    T: PartialEq + Clone + Send + 'static,
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = Opened<T>> + Send + 'static,
{
    let state = State {
        open: Box::new(move || open().boxed()),
        current: Some(first),
        last: None,
        down_since: None,
        window,
        call,
        given_up: false,
        reconnects,
    };
    stream::unfold(state, |mut s| async move {
        loop {
            if s.given_up {
                return None;
            }
            let Some(current) = s.current.as_mut() else {
                s.reconnects.mark_seen();
                // Opening creates a consumer: one small request, which a stream without a
                // leader never answers (after a node crashed); sent again instead of waiting
                // out the client's timeout.
                let opened = tokio::time::timeout(transient::REQUEST_ATTEMPT_TIMEOUT, (s.open)())
                    .await
                    .unwrap_or_else(|_| {
                        Err(MeshError::RecordWatch(format!(
                            "no answer to opening the watch within {:?}",
                            transient::REQUEST_ATTEMPT_TIMEOUT
                        )))
                    });
                match opened {
                    Ok(watch) => s.current = Some(watch),
                    Err(err) if s.down_since.is_some_and(|t| t.elapsed() >= s.window) => {
                        s.given_up = true;
                        return Some((Err(err), s));
                    }
                    Err(err) => {
                        tracing::warn!(call = s.call, error = %err, "cannot open the watch yet");
                        tokio::time::sleep(transient::RETRY_DELAY).await;
                    }
                }
                continue;
            };
            let next = tokio::select! {
                next = current.next() => next,
                () = s.reconnects.next() => {
                    tracing::info!(call = s.call, "NATS client reconnected; opening the watch again");
                    transient::count_retry(s.call);
                    s.current = None;
                    continue;
                }
            };
            match next {
                Some(Ok(value)) => {
                    s.down_since = None;
                    if s.last.as_ref() == Some(&value) {
                        continue;
                    }
                    s.last = Some(value.clone());
                    return Some((Ok(value), s));
                }
                Some(Err(err)) if !watch_failed(&err) => return Some((Err(err), s)),
                ended => {
                    let reason = match ended {
                        Some(Err(err)) => err.to_string(),
                        _ => "ended".to_string(),
                    };
                    tracing::warn!(call = s.call, %reason, "watch stopped; opening it again");
                    transient::count_retry(s.call);
                    s.current = None;
                    s.down_since.get_or_insert_with(Instant::now);
                    tokio::time::sleep(transient::RETRY_DELAY).await;
                }
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    /// A counter whose sender is gone: `Reconnects::next` then never resolves.
    fn no_reconnects() -> Reconnects {
        Reconnects::watching(tokio::sync::watch::channel(0).1)
    }

    fn failing_after(values: Vec<u32>) -> BoxStream<'static, Result<u32, MeshError>> {
        stream::iter(values.into_iter().map(Ok))
            .chain(stream::once(async {
                Err(MeshError::RecordWatch("missed idle heartbeat".into()))
            }))
            .boxed()
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_watch_is_opened_again_without_repeating_the_last_value() {
        let opened = Arc::new(AtomicU32::new(0));
        let counter = opened.clone();
        let watch = reopening(
            "test.watch",
            WATCH_REOPEN_WINDOW,
            no_reconnects(),
            failing_after(vec![1, 2]),
            move || {
                let n = counter.fetch_add(1, Ordering::SeqCst);
                async move {
                    // The reopened watch starts with the current value (2), then goes on.
                    Ok(if n == 0 {
                        failing_after(vec![2, 3])
                    } else {
                        stream::iter(vec![Ok(3), Ok(4)])
                            .chain(stream::pending())
                            .boxed()
                    })
                }
            },
        );
        let values: Vec<u32> = watch.take(4).map(|v| v.unwrap()).collect().await;
        assert_eq!(values, vec![1, 2, 3, 4]);
        assert_eq!(
            opened.load(Ordering::SeqCst),
            2,
            "opened again after each stop"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_that_cannot_be_opened_for_the_window_fails() {
        let watch = reopening(
            "test.watch",
            Duration::from_secs(5),
            no_reconnects(),
            failing_after(vec![7]),
            || async {
                Err::<BoxStream<'static, Result<u32, MeshError>>, _>(MeshError::RecordWatch(
                    "no responders".into(),
                ))
            },
        );
        let items: Vec<Result<u32, MeshError>> = watch.collect().await;
        assert_eq!(items.len(), 2, "{items:?}");
        assert_eq!(*items[0].as_ref().unwrap(), 7);
        assert!(matches!(items[1], Err(MeshError::RecordWatch(_))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_without_a_window_is_opened_until_it_opens() {
        let tries = Arc::new(AtomicU32::new(0));
        let counter = tries.clone();
        // Down for an hour of (paused) time: 14,400 tries at one per RETRY_DELAY.
        let down_for = 3600 * 1000 / transient::RETRY_DELAY.as_millis() as u32;
        let mut watch = reopening(
            "test.watch",
            Duration::MAX,
            no_reconnects(),
            failing_after(vec![1]),
            move || {
                let n = counter.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n < down_for {
                        Err(MeshError::RecordWatch("no responders".into()))
                    } else {
                        Ok(stream::iter(vec![Ok(2u32)])
                            .chain(stream::pending())
                            .boxed())
                    }
                }
            },
        );
        assert_eq!(watch.next().await.unwrap().unwrap(), 1);
        assert_eq!(watch.next().await.unwrap().unwrap(), 2, "never given up");
        assert_eq!(tries.load(Ordering::SeqCst), down_for + 1);
    }

    #[tokio::test]
    async fn a_record_that_does_not_decode_is_passed_on_and_the_watch_goes_on() {
        let first = stream::iter(vec![
            Ok(1u32),
            Err(MeshError::Json(
                serde_json::from_str::<u32>("x").unwrap_err(),
            )),
            Ok(2),
        ])
        .boxed();
        let watch = reopening(
            "test.watch",
            WATCH_REOPEN_WINDOW,
            no_reconnects(),
            first,
            || async { Ok(stream::empty().boxed()) },
        );
        let items: Vec<_> = watch.take(3).collect().await;
        assert!(matches!(items[1], Err(MeshError::Json(_))));
        assert_eq!(*items[2].as_ref().unwrap(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_watch_is_opened_again_when_the_client_reconnects() {
        let (connects, receiver) = tokio::sync::watch::channel(1u64);
        let reconnects = Reconnects::watching(receiver);
        // A consumer lost to a restart: it delivered 1, then never anything, and no error.
        let first = stream::iter(vec![Ok(1u32)])
            .chain(stream::pending())
            .boxed();
        let mut watch = reopening(
            "test.watch",
            WATCH_REOPEN_WINDOW,
            reconnects,
            first,
            || async {
                Ok(stream::iter(vec![Ok(1u32), Ok(2)])
                    .chain(stream::pending())
                    .boxed())
            },
        );
        assert_eq!(watch.next().await.unwrap().unwrap(), 1);
        let silent = tokio::time::timeout(Duration::from_secs(30), watch.next()).await;
        assert!(silent.is_err(), "nothing to see before the reconnect");
        connects.send_modify(|n| *n += 1);
        let next = tokio::time::timeout(Duration::from_secs(1), watch.next())
            .await
            .expect("reopened within a reconnect check");
        assert_eq!(next.unwrap().unwrap(), 2, "the repeated 1 is left out");
    }

    /// An opening that gets no answer (its stream has no leader) is given up after the
    /// request bound and tried again, not waited on.
    #[tokio::test(start_paused = true)]
    async fn an_unanswered_opening_is_tried_again() {
        let opened = Arc::new(AtomicU32::new(0));
        let counter = opened.clone();
        let start = tokio::time::Instant::now();
        let watch = reopening(
            "test.watch",
            WATCH_REOPEN_WINDOW,
            no_reconnects(),
            failing_after(vec![1]),
            move || {
                let n = counter.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 0 {
                        std::future::pending::<()>().await;
                    }
                    Ok(stream::iter(vec![Ok(2)]).chain(stream::pending()).boxed())
                }
            },
        );
        let values: Vec<u32> = tokio::time::timeout(
            Duration::from_secs(30),
            watch.take(2).map(|v| v.unwrap()).collect(),
        )
        .await
        .expect("the watch stalled on the unanswered opening");
        assert_eq!(values, vec![1, 2]);
        assert_eq!(opened.load(Ordering::SeqCst), 2);
        assert!(
            start.elapsed() < transient::REQUEST_ATTEMPT_TIMEOUT * 2,
            "{:?}",
            start.elapsed()
        );
    }
}
