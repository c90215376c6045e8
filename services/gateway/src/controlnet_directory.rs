//! The ControlNets a steered generation may name now (`GET /v1/controlnets`), from the
//! heartbeats of the denoisers (what each can steer with, on its own or through ControlNet
//! workers) and of the ControlNet workers (what each serves and has loaded); the heartbeats
//! are kept by the `directory` actor, which answers with these views.
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use diffmesh_shared::wire::controlnet_service::ControlNetHeartbeat;
use diffmesh_shared::wire::messages::{FieldError, Heartbeat};
use serde::Serialize;
use utoipa::ToSchema;

/// A worker unheard of this long is gone (they beat every 500 ms by default; the router
/// expires denoisers sooner).
pub const STALE_AFTER: Duration = Duration::from_secs(5);

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

/// The denoisers that take jobs: a draining one takes no new jobs, so it steers nothing from
/// now on.
pub fn taking_jobs<'a>(hbs: &mut dyn Iterator<Item = &'a Heartbeat>) -> Vec<&'a Heartbeat> {
    hbs.filter(|hb| !hb.draining).collect()
}

/// The ControlNet workers' last heartbeats.
#[derive(Default)]
pub struct Workers {
    seen: HashMap<String, (ControlNetHeartbeat, Instant)>,
}

impl Workers {
    pub fn expire(&mut self) {
        self.seen.retain(|_, (_, at)| at.elapsed() < STALE_AFTER);
    }

    pub fn record(&mut self, hb: ControlNetHeartbeat) {
        self.seen.insert(hb.worker_id.clone(), (hb, Instant::now()));
    }

