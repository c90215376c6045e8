//! diffmesh gateway: the OpenAI-images-compatible HTTP API in front of the mesh.
//!
//! `POST /v1/images/edits` (multipart) and `POST /v1/images/generations` (JSON) are validated
//! here (4xx naming the field), then driven through codec -> router -> denoiser -> codec over
//! NATS (see `job_driver`), answered when done or, with `Prefer: respond-async`, at once as a job
//! (`jobs`, `events`: state, progress stream, results, cancel). API keys and per-key limits are
//! in `auth` and `limits`, the OpenAPI document in `openapi`, the browser playground at `/` in
//! `playground`, registered templates and LoRAs in `templates` and `loras`. `/healthz`,
//! `/readyz`, `/metrics` answer on the API port and on the common health port.
pub mod api;
pub mod async_jobs;
pub mod auth;
pub mod controlnet;
pub mod controlnet_directory;
pub mod directory;
pub mod disconnect;
pub mod error;
pub mod idempotency;
pub mod job_driver;
pub mod limits;
pub mod loras;
pub mod lost_events;
pub mod metrics;
pub mod model_catalogue;
pub mod openapi;
pub mod output_format;
pub mod overload_gate;
pub mod parse;
pub mod quotas;
pub mod raw_params;
pub mod request_limits;
pub mod request_model;
pub mod result_urls;
pub mod routes;
pub mod state;
pub mod templates;
pub mod upload;
pub mod validate;
pub mod webhooks;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, App, HttpServer};
use diffmesh_shared::process::config::duration;
use diffmesh_shared::process::health::{
    configure_health_routes, health_data, HealthServer, Readiness,
};
use diffmesh_shared::stores::async_queue::{AsyncQueue, QueueBounds};
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::idempotency::IdempotencyStore;
use diffmesh_shared::stores::job::JobStore;
use diffmesh_shared::{CommonConfig, MeshError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use auth::ApiKeys;
pub use error::ApiError;
use job_driver::{FlowConfig, Mesh};
use limits::{KeyLimiter, KeyLimits};
use metrics::{GatewayMetrics, RequestCounting};
use request_limits::{parse_size, Defaults, Limits};
use state::ApiState;

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
    /// Largest LoRA weights file (`POST /v1/loras`), in bytes; such an upload is not bound by
    /// --max-body-bytes.
    #[arg(long, env = "GATEWAY_MAX_LORA_BYTES", default_value_t = 512 * 1024 * 1024)]
    pub max_lora_bytes: usize,
    /// Largest image (edits) or requested size (generations), in pixels.
    #[arg(long, env = "GATEWAY_MAX_PIXELS", default_value_t = 4096 * 4096)]
    pub max_pixels: u64,
    /// Largest `n` (images per request; OpenAI's limit is 10).
    #[arg(long, env = "GATEWAY_MAX_N", default_value_t = 10)]
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
    /// `true_cfg_scale` when the request gives none: 1 is off; models trained for true
    /// classifier-free guidance (the shipped tiny model: 4) serve better with it on.
    #[arg(long, env = "GATEWAY_DEFAULT_TRUE_CFG_SCALE", default_value_t = 1.0)]
    pub default_true_cfg_scale: f32,
    /// Generation `size` when the request gives none (WxH); unset: the model's own default
    /// (its announcement: 64x64 for the tiny model, 1024x1024 for FLUX.1).
    #[arg(long, env = "GATEWAY_DEFAULT_SIZE")]
    pub default_size: Option<String>,
    /// The model of a request that names none; unset: the mesh's only model (a request that
    /// names none is a 400 while the mesh serves several).
    #[arg(long, env = "GATEWAY_DEFAULT_MODEL")]
    pub default_model: Option<String>,
    /// Deadline of the codec preprocessing request.
    #[arg(long, env = "GATEWAY_CODEC_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub codec_timeout: Duration,
    /// Deadline of the first preprocessing attempt; each attempt sent again after a timeout
    /// doubles it, up to --codec-timeout. A codec killed while it held the request
    /// then costs this, not the whole deadline.
    #[arg(long, env = "GATEWAY_CODEC_FIRST_ATTEMPT", default_value = "5s", value_parser = duration)]
    pub codec_first_attempt: Duration,
    /// Deadline of one router submit request; the router may hold it while admitting.
    #[arg(long, env = "GATEWAY_ROUTER_TIMEOUT", default_value = "5s", value_parser = duration)]
    pub router_timeout: Duration,
    /// How long to keep resubmitting while no denoiser can take a job, and to send
    /// pre-processing again while no codec takes it, before answering 503.
    #[arg(long, env = "GATEWAY_SUBMIT_WAIT", default_value = "10s", value_parser = duration)]
    pub submit_wait: Duration,
    /// The key result URLs are signed with (`response_format: "url"`); gateways behind one
    /// address must share it. Unset: a random key of this process (its URLs work only here
    /// and not after a restart).
    #[arg(long, env = "GATEWAY_RESULT_URL_KEY", hide_env_values = true)]
    pub result_url_key: Option<String>,
    /// How long a result URL stays readable (results may expire from the store earlier).
    #[arg(long, env = "GATEWAY_RESULT_URL_TTL", default_value = "1h", value_parser = duration)]
    pub result_url_ttl: Duration,
    /// The gateway's public base URL (`https://images.example.com`) for result URLs; unset:
    /// the scheme and Host of each request.
    #[arg(long, env = "GATEWAY_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// Whole-job deadline; a job still running then is cancelled and answered 504.
    #[arg(long, env = "GATEWAY_JOB_TIMEOUT", default_value = "120s", value_parser = duration)]
    pub job_timeout: Duration,
    /// File of API keys, one a line: `key` or `name:key` (`#` comments). With no keys from
    /// here or GATEWAY_API_KEYS, authentication is off, which the gateway allows only on a
    /// loopback --bind or with --insecure-no-auth.
    #[arg(long, env = "GATEWAY_API_KEYS_FILE")]
    pub api_keys_file: Option<std::path::PathBuf>,
    /// API keys, comma-separated, each `key` or `name:key` (environment only: keys do not
    /// belong on a command line).
    #[arg(skip = std::env::var("GATEWAY_API_KEYS").ok())]
    pub api_keys: Option<String>,
    /// Serve without API keys on an address other machines reach (every caller then sees and
    /// cancels every job): without this flag such a gateway refuses to start.
    #[arg(long, env = "GATEWAY_INSECURE_NO_AUTH", default_value_t = false, action = clap::ArgAction::Set)]
    pub insecure_no_auth: bool,
    /// Image requests per second per API key, sustained (token bucket; 0 = unlimited).
    #[arg(long, env = "GATEWAY_RATE_LIMIT_PER_S", default_value_t = 0.0)]
    pub rate_limit_per_s: f64,
    /// Image requests a key may make at once after being idle (0 = one second's worth).
    #[arg(long, env = "GATEWAY_RATE_LIMIT_BURST", default_value_t = 0)]
    pub rate_limit_burst: u32,
    /// Jobs in flight per API key, synchronous and async together (0 = unlimited).
    #[arg(long, env = "GATEWAY_MAX_CONCURRENT_PER_KEY", default_value_t = 0)]
    pub max_concurrent_per_key: usize,
    /// Job records whose last revision the gateway keeps, to update them without reading
    /// them first (`JobStore::with_known_revisions`; about 1 KB each; 0 = read every time).
    #[arg(long, env = "GATEWAY_KNOWN_JOB_RECORDS", default_value_t = 16_384)]
    pub known_job_records: u64,
    /// Async jobs the mesh's durable queue holds at most, all keys together; beyond it an
    /// async request is answered 429. Kept by JetStream for every gateway replica: give them
    /// all the same value.
    #[arg(long, env = "GATEWAY_ASYNC_QUEUE_MAX", default_value_t = 10_000)]
    pub async_queue_max: u32,
    /// Async jobs one API key may have waiting in the durable queue; beyond it its async
    /// requests are answered 429.
    #[arg(long, env = "GATEWAY_ASYNC_QUEUE_PER_KEY", default_value_t = 1_000)]
    pub async_queue_per_key: u32,
    /// Longest an async job waits in the queue for a denoiser (a shorter `deadline_ms` of the
    /// request wins); then it fails with `timeout`.
    #[arg(long, env = "GATEWAY_ASYNC_QUEUE_TIME", default_value = "10m", value_parser = duration)]
    pub async_queue_time: Duration,
    /// Gateway replicas behind the load balancer: each enforces 1/N of the per-key rate and
    /// concurrency limits, so the mesh as a whole enforces them without a shared counter on
    /// every request (the async queue's per-key bound is shared: JetStream keeps it).
    #[arg(long, env = "GATEWAY_REPLICAS", default_value_t = 1)]
    pub replicas: u32,
    /// Templates one API key may keep (0 = no limit); beyond it a registration is a 429
    /// naming this quota.
    #[arg(long, env = "GATEWAY_MAX_TEMPLATES_PER_KEY", default_value_t = 100)]
    pub max_templates_per_key: usize,
    /// LoRAs one API key may keep (0 = no limit); beyond it an upload is a 429.
    #[arg(long, env = "GATEWAY_MAX_LORAS_PER_KEY", default_value_t = 50)]
    pub max_loras_per_key: usize,
    /// Bytes one API key's templates (images and activation caches) and LoRA weights may
    /// take together (0 = no limit); a registration beyond it is a 413 naming this quota.
    /// Keep it well under the mesh's storage (JS_MAX_BYTES) so no one key can fill it.
    #[arg(long, env = "GATEWAY_MAX_STORED_BYTES_PER_KEY", default_value_t = 2 * 1024 * 1024 * 1024)]
    pub max_stored_bytes_per_key: u64,
    /// LoRA uploads this gateway reads at once (each streamed to a file in
    /// --upload-spool-dir, up to --max-lora-bytes); one more is a 429 with Retry-After.
    #[arg(long, env = "GATEWAY_LORA_UPLOADS_AT_ONCE", default_value_t = 2)]
    pub lora_uploads_at_once: usize,
    /// Longest a LoRA upload may take to arrive; a slower one is answered 504 and its reader
    /// freed.
    #[arg(long, env = "GATEWAY_LORA_UPLOAD_TIMEOUT", default_value = "5m", value_parser = duration)]
    pub lora_upload_timeout: Duration,
    /// Where LoRA uploads are written while they arrive (removed once stored or refused);
    /// the system's temporary directory when unset. Needs room for --lora-uploads-at-once
    /// files of --max-lora-bytes.
    #[arg(long, env = "GATEWAY_UPLOAD_SPOOL_DIR")]
    pub upload_spool_dir: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub webhooks: webhooks::WebhookConfig,
}

