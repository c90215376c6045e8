//! diffmesh ControlNet worker (`diffmesh-controlnet`, Katz's ControlNet-as-a-Service): serves
//! the ControlNets of a folder to the denoisers over NATS, keeps the most recently used ones
//! loaded, and announces what it serves in heartbeats. Requests arrive on its own subjects
//! (chunked when large) and run on the compute actor ([`compute`]), a bounded number waiting.
//!
//! Start it in-process with [`start`] (tests) or run it until a signal with [`run`] (the binary).
pub mod compute;
mod unet_session;
pub mod wire;

use compute::{Compute, ComputeObserver, ComputeStatus, Work};
use diffmesh_model::controlnets::{ControlNets, Lookup};
use diffmesh_shared::nats::chunked::{chunk_bytes, publish_chunked, Assembler};
use diffmesh_shared::process::config::duration;
use diffmesh_shared::process::health::{HealthServer, Readiness};
use diffmesh_shared::wire::controlnet_service::{
    self as contract, ControlNetHeartbeat, OpenReply, SessionClose, StepReply,
};
use diffmesh_shared::wire::messages::{decode, encode};
use diffmesh_shared::{CommonConfig, MeshError};
use futures::StreamExt;
use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// ControlNet worker flags (every one also from the environment).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "diffmesh-controlnet",
    about = "Runs ControlNets for the denoisers' steered generations (ControlNet-as-a-Service)"
)]
pub struct WorkerConfig {
    #[command(flatten)]
    pub common: CommonConfig,
    /// Unique id of this worker in the mesh (default: hostname and process id).
    #[arg(long, env = "CONTROLNET_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Folder of named ControlNets (`<dir>/<name>/config.json` + safetensors).
    #[arg(
        long,
        env = "CONTROLNET_DIR",
        default_value = "weights/tiny-controlnets"
    )]
    pub controlnet_dir: PathBuf,
    /// ControlNets kept loaded (the least recently used is dropped beyond it).
    #[arg(long, env = "CONTROLNET_CACHE", default_value_t = 4)]
    pub controlnet_cache: usize,
    /// Device: auto (CUDA when available), cpu, cuda, or cuda:N.
    #[arg(long, env = "CONTROLNET_DEVICE", default_value = "auto")]
    pub device: String,
    /// Weight dtype: f32, bf16, f16, or auto (as the denoiser's --dtype).
    #[arg(long, env = "CONTROLNET_DTYPE", default_value = "f32")]
    pub dtype: String,
    /// Open sessions kept (one per steered image in flight; the least recently used beyond it
    /// is dropped, and its denoiser opens it again).
    #[arg(long, env = "CONTROLNET_MAX_SESSIONS", default_value_t = 1024)]
    pub max_sessions: usize,
    /// A session unused this long is dropped.
    #[arg(long, env = "CONTROLNET_SESSION_IDLE", default_value = "10m", value_parser = duration)]
    pub session_idle: Duration,
    /// Most steps (of different sessions) run in one ControlNet forward.
    #[arg(long, env = "CONTROLNET_MAX_BATCH", default_value_t = 8)]
    pub max_batch: usize,
    /// Requests waiting for the compute actor (more wait in NATS).
    #[arg(long, env = "CONTROLNET_QUEUE_CAPACITY", default_value_t = 64)]
    pub queue_capacity: usize,
    /// Largest request accepted (bytes, after its chunks are put together).
    #[arg(long, env = "CONTROLNET_MAX_REQUEST_BYTES", default_value_t = 256 << 20)]
    pub max_request_bytes: usize,
    /// Heartbeat period (the denoisers read it from the heartbeats).
    #[arg(long, env = "CONTROLNET_HEARTBEAT_INTERVAL", default_value = "500ms", value_parser = duration)]
    pub heartbeat_interval: Duration,
}

