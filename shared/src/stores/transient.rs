//! Trying a JetStream call again while its stream has no leader.
//!
//! On a cluster, losing a node leaves the streams it led without a leader until the others
//! elect one (seconds; longer on a loaded machine). Every read and write of those streams
//! fails meanwhile (503 "temporarily unavailable", or a timeout), and a request must not fail
//! for that. The stores (`JobStore`, `IdempotencyStore`, `BlobStore`, the gateway's template
//! records) run their JetStream calls through [`retried`]: a failure is tried again for a
//! window ([`ELECTION_WINDOW`] unless a store is given another), while errors that say
//! something about the data (the key exists, another writer got in first, not found) are
//! returned at once. An attempt in flight while NATS reconnects is started over at once
//! (its request may have gone into the dropped connection: `reconnects`). Each retry counts
//! in `diffmesh_jetstream_retries_total{call}`.
use std::fmt::Display;
use std::future::Future;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use bytes::Bytes;
use prometheus::IntCounterVec;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::MeshError;
use crate::nats::reconnects::Reconnects;
use crate::process::metrics::{counter_vec, process_registry};

/// How long a failing call is tried again: a leader election on a three-node cluster took
/// 1-5 s in the failover runs (docs/BENCHMARKS.md, "JetStream cluster: losing a node").
pub const ELECTION_WINDOW: Duration = Duration::from_secs(10);

/// Pause between attempts: short enough to catch the new leader soon, long enough not to
/// flood a cluster that is electing one.
pub const RETRY_DELAY: Duration = Duration::from_millis(250);

/// How long one small request (a KV read or write, a stream publish or purge) is waited for
/// before it is sent again, within the window ([`retried_bounded`]). Answered, such a request
/// takes milliseconds; one sent while its stream has no leader gets no answer at all (after
/// a node crashed, until the others elect a leader: 3.5-7 s in the failover runs). Waiting
/// for it spent the whole window, and every request of those seconds failed after 10 s.
pub const REQUEST_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// The `call` names of the stores' JetStream calls. They are exported at 0 from the start, so
/// the counter is on `/metrics` before the first retry and `rate()` sees the first one.
pub const CALLS: &[&str] = &[
    // Every kind of record ([`crate::stores::record::RecordStore`]), every operation.
    "job.get",
    "job.create",
    "job.put",
    "job.update",
    "job.delete",
    "job.list",
    "idempotency.get",
    "idempotency.create",
    "idempotency.put",
    "idempotency.update",
    "idempotency.delete",
    "idempotency.list",
    "template.get",
    "template.create",
    "template.put",
    "template.update",
    "template.delete",
    "template.list",
    "lora.get",
    "lora.create",
    "lora.put",
    "lora.update",
    "lora.delete",
    "lora.list",
    // Job record watches.
    "job.watch",
    "job.watch_since",
    "blob.put",
    "blob.delete",
    "blob.get",
    "blob.get_from_leader",
    "template_use.publish",
    "template_use.end",
    "template_use.list",
];

/// `diffmesh_jetstream_retries_total{call}`: JetStream calls tried again after a failure, by
/// call ([`CALLS`]), in the process registry.
pub fn retries() -> &'static IntCounterVec {
    static RETRIES: OnceLock<IntCounterVec> = OnceLock::new();
    RETRIES.get_or_init(|| {
        let counter = counter_vec(
            process_registry(),
            "jetstream",
            "retries",
            "JetStream calls tried again after a failure (a stream without a leader), by call",
            &["call"],
        )
        .expect("the JetStream retry counter is registered once, with a valid name");
        for call in CALLS {
            counter.with_label_values(&[*call]);
        }
        counter
    })
}

/// Count one retry of `call` (for loops that cannot use [`retried`]).
pub fn count_retry(call: &str) {
    debug_assert!(
        CALLS.contains(&call) || call.starts_with("test."),
        "{call} is not in transient::CALLS"
    );
    retries().with_label_values(&[call]).inc();
}