impl GatewayConfig {
    /// In-process test config: API and health on free local ports, short deadlines.
    pub fn for_tests(nats_url: impl Into<String>) -> Self {
        Self {
            common: CommonConfig::for_tests(nats_url),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            http_workers: 1,
            max_body_bytes: 8 * 1024 * 1024,
            max_lora_bytes: 16 * 1024 * 1024,
            max_pixels: 1024 * 1024,
            max_n: 4,
            max_steps: 100,
            max_guidance: 30.0,
            max_prompt_chars: 4000,
            default_steps: 4,
            default_guidance: 3.5,
            default_true_cfg_scale: 1.0,
            default_size: None,
            default_model: None,
            codec_timeout: Duration::from_secs(10),
            codec_first_attempt: Duration::from_secs(5),
            router_timeout: Duration::from_secs(3),
            submit_wait: Duration::from_secs(2),
            job_timeout: Duration::from_secs(60),
            result_url_key: None,
            result_url_ttl: Duration::from_secs(3600),
            public_url: None,
            api_keys_file: None,
            api_keys: None,
            insecure_no_auth: false,
            rate_limit_per_s: 0.0,
            rate_limit_burst: 0,
            known_job_records: 1024,
            max_concurrent_per_key: 0,
            async_queue_max: 10_000,
            async_queue_per_key: 1_000,
            async_queue_time: Duration::from_secs(600),
            replicas: 1,
            max_templates_per_key: 100,
            max_loras_per_key: 50,
            max_stored_bytes_per_key: 2 * 1024 * 1024 * 1024,
            lora_uploads_at_once: 2,
            lora_upload_timeout: Duration::from_secs(60),
            upload_spool_dir: None,
            webhooks: webhooks::WebhookConfig::for_tests(),
        }
    }

