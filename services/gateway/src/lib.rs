//! diffmesh gateway: the OpenAI-images-compatible HTTP API in front of the mesh.
//!
//! `POST /v1/images/edits` (multipart) and `POST /v1/images/generations` (JSON) are validated
//! here (4xx naming the field), then driven through codec -> router -> denoiser -> codec over
//! NATS (see `pipeline`). `/healthz`, `/readyz`, `/metrics` answer on the API port and on the
//! common health port.
pub mod error;
pub mod metrics;
pub mod pipeline;
pub mod routes;
pub mod validate;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, App, HttpServer};
use diffmesh_shared::health::{configure_health_routes, health_data, HealthServer, Readiness};
use diffmesh_shared::job::JobStore;
use diffmesh_shared::nats::{self, BlobStore};
use diffmesh_shared::{CommonConfig, MeshError};
use tokio_util::sync::CancellationToken;

pub use error::ApiError;
use metrics::GatewayMetrics;
use pipeline::{FlowConfig, Mesh};
use routes::ApiState;
use validate::{parse_size, Defaults, Limits};

/// Gateway flags.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayConfig {
    #[command(flatten)]
    pub common: CommonConfig,
    /// Address of the public HTTP API.
    #[arg(long, env = "GATEWAY_BIND", default_value = "0.0.0.0:8080")]
    pub bind: SocketAddr,
    /// HTTP worker threads.
    #[arg(long, env = "GATEWAY_HTTP_WORKERS", default_value_t = 2)]
    pub http_workers: usize,
    /// Largest request body in bytes (all multipart parts together).
    #[arg(long, env = "GATEWAY_MAX_BODY_BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Largest image (edits) or requested size (generations), in pixels.
    #[arg(long, env = "GATEWAY_MAX_PIXELS", default_value_t = 4096 * 4096)]
    pub max_pixels: u64,
    /// Largest `n` (images per request).
    #[arg(long, env = "GATEWAY_MAX_N", default_value_t = 4)]
    pub max_n: u32,
    /// Largest `num_inference_steps`.
    #[arg(long, env = "GATEWAY_MAX_STEPS", default_value_t = 100)]
    pub max_steps: u32,
    /// Largest `guidance_scale`.
    #[arg(long, env = "GATEWAY_MAX_GUIDANCE", default_value_t = 30.0)]
    pub max_guidance: f32,
    /// Longest prompt, in characters.
    #[arg(long, env = "GATEWAY_MAX_PROMPT_CHARS", default_value_t = 4000)]
    pub max_prompt_chars: usize,
    /// `num_inference_steps` when the request gives none.
    #[arg(long, env = "GATEWAY_DEFAULT_STEPS", default_value_t = 20)]
    pub default_steps: u32,
    /// `guidance_scale` when the request gives none.
    #[arg(long, env = "GATEWAY_DEFAULT_GUIDANCE", default_value_t = 3.5)]
    pub default_guidance: f32,
    /// Generation `size` when the request gives none (WxH).
    #[arg(long, env = "GATEWAY_DEFAULT_SIZE", default_value = "64x64")]
    pub default_size: String,
    /// Deadline of the codec preprocessing request (seconds).
    #[arg(long, env = "GATEWAY_CODEC_TIMEOUT_S", default_value_t = 30.0)]
    pub codec_timeout_s: f64,
    /// Deadline of one router submit request (seconds); the router may hold it while admitting.
    #[arg(long, env = "GATEWAY_ROUTER_TIMEOUT_S", default_value_t = 5.0)]
    pub router_timeout_s: f64,
    /// How long to keep resubmitting while no denoiser can take a job before answering 503.
    #[arg(long, env = "GATEWAY_SUBMIT_WAIT_S", default_value_t = 10.0)]
    pub submit_wait_s: f64,
    /// Whole-job deadline; a job still running then is cancelled and answered 504 (seconds).
    #[arg(long, env = "GATEWAY_JOB_TIMEOUT_S", default_value_t = 120.0)]
    pub job_timeout_s: f64,
}

impl GatewayConfig {
    /// In-process test config: API and health on free local ports, short deadlines.
    pub fn for_tests(nats_url: impl Into<String>) -> Self {
        Self {
            common: CommonConfig::for_tests(nats_url),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            http_workers: 1,
            max_body_bytes: 8 * 1024 * 1024,
            max_pixels: 1024 * 1024,
            max_n: 4,
            max_steps: 100,
            max_guidance: 30.0,
            max_prompt_chars: 4000,
            default_steps: 4,
            default_guidance: 3.5,
            default_size: "64x64".into(),
            codec_timeout_s: 10.0,
            router_timeout_s: 3.0,
            submit_wait_s: 2.0,
            job_timeout_s: 60.0,
        }
    }