    /// Every ControlNet some denoiser steers with, with who serves it.
    pub fn views(&self, denoisers: &[&Heartbeat]) -> Vec<ControlNetView> {
        let mut by_name: BTreeMap<&str, ControlNetView> = BTreeMap::new();
        for d in denoisers {
            for name in &d.controlnets {
                by_name
                    .entry(name)
                    .or_insert_with(|| ControlNetView {
                        id: name.clone(),
                        object: "controlnet".into(),
                        denoisers: Vec::new(),
                        workers: Vec::new(),
                    })
                    .denoisers
                    .push(d.worker_id.clone());
            }
        }
        for (id, (hb, _)) in self.seen.iter().filter(|(_, (hb, _))| !hb.draining) {
            for name in hb.served.iter().chain(&hb.served_unet) {
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

/// Whether a generation of `model` may name the ControlNets `wanted` (each with the request's
/// field naming it): refused when denoisers of that model that take jobs were heard and none
/// steers with one of them, or (several) none steers with all of them, since a job runs on one
/// denoiser; let through while none was heard (this gateway just started, or none is up:
/// placement answers for the job then).
pub fn check_offered(
    denoisers: &[&Heartbeat],
    wanted: &[(&str, &str)],
    model: &str,
) -> Result<(), FieldError> {
    // A ControlNet fits one model's network: only the denoisers of the requested model count.
    let of_model: Vec<&&Heartbeat> = denoisers.iter().filter(|d| d.model == model).collect();
    if of_model.is_empty() {
        return Ok(());
    }
    let offers = |d: &Heartbeat, name: &str| d.controlnets.iter().any(|n| n == name);
    let mut offered: Vec<&str> = of_model
        .iter()
        .flat_map(|d| d.controlnets.iter().map(String::as_str))
        .collect();
    offered.sort_unstable();
    offered.dedup();
    let on_offer = offered.join(", ");
    for (name, field) in wanted {
        if !of_model.iter().any(|d| offers(d, name)) {
            return Err(FieldError::invalid(
                *field,
                format!(
                    "no denoiser of model {model:?} steers with {name:?}; offered for it now: \
                     [{on_offer}] (GET /v1/controlnets)"
                ),
            ));
        }
    }
    if wanted.len() > 1
        && !of_model
            .iter()
            .any(|d| wanted.iter().all(|(name, _)| offers(d, name)))
    {
        let names: Vec<&str> = wanted.iter().map(|(name, _)| *name).collect();
        return Err(FieldError::invalid(
            "controlnets",
            format!(
                "no denoiser of model {model:?} steers with all of {names:?} together \
                 (GET /v1/controlnets lists who steers with each)"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::directory::heartbeat;

    fn worker(id: &str, served: &[&str], resident: &[&str], draining: bool) -> ControlNetHeartbeat {
        ControlNetHeartbeat {
            worker_id: id.into(),
            served: served.iter().map(|s| s.to_string()).collect(),
            served_unet: Vec::new(),
            resident: resident.iter().map(|s| s.to_string()).collect(),
            sessions: 0,
            queued: 0,
            draining,
            interval_ms: 500,
        }
    }

    /// The denoisers as the directory reads them.
    fn denoisers(hbs: &[Heartbeat]) -> Vec<&Heartbeat> {
        taking_jobs(&mut hbs.iter())
    }

    #[test]
    fn lists_what_live_denoisers_steer_with_and_the_workers_serving_it() {
        let heard = [
            heartbeat("d2", &["silhouette"], &[], false),
            heartbeat("d1", &["silhouette", "edges"], &[], false),
            heartbeat("d3", &["depth"], &[], true), // draining: steers nothing new
        ];
        let mut workers = Workers::default();
        workers.record(worker("w2", &["silhouette"], &[], false));
        workers.record(worker(
            "w1",
            &["silhouette", "pose"],
            &["silhouette"],
            false,
        ));
        workers.record(worker("w3", &["edges"], &["edges"], true)); // draining
        let views = workers.views(&denoisers(&heard));
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
        let check = |hbs: &[Heartbeat], name: &str| {
            check_offered(&denoisers(hbs), &[(name, "controlnet.name")], "tiny")
        };
        // Nothing heard yet (just started): let through, placement answers for it.
        assert!(check(&[], "canny").is_ok());
        let live = [
            heartbeat("d1", &["silhouette"], &[], false),
            heartbeat("d2", &["edges", "silhouette"], &[], false),
        ];
        assert!(check(&live, "silhouette").is_ok());
        let e = check(&live, "canny").unwrap_err();
        assert_eq!(e.field, "controlnet.name");
        assert!(
            e.message.contains("\"canny\"") && e.message.contains("[edges, silhouette]"),
            "{}",
            e.message
        );
        // A draining denoiser no longer offers its ControlNets.
        let d2_draining = [live[0].clone(), heartbeat("d2", &["edges"], &[], true)];
        assert!(check(&d2_draining, "edges").is_err());
        let all_draining = [heartbeat("d2", &["edges"], &[], true)];
        assert!(
            check(&all_draining, "edges").is_ok(),
            "none heard that takes jobs"
        );
        // Another model's ControlNets do not steer this one's generations.
        let mut sd = heartbeat("d3", &["depth"], &[], false);
        sd.model = "sd".into();
        let mixed = [live[0].clone(), sd];
        let e = check(&mixed, "depth").unwrap_err();
        assert!(e.message.contains("[silhouette]"), "{}", e.message);
        let sd = |wanted: &[(&str, &str)]| check_offered(&denoisers(&mixed), wanted, "sd");
        assert!(sd(&[("depth", "controlnets[1].name")]).is_ok());
        let e = sd(&[
            ("depth", "controlnets[0].name"),
            ("edges", "controlnets[1].name"),
        ]);
        assert_eq!(e.unwrap_err().field, "controlnets[1].name");
        assert!(
            check_offered(
                &denoisers(&mixed),
                &[("depth", "controlnet.name")],
                "unheard"
            )
            .is_ok(),
            "no denoiser of that model heard: placement answers"
        );
        // Several must be on one denoiser: a job runs on one.
        let apart = [
            heartbeat("d1", &["edges"], &[], false),
            heartbeat("d2", &["depth"], &[], false),
            heartbeat("d3", &["edges", "pose"], &[], false),
        ];
        let both = [
            ("edges", "controlnets[0].name"),
            ("depth", "controlnets[1].name"),
        ];
        let e = check_offered(&denoisers(&apart), &both, "tiny").unwrap_err();
        assert_eq!(e.field, "controlnets");
        let together = [
            ("edges", "controlnets[0].name"),
            ("pose", "controlnets[1].name"),
        ];
        assert!(check_offered(&denoisers(&apart), &together, "tiny").is_ok());
    }

    #[test]
    fn a_silent_worker_drops_out() {
        let heard = [heartbeat("d1", &["silhouette"], &[], false)];
        let mut workers = Workers::default();
        workers.record(worker("w1", &["silhouette"], &[], false));
        workers.seen.get_mut("w1").unwrap().1 = Instant::now() - STALE_AFTER;
        workers.expire();
        assert!(workers.views(&denoisers(&heard))[0].workers.is_empty());
    }
}