impl WorkerConfig {
    /// In-process test config: health on a free port, fast heartbeats, CPU.
    pub fn for_tests(
        nats_url: impl Into<String>,
        controlnet_dir: PathBuf,
        worker_id: &str,
    ) -> Self {
        Self {
            common: CommonConfig::for_tests(nats_url),
            worker_id: Some(worker_id.into()),
            controlnet_dir,
            controlnet_cache: 2,
            device: "cpu".into(),
            dtype: "f32".into(),
            max_sessions: 64,
            max_batch: 8,
            session_idle: Duration::from_secs(600),
            queue_capacity: 16,
            max_request_bytes: 64 << 20,
            heartbeat_interval: Duration::from_millis(100),
        }
    }
}

/// Metrics of a ControlNet worker.
#[derive(Clone)]
pub struct WorkerMetrics {
    /// Requests by kind (open, step) and outcome (ok, unknown_session, failed).
    pub requests: IntCounterVec,
    /// One step's ControlNet forward, loading included.
    pub forward_seconds: Histogram,
    /// ControlNet lookups by outcome (hit, loaded).
    pub lookups: IntCounterVec,
    pub sessions: IntGauge,
}

impl WorkerMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let requests = IntCounterVec::new(
            Opts::new(
                "diffmesh_controlnet_requests_total",
                "ControlNet worker requests by kind (open, step) and outcome",
            ),
            &["kind", "outcome"],
        )?;
        for (kind, outcome) in [
            ("open", "ok"),
            ("open", "failed"),
            ("step", "ok"),
            ("step", "failed"),
            ("step", "unknown_session"),
        ] {
            requests.with_label_values(&[kind, outcome]);
        }
        let forward_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_controlnet_forward_duration_seconds",
                "One step's ControlNet forward on a ControlNet worker (loading included)",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ]),
        )?;
        let lookups = IntCounterVec::new(
            Opts::new(
                "diffmesh_controlnet_lookups_total",
                "ControlNets looked up by a ControlNet worker, by outcome (loaded: read from its folder)",
            ),
            &["outcome"],
        )?;
        for outcome in [Lookup::Hit, Lookup::Loaded] {
            lookups.with_label_values(&[outcome.as_str()]);
        }
        let sessions = IntGauge::new(
            "diffmesh_controlnet_sessions",
            "Sessions open on a ControlNet worker",
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(forward_seconds.clone()))?;
        registry.register(Box::new(lookups.clone()))?;
        registry.register(Box::new(sessions.clone()))?;
        Ok(Self {
            requests,
            forward_seconds,
            lookups,
            sessions,
        })
    }
}

impl ComputeObserver for WorkerMetrics {
    fn request(&self, kind: &'static str, outcome: &'static str) {
        self.requests.with_label_values(&[kind, outcome]).inc();
    }
    fn forward(&self, seconds: f64, lookup: Lookup) {
        self.forward_seconds.observe(seconds);
        self.lookups.with_label_values(&[lookup.as_str()]).inc();
    }
}

/// A running ControlNet worker.
pub struct WorkerHandle {
    pub worker_id: String,
    pub metrics: WorkerMetrics,
    pub health_addr: std::net::SocketAddr,
    stop: CancellationToken,
    serve: tokio::task::JoinHandle<()>,
    heartbeats: tokio::task::JoinHandle<()>,
    health: HealthServer,
}

