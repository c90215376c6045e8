//! Noticing that NATS connected again. Two things are lost with a connection that drops:
//! a request written to the dead socket before the drop was noticed (its reply never comes;
//! it would wait out its whole timeout, 5-10 s), and a JetStream consumer that was
//! streaming to the client (async-nats's ordered consumer notices only when its idle
//! heartbeats stay away, 10 s; until then a watch sees nothing). Both are mended by trying
//! again once connected: `transient::retried` starts an attempt in flight over,
//! `nats::request_msgpack` sends its request again, and `reopening_watch` opens its watch
//! again.
//!
//! The signal is process-wide: [`crate::nats::connect`] reports every connect of its
//! clients here. A service holds one client; where a process holds several (tests), another
//! client's reconnect only makes a call try again, which every caller must allow anyway.
use std::sync::OnceLock;

use tokio::sync::watch;

fn connects() -> &'static watch::Sender<u64> {
    static CONNECTS: OnceLock<watch::Sender<u64>> = OnceLock::new();
    CONNECTS.get_or_init(|| watch::Sender::new(0))
}

/// Count a (re)connect of a client of this process (`nats::connect`'s event callback).
pub fn note_connect() {
    connects().send_modify(|n| *n += 1);
}

/// The client's first connect, which async-nats reports to the event callback from a task of
/// its own, possibly after `connect` returned: waiting for it keeps it from counting as a
/// reconnect for the first watches the service opens (one needless reopening each).
#[derive(Debug)]
pub(crate) struct FirstConnect {
    connects: watch::Receiver<u64>,
}

impl FirstConnect {
    /// Taken before connecting.
    pub(crate) fn before_connecting() -> Self {
        Self {
            connects: connects().subscribe(),
        }
    }

    /// Once a connect was counted since [`before_connecting`](Self::before_connecting), or
    /// after [`FIRST_CONNECT_WAIT`] (the callback is late or never comes: nothing breaks).
    pub(crate) async fn counted(mut self) {
        let _ = tokio::time::timeout(FIRST_CONNECT_WAIT, self.connects.changed()).await;
    }
}

/// Longest wait for the event of a client's first connect.
const FIRST_CONNECT_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Waits for connects after a point in time.
#[derive(Debug, Clone)]
pub struct Reconnects {
    connects: watch::Receiver<u64>,
}

impl Reconnects {
    /// Counting from now: connects before this call are not reconnects.
    pub fn from_now() -> Self {
        Self::watching(connects().subscribe())
    }

    /// Over another counter (tests send on its sender).
    pub fn watching(mut connects: watch::Receiver<u64>) -> Self {
        connects.mark_unchanged();
        Self { connects }
    }

    /// Forget connects so far (call it before opening what a reconnect would invalidate, so a
    /// reconnect during the opening is still noticed).
    pub fn mark_seen(&mut self) {
        self.connects.mark_unchanged();
    }

    /// Resolves once a client connected again since the last [`mark_seen`](Self::mark_seen)
    /// (or creation); cancel-safe, and it does not mark the connect seen.
    pub async fn next(&self) {
        let mut connects = self.connects.clone();
        // The process's sender lives in a static; a dropped one (tests) sends nothing more.
        if connects.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_connect_after_mark_seen_is_noticed_and_earlier_ones_are_not() {
        let (sender, receiver) = watch::channel(1u64);
        sender.send_modify(|n| *n += 1);
        let mut reconnects = Reconnects::watching(receiver);
        let waiting = tokio::time::timeout(Duration::from_millis(50), reconnects.next()).await;
        assert!(
            waiting.is_err(),
            "a connect before creation is not a reconnect"
        );
        sender.send_modify(|n| *n += 1);
        tokio::time::timeout(Duration::from_secs(5), reconnects.next())
            .await
            .expect("a reconnect is noticed");
        reconnects.next().await; // still unseen: noticed again
        reconnects.mark_seen();
        let waiting = tokio::time::timeout(Duration::from_millis(50), reconnects.next()).await;
        assert!(waiting.is_err(), "seen");
    }

    #[tokio::test]
    async fn a_clients_first_connect_is_not_a_reconnect() {
        // The only test of this crate that connects: nothing else moves the process's counter.
        let server = crate::testing::NatsServer::start();
        for _ in 0..20 {
            let client =
                crate::nats::connect(&server.url(), "first-connect", Duration::from_secs(10))
                    .await
                    .expect("connects");
            let reconnects = Reconnects::from_now();
            let spurious =
                tokio::time::timeout(Duration::from_millis(100), reconnects.next()).await;
            assert!(
                spurious.is_err(),
                "the first connect's event came after connect returned"
            );
            drop(client);
        }
    }
}
