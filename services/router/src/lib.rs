//! diffmesh router: worker registry from denoiser heartbeats, placement by the scheduler's
//! `Policy` trait (the simulator's, with the same cost models), a bounded admission queue, a
//! run-time policy switch on its HTTP address, and failover of a lost worker's jobs.
//!
//! Start it in-process with [`start`] (tests) or run it until a signal with [`run`] (the binary).
pub mod admin;
pub mod admission;
pub mod adopt;
pub mod adopted_progress;
pub mod async_jobs;
pub mod cost_check;
pub mod metrics;
pub mod placement;
pub mod prefetch;
pub mod registry;
pub mod service;
pub mod state;
pub mod submit;
pub mod wait_estimate;
pub mod worker_state;

use admin::AdminServer;
use diffmesh_sched::{CostModels, SchedError};
use diffmesh_shared::process::config::duration;
use diffmesh_shared::process::health::{HealthServer, Readiness};
use diffmesh_shared::stores::job::JobStore;
use diffmesh_shared::{CommonConfig, MeshError};
use registry::ExpiryPolicy;
use service::Router;
use state::RouterState;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Router flags (every one also from the environment).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "diffmesh-router", about = "Places denoise jobs on denoisers")]
pub struct RouterConfig {
    #[command(flatten)]
    pub common: CommonConfig,
    /// A denoiser is lost after this many heartbeats in a row did not arrive (each denoiser's
    /// heartbeats say how often it sends them).
    #[arg(long, env = "ROUTER_MISSED_HEARTBEATS", default_value_t = 3)]
    pub missed_heartbeats: u32,
    /// How many placements a job gets in total (first try plus re-placements after losses).
    #[arg(long, env = "ROUTER_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: u32,
    /// Submits that may wait in the router for a denoiser slot (the admission queue); beyond
    /// it a submit is answered `Overloaded` (HTTP 429 with Retry-After at the gateway).
    #[arg(long, env = "ROUTER_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// How long one submit waits in the admission queue before it is rejected with a retry
    /// hint. Keep it plus --forward-timeout below the gateway's router timeout.
    #[arg(long, env = "ROUTER_ADMISSION_WAIT", default_value = "2s", value_parser = duration)]
    pub admission_wait: Duration,
    /// Deadline of the request that hands a job to a denoiser.
    #[arg(long, env = "ROUTER_FORWARD_TIMEOUT", default_value = "2s", value_parser = duration)]
    pub forward_timeout: Duration,
    /// Retry hint sent with rejections.
    #[arg(long, env = "ROUTER_RETRY_AFTER", default_value = "1s", value_parser = duration)]
    pub retry_after: Duration,
    /// How long a job whose denoiser was lost waits to be placed again (for a slot, and for a
    /// denoiser to come back while none is live, a restarting one included); then it fails
    /// with `worker_lost`.
    #[arg(long, env = "ROUTER_FAILOVER_WAIT", default_value = "60s", value_parser = duration)]
    pub failover_wait: Duration,
    /// How long the router keeps trying to place an async job it adopted (its gateway died
    /// before placing it) while no denoiser can take it; then the job fails.
    #[arg(long, env = "ROUTER_ADOPT_WAIT", default_value = "60s", value_parser = duration)]
    pub adopt_wait: Duration,
    /// Placement policy: round-robin, request-count, token-count, mask-aware (FlashPS
    /// Algorithm 2 with remaining steps), mask-aware-marginal, mask-aware-deferring (holds jobs
    /// in the admission queue where batching saves no work, as on CPU denoisers of a larger
    /// model) or flashps-greedy. Switch it at run time with `POST /admin/policy` on the admin
    /// address.
    #[arg(long, env = "ROUTER_POLICY", default_value = "mask-aware")]
    pub policy: String,
    /// Profile to fit the policies' cost models from: a built-in one's name (`tiny-cpu`, the
    /// default; `medium-cpu`; `tiny-h100` and `medium-h100` for denoisers on GPUs) or a file
    /// written by `cargo xtask profile` on the denoisers' hardware.
    #[arg(long, env = "ROUTER_PROFILE")]
    pub profile: Option<PathBuf>,
    /// Scale each denoiser's forecasts by its measured / predicted step time (learned from its
    /// heartbeats). false: trust the profile for every denoiser (the factor is still measured
    /// and exported).
    #[arg(long, env = "ROUTER_STEP_CALIBRATION", default_value_t = true, action = clap::ArgAction::Set)]
    pub step_calibration: bool,
    /// Address of the admin API (`/admin/policy`), apart from the health address; it asks for
    /// ROUTER_ADMIN_KEY. Unset: no admin API.
    #[arg(long, env = "ROUTER_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
    /// The admin API's key, at least 16 characters (environment only: keys do not belong on a
    /// command line).
    #[arg(skip = std::env::var("ROUTER_ADMIN_KEY").ok())]
    pub admin_key: Option<String>,
}

