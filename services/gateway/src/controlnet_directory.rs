//! `GET /v1/controlnets`: the ControlNets a steered generation may name now, from the
//! heartbeats of the denoisers (what each can steer with, on its own or through ControlNet
//! workers) and of the ControlNet workers (what each serves and has loaded).
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_web::http::Method;
use actix_web::{web, HttpRequest, HttpResponse, Route};
use diffmesh_shared::controlnet_service::{ControlNetHeartbeat, HEARTBEAT as WORKER_HEARTBEAT};
use diffmesh_shared::messages::{decode, FieldError, Heartbeat};
use diffmesh_shared::subjects::DENOISER_HEARTBEAT;
use diffmesh_shared::MeshError;
use futures::StreamExt;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;

use crate::error::ErrorBody;
use crate::routes::{finish, ApiState};

/// A sender unheard of this long is gone (heartbeats come every second).
const STALE_AFTER: Duration = Duration::from_secs(5);

/// The routes, for `routes::routes()`.
pub fn routes() -> Vec<(Method, &'static str, Route)> {
    vec![(
        Method::GET,
        "/v1/controlnets",
        web::get().to(list_controlnets),
    )]
}

/// One ControlNet the mesh can steer with now.
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct ControlNetView {
    /// Name it in a generation's `controlnet.name`.
    pub id: String,
    /// Always `controlnet`.
    pub object: String,
    /// Denoisers that take generations steered by it, sorted (not draining).
    pub denoisers: Vec<String>,
    /// ControlNet workers that serve it, sorted (not draining).
    pub workers: Vec<ControlNetWorkerView>,
}

/// A ControlNet worker serving a ControlNet.
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct ControlNetWorkerView {
    pub id: String,
    /// Loaded now: its first step needs no load.
    pub resident: bool,
}

/// `GET /v1/controlnets`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ControlNetList {
    /// Always `list`.
    pub object: String,
    /// Sorted by id; empty while no denoiser can steer.
    pub data: Vec<ControlNetView>,
}

#[derive(Default)]
struct Seen {
    /// Denoiser id -> (ControlNets it steers with, when heard). A draining denoiser is not
    /// here: it takes no new jobs, so it steers nothing from now on.
    denoisers: HashMap<String, (Vec<String>, Instant)>,
    workers: HashMap<String, (ControlNetHeartbeat, Instant)>,
}

impl Seen {
    fn expire(&mut self) {
        self.denoisers
            .retain(|_, (_, at)| at.elapsed() < STALE_AFTER);
        self.workers.retain(|_, (_, at)| at.elapsed() < STALE_AFTER);
    }

    fn denoiser(&mut self, hb: Heartbeat) {
        if hb.draining {
            self.denoisers.remove(&hb.worker_id);
        } else {
            self.denoisers
                .insert(hb.worker_id, (hb.controlnets, Instant::now()));
        }
    }

    /// Whether a generation may name `name`: refused when denoisers that take jobs were heard
    /// and none steers with it; let through while none was heard (this gateway just started,
    /// or none is up: placement answers for the job then).
    fn check_offered(&self, name: &str) -> Result<(), FieldError> {
        if self.denoisers.is_empty()
            || self
                .denoisers
                .values()
                .any(|(nets, _)| nets.iter().any(|n| n == name))
        {
            return Ok(());
        }
        let offered: Vec<String> = self.views().into_iter().map(|v| v.id).collect();
        Err(FieldError::invalid(
            "controlnet.name",
            format!(
                "no denoiser steers with {name:?}; offered now: [{}] (GET /v1/controlnets)",
                offered.join(", ")
            ),
        ))
    }

    fn worker(&mut self, hb: ControlNetHeartbeat) {
        self.workers
            .insert(hb.worker_id.clone(), (hb, Instant::now()));
    }

    /// Every ControlNet some live denoiser steers with, with who serves it.
    fn views(&self) -> Vec<ControlNetView> {
        let mut by_name: BTreeMap<&str, ControlNetView> = BTreeMap::new();
        for (id, (nets, _)) in &self.denoisers {
            for name in nets {
                by_name
                    .entry(name)
                    .or_insert_with(|| ControlNetView {
                        id: name.clone(),
                        object: "controlnet".into(),
                        denoisers: Vec::new(),
                        workers: Vec::new(),
                    })
                    .denoisers
                    .push(id.clone());
            }
        }
        for (id, (hb, _)) in self.workers.iter().filter(|(_, (hb, _))| !hb.draining) {
            for name in &hb.served {
                if let Some(view) = by_name.get_mut(name.as_str()) {
                    view.workers.push(ControlNetWorkerView {
                        id: id.clone(),
                        resident: hb.resident.contains(name),
                    });
                }
            }
        }
        let mut views: Vec<ControlNetView> = by_name.into_values().collect();
        for v in &mut views {
            v.denoisers.sort();
            v.workers.sort_by(|a, b| a.id.cmp(&b.id));
        }
        views
    }
}

/// The table, kept from heartbeats in the background while this lives.
pub struct ControlNetDirectory {
    seen: Arc<Mutex<Seen>>,
    stop: CancellationToken,
}

