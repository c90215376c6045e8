//! The mesh's workers as the gateway hears them: an actor ([`Directory`]) that owns the last
//! heartbeat of every denoiser and of every ControlNet worker, fed by one subscription each,
//! and answers the parts of the gateway that read them: the template views (which denoisers
//! hold a template's cache in their local tier), the ControlNet views and checks
//! (`controlnet_directory`: what a steered generation may name) and the models requests may
//! name (`model_catalogue`).
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, Addr, Context, Handler, Message, MessageResult};
use diffmesh_shared::wire::controlnet_service::{
    ControlNetHeartbeat, HEARTBEAT as WORKER_HEARTBEAT,
};
use diffmesh_shared::wire::messages::{decode, FieldError, Heartbeat};
use diffmesh_shared::wire::subjects::DENOISER_HEARTBEAT;
use diffmesh_shared::MeshError;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::controlnet_directory::{
    check_offered, taking_jobs, ControlNetView, Workers, STALE_AFTER,
};
use crate::model_catalogue::{ModelCatalogue, NoModel, ResolvedModel};

/// The actor: the heartbeats, by worker id, and the models they announced.
#[derive(Default)]
pub struct Directory {
    denoisers: HashMap<String, (Heartbeat, Instant)>,
    workers: Workers,
    models: ModelCatalogue,
}

impl Actor for Directory {
    type Context = Context<Self>;
}

/// The denoisers heard within [`STALE_AFTER`] (the others are dropped first).
fn live(denoisers: &mut HashMap<String, (Heartbeat, Instant)>) -> Vec<&Heartbeat> {
    denoisers.retain(|_, (_, at)| at.elapsed() < STALE_AFTER);
    denoisers.values().map(|(hb, _)| hb).collect()
}

/// A denoiser's heartbeat, heard at the instant given.
pub struct DenoiserBeat(pub Heartbeat, pub Instant);

impl Message for DenoiserBeat {
    type Result = ();
}

impl Handler<DenoiserBeat> for Directory {
    type Result = ();

    fn handle(&mut self, msg: DenoiserBeat, _: &mut Context<Self>) {
        self.models.record(&msg.0, msg.1);
        self.denoisers
            .insert(msg.0.worker_id.clone(), (msg.0, msg.1));
    }
}

/// The model a request runs on (`ModelCatalogue::resolve`): the one it names, else `default`.
pub struct ResolveModel {
    pub requested: Option<String>,
    pub default: Option<String>,
}

impl Message for ResolveModel {
    type Result = Result<ResolvedModel, NoModel>;
}

impl Handler<ResolveModel> for Directory {
    type Result = Result<ResolvedModel, NoModel>;

    fn handle(&mut self, msg: ResolveModel, _: &mut Context<Self>) -> Self::Result {
        self.models.resolve(
            msg.requested.as_deref(),
            msg.default.as_deref(),
            Instant::now(),
        )
    }
}

/// A ControlNet worker's heartbeat.
pub struct WorkerBeat(pub ControlNetHeartbeat);

impl Message for WorkerBeat {
    type Result = ();
}

impl Handler<WorkerBeat> for Directory {
    type Result = ();

    fn handle(&mut self, msg: WorkerBeat, _: &mut Context<Self>) {
        self.workers.record(msg.0);
    }
}

/// The last heartbeat of every live denoiser.
pub struct Denoisers;

impl Message for Denoisers {
    type Result = Vec<Heartbeat>;
}

impl Handler<Denoisers> for Directory {
    type Result = MessageResult<Denoisers>;

    fn handle(&mut self, _: Denoisers, _: &mut Context<Self>) -> Self::Result {
        MessageResult(live(&mut self.denoisers).into_iter().cloned().collect())
    }
}

/// The ControlNets a generation may name now, with who serves each.
pub struct ControlNets;

impl Message for ControlNets {
    type Result = Vec<ControlNetView>;
}

impl Handler<ControlNets> for Directory {
    type Result = MessageResult<ControlNets>;

    fn handle(&mut self, _: ControlNets, _: &mut Context<Self>) -> Self::Result {
        self.workers.expire();
        let denoisers = live(&mut self.denoisers);
        MessageResult(self.workers.views(&taking_jobs(&mut denoisers.into_iter())))
    }
}

/// Whether a steered generation of `model` may name the ControlNets `wanted`
/// (`controlnet_directory::check_offered`).
pub struct CheckOffered {
    /// Each ControlNet with the request's field naming it (`controlnet.name`,
    /// `controlnets[i].name`).
    pub wanted: Vec<(String, String)>,
    pub model: String,
}

impl Message for CheckOffered {
    type Result = Result<(), FieldError>;
}

impl Handler<CheckOffered> for Directory {
    type Result = Result<(), FieldError>;

    fn handle(&mut self, msg: CheckOffered, _: &mut Context<Self>) -> Self::Result {
        let denoisers = live(&mut self.denoisers);
        let wanted: Vec<(&str, &str)> = msg
            .wanted
            .iter()
            .map(|(name, field)| (name.as_str(), field.as_str()))
            .collect();
        check_offered(
            &taking_jobs(&mut denoisers.into_iter()),
            &wanted,
            &msg.model,
        )
    }
}

/// Stops the subscriptions feeding the actor once the last handle is gone.
struct Feeds(CancellationToken);