    fn secs(field: &str, v: f64) -> Result<Duration, GatewayError> {
        Duration::try_from_secs_f64(v)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                GatewayError::Config(format!("--{field} must be a positive number of seconds"))
            })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("invalid gateway configuration: {0}")]
    Config(String),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics registration: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// A running gateway.
pub struct GatewayHandle {
    /// The bound API address (the real port when 0 was asked).
    pub addr: SocketAddr,
    /// The bound health/metrics address.
    pub health_addr: SocketAddr,
    server: actix_web::dev::ServerHandle,
    task: tokio::task::JoinHandle<()>,
    health: HealthServer,
}

impl GatewayHandle {
    /// Stop accepting requests, let in-flight ones finish (up to the job deadline), stop.
    pub async fn shutdown(self) {
        self.server.stop(true).await;
        let _ = self.task.await;
        self.health.stop().await;
    }
}

/// Connect to the mesh, bind the API and serve in the background.
pub async fn start(config: GatewayConfig) -> Result<GatewayHandle, GatewayError> {
    let (dw, dh) = parse_size(&config.default_size)
        .map_err(|e| GatewayError::Config(format!("--default-size: {}", e.message)))?;
    let flow = FlowConfig {
        codec_timeout: GatewayConfig::secs("codec-timeout-s", config.codec_timeout_s)?,
        router_timeout: GatewayConfig::secs("router-timeout-s", config.router_timeout_s)?,
        submit_wait: GatewayConfig::secs("submit-wait-s", config.submit_wait_s)?,
        job_timeout: GatewayConfig::secs("job-timeout-s", config.job_timeout_s)?,
    };
    let limits = Limits {
        max_n: config.max_n,
        min_steps: 1,
        max_steps: config.max_steps,
        max_guidance: config.max_guidance,
        max_pixels: config.max_pixels,
        max_prompt_chars: config.max_prompt_chars,
    };
    let defaults = Defaults {
        steps: config.default_steps,
        guidance: config.default_guidance,
        width: dw,
        height: dh,
    };
    let registry = prometheus::Registry::new();
    let metrics = GatewayMetrics::register(&registry)?;
    let client = nats::connect(
        &config.common.nats_url,
        "diffmesh-gateway",
        Duration::from_secs(config.common.nats_connect_timeout_s),
    )
    .await?;
    let js = async_nats::jetstream::new(client.clone());
    let mesh = Mesh {
        blobs: BlobStore::open(&js).await?,
        jobs: JobStore::open(&js).await?,
        client: client.clone(),
        flow: flow.clone(),
        metrics,
    };
    let api = web::Data::new(ApiState {
        mesh,
        limits,
        defaults,
        max_body_bytes: config.max_body_bytes,
    });
    let probe = client.clone();
    let ready: Readiness =
        Arc::new(move || probe.connection_state() == async_nats::connection::State::Connected);
    let health = HealthServer::start(config.common.health_addr, registry.clone(), ready.clone())
        .map_err(|source| GatewayError::Bind {
            addr: config.common.health_addr,
            source,
        })?;
    let health_state = health_data(registry, ready);
    let server = HttpServer::new(move || {
        App::new()
            .app_data(api.clone())
            .app_data(health_state.clone())
            .configure(routes::configure)
            .configure(configure_health_routes)
    })
    .workers(config.http_workers.max(1))
    .disable_signals()
    // In-flight jobs may take up to the job deadline; give them that long on shutdown.
    .shutdown_timeout(flow.job_timeout.as_secs().max(1))
    .bind(config.bind)
    .map_err(|source| GatewayError::Bind {
        addr: config.bind,
        source,
    })?;
    let addr = server.addrs().first().copied().unwrap_or(config.bind);
    let server = server.run();
    let server_handle = server.handle();
    let task = tokio::spawn(async move {
        if let Err(err) = server.await {
            tracing::error!(error = %err, "HTTP server stopped with an error");
        }
    });
    tracing::info!(%addr, health = %health.addr, "gateway listening");
    Ok(GatewayHandle {
        addr,
        health_addr: health.addr,
        server: server_handle,
        task,
        health,
    })
}

/// Serve until `shutdown` is cancelled (SIGTERM in the binary), then drain gracefully.
pub async fn run(config: GatewayConfig, shutdown: CancellationToken) -> Result<(), GatewayError> {
    let handle = start(config).await?;
    shutdown.cancelled().await;
    tracing::info!("gateway draining");
    handle.shutdown().await;
    Ok(())
}