impl RouterConfig {
    /// In-process test config: health on a free port, fast heartbeats.
    pub fn for_tests(nats_url: impl Into<String>) -> Self {
        Self {
            common: CommonConfig::for_tests(nats_url),
            missed_heartbeats: 3,
            max_attempts: 3,
            max_queue: 16,
            admission_wait: Duration::from_millis(500),
            forward_timeout: Duration::from_secs(1),
            retry_after: Duration::from_millis(200),
            adopt_wait: Duration::from_secs(30),
            failover_wait: Duration::from_secs(30),
            policy: "mask-aware".into(),
            profile: None,
            step_calibration: true,
            admin_addr: None,
            admin_key: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("--policy: {0}")]
    Policy(#[source] SchedError),
    #[error("--profile: {0}")]
    Profile(#[source] SchedError),
    #[error("--admin-addr: {0}")]
    AdminKey(String),
    #[error("health server on {addr}: {source}")]
    Health {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics registration: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// A running router.
pub struct RouterHandle {
    /// Where /healthz, /readyz and /metrics answer (the bound port when 0 was asked).
    pub health_addr: SocketAddr,
    /// Where the admin API answers, when configured (the bound port when 0 was asked).
    pub admin_addr: Option<SocketAddr>,
    pub router: Arc<Router>,
    shutdown: CancellationToken,
    tasks: JoinSet<Result<(), MeshError>>,
    health: HealthServer,
    admin: Option<AdminServer>,
}

impl RouterHandle {
    /// Stop taking submits, answer those in flight and every queued one (rejected with a
    /// retry hint, so the gateway submits them again), stop the HTTP server.
    pub async fn shutdown(mut self) -> Result<(), RouterError> {
        self.shutdown.cancel();
        while let Some(r) = self.tasks.join_next().await {
            if let Ok(Err(e)) = r {
                tracing::warn!(error = %e, "router task ended with an error");
            }
        }
        // No submit handler runs any more: nothing can join the queue after this.
        self.router
            .drain_admission("the router is shutting down; submit again")
            .await;
        let _ = self.router.client.flush().await;
        self.health.stop().await;
        if let Some(admin) = self.admin {
            admin.stop().await;
        }
        Ok(())
    }
}

/// Connect, subscribe, and serve in the background.
/// The cost models of `--profile`, or of the built-in profile.
pub fn cost_models(config: &RouterConfig) -> Result<CostModels, RouterError> {
    match &config.profile {
        Some(spec) => diffmesh_sched::profiles::load(spec)
            .and_then(|p| CostModels::fit(&p))
            .map_err(RouterError::Profile),
        None => diffmesh_sched::profiles::builtin_models().map_err(RouterError::Profile),
    }
}

pub async fn start(config: RouterConfig) -> Result<RouterHandle, RouterError> {
    let policy = diffmesh_sched::policy_by_name(&config.policy).map_err(RouterError::Policy)?;
    let models = cost_models(&config)?;
    // A bad admin key is a configuration error, found before anything starts.
    let admin_key = match config.admin_addr {
        Some(_) => Some(
            admin::check_admin_key(config.admin_key.as_deref()).map_err(RouterError::AdminKey)?,
        ),
        None => None,
    };
    let registry = prometheus::Registry::new();
    let metrics = metrics::RouterMetrics::new(&registry)?;
    let client = config.common.connect_nats("diffmesh-router").await?;
    let expiry = ExpiryPolicy {
        missed_heartbeats: config.missed_heartbeats,
    };
    tracing::info!(
        policy = policy.name(),
        cost_models = %models.label,
        fits = %models.describe(),
        "placement policy"
    );
    let state = RouterState::new(expiry, policy, models, config.max_attempts)
        .with_step_calibration(config.step_calibration);
    let js = diffmesh_shared::stores::jetstream_layout::context(
        &client,
        &config.common,
        diffmesh_shared::nats::auth::Role::Router,
        None,
    )
    .await?;
    let jobs = JobStore::open(&js).await?;
    let storage = diffmesh_shared::stores::storage_usage::StorageGauges::new(&registry)?;
    // The gateways set the queue's bounds; a router takes the stream as it is.
    let queue = diffmesh_shared::stores::async_queue::AsyncQueue::open(
        &js,
        None,
        usize::from(config.common.js_replicas),
    )
    .await?;
    let router = Arc::new(Router::new(
        client.clone(),
        state,
        metrics,
        config.clone(),
        jobs,
        queue,
    ));
    let shutdown = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let subs = service::Subscriptions::new(&client).await?;
    tasks.spawn(router.clone().heartbeats(subs.heartbeats, shutdown.clone()));
    tasks.spawn(router.clone().submits(subs.submits, shutdown.clone()));
    tasks.spawn(router.clone().cancels(subs.cancels, shutdown.clone()));
    tasks.spawn(router.clone().job_events(subs.job_events, shutdown.clone()));
    let r = router.clone();
    let s = shutdown.clone();
    tasks.spawn(async move {
        r.dispatch(s).await;
        Ok(())
    });
    let (s, storage_js) = (shutdown.clone(), js.clone());
    tasks.spawn(async move {
        storage.watch(storage_js, s).await;
        Ok(())
    });
    let r = router.clone();
    let s = shutdown.clone();
    tasks.spawn(async move {
        r.expiry(s).await;
        Ok(())
    });
    let r = router.clone();
    let s = shutdown.clone();
    tasks.spawn(async move {
        r.adopt_orphans(s).await;
        Ok(())
    });
    let r = router.clone();
    let s = shutdown.clone();
    tasks.spawn(async move {
        r.pull_async_jobs(s).await;
        Ok(())
    });
    // The subscriptions reach the server before anyone is told the router is up.
    client
        .flush()
        .await
        .map_err(|e| MeshError::Telemetry(format!("NATS flush: {e}")))?;
    let (nats, placement) = (client.clone(), router.placement.clone());
    // Ready while connected and while the placement actor lives (see `placement`).
    let ready: Readiness = Arc::new(move || {
        nats.connection_state() == async_nats::connection::State::Connected && placement.connected()
    });
    let addr = config.common.health_addr;
    let health = HealthServer::start(addr, registry, ready)
        .map_err(|source| RouterError::Health { addr, source })?;
    let admin = match (config.admin_addr, admin_key) {
        (Some(addr), Some(key)) => Some(
            AdminServer::start(addr, key, router.clone())
                .map_err(|source| RouterError::Health { addr, source })?,
        ),
        _ => None,
    };
    let admin_addr = admin.as_ref().map(|a| a.addr);
    tracing::info!(health = %health.addr, admin = ?admin_addr, "router up");
    Ok(RouterHandle {
        health_addr: health.addr,
        admin_addr,
        router,
        shutdown,
        tasks,
        health,
        admin,
    })
}

/// Serve until `shutdown` is cancelled, then stop cleanly.
pub async fn run(config: RouterConfig, shutdown: CancellationToken) -> Result<(), RouterError> {
    let handle = start(config).await?;
    shutdown.cancelled().await;
    handle.shutdown().await
}