/// Run `call` until it succeeds, fails with an error `settled` accepts (an answer about the
/// data, not about the cluster), or `window` has passed since the first attempt; the last
/// result is returned. `call` must be safe to repeat: a write whose reply was lost may have
/// landed, so callers that create or compare-and-set check what is stored on the next attempt.
pub async fn retried<T, E, F, Fut>(
    call: &str,
    window: Duration,
    settled: impl Fn(&E) -> bool,
    attempt: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: Display,
{
    retried_bounded(call, window, None, settled, attempt).await
}

/// [`retried`], and within the window an attempt that got no answer within `bound` is sent
/// again (for calls of one small request: [`REQUEST_ATTEMPT_TIMEOUT`]). Not for calls whose
/// answer may take long (whole blobs, listings): they would never finish.
pub async fn retried_bounded<T, E, F, Fut>(
    call: &str,
    window: Duration,
    bound: Option<Duration>,
    settled: impl Fn(&E) -> bool,
    mut attempt: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: Display,
{
    let start = Instant::now();
    let mut attempts = 1u32;
    loop {
        let result = match attempt_once(attempt(), start, window, bound).await {
            Attempt::Done(result) => result,
            Attempt::Reconnected => {
                tracing::info!(
                    call,
                    attempts,
                    "NATS reconnected during the call; trying again"
                );
                count_retry(call);
                attempts += 1;
                continue;
            }
            Attempt::Unanswered => {
                tracing::warn!(call, attempts, "no answer in time; sending the call again");
                count_retry(call);
                attempts += 1;
                continue;
            }
        };
        match result {
            Err(err) if !settled(&err) && start.elapsed() < window => {
                tracing::warn!(call, attempts, error = %err, "JetStream call failed; trying again");
                count_retry(call);
                attempts += 1;
                tokio::time::sleep(RETRY_DELAY).await;
            }
            done => return done,
        }
    }
}

/// How one attempt ended.
enum Attempt<T> {
    /// Answered (or failed) by the call itself.
    Done(T),
    /// NATS connected again while it was in flight: its request may have gone into the
    /// dropped connection, and its reply would then never come.
    Reconnected,
    /// No answer within the bound.
    Unanswered,
}

/// `call`, cut short when NATS connects again while it is in flight or, with a `bound`, when
/// it has no answer within it; both only within `window` from `start`. Past the window the
/// call is left to finish (its own timeout gives the error), so a flapping connection or a
/// lasting outage cannot keep a call going forever.
async fn attempt_once<T>(
    call: impl Future<Output = T>,
    start: Instant,
    window: Duration,
    bound: Option<Duration>,
) -> Attempt<T> {
    let reconnects = Reconnects::from_now();
    let reconnected = async {
        reconnects.next().await;
        if start.elapsed() >= window {
            std::future::pending::<()>().await;
        }
    };
    let unanswered = async {
        match bound {
            Some(bound) if start.elapsed() < window => tokio::time::sleep(bound).await,
            _ => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        result = call => Attempt::Done(result),
        () = reconnected => Attempt::Reconnected,
        () = unanswered => Attempt::Unanswered,
    }
}

/// A KV entry's JSON value and revision (`None` when the key is missing or deleted), the read
/// tried again like [`retried`].
pub async fn kv_get_json<T: DeserializeOwned>(
    kv: &kv::Store,
    call: &str,
    window: Duration,
    key: &str,
) -> Result<Option<(T, u64)>, MeshError> {
    let bound = Some(REQUEST_ATTEMPT_TIMEOUT);
    match retried_bounded(call, window, bound, kv_entry_settled, || kv.entry(key)).await? {
        Some(entry) if entry.operation == kv::Operation::Put => Ok(Some((
            serde_json::from_slice(&entry.value)?,
            entry.revision,
        ))),
        _ => Ok(None),
    }
}

/// A KV create tried again like [`retried`], counting a write that landed as done: when its
/// reply was lost, the next attempt (and async-nats itself) finds the key taken, and the stored
/// value is then exactly `value`. The stored revision; fails with `KvCreate`
/// (`AlreadyExists`) when another value holds the key.
pub async fn kv_create(
    kv: &kv::Store,
    call: &str,
    window: Duration,
    key: &str,
    value: Bytes,
) -> Result<u64, MeshError> {
    let bound = Some(REQUEST_ATTEMPT_TIMEOUT);
    let created = retried_bounded(call, window, bound, kv_create_settled, || {
        kv.create(key, value.clone())
    })
    .await;
    match created {
        Ok(revision) => Ok(revision),
        Err(err) if err.kind() == kv::CreateErrorKind::AlreadyExists => {
            let stored =
                retried_bounded(call, window, bound, kv_entry_settled, || kv.entry(key)).await?;
            match stored {
                Some(entry) if entry.operation == kv::Operation::Put && entry.value == value => {
                    Ok(entry.revision)
                }
                _ => Err(err.into()),
            }
        }
        Err(err) => Err(err.into()),
    }
}

/// What [`kv_update_json`] did.
#[derive(Debug, PartialEq)]
pub enum KvUpdated<T> {
    /// `change` was applied to the latest value and written: the value as written, and its
    /// revision.
    Written(T, u64),
    /// `change` declined (returned false) on the latest value; nothing was written: that
    /// value and its revision.
    Declined(T, u64),
    /// The key is missing (or deleted).
    Missing,
}

/// Read-modify-write of a JSON entry with compare-and-set: `change` runs on the latest
/// revision, and its result is written only if nobody wrote in between (else the entry is read
/// again, up to `max_contended` times, then [`MeshError::KvContention`]). A write that failed
/// otherwise is tried again for `window` (an election); if it had landed after all, the next
/// read finds exactly the value written and the update is done.
///
/// `guess`, a value and revision the caller believes latest (its own last write), saves the
/// read: `change` is applied to it and written against its revision, and only when that
/// write finds a newer revision, or `change` declines on the guess, is the entry read.
pub async fn kv_update_json<T, F>(
    kv: &kv::Store,
    call: &str,
    window: Duration,
    key: &str,
    max_contended: u32,
    mut guess: Option<(T, u64)>,
    mut change: F,
) -> Result<KvUpdated<T>, MeshError>
where
    T: Serialize + DeserializeOwned + PartialEq + Clone,
    F: FnMut(&mut T) -> bool,
{
    let start = Instant::now();
    let mut written: Option<T> = None;
    let mut contended = 0;
    while contended < max_contended {
        let guessed = guess.is_some();
        let (mut value, revision) = match guess.take() {
            Some(known) => known,
            None => match kv_get_json::<T>(kv, call, window, key).await? {
                Some(latest) => latest,
                None => return Ok(KvUpdated::Missing),
            },
        };
        if written.as_ref() == Some(&value) {
            return Ok(KvUpdated::Written(value, revision));
        }
        let latest = value.clone();
        if !change(&mut value) {
            // A decline counts only on what is stored now, which a guess may not be.
            if guessed {
                continue;
            }
            return Ok(KvUpdated::Declined(latest, revision));
        }
        let bytes = Bytes::from(serde_json::to_vec(&value)?);
        let update = kv.update(key, bytes, revision);
        let result = match attempt_once(update, start, window, Some(REQUEST_ATTEMPT_TIMEOUT)).await
        {
            Attempt::Done(result) => result,
            cut_short => {
                // Landed or not: the next read tells.
                let why = if matches!(cut_short, Attempt::Reconnected) {
                    "NATS reconnected during the update"
                } else {
                    "no answer to the update in time"
                };
                tracing::info!(call, key, why, "trying the update again");
                count_retry(call);
                written = Some(value);
                continue;
            }
        };
        match result {
            Ok(revision) => return Ok(KvUpdated::Written(value, revision)),
            // A stale guess is no contention.
            Err(err) if err.kind() == kv::UpdateErrorKind::WrongLastRevision && guessed => {}
            Err(err) if err.kind() == kv::UpdateErrorKind::WrongLastRevision => contended += 1,
            Err(err)
                if err.kind() != kv::UpdateErrorKind::InvalidKey && start.elapsed() < window =>
            {
                tracing::warn!(call, key, error = %err, "JetStream call failed; trying again");
                count_retry(call);
                written = Some(value);
                tokio::time::sleep(RETRY_DELAY).await;
            }
            Err(err) => return Err(err.into()),
        }
    }
    Err(MeshError::KvContention {
        key: key.to_string(),
        attempts: max_contended,
    })
}

// KV errors that answer for the data (or the key), not for the cluster: not tried again.
fn kv_create_settled(e: &kv::CreateError) -> bool {
    matches!(
        e.kind(),
        kv::CreateErrorKind::AlreadyExists | kv::CreateErrorKind::InvalidKey
    )
}

/// For calls whose every failure is about the cluster (a stream listing, a publish to a
/// subject built from checked ids): every error is tried again.
pub fn no_error_settles<E>(_: &E) -> bool {
    false
}

/// A KV put's errors that are not tried again (an invalid key).
pub fn kv_put_settled(e: &kv::PutError) -> bool {
    e.kind() == kv::PutErrorKind::InvalidKey
}

fn kv_entry_settled(e: &kv::EntryError) -> bool {
    e.kind() == kv::EntryErrorKind::InvalidKey
}

#[cfg(test)]
mod tests {
    use super::*;

    fn never(_: &String) -> bool {
        false
    }
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn a_failing_call_is_tried_until_it_succeeds() {
        let calls = AtomicU32::new(0);
        let before = retries().with_label_values(&["test.succeeds"]).get();
        let result: Result<u32, String> =
            retried("test.succeeds", Duration::from_secs(5), never, || async {
                match calls.fetch_add(1, Ordering::SeqCst) {
                    0 | 1 => Err("no leader".to_string()),
                    n => Ok(n),
                }
            })
            .await;
        assert_eq!(result, Ok(2));
        assert_eq!(
            retries().with_label_values(&["test.succeeds"]).get() - before,
            2
        );
    }

    #[tokio::test]
    async fn a_settled_error_is_returned_at_once() {
        let calls = AtomicU32::new(0);
        let result: Result<(), String> = retried(
            "test.settled",
            Duration::from_secs(5),
            |e: &String| e == "exists",
            || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err("exists".to_string())
            },
        )
        .await;
        assert_eq!(result, Err("exists".to_string()));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn the_last_error_is_returned_once_the_window_has_passed() {
        let calls = AtomicU32::new(0);
        let start = Instant::now();
        let result: Result<(), String> = retried(
            "test.gives_up",
            Duration::from_millis(600),
            never,
            || async {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                Err(format!("attempt {n}"))
            },
        )
        .await;
        let n = calls.load(Ordering::SeqCst);
        assert!((3..=5).contains(&n), "{n} attempts in a 600 ms window");
        assert_eq!(result, Err(format!("attempt {}", n - 1)));
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    /// A request sent while its stream has no leader gets no answer: within the window it is
    /// sent again after the bound instead of waiting out the client's timeout.
    #[tokio::test]
    async fn an_unanswered_attempt_is_sent_again_after_the_bound() {
        let calls = AtomicU32::new(0);
        let start = Instant::now();
        let result: Result<u32, String> = retried_bounded(
            "test.unanswered",
            Duration::from_secs(5),
            Some(Duration::from_millis(50)),
            never,
            || {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 0 {
                        std::future::pending::<()>().await;
                    }
                    Ok(n)
                }
            },
        )
        .await;
        assert_eq!(result, Ok(1));
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
    }

    /// Past the window an attempt is no longer cut short: its own answer (here an error after
    /// 150 ms, three times the bound) ends the call.
    #[tokio::test]
    async fn past_the_window_an_attempt_runs_to_its_own_end() {
        let calls = AtomicU32::new(0);
        let result: Result<(), String> = tokio::time::timeout(
            Duration::from_secs(5),
            retried_bounded(
                "test.slow",
                Duration::from_millis(200),
                Some(Duration::from_millis(50)),
                never,
                || {
                    let n = calls.fetch_add(1, Ordering::SeqCst);
                    async move {
                        tokio::time::sleep(Duration::from_millis(150)).await;
                        Err(format!("slow {n}"))
                    }
                },
            ),
        )
        .await
        .expect("the call ended");
        let n = calls.load(Ordering::SeqCst);
        assert!(
            n >= 3,
            "only {n} attempts in a 200 ms window with a 50 ms bound"
        );
        assert_eq!(result, Err(format!("slow {}", n - 1)));
    }
}