    /// `d`, refused when zero (a deadline of nothing fails every job).
    fn positive(field: &str, d: Duration) -> Result<Duration, GatewayError> {
        if d.is_zero() {
            return Err(GatewayError::Config(format!(
                "--{field} must be longer than 0"
            )));
        }
        Ok(d)
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
    /// Async jobs, cancels and webhook posts still running.
    background: TaskTracker,
    /// Stops the webhook relay and senders' pulls.
    stop_pulls: CancellationToken,
    job_timeout: Duration,
}

impl GatewayHandle {
    /// Stop accepting requests, let in-flight requests and async jobs finish (each up to the
    /// job deadline), stop.
    pub async fn shutdown(self) {
        self.server.stop(true).await;
        let _ = self.task.await;
        self.stop_pulls.cancel();
        self.background.close();
        if tokio::time::timeout(self.job_timeout, self.background.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                left = self.background.len(),
                "async jobs still running at shutdown were abandoned"
            );
        }
        self.health.stop().await;
    }
}

/// Whether the gateway may serve without API keys on `bind`: on a loopback address (this machine
/// only, as `cargo xtask up` binds it) or when the operator said `--insecure-no-auth`; an open API
/// on an address other machines reach is refused, so a deployment cannot forget its keys.
pub fn open_api_allowed(
    has_keys: bool,
    bind: SocketAddr,
    insecure_no_auth: bool,
) -> Result<(), String> {
    if has_keys || insecure_no_auth || bind.ip().is_loopback() {
        return Ok(());
    }
    Err(format!(
        "no API keys configured and --bind {bind} reaches other machines: give keys \
         (--api-keys-file or GATEWAY_API_KEYS), bind 127.0.0.1, or pass --insecure-no-auth \
         (GATEWAY_INSECURE_NO_AUTH=true) to serve every caller every job knowingly"
    ))
}

