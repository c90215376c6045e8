//! The denoisers' last heartbeats, kept from one subscription for every part of the gateway
//! that reads them: the template views (which denoisers hold a template's cache in their local
//! tier) and the ControlNet directory (what each steers with).
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use diffmesh_shared::messages::{decode, Heartbeat};
use diffmesh_shared::subjects::DENOISER_HEARTBEAT;
use diffmesh_shared::MeshError;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

/// A denoiser unheard of this long is gone (denoisers beat every 500 ms by default; the router
/// expires them sooner).
pub const STALE_AFTER: Duration = Duration::from_secs(5);

type Table = HashMap<String, (Heartbeat, Instant)>;

struct Shared {
    table: Mutex<Table>,
    stop: CancellationToken,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The table; clones share it, and the background task keeping it stops with the last clone.
#[derive(Clone)]
pub struct DenoiserHeartbeats {
    shared: Arc<Shared>,
}

impl DenoiserHeartbeats {
    /// Subscribe (before returning, so no heartbeat sent afterwards is missed) and keep the
    /// table in the background.
    pub async fn watch(client: &async_nats::Client) -> Result<Self, MeshError> {
        let mut sub = client.subscribe(DENOISER_HEARTBEAT).await?;
        let heartbeats = Self::empty();
        // Weak: the task must not keep the table (and itself) alive.
        let (kept, token) = (
            Arc::downgrade(&heartbeats.shared),
            heartbeats.shared.stop.clone(),
        );
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    _ = token.cancelled() => return,
                    msg = sub.next() => match msg { Some(m) => m, None => return },
                };
                let Some(shared) = kept.upgrade() else { return };
                match decode::<Heartbeat>(&msg.payload) {
                    Ok(hb) => record(&mut lock(&shared.table), hb, Instant::now()),
                    Err(err) => tracing::debug!(error = %err, "undecodable heartbeat"),
                }
            }
        });
        Ok(heartbeats)
    }

    /// A table no subscription fills (tests fill it with [`Self::record`]).
    pub fn empty() -> Self {
        Self {
            shared: Arc::new(Shared {
                table: Mutex::default(),
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Keep `hb` as its denoiser's last heartbeat, heard at `at`.
    pub fn record(&self, hb: Heartbeat, at: Instant) {
        record(&mut lock(&self.shared.table), hb, at);
    }

    /// `f` over the last heartbeat of every denoiser heard within [`STALE_AFTER`] (the others
    /// are dropped first).
    pub fn read<R>(&self, f: impl FnOnce(&mut dyn Iterator<Item = &Heartbeat>) -> R) -> R {
        let mut table = lock(&self.shared.table);
        table.retain(|_, (_, at)| at.elapsed() < STALE_AFTER);
        f(&mut table.values().map(|(hb, _)| hb))
    }
}

fn record(table: &mut Table, hb: Heartbeat, at: Instant) {
    table.insert(hb.worker_id.clone(), (hb, at));
}

fn lock(table: &Mutex<Table>) -> MutexGuard<'_, Table> {
    table.lock().unwrap_or_else(|p| p.into_inner())
}

/// A heartbeat for unit tests.
#[cfg(test)]
pub fn heartbeat(id: &str, controlnets: &[&str], templates: &[&str], draining: bool) -> Heartbeat {
    Heartbeat {
        worker_id: id.into(),
        running: Vec::new(),
        queued: 0,
        waiting: Vec::new(),
        max_batch: 4,
        model: "tiny".into(),
        draining,
        queue_capacity: 16,
        cached_templates: templates.iter().map(|s| s.to_string()).collect(),
        cached_loras: Vec::new(),
        controlnets: controlnets.iter().map(|s| s.to_string()).collect(),
        recent_steps: Vec::new(),
        controlnet_step_s: vec![],
        interval_ms: 500,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_heartbeat_counts_and_silent_denoisers_drop_out() {
        let table = DenoiserHeartbeats::empty();
        table.record(heartbeat("d1", &[], &["a"], false), Instant::now());
        table.record(heartbeat("d1", &[], &["b"], false), Instant::now());
        table.record(
            heartbeat("d2", &[], &["a"], false),
            Instant::now() - STALE_AFTER,
        );
        let seen: Vec<(String, Vec<String>)> = table.read(|hbs| {
            hbs.map(|hb| (hb.worker_id.clone(), hb.cached_templates.clone()))
                .collect()
        });
        assert_eq!(seen, [("d1".to_string(), vec!["b".to_string()])]);
    }
}
