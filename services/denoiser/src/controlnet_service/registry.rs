//! The ControlNet workers a denoiser knows of, from their heartbeats.
use diffmesh_shared::wire::controlnet_service::{ControlNetHeartbeat, HEARTBEAT};
use diffmesh_shared::wire::messages::decode;
use futures::StreamExt;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// The network a denoiser's ControlNets steer: which of a worker's lists it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Network {
    /// Flux ControlNets (`ControlNetHeartbeat::served`).
    Flux,
    /// The UNet family's (`ControlNetHeartbeat::served_unet`).
    Unet,
}

/// Workers by id with their latest heartbeat; one that missed `missed` of its heartbeats (at
/// the period they announce) is gone. Lookups see only the ControlNets of `network`.
#[derive(Clone)]
pub struct ControlNetWorkers {
    seen: Arc<Mutex<HashMap<String, (ControlNetHeartbeat, Instant)>>>,
    missed: u32,
    network: Network,
}

impl ControlNetWorkers {
    pub fn new(missed: u32, network: Network) -> Self {
        Self {
            seen: Arc::new(Mutex::new(HashMap::new())),
            missed: missed.max(1),
            network,
        }
    }

    /// The ControlNets of this registry's network that `hb` serves.
    fn names<'a>(&self, hb: &'a ControlNetHeartbeat) -> &'a [String] {
        match self.network {
            Network::Flux => &hb.served,
            Network::Unet => &hb.served_unet,
        }
    }

    pub fn record(&self, hb: ControlNetHeartbeat) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.insert(hb.worker_id.clone(), (hb, Instant::now()));
        }
    }

    /// `f` over the heartbeats of the workers alive (and not draining) now, under the lock:
    /// lookups run on every steered step, so nothing is cloned but what `f` returns.
    fn with_live<R: Default>(&self, f: impl FnOnce(Vec<&ControlNetHeartbeat>) -> R) -> R {
        let Ok(mut seen) = self.seen.lock() else {
            return R::default();
        };
        seen.retain(|_, (hb, at)| at.elapsed() < hb.interval() * self.missed);
        f(seen
            .values()
            .map(|(hb, _)| hb)
            .filter(|hb| !hb.draining)
            .collect())
    }

    /// The ControlNets some live worker serves.
    pub fn served(&self) -> BTreeSet<String> {
        self.with_live(|live| {
            live.into_iter()
                .flat_map(|hb| self.names(hb).iter().cloned())
                .collect()
        })
    }

    pub fn serves(&self, name: &str) -> bool {
        self.with_live(|live| {
            live.into_iter()
                .any(|hb| self.names(hb).iter().any(|n| n == name))
        })
    }

    /// The worker to open a session of `name` on, passing over those in `avoid`: one that has
    /// it loaded first (Katz keeps the popular ControlNets resident), then the least busy
    /// (sessions plus queued requests), then by id so that ties go one way.
    pub fn pick(&self, name: &str, avoid: &[String]) -> Option<String> {
        self.with_live(|live| {
            live.into_iter()
                .filter(|hb| !avoid.contains(&hb.worker_id))
                .filter(|hb| self.names(hb).iter().any(|n| n == name))
                .min_by_key(|hb| {
                    let loaded = hb.resident.iter().any(|n| n == name);
                    (!loaded, hb.sessions + hb.queued, hb.worker_id.as_str())
                })
                .map(|hb| hb.worker_id.clone())
        })
    }

    /// Record heartbeats until `stop`.
    pub async fn listen(self, client: async_nats::Client, stop: CancellationToken) {
        let mut sub = match client.subscribe(HEARTBEAT).await {
            Ok(sub) => sub,
            Err(e) => {
                tracing::warn!(error = %e, "cannot follow ControlNet workers");
                return;
            }
        };
        loop {
            let msg = tokio::select! {
                _ = stop.cancelled() => break,
                msg = sub.next() => match msg { Some(m) => m, None => break },
            };
            match decode::<ControlNetHeartbeat>(&msg.payload) {
                Ok(hb) => self.record(hb),
                Err(e) => tracing::debug!(error = %e, "undecodable ControlNet heartbeat"),
            }
        }
        let _ = sub.unsubscribe().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hb(id: &str, served: &[&str], resident: &[&str], sessions: u32) -> ControlNetHeartbeat {
        ControlNetHeartbeat {
            worker_id: id.into(),
            served: served.iter().map(|s| s.to_string()).collect(),
            served_unet: Vec::new(),
            resident: resident.iter().map(|s| s.to_string()).collect(),
            sessions,
            queued: 0,
            draining: false,
            interval_ms: 10,
        }
    }

    #[test]
    fn picks_a_worker_with_the_controlnet_loaded_then_the_least_busy() {
        let w = ControlNetWorkers::new(500, Network::Flux);
        w.record(hb("a", &["canny", "depth"], &["depth"], 0));
        w.record(hb("b", &["canny"], &["canny"], 9));
        w.record(hb("c", &["canny"], &[], 1));
        assert_eq!(w.pick("canny", &[]).as_deref(), Some("b"));
        assert_eq!(w.pick("canny", &["b".into()]).as_deref(), Some("a"));
        assert_eq!(w.pick("depth", &[]).as_deref(), Some("a"));
        assert_eq!(w.pick("pose", &[]), None);
        let mut draining = hb("b", &["canny"], &["canny"], 0);
        draining.draining = true;
        w.record(draining);
        assert_eq!(w.pick("canny", &[]).as_deref(), Some("a"));
        assert_eq!(
            w.served().into_iter().collect::<Vec<_>>(),
            ["canny", "depth"]
        );
    }

    #[test]
    fn each_network_sees_only_its_own_controlnets() {
        let mut both = hb("a", &["canny"], &["canny"], 0);
        both.served_unet = vec!["depth-xl".into()];
        let flux_only = hb("b", &["canny"], &[], 0);
        let (flux, unet) = (
            ControlNetWorkers::new(500, Network::Flux),
            ControlNetWorkers::new(500, Network::Unet),
        );
        for w in [&flux, &unet] {
            w.record(both.clone());
            w.record(flux_only.clone());
        }
        assert!(flux.serves("canny") && !flux.serves("depth-xl"));
        assert!(unet.serves("depth-xl") && !unet.serves("canny"));
        assert_eq!(unet.pick("depth-xl", &[]).as_deref(), Some("a"));
        assert_eq!(unet.pick("canny", &[]), None);
        assert_eq!(unet.served().into_iter().collect::<Vec<_>>(), ["depth-xl"]);
    }

    #[test]
    fn silent_workers_expire() {
        // Heartbeats every 10 ms: gone after 2 missed.
        let w = ControlNetWorkers::new(2, Network::Flux);
        w.record(hb("a", &["canny"], &[], 0));
        assert!(w.serves("canny"));
        std::thread::sleep(std::time::Duration::from_millis(40));
        assert!(!w.serves("canny"));
        assert_eq!(w.pick("canny", &[]), None);
    }
}