impl Drop for Feeds {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// The gateway's handle on the directory (cheap to clone).
#[derive(Clone)]
pub struct MeshDirectory {
    addr: Addr<Directory>,
    _feeds: Arc<Feeds>,
    /// When it began to listen (`request_model` waits a moment for the first heartbeats).
    since: Instant,
}

impl MeshDirectory {
    /// Start the actor and subscribe to both kinds of heartbeat (before returning, so none
    /// sent afterwards is missed).
    pub async fn watch(client: &async_nats::Client) -> Result<Self, MeshError> {
        let directory = Self::empty();
        let stop = directory._feeds.0.clone();
        let denoisers = client.subscribe(DENOISER_HEARTBEAT).await?;
        let workers = client.subscribe(WORKER_HEARTBEAT).await?;
        let addr = directory.addr.clone();
        tokio::spawn(feed(denoisers, stop.clone(), move |hb: Heartbeat| {
            addr.do_send(DenoiserBeat(hb, Instant::now()))
        }));
        let addr = directory.addr.clone();
        tokio::spawn(feed(workers, stop, move |hb: ControlNetHeartbeat| {
            addr.do_send(WorkerBeat(hb))
        }));
        Ok(directory)
    }

    /// A directory no subscription feeds (tests feed it with [`Self::record_denoiser`]).
    pub fn empty() -> Self {
        Self {
            addr: diffmesh_shared::process::actors::start(|_| Directory::default()),
            _feeds: Arc::new(Feeds(CancellationToken::new())),
            since: Instant::now(),
        }
    }

    /// When the directory began to listen for heartbeats.
    pub fn since(&self) -> Instant {
        self.since
    }

    /// Keep `hb` as its denoiser's last heartbeat, heard at `at`.
    pub fn record_denoiser(&self, hb: Heartbeat, at: Instant) {
        self.addr.do_send(DenoiserBeat(hb, at));
    }

    /// The last heartbeat of every live denoiser (none when the actor is gone).
    pub async fn denoisers(&self) -> Vec<Heartbeat> {
        self.addr.send(Denoisers).await.unwrap_or_default()
    }

    /// The ControlNets a generation may name now.
    pub async fn controlnets(&self) -> Vec<ControlNetView> {
        self.addr.send(ControlNets).await.unwrap_or_default()
    }

    /// The model a request runs on; `NoneHeard` also when the actor is gone.
    pub async fn resolve_model(
        &self,
        requested: Option<&str>,
        default: Option<&str>,
    ) -> Result<ResolvedModel, NoModel> {
        self.addr
            .send(ResolveModel {
                requested: requested.map(str::to_string),
                default: default.map(str::to_string),
            })
            .await
            .unwrap_or(Err(NoModel::NoneHeard))
    }

    /// A steered generation's ControlNet, checked against what live denoisers offer.
    pub async fn check_offered(
        &self,
        wanted: Vec<(String, String)>,
        model: &str,
    ) -> Result<(), FieldError> {
        // A directory that is gone lets the request through: placement answers for it then.
        self.addr
            .send(CheckOffered {
                wanted,
                model: model.to_string(),
            })
            .await
            .unwrap_or(Ok(()))
    }
}

/// Decode every message of `sub` as `T` and hand it to `deliver`, until `stop`.
async fn feed<T: DeserializeOwned>(
    mut sub: async_nats::Subscriber,
    stop: CancellationToken,
    deliver: impl Fn(T),
) {
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => return,
            msg = sub.next() => match msg { Some(m) => m, None => return },
        };
        match decode::<T>(&msg.payload) {
            Ok(hb) => deliver(hb),
            Err(err) => tracing::debug!(error = %err, "undecodable heartbeat"),
        }
    }
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
        card: None,
        draining,
        queue_capacity: 16,
        cached_templates: templates.iter().map(|s| s.to_string()).collect(),
        cached_loras: Vec::new(),
        controlnets: controlnets.iter().map(|s| s.to_string()).collect(),
        recent_steps: Vec::new(),
        controlnet_step_s: vec![],
        interval_ms: 500,
        ranks: 0,
        free_ranks: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_last_heartbeat_counts_and_silent_denoisers_drop_out() {
        let directory = MeshDirectory::empty();
        directory.record_denoiser(heartbeat("d1", &[], &["a"], false), Instant::now());
        directory.record_denoiser(heartbeat("d1", &[], &["b"], false), Instant::now());
        directory.record_denoiser(
            heartbeat("d2", &[], &["a"], false),
            Instant::now() - STALE_AFTER,
        );
        let seen: Vec<(String, Vec<String>)> = directory
            .denoisers()
            .await
            .into_iter()
            .map(|hb| (hb.worker_id, hb.cached_templates))
            .collect();
        assert_eq!(seen, [("d1".to_string(), vec!["b".to_string()])]);
    }

    #[tokio::test]
    async fn controlnet_names_are_checked_against_the_live_denoisers() {
        let directory = MeshDirectory::empty();
        assert!(
            directory
                .check_offered(vec![("canny".into(), "controlnet.name".into())], "tiny")
                .await
                .is_ok(),
            "none heard yet"
        );
        directory.record_denoiser(heartbeat("d1", &["silhouette"], &[], false), Instant::now());
        assert!(directory
            .check_offered(
                vec![("silhouette".into(), "controlnet.name".into())],
                "tiny"
            )
            .await
            .is_ok());
        let refused = directory
            .check_offered(vec![("canny".into(), "controlnet.name".into())], "tiny")
            .await
            .unwrap_err();
        assert_eq!(refused.field, "controlnet.name");
        let views = directory.controlnets().await;
        assert_eq!(views.len(), 1);
        assert_eq!(views[0].id, "silhouette");
    }
}
