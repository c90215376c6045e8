//! Noticing that NATS connected again. Two things are lost with a connection that drops:
//! a request written to the dead socket before the drop was noticed (its reply never comes;
//! it would wait out its whole timeout, 5-10 s), and a JetStream consumer that was
//! streaming to the client (async-nats's ordered consumer notices only when its idle
//! heartbeats stay away, 10 s; until then a watch sees nothing). Both are mended by trying
//! again once connected: `transient::retried` starts an attempt in flight over, and
//! `reopening_watch` opens its watch again.
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
}