impl Drop for ControlNetDirectory {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl ControlNetDirectory {
    /// Subscribe to both heartbeats (before returning, so none sent afterwards is missed).
    pub async fn watch(client: &async_nats::Client) -> Result<Self, MeshError> {
        let mut denoisers = client.subscribe(DENOISER_HEARTBEAT).await?;
        let mut workers = client.subscribe(WORKER_HEARTBEAT).await?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = CancellationToken::new();
        let (table, token) = (seen.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    msg = denoisers.next() => {
                        let Some(msg) = msg else { return };
                        match decode::<Heartbeat>(&msg.payload) {
                            Ok(hb) => lock(&table).denoiser(hb),
                            Err(err) => tracing::debug!(error = %err, "undecodable heartbeat"),
                        }
                    }
                    msg = workers.next() => {
                        let Some(msg) = msg else { return };
                        match decode::<ControlNetHeartbeat>(&msg.payload) {
                            Ok(hb) => lock(&table).worker(hb),
                            Err(err) => tracing::debug!(error = %err, "undecodable heartbeat"),
                        }
                    }
                }
            }
        });
        Ok(Self { seen, stop })
    }

    pub fn list(&self) -> Vec<ControlNetView> {
        let mut seen = lock(&self.seen);
        seen.expire();
        seen.views()
    }

    /// A steered generation's ControlNet, checked against what live denoisers offer (400
    /// naming `controlnet.name` when none does).
    pub fn check_offered(&self, name: &str) -> Result<(), FieldError> {
        let mut seen = lock(&self.seen);
        seen.expire();
        seen.check_offered(name)
    }
}

fn lock(seen: &Mutex<Seen>) -> std::sync::MutexGuard<'_, Seen> {
    seen.lock().unwrap_or_else(|p| p.into_inner())
}

#[utoipa::path(
    get,
    path = "/v1/controlnets",
    tag = "images",
    responses(
        (status = 200, description = "The ControlNets a generation's `controlnet.name` may name \
            now, with the denoisers and ControlNet workers that serve each", body = ControlNetList),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn list_controlnets(req: HttpRequest, state: web::Data<ApiState>) -> HttpResponse {
    let start = std::time::Instant::now();
    let result = async {
        state.caller(&req)?;
        Ok(HttpResponse::Ok().json(ControlNetList {
            object: "list".into(),
            data: state.controlnets.list(),
        }))
    }
    .await;
    finish(&state, "controlnets_list", start, result)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn denoiser(id: &str, nets: &[&str], draining: bool) -> Heartbeat {
        Heartbeat {
            worker_id: id.into(),
            running: Vec::new(),
            queued: 0,
            max_batch: 4,
            model: "tiny".into(),
            draining,
            queue_capacity: 16,
            cached_templates: Vec::new(),
            cached_loras: Vec::new(),
            controlnets: nets.iter().map(|s| s.to_string()).collect(),
            recent_steps: Vec::new(),
        }
    }

    fn worker(id: &str, served: &[&str], resident: &[&str], draining: bool) -> ControlNetHeartbeat {
        ControlNetHeartbeat {
            worker_id: id.into(),
            served: served.iter().map(|s| s.to_string()).collect(),
            resident: resident.iter().map(|s| s.to_string()).collect(),
            sessions: 0,
            queued: 0,
            draining,
        }
    }

    #[test]
    fn lists_what_live_denoisers_steer_with_and_the_workers_serving_it() {
        let mut seen = Seen::default();
        seen.denoiser(denoiser("d2", &["silhouette"], false));
        seen.denoiser(denoiser("d1", &["silhouette", "edges"], false));
        seen.denoiser(denoiser("d3", &["depth"], true)); // draining: steers nothing new
        seen.worker(worker("w2", &["silhouette"], &[], false));
        seen.worker(worker(
            "w1",
            &["silhouette", "pose"],
            &["silhouette"],
            false,
        ));
        seen.worker(worker("w3", &["edges"], &["edges"], true)); // draining
        let views = seen.views();
        let names: Vec<&str> = views.iter().map(|v| v.id.as_str()).collect();
        // "pose": a worker has it but no denoiser offers it, so no request may name it.
        assert_eq!(names, ["edges", "silhouette"]);
        assert_eq!(views[0].denoisers, ["d1"]);
        assert!(views[0].workers.is_empty());
        assert_eq!(views[1].denoisers, ["d1", "d2"]);
        assert_eq!(
            views[1].workers,
            [
                ControlNetWorkerView {
                    id: "w1".into(),
                    resident: true
                },
                ControlNetWorkerView {
                    id: "w2".into(),
                    resident: false
                },
            ]
        );
    }

    #[test]
    fn a_name_no_live_denoiser_offers_is_refused_once_denoisers_are_heard() {
        let mut seen = Seen::default();
        // Nothing heard yet (just started): let through, placement answers for it.
        assert!(seen.check_offered("canny").is_ok());
        seen.denoiser(denoiser("d1", &["silhouette"], false));
        seen.denoiser(denoiser("d2", &["edges"], false));
        assert!(seen.check_offered("silhouette").is_ok());
        let e = seen.check_offered("canny").unwrap_err();
        assert_eq!(e.field, "controlnet.name");
        assert!(e.message.contains("\"canny\"") && e.message.contains("[edges, silhouette]"));
        // A draining denoiser no longer offers its ControlNets.
        seen.denoiser(denoiser("d2", &["edges"], true));
        assert!(seen.check_offered("edges").is_err());
        seen.denoiser(denoiser("d1", &["silhouette"], true));
        assert!(
            seen.check_offered("edges").is_ok(),
            "none heard that takes jobs"
        );
    }

    #[test]
    fn a_silent_sender_drops_out() {
        let mut seen = Seen::default();
        seen.denoiser(denoiser("d1", &["silhouette"], false));
        seen.denoisers.get_mut("d1").unwrap().1 = Instant::now() - STALE_AFTER;
        seen.expire();
        assert!(seen.views().is_empty());
    }
}
