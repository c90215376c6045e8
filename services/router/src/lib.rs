//! diffmesh router: worker registry from denoiser heartbeats, placement behind a policy trait,
//! bounded admission, and failover of a lost worker's jobs.
//!
//! Start it in-process with [`start`] (tests) or run it until a signal with [`run`] (the binary).
pub mod metrics;
pub mod placement;
pub mod registry;
pub mod service;
pub mod state;

use diffmesh_shared::health::{HealthServer, Readiness};
use diffmesh_shared::{CommonConfig, MeshError};
use registry::ExpiryPolicy;
use service::Router;
use state::RouterState;
use std::net::SocketAddr;
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
    /// Interval at which denoisers send heartbeats (must match their --heartbeat-interval-ms).
    #[arg(long, env = "HEARTBEAT_INTERVAL_MS", default_value_t = 500)]
    pub heartbeat_interval_ms: u64,
    /// A denoiser is lost after this many heartbeats in a row did not arrive.
    #[arg(long, env = "MISSED_HEARTBEATS", default_value_t = 3)]
    pub missed_heartbeats: u32,
    /// How many placements a job gets in total (first try plus re-placements after losses).
    #[arg(long, env = "MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: u32,
    /// Submits that may wait at once for a denoiser slot; more are rejected immediately.
    #[arg(long, env = "ADMISSION_QUEUE", default_value_t = 256)]
    pub admission_queue: usize,
    /// How long one submit waits for a free slot before it is rejected (ms).
    #[arg(long, env = "ADMISSION_WAIT_MS", default_value_t = 2000)]
    pub admission_wait_ms: u64,
    /// Deadline of the request that hands a job to a denoiser (ms).
    #[arg(long, env = "FORWARD_TIMEOUT_MS", default_value_t = 2000)]
    pub forward_timeout_ms: u64,
    /// Retry hint sent with rejections (ms).
    #[arg(long, env = "RETRY_AFTER_MS", default_value_t = 1000)]
    pub retry_after_ms: u64,
    /// Placement policy: round_robin.
    #[arg(long, env = "PLACEMENT", default_value = "round_robin")]
    pub placement: String,
}

impl RouterConfig {
    /// In-process test config: health on a free port, fast heartbeats.
    pub fn for_tests(nats_url: impl Into<String>) -> Self {
        Self {
            common: CommonConfig::for_tests(nats_url),
            heartbeat_interval_ms: 100,
            missed_heartbeats: 3,
            max_attempts: 3,
            admission_queue: 16,
            admission_wait_ms: 500,
            forward_timeout_ms: 1000,
            retry_after_ms: 200,
            placement: "round_robin".into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("unknown placement policy `{0}` (flag --placement); known: round_robin")]
    UnknownPolicy(String),
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
    pub router: Arc<Router>,
    shutdown: CancellationToken,
    tasks: JoinSet<Result<(), MeshError>>,
    health: HealthServer,
}

impl RouterHandle {
    /// Stop taking submits, answer those in flight, stop the health server.
    pub async fn shutdown(mut self) -> Result<(), RouterError> {
        self.shutdown.cancel();
        while let Some(r) = self.tasks.join_next().await {
            if let Ok(Err(e)) = r {
                tracing::warn!(error = %e, "router task ended with an error");
            }
        }
        let _ = self.router.client.flush().await;
        self.health.stop().await;
        Ok(())
    }
}

/// Connect, subscribe, and serve in the background.
pub async fn start(config: RouterConfig) -> Result<RouterHandle, RouterError> {
    let policy = placement::policy_by_name(&config.placement)
        .ok_or_else(|| RouterError::UnknownPolicy(config.placement.clone()))?;
    let registry = prometheus::Registry::new();
    let metrics = metrics::RouterMetrics::new(&registry)?;
    let client = diffmesh_shared::nats::connect(
        &config.common.nats_url,
        "diffmesh-router",
        Duration::from_secs(config.common.nats_connect_timeout_s),
    )
    .await?;
    let expiry = ExpiryPolicy {
        heartbeat_interval: Duration::from_millis(config.heartbeat_interval_ms),
        missed_heartbeats: config.missed_heartbeats,
    };
    let state = RouterState::new(expiry, policy, config.max_attempts);
    tracing::info!(policy = state.policy_name(), "placement policy");
    let router = Arc::new(Router::new(client.clone(), state, metrics, config.clone()));
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
        r.expiry(s).await;
        Ok(())
    });
    // The subscriptions reach the server before anyone is told the router is up.
    client
        .flush()
        .await
        .map_err(|e| MeshError::Telemetry(format!("NATS flush: {e}")))?;
    let nats = client.clone();
    let ready: Readiness =
        Arc::new(move || nats.connection_state() == async_nats::connection::State::Connected);
    let addr = config.common.health_addr;
    let health = HealthServer::start(addr, registry, ready)
        .map_err(|source| RouterError::Health { addr, source })?;
    tracing::info!(health = %health.addr, "router up");
    Ok(RouterHandle {
        health_addr: health.addr,
        router,
        shutdown,
        tasks,
        health,
    })
}

/// Serve until `shutdown` is cancelled, then stop cleanly.
pub async fn run(config: RouterConfig, shutdown: CancellationToken) -> Result<(), RouterError> {
    let handle = start(config).await?;
    shutdown.cancelled().await;
    handle.shutdown().await
}