impl WorkerHandle {
    /// Stop taking requests (heartbeats say draining), answer those taken, then stop.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.serve.await;
        let _ = self.heartbeats.await;
        self.health.stop().await;
        tracing::info!(worker_id = %self.worker_id, "ControlNet worker stopped");
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("invalid --{flag} `{value}`: expected {expected}")]
    Flag {
        flag: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("--controlnet-dir {0}: not a folder")]
    Dir(PathBuf),
    #[error("health server: {0}")]
    Health(#[source] std::io::Error),
    #[error("metrics registration: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// Connect, start the compute actor, and serve in the background.
pub async fn start(config: WorkerConfig) -> Result<WorkerHandle, WorkerError> {
    let worker_id = config.worker_id.clone().unwrap_or_else(|| {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "controlnet".into());
        format!("{host}-{}", std::process::id())
    });
    if worker_id.is_empty() || worker_id.contains(['.', '*', '>', ' ']) {
        return Err(WorkerError::Flag {
            flag: "worker-id",
            value: worker_id,
            expected: "a single NATS subject token (no '.', '*', '>' or spaces)",
        });
    }
    if !config.controlnet_dir.is_dir() {
        return Err(WorkerError::Dir(config.controlnet_dir.clone()));
    }
    let device = diffmesh_model::device::parse_device(&config.device).map_err(|expected| {
        WorkerError::Flag {
            flag: "device",
            value: config.device.clone(),
            expected,
        }
    })?;
    let kind =
        diffmesh_model::device::parse_model_dtype(&config.dtype, device).map_err(|expected| {
            WorkerError::Flag {
                flag: "dtype",
                value: config.dtype.clone(),
                expected,
            }
        })?;
    let registry = Registry::new();
    let metrics = WorkerMetrics::new(&registry)?;
    let client = config
        .common
        .connect_nats(&format!("diffmesh-controlnet-{worker_id}"))
        .await?;

    let status = Arc::new(Mutex::new(ComputeStatus::default()));
    let work_tx = ComputeQueue::start(&config, device, kind, status.clone(), metrics.clone());

    let stop = CancellationToken::new();
    let draining = Arc::new(AtomicBool::new(false));
    let sub = client
        .subscribe(contract::worker_requests(&worker_id))
        .await
        .map_err(MeshError::from)?;
    let serve = tokio::spawn(serve(
        client.clone(),
        sub,
        work_tx.clone(),
        config.max_request_bytes,
        stop.clone(),
    ));
    // Heartbeats only once the server routes this worker's requests to it (a denoiser that
    // hears one may send at once; SUB and PUB of two connections can cross otherwise).
    wait_until_reachable(&client, &worker_id).await;
    let heartbeats = tokio::spawn(heartbeats(Beat {
        client: client.clone(),
        worker_id: worker_id.clone(),
        dir: config.controlnet_dir.clone(),
        status,
        work: work_tx,
        period: config.heartbeat_interval.max(Duration::from_millis(10)),
        draining: draining.clone(),
        sessions: metrics.sessions.clone(),
        stop: stop.clone(),
    }));
    client
        .flush()
        .await
        .map_err(|e| MeshError::Telemetry(format!("NATS flush: {e}")))?;
    let (nats, drain) = (client.clone(), draining.clone());
    let ready: Readiness = Arc::new(move || {
        nats.connection_state() == async_nats::connection::State::Connected
            && !drain.load(Ordering::SeqCst)
    });
    let health = HealthServer::start(config.common.health_addr, registry, ready)
        .map_err(WorkerError::Health)?;
    tracing::info!(%worker_id, dir = %config.controlnet_dir.display(), ?device, ?kind, health = %health.addr, "ControlNet worker up");
    Ok(WorkerHandle {
        worker_id,
        metrics,
        health_addr: health.addr,
        stop,
        serve,
        heartbeats,
        health,
    })
}

/// Serve until `shutdown` is cancelled, then drain and stop.
pub async fn run(config: WorkerConfig, shutdown: CancellationToken) -> Result<(), WorkerError> {
    let handle = start(config).await?;
    shutdown.cancelled().await;
    handle.shutdown().await;
    Ok(())
}