/// Connect to the mesh, bind the API and serve in the background.
pub async fn start(config: GatewayConfig) -> Result<GatewayHandle, GatewayError> {
    let default_size = config
        .default_size
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(|e| GatewayError::Config(format!("--default-size: {}", e.message)))?;
    // Models that announce no default size (older denoisers) get the tiny model's.
    let (dw, dh) = default_size.unwrap_or((64, 64));
    let flow = FlowConfig {
        codec_timeout: GatewayConfig::positive("codec-timeout", config.codec_timeout)?,
        codec_first_attempt: GatewayConfig::positive(
            "codec-first-attempt",
            config.codec_first_attempt,
        )?,
        router_timeout: GatewayConfig::positive("router-timeout", config.router_timeout)?,
        submit_wait: GatewayConfig::positive("submit-wait", config.submit_wait)?,
        job_timeout: GatewayConfig::positive("job-timeout", config.job_timeout)?,
    };
    let limits = Limits {
        max_n: config.max_n,
        min_steps: 1,
        max_steps: config.max_steps,
        max_guidance: config.max_guidance,
        max_pixels: config.max_pixels,
        max_prompt_chars: config.max_prompt_chars,
    };
    validate::validate_true_cfg(f64::from(config.default_true_cfg_scale), None, &limits)
        .map_err(|e| GatewayError::Config(format!("--default-true-cfg-scale: {}", e.message)))?;
    let defaults = Defaults {
        steps: config.default_steps,
        guidance: config.default_guidance,
        true_cfg: config.default_true_cfg_scale,
        width: dw,
        height: dh,
    };
    let keys = ApiKeys::load(config.api_keys_file.as_deref(), config.api_keys.as_deref())
        .map_err(GatewayError::Config)?;
    open_api_allowed(keys.is_enabled(), config.bind, config.insecure_no_auth)
        .map_err(GatewayError::Config)?;
    if keys.is_enabled() {
        tracing::info!(
            keys = keys.len(),
            "API keys configured: Bearer authentication is on"
        );
    } else {
        tracing::warn!(
            bind = %config.bind,
            "no API keys configured (--api-keys-file, GATEWAY_API_KEYS): authentication is off \
             and every caller sees every job"
        );
    }
    if !config.rate_limit_per_s.is_finite() || config.rate_limit_per_s < 0.0 {
        return Err(GatewayError::Config(
            "--rate-limit-per-s must be a non-negative number".into(),
        ));
    }
    if config.replicas == 0 {
        return Err(GatewayError::Config("--replicas must be at least 1".into()));
    }
    let key_limits = KeyLimiter::new(
        KeyLimits {
            rate_per_s: config.rate_limit_per_s,
            burst: config.rate_limit_burst,
            max_concurrent: config.max_concurrent_per_key,
        }
        .share_of(config.replicas),
    );
    if config.async_queue_max == 0 || config.async_queue_per_key == 0 {
        return Err(GatewayError::Config(
            "--async-queue-max and --async-queue-per-key must be at least 1".into(),
        ));
    }
    let webhook_keys = config.webhooks.keys().map_err(GatewayError::Config)?;
    let registry = prometheus::Registry::new();
    let metrics = GatewayMetrics::register(&registry)?;
    let client = config.common.connect_nats("diffmesh-gateway").await?;
    let js = diffmesh_shared::stores::jetstream_layout::context(
        &client,
        &config.common,
        diffmesh_shared::nats::auth::Role::Gateway,
        None,
    )
    .await?;
    let background = TaskTracker::new();
    // The gateway writes most of a job's changes: it updates them without reading first.
    let mut jobs = JobStore::open(&js).await?;
    if config.known_job_records > 0 {
        jobs = jobs.with_known_revisions(config.known_job_records);
    }
    // ControlNet directory.
    // The workers' heartbeats, kept by one actor for the template views and the ControlNets.
    let directory = directory::MeshDirectory::watch(&client).await?;
    let templates = templates::Templates::open(&client, jobs.clone(), flow.job_timeout).await?;
    let loras = loras::store::LoraStore::open(&js).await?;
    let queue = AsyncQueue::open(
        &js,
        Some(QueueBounds {
            max_jobs: config.async_queue_max,
            max_per_key: config.async_queue_per_key,
        }),
        usize::from(config.common.js_replicas),
    )
    .await?;
    let mesh = Mesh {
        queue,
        max_queue_time: GatewayConfig::positive("async-queue-time", config.async_queue_time)?,
        blobs: BlobStore::open(&js).await?,
        jobs,
        idempotency: IdempotencyStore::open(&js).await?,
        client: client.clone(),
        flow: flow.clone(),
        metrics,
        runtime: tokio::runtime::Handle::current(),
        background: background.clone(),
        driving: Default::default(),
        template_uses: templates.uses.clone(),
        overload_gate: Default::default(),
    };
    {
        // Deletes a stopped gateway left pending; in the background, not to delay start-up.
        let (deleter, mesh) = (templates.deleter.clone(), mesh.clone());
        tokio::spawn(async move { deleter.resume_pending(&mesh).await });
    }
    // A spool directory the gateway cannot write would fail every LoRA upload: say so now.
    let upload_spool_dir = config
        .upload_spool_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir);
    tempfile::tempfile_in(&upload_spool_dir).map_err(|e| {
        GatewayError::Config(format!(
            "--upload-spool-dir {}: cannot write a file there: {e}",
            upload_spool_dir.display()
        ))
    })?;
    // One signer for the API's result URLs and the webhooks' (its key may be random).
    let result_urls =
        result_urls::ResultUrls::new(config.result_url_key.as_deref(), config.result_url_ttl);
    let public_url = config
        .public_url
        .as_ref()
        .map(|u| u.trim_end_matches('/').to_string());
    let stop_pulls = CancellationToken::new();
    if let Some(keys) = webhook_keys {
        let links = webhooks::sender::ResultLinks {
            urls: result_urls.clone(),
            public_url: public_url.clone(),
        };
        webhooks::start(&js, &config, keys, &mesh, links, stop_pulls.clone()).await?;
    }
    let openapi = openapi::document(&limits);
    let api = web::Data::new(ApiState {
        mesh,
        limits,
        defaults,
        max_body_bytes: config.max_body_bytes,
        openapi,
        keys,
        key_limits,
        templates,
        loras,
        max_lora_bytes: config.max_lora_bytes,
        quotas: quotas::StorageQuotas {
            templates: config.max_templates_per_key,
            loras: config.max_loras_per_key,
            bytes: config.max_stored_bytes_per_key,
        },
        lora_uploads: Arc::new(tokio::sync::Semaphore::new(
            config.lora_uploads_at_once.max(1),
        )),
        lora_upload_timeout: config.lora_upload_timeout,
        upload_spool_dir,
        directory,
        default_model: config.default_model.clone(),
        default_size,
        result_urls,
        public_url,
        webhooks: webhooks::callback_url::WebhookGate {
            policy: config.webhooks.policy(),
            enabled: config.webhooks.webhook_signing_key.is_some(),
        },
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
    let counting = web::Data::new(RequestCounting {
        metrics: api.mesh.metrics.clone(),
        endpoints: routes::endpoints(),
    });
    let server = HttpServer::new(move || {
        App::new()
            .app_data(api.clone())
            .app_data(health_state.clone())
            .app_data(counting.clone())
            .wrap(actix_web::middleware::from_fn(metrics::count_requests))
            .configure(routes::configure)
            .configure(configure_health_routes)
    })
    .on_connect(disconnect::on_connect)
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
        background,
        stop_pulls,
        job_timeout: flow.job_timeout,
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

#[cfg(test)]
mod tests {
    use super::open_api_allowed;

    #[test]
    fn an_open_api_is_refused_where_other_machines_reach_it() {
        let public = "0.0.0.0:8080".parse().unwrap();
        let err = open_api_allowed(false, public, false).unwrap_err();
        assert!(
            err.contains("--insecure-no-auth") && err.contains("GATEWAY_API_KEYS"),
            "{err}"
        );
        assert!(open_api_allowed(false, "10.1.2.3:80".parse().unwrap(), false).is_err());
        // Keys, the explicit flag, or this machine only: allowed.
        assert!(open_api_allowed(true, public, false).is_ok());
        assert!(open_api_allowed(false, public, true).is_ok());
        assert!(open_api_allowed(false, "127.0.0.1:8080".parse().unwrap(), false).is_ok());
        assert!(open_api_allowed(false, "[::1]:8080".parse().unwrap(), false).is_ok());
    }
}