/// Put requests together from their chunks and hand them to the compute thread; each answer
/// goes back from its own task, so a slow forward holds up no other message.
async fn serve(
    client: async_nats::Client,
    mut sub: async_nats::Subscriber,
    work: ComputeQueue,
    max_bytes: usize,
    stop: CancellationToken,
) {
    let mut assembler = Assembler::new(max_bytes);
    let mut answers = tokio::task::JoinSet::new();
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => break,
            msg = sub.next() => match msg { Some(m) => m, None => break },
        };
        let kind = request_kind(&msg);
        let complete = match assembler.push(msg) {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "dropped a malformed ControlNet request");
                continue;
            }
        };
        let reply = complete.reply.map(|r| r.to_string());
        let payload = complete.payload;
        let client = client.clone();
        let work = work.clone();
        match kind.as_str() {
            "open" => {
                answers.spawn(async move {
                    let failed = |error| OpenReply::Failed { error };
                    answer(&client, &work, reply, &payload, Work::Open, failed).await
                });
            }
            "step" => {
                answers.spawn(async move {
                    let failed = |error| StepReply::Failed { error };
                    answer(&client, &work, reply, &payload, Work::Step, failed).await
                });
            }
            "ping" => {
                if let Some(reply) = reply {
                    let _ = client.publish(reply, bytes::Bytes::new()).await;
                }
            }
            "close" => {
                if let Ok(close) = decode::<SessionClose>(&payload) {
                    drop(work.send(Work::Close(close.session)).await);
                }
            }
            other => tracing::debug!(subject = other, "ignored ControlNet request"),
        }
        while answers.try_join_next().is_some() {}
    }
    // Requests that reached the subscription before it ended are refused at once, so their
    // denoisers move to another worker now rather than after their timeout.
    let _ = sub.unsubscribe().await;
    while let Ok(Some(msg)) = tokio::time::timeout(Duration::from_millis(100), sub.next()).await {
        let kind = request_kind(&msg);
        let Ok(Some(complete)) = assembler.push(msg) else {
            continue;
        };
        let reply = complete.reply.map(|r| r.to_string());
        let error = "this ControlNet worker is stopping".to_string();
        match kind.as_str() {
            "open" => answer_with(&client, reply, &OpenReply::Failed { error }).await,
            "step" => answer_with(&client, reply, &StepReply::Failed { error }).await,
            _ => {}
        }
    }
    while answers.join_next().await.is_some() {}
}

/// The last token of a request's subject: open, step, close or ping.
fn request_kind(msg: &async_nats::Message) -> String {
    msg.subject
        .rsplit('.')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Wait (up to 5 s) until a request to this worker's own subjects reaches it.
async fn wait_until_reachable(client: &async_nats::Client, worker_id: &str) {
    let ping = contract::ping_subject(worker_id);
    for _ in 0..100 {
        let answer = tokio::time::timeout(
            Duration::from_millis(200),
            client.request(ping.clone(), bytes::Bytes::new()),
        )
        .await;
        if matches!(answer, Ok(Ok(_))) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::warn!(%worker_id, "own subjects not reachable after 5 s; announcing anyway");
}

/// Decode a request, run it on the compute thread, and answer it.
async fn answer<Req, Ans>(
    client: &async_nats::Client,
    work: &ComputeQueue,
    reply: Option<String>,
    payload: &[u8],
    into_work: fn(Box<Req>, oneshot::Sender<Ans>) -> Work,
    failed: impl Fn(String) -> Ans,
) where
    Req: serde::de::DeserializeOwned,
    Ans: serde::Serialize,
{
    let answer = match decode::<Req>(payload) {
        Ok(req) => {
            let (tx, rx) = oneshot::channel();
            // The slot is held until the answer comes.
            let _slot = work.send(into_work(Box::new(req), tx)).await;
            rx.await
                .unwrap_or_else(|_| failed("the ControlNet worker is stopping".into()))
        }
        Err(e) => failed(format!("undecodable request: {e}")),
    };
    answer_with(client, reply, &answer).await;
}

async fn answer_with<T: serde::Serialize>(
    client: &async_nats::Client,
    reply: Option<String>,
    answer: &T,
) {
    let Some(reply) = reply else { return };
    let payload = match encode(answer) {
        Ok(p) => bytes::Bytes::from(p),
        Err(e) => {
            tracing::warn!(error = %e, "could not encode a ControlNet answer");
            return;
        }
    };
    let headers = async_nats::HeaderMap::new();
    if let Err(e) =
        publish_chunked(client, &reply, None, &headers, payload, chunk_bytes(client)).await
    {
        tracing::warn!(error = %e, "could not send a ControlNet answer");
    }
}

struct Beat {
    client: async_nats::Client,
    worker_id: String,
    dir: PathBuf,
    status: Arc<Mutex<ComputeStatus>>,
    work: ComputeQueue,
    period: Duration,
    draining: Arc<AtomicBool>,
    sessions: IntGauge,
    stop: CancellationToken,
}

impl Beat {
    fn heartbeat(&self) -> ControlNetHeartbeat {
        let status = self.status.lock().map(|s| s.clone()).unwrap_or_default();
        self.sessions.set(status.sessions as i64);
        let (served, served_unet) =
            diffmesh_shared::wire::controlnet::served_by_network(Some(&self.dir));
        ControlNetHeartbeat {
            worker_id: self.worker_id.clone(),
            served,
            served_unet,
            resident: status.resident,
            sessions: status.sessions,
            queued: self.work.queued() as u32,
            draining: self.draining.load(Ordering::SeqCst),
            interval_ms: self.period.as_millis().min(u32::MAX.into()) as u32,
        }
    }

    async fn send(&self) {
        let hb = self.heartbeat();
        if let Err(e) =
            diffmesh_shared::nats::publish_msgpack(&self.client, contract::HEARTBEAT, None, &hb)
                .await
        {
            tracing::warn!(error = %e, "could not publish a ControlNet heartbeat");
        }
    }
}

/// Heartbeats until stopped; the last one says draining, so denoisers stop picking this worker.
async fn heartbeats(beat: Beat) {
    let mut tick = tokio::time::interval(beat.period);
    loop {
        tokio::select! {
            _ = beat.stop.cancelled() => break,
            _ = tick.tick() => beat.send().await,
        }
    }
    beat.draining.store(true, Ordering::SeqCst);
    beat.send().await;
    let _ = beat.client.flush().await;
}

/// The compute actor's address, with a bound on the work sent and not yet answered
/// (`--queue-capacity`): beyond it a request waits here (and more wait in NATS).
#[derive(Clone)]
struct ComputeQueue {
    addr: actix::Addr<Compute>,
    slots: Arc<Semaphore>,
    capacity: usize,
}

impl ComputeQueue {
    /// Start the compute actor on a thread of its own. Should it ever stop, actix makes a
    /// fresh one (its sessions gone: denoisers open them again).
    fn start(
        config: &WorkerConfig,
        device: diffmesh_model::tch::Device,
        kind: diffmesh_model::tch::Kind,
        status: Arc<Mutex<ComputeStatus>>,
        metrics: WorkerMetrics,
    ) -> Self {
        let (dir, cache) = (config.controlnet_dir.clone(), config.controlnet_cache);
        let (sessions, max_batch) = (config.max_sessions, config.max_batch);
        let idle = config.session_idle;
        let addr =
            diffmesh_shared::process::actors::start_sync("controlnet-compute", 1, move || {
                // Each family keeps up to `cache` ControlNets loaded.
                let controlnets = ControlNets::new(Some(dir.clone()), cache, device, kind);
                let unet_controlnets = ControlNets::new(Some(dir.clone()), cache, device, kind);
                let mut compute = Compute::new(
                    controlnets,
                    unet_controlnets,
                    device,
                    sessions,
                    idle,
                    max_batch,
                );
                compute.status = status.clone();
                compute.observer = Some(Box::new(metrics.clone()));
                compute
            });
        let capacity = config.queue_capacity.max(1);
        Self {
            addr,
            slots: Arc::new(Semaphore::new(capacity)),
            capacity,
        }
    }

    /// Send `work` once a slot is free; the slot is the caller's until the work is answered.
    async fn send(&self, work: Work) -> Option<OwnedSemaphorePermit> {
        let slot = self.slots.clone().acquire_owned().await.ok()?;
        self.addr.do_send(work);
        Some(slot)
    }

    /// Work sent and not yet answered.
    fn queued(&self) -> usize {
        self.capacity - self.slots.available_permits()
    }
}
