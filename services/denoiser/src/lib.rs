//! diffmesh denoiser: one engine thread per device that owns the model and runs step-level
//! continuous batching; NATS tasks around it take submits and cancels, send heartbeats, and hand
//! finished outputs to the codec.
//!
//! Start it in-process with [`start`] (tests) or run it until a signal with [`run`] (the binary).
pub mod cached_step;
pub mod capture_log;
pub mod controlnet_service;
pub mod device_memory;
pub mod engine;
pub mod labels;
pub mod lora;
pub mod metrics;
pub mod model;
pub mod outcomes;
pub mod previews;
pub mod prompt_stage;
pub mod ranks;
pub mod service;
pub mod sickness;
pub mod step_samples;
pub mod templates;
pub mod unet_engine;
pub mod warming;

#[cfg(test)]
mod gpu_checks;
mod job_inputs;
mod loading;

use diffmesh_model::tch::{Device, Kind};
use diffmesh_shared::process::config::duration;
use diffmesh_shared::process::health::{HealthServer, Readiness};
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::{CommonConfig, MeshError};
use engine::{spawn_engine, EngineConfig, EngineDrained};
use loading::{load_model, Loaded};
use service::Service;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Denoiser flags (every one also from the environment).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "diffmesh-denoiser",
    about = "Runs denoising jobs on one device"
)]
pub struct DenoiserConfig {
    #[command(flatten)]
    pub common: CommonConfig,
    /// Unique id of this worker in the mesh (default: hostname and process id).
    #[arg(long, env = "DENOISER_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Diffusers-format model directory: FLUX.1 layout, the tiny model, or an SD 2.x / SDXL
    /// pipeline (served by the UNet engine); relative paths are tried from the working directory,
    /// then from the repository root.
    #[arg(long, env = "DENOISER_MODEL_DIR", default_value = "weights/tiny")]
    pub model_dir: PathBuf,
    /// Model id announced in heartbeats (default: the model directory's name).
    #[arg(long, env = "DENOISER_MODEL_ID")]
    pub model_id: Option<String>,
    /// Device: auto (CUDA when available), cpu, cuda, or cuda:N.
    #[arg(long, env = "DENOISER_DEVICE", default_value = "auto")]
    pub device: String,
    /// Weight and activation dtype: f32, bf16, f16, or auto (bf16 on a GPU or a CPU with bf16
    /// units, f32 elsewhere).
    #[arg(long, env = "DENOISER_DTYPE", default_value = "f32")]
    pub dtype: String,
    /// Image rows denoised together in one step.
    #[arg(long, env = "DENOISER_MAX_BATCH", default_value_t = 8)]
    pub max_batch: usize,
    /// Jobs that may wait for a batch slot; more are rejected (the router tries elsewhere).
    #[arg(long, env = "DENOISER_MAX_QUEUE", default_value_t = 16)]
    pub max_queue: usize,
    /// Batch formation: `continuous` (jobs join at every step boundary) or `static` (a batch
    /// forms only when none runs, the baseline).
    #[arg(long, env = "DENOISER_BATCHING", value_enum, default_value_t = engine::Batching::Continuous)]
    pub batching: engine::Batching,
    /// Most image tokens (masked tokens per image) computed per step over the running batch;
    /// unset: only --max-batch limits it.
    #[arg(long, env = "DENOISER_TOKEN_BUDGET")]
    pub token_budget: Option<u64>,
    /// Capacity of the engine's command channel.
    #[arg(long, env = "DENOISER_COMMAND_CAPACITY", default_value_t = 64)]
    pub command_capacity: usize,
    /// Heartbeat period; the router expires this worker after a few missed ones (it reads
    /// the period from the heartbeats themselves).
    #[arg(long, env = "DENOISER_HEARTBEAT_INTERVAL", default_value = "500ms", value_parser = duration)]
    pub heartbeat_interval: Duration,
    /// Default output size (square, pixels) the model announces: the one resolution the tiny
    /// model runs at (default 64), a FLUX.1 model's generations that name no size (default
    /// 1024). Also the resolution of jobs that carry none (from older codecs).
    #[arg(long, env = "DENOISER_DEFAULT_RESOLUTION")]
    pub default_resolution: Option<i64>,
    /// Largest model resolution (pixels) a FLUX.1 model announces; larger inputs are scaled
    /// down to it by the codec.
    #[arg(long, env = "DENOISER_MAX_MODEL_PIXELS", default_value_t = model::DEFAULT_MAX_MODEL_PIXELS)]
    pub max_model_pixels: u64,
    /// Deadline of the post-processing request to the codec.
    #[arg(long, env = "DENOISER_CODEC_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub codec_timeout: Duration,
    /// Deadline of the first post-processing attempt; each attempt sent again after a
    /// timeout doubles it, up to --codec-timeout. A codec killed while it held the request
    /// then costs this, not the whole deadline (post-processing takes well under a second).
    #[arg(long, env = "DENOISER_CODEC_FIRST_ATTEMPT", default_value = "5s", value_parser = duration)]
    pub codec_first_attempt: Duration,
    /// How long a finished job's post-processing is sent again while no codec takes it (its
    /// outputs are kept in the object store); then the job fails
    /// (`shared::nats::unanswered`).
    #[arg(long, env = "DENOISER_POST_RETRY_WINDOW", default_value = "60s", value_parser = duration)]
    pub post_retry_window: Duration,
    /// Deadline of each hand-back of a queued job to the router at shutdown.
    #[arg(long, env = "DENOISER_HANDBACK_TIMEOUT", default_value = "5s", value_parser = duration)]
    pub handback_timeout: Duration,
    /// Retry hint sent with rejections.
    #[arg(long, env = "DENOISER_RETRY_AFTER", default_value = "500ms", value_parser = duration)]
    pub retry_after: Duration,
    /// What captured template caches hold: `prepared` (K/V, keys after norm + RoPE: the
    /// cheapest edits), `raw` (the K/V projections) or `hidden` (alias `y`: each block's input
    /// hidden stream, FlashPS's Y cache: half the bytes, K/V re-projected in the edit), or
    /// `prepared+hidden` / `raw+hidden`: both, 1.5x the bytes held, each step's planner
    /// choosing per block which one to load (three-way: compute, load K/V or load Y).
    #[arg(long, env = "DENOISER_CACHE_FORMAT", default_value = "prepared")]
    pub cache_format: String,
    /// Storage dtype of template caches: f32, f16, bf16 or fp8 (lossy, per-row scaled).
    #[arg(long, env = "DENOISER_CACHE_DTYPE", default_value = "bf16")]
    pub cache_dtype: String,
    /// Bytes of template caches kept in this denoiser's memory (local tier, LRU).
    #[arg(long, env = "DENOISER_LOCAL_CACHE_BYTES", default_value_t = 1 << 30)]
    pub local_cache_bytes: u64,
    /// Bytes of registered templates' model-resolution pixels kept in memory, so a template's
    /// edits read them once (LRU; 0 reads them for every edit).
    #[arg(long, env = "DENOISER_TEMPLATE_PIXELS_BYTES", default_value_t = 256 << 20)]
    pub template_pixels_bytes: u64,
    /// Bytes of prompt embeddings, template latents and template noise the engine keeps, so
    /// edits of one template (and requests repeating a prompt) skip the text and image encoders
    /// on the step loop (LRU; 0 keeps nothing).
    #[arg(long, env = "DENOISER_CONDITIONING_CACHE_BYTES", default_value_t = 256 << 20)]
    pub conditioning_cache_bytes: u64,
    /// Bytes of prompt embeddings the prompt stage keeps by (model, prompt, max tokens), so
    /// repeated prompts encode once (LRU; 0 keeps nothing). The stage encodes prompts on a
    /// thread of its own, off the engine's step loop.
    #[arg(long, env = "DENOISER_PROMPT_CACHE_BYTES", default_value_t = 64 << 20)]
    pub prompt_cache_bytes: u64,
    /// Jobs failed in a row (for a reason other than their input) after which the denoiser
    /// takes itself out: unready, and draining in its heartbeats (0: never; `sickness`).
    #[arg(long, env = "DENOISER_SICK_AFTER_FAILURES", default_value_t = 5)]
    pub sick_after_failures: u32,
    /// How long a sick denoiser takes no work before it tries again.
    #[arg(long, env = "DENOISER_SICK_COOLDOWN", default_value = "30s", value_parser = duration)]
    pub sick_cooldown: Duration,
    /// The order waiting jobs join the running batch in: `fcfs`, `srtf` (least image tokens x
    /// steps first) or `edf` (earliest `deadline_ms` first; jobs without one after them).
    #[arg(long, env = "DENOISER_QUEUE_ORDER", value_enum, default_value_t = diffmesh_sched::QueueOrder::Fcfs)]
    pub queue_order: diffmesh_sched::QueueOrder,
    /// Bounded asynchronous LoRA loading: the share of a job's steps it may run on the base
    /// model while its LoRA adapters load (Katz's K = 10 of 50 steps is 0.2); 0 waits for them.
    #[arg(long, env = "DENOISER_LORA_ASYNC_FRACTION", default_value_t = 0.2)]
    pub lora_async_fraction: f64,
    /// Where the base copies of LoRA-patched layers live: `device` (switches stay on the GPU; a
    /// second copy of the adapted layers in device memory) or `host` (no device memory; every
    /// switch copies them host to device). The same on a CPU.
    #[arg(long, env = "DENOISER_LORA_ORIGINALS", value_enum, default_value_t = diffmesh_model::lora::OriginalsOn::Device)]
    pub lora_originals: diffmesh_model::lora::OriginalsOn,
    /// Folder of named ControlNets (`<dir>/<name>/config.json` + safetensors, diffusers'
    /// `FluxControlNetModel` layout for a Flux model, `ControlNetModel` for a UNet one) that
    /// generations may name in `controlnet.name`; none: this denoiser takes no steered
    /// generations.
    #[arg(long, env = "DENOISER_CONTROLNET_DIR")]
    pub controlnet_dir: Option<std::path::PathBuf>,
    /// ControlNets kept loaded (the least recently used is dropped beyond it).
    #[arg(long, env = "DENOISER_CONTROLNET_CACHE", default_value_t = 4)]
    pub controlnet_cache: usize,
    /// Where steered steps get their ControlNet residuals: `off` (here, from
    /// --controlnet-dir), `sync` (from ControlNet workers, `diffmesh-controlnet`, for the step
    /// about to run) or `pipelined` (from workers, one step behind, hidden behind the forward).
    /// A ControlNet no worker serves, or a worker that fails, is computed here when
    /// --controlnet-dir holds it. UNet models (SD 2.x, SDXL) run `pipelined` as `sync`.
    #[arg(long, env = "DENOISER_CONTROLNET_REMOTE", value_enum, default_value_t = controlnet_service::RemoteMode::Off)]
    pub controlnet_remote: controlnet_service::RemoteMode,
    /// Deadline of each request to a ControlNet worker; past it the step goes to another
    /// worker, then falls back.
    #[arg(long, env = "DENOISER_CONTROLNET_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub controlnet_timeout: Duration,
    /// Bytes of LoRA adapters held in memory (LRU).
    #[arg(long, env = "DENOISER_LORA_CACHE_BYTES", default_value_t = 2 << 30)]
    pub lora_cache_bytes: u64,
    /// Largest LoRA weights file read from the LoRA store.
    #[arg(long, env = "DENOISER_MAX_LORA_BYTES", default_value_t = 512 << 20)]
    pub max_lora_bytes: usize,
    /// Load template caches other denoisers capture (broadcast on
    /// `diffmesh.templates.captured.<cache_key>`; at start, those announced before it, newest
    /// first) into the local tier while it has room, so their first edits here do not wait
    /// for the cachestore.
    #[arg(long, env = "DENOISER_WARM_ON_CAPTURE", default_value_t = true, action = clap::ArgAction::Set)]
    pub warm_on_capture: bool,
    /// Cache blocks the loader thread decodes ahead of the compute, per request.
    #[arg(long, env = "DENOISER_CACHE_LOOKAHEAD", default_value_t = 2)]
    pub cache_lookahead: usize,
    /// How the blocks of a mask-aware step run: `auto` (planned every step from measured
    /// compute and load costs), a fixed count of leading blocks computed over all tokens, or
    /// a fixed plan of `f` (full), `k` (K/V), `y` (Y) per block, full blocks first (benches).
    #[arg(long, env = "DENOISER_CACHE_PREFIX", default_value = "auto")]
    pub cache_prefix: String,
    /// Quality guard of captures (off unless set): each capture also runs a typical edit of
    /// its template in full and mask-aware from the cache being captured (about twice a
    /// capture's compute); where their SSIM over the mask's box is below this floor (0..=1),
    /// the cache stored holds no steps and the template's edits compute in full.
    #[arg(long, env = "DENOISER_CACHE_QUALITY_FLOOR", value_parser = quality_floor)]
    pub cache_quality_floor: Option<f64>,
    /// Deadline of each cachestore request.
    #[arg(long, env = "DENOISER_CACHESTORE_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub cachestore_timeout: Duration,
    /// Elastic ranks (GF-DiT): above 1, the node runs R ranks (one per device: cuda:0..R-1;
    /// worker threads on a CPU), each with a transformer replica, and its elastic policy
    /// places every denoising step on a group of them. Such a node serves no LoRAs or
    /// ControlNets.
    #[arg(long, env = "DENOISER_RANKS", default_value_t = 1)]
    pub ranks: usize,
    /// The policy binding steps to rank groups (`diffmesh-sim --elastic`'s: static-sp<k>,
    /// fcfs-elastic, srtf-elastic, edf-bestfit, slo-elastic).
    #[arg(long, env = "DENOISER_ELASTIC_POLICY", default_value = "slo-elastic")]
    pub elastic_policy: String,
    /// Square image sides (pixels, comma-separated) whose step costs the ranks measure at
    /// start (default: the model's default size).
    #[arg(long, env = "DENOISER_ELASTIC_SIZES", value_delimiter = ',')]
    pub elastic_sizes: Vec<u32>,
    /// Intra-op threads per rank (default: the machine's cores shared among the ranks).
    #[arg(long, env = "DENOISER_RANK_THREADS")]
    pub rank_threads: Option<i32>,
    /// A step-cost table (`cargo xtask bench sp`'s JSON, or the one a node logged) to plan
    /// with instead of measuring one at start.
    #[arg(long, env = "DENOISER_ELASTIC_COST")]
    pub elastic_cost: Option<PathBuf>,
}

impl DenoiserConfig {
    /// In-process test config: health on a free port, fast heartbeats, CPU.
    pub fn for_tests(nats_url: impl Into<String>, model_dir: PathBuf, worker_id: &str) -> Self {
        Self {
            common: CommonConfig::for_tests(nats_url),
            worker_id: Some(worker_id.to_string()),
            model_dir,
            model_id: Some("tiny".into()),
            device: "cpu".into(),
            dtype: "f32".into(),
            max_batch: 4,
            max_queue: 8,
            batching: engine::Batching::Continuous,
            token_budget: None,
            command_capacity: 16,
            heartbeat_interval: Duration::from_millis(100),
            default_resolution: None,
            max_model_pixels: model::DEFAULT_MAX_MODEL_PIXELS,
            codec_timeout: Duration::from_secs(10),
            codec_first_attempt: Duration::from_secs(5),
            post_retry_window: Duration::from_secs(30),
            handback_timeout: Duration::from_secs(2),
            retry_after: Duration::from_millis(200),
            cache_format: "prepared".into(),
            cache_dtype: "bf16".into(),
            local_cache_bytes: 256 << 20,
            template_pixels_bytes: 64 << 20,
            conditioning_cache_bytes: 64 << 20,
            prompt_cache_bytes: 16 << 20,
            sick_after_failures: 5,
            sick_cooldown: Duration::from_secs(30),
            queue_order: Default::default(),
            lora_async_fraction: 0.2,
            lora_originals: Default::default(),
            controlnet_dir: None,
            controlnet_cache: 4,
            controlnet_remote: controlnet_service::RemoteMode::Off,
            controlnet_timeout: Duration::from_secs(5),
            lora_cache_bytes: 64 << 20,
            max_lora_bytes: 64 << 20,
            warm_on_capture: true,
            cache_lookahead: 2,
            cache_quality_floor: None,
            cache_prefix: "auto".into(),
            cachestore_timeout: Duration::from_secs(5),
            ranks: 1,
            elastic_policy: "slo-elastic".into(),
            elastic_sizes: Vec::new(),
            rank_threads: None,
            elastic_cost: None,
        }
    }

    /// The elastic ranks' settings (None: one device, no ranks).
    pub fn elastic_settings(
        &self,
        default_side: u32,
    ) -> Result<Option<ranks::ElasticSettings>, DenoiserError> {
        if self.ranks <= 1 {
            return Ok(None);
        }
        if self.controlnet_dir.is_some()
            || self.controlnet_remote != controlnet_service::RemoteMode::Off
        {
            return Err(DenoiserError::Flag {
                flag: "ranks",
                value: self.ranks.to_string(),
                expected:
                    "1 with --controlnet-dir or --controlnet-remote (ranks serve plain generations)",
            });
        }
        if diffmesh_sched::elastic::policies::by_name(&self.elastic_policy).is_none() {
            return Err(DenoiserError::Flag {
                flag: "elastic-policy",
                value: self.elastic_policy.clone(),
                expected: "static-sp<k>, fcfs-elastic, srtf-elastic, edf-bestfit or slo-elastic",
            });
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(Some(ranks::ElasticSettings {
            ranks: self.ranks,
            policy: self.elastic_policy.clone(),
            sizes: if self.elastic_sizes.is_empty() {
                vec![default_side]
            } else {
                self.elastic_sizes.clone()
            },
            threads_per_rank: self
                .rank_threads
                .unwrap_or((cores / self.ranks).max(1) as i32),
            calibration_repeats: 3,
            table: self
                .elastic_cost
                .as_deref()
                .map(read_cost_table)
                .transpose()?,
        }))
    }

    /// The template-cache settings of the engine, from the flags.
    pub fn cache_settings(&self) -> Result<cached_step::CacheSettings, DenoiserError> {
        let flag = |flag: &'static str, value: &str, expected: &'static str| DenoiserError::Flag {
            flag,
            value: value.into(),
            expected,
        };
        Ok(cached_step::CacheSettings {
            layout: templates::CacheLayout::parse(&self.cache_format).map_err(|_| {
                flag(
                    "cache-format",
                    &self.cache_format,
                    "prepared, raw or hidden (y), or prepared+hidden / raw+hidden (the three-way planner)",
                )
            })?,
            dtype: diffmesh_model::flux::kv_codec::CacheDtype::parse(&self.cache_dtype)
                .map_err(|_| flag("cache-dtype", &self.cache_dtype, "f32, f16, bf16 or fp8"))?,
            lookahead: self.cache_lookahead.max(1),
            prefix: cached_step::PrefixPolicy::parse(&self.cache_prefix)
                .map_err(|_| {
                    flag(
                        "cache-prefix",
                        &self.cache_prefix,
                        "auto, a block count, or f/k/y per block",
                    )
                })?,
        })
    }

    pub fn parse_device(&self) -> Result<Device, DenoiserError> {
        diffmesh_model::device::parse_device(&self.device).map_err(|expected| DenoiserError::Flag {
            flag: "device",
            value: self.device.clone(),
            expected,
        })
    }

    /// The dtype for a model on `device` (what `auto` resolves to depends on it).
    pub fn parse_dtype(&self, device: Device) -> Result<Kind, DenoiserError> {
        diffmesh_model::device::parse_model_dtype(&self.dtype, device).map_err(|expected| {
            DenoiserError::Flag {
                flag: "dtype",
                value: self.dtype.clone(),
                expected,
            }
        })
    }

    /// The model directory: as given when it exists, else relative to the repository root.
    pub fn resolved_model_dir(&self) -> PathBuf {
        let dir = &self.model_dir;
        if dir.is_absolute() || dir.exists() {
            return dir.clone();
        }
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(dir);
        if repo.exists() {
            repo
        } else {
            dir.clone()
        }
    }

    fn resolved_worker_id(&self) -> String {
        self.worker_id.clone().unwrap_or_else(|| {
            let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "denoiser".into());
            format!("{host}-{}", std::process::id())
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DenoiserError {
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("the CUDA device faulted (its context is lost): exiting so that it is restarted")]
    DeviceFault,
    #[error("loading the model from {dir}: {source}")]
    Model {
        dir: PathBuf,
        #[source]
        source: diffmesh_model::ModelError,
    },
    #[error("invalid --{flag} `{value}`: expected {expected}")]
    Flag {
        flag: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("worker id `{0}` must be a single NATS subject token (no '.', '*', '>' or spaces)")]
    WorkerId(String),
    #[error("starting the engine thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("health server on {addr}: {source}")]
    Health {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("starting the elastic ranks: {0}")]
    Ranks(String),
    #[error("metrics registration: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// A running denoiser.
pub struct DenoiserHandle {
    /// Where /healthz, /readyz and /metrics answer (the bound port when 0 was asked).
    pub health_addr: SocketAddr,
    pub worker_id: String,
    pub service: Arc<Service>,
    intake: CancellationToken,
    background: CancellationToken,
    submits: JoinHandle<Result<(), MeshError>>,
    others: Vec<JoinHandle<Result<(), MeshError>>>,
    pump: JoinHandle<Result<(), MeshError>>,
    engine_drained: EngineDrained,
    health: HealthServer,
}

impl DenoiserHandle {
    /// Graceful stop: take no new jobs (heartbeats say draining), hand queued jobs back to the
    /// router, finish the running ones (outputs post-processed and Done published), then stop.
    pub async fn shutdown(self) -> Result<(), DenoiserError> {
        let s = &self.service;
        s.draining.store(true, Ordering::SeqCst);
        s.send_heartbeat().await;
        self.intake.cancel();
        let _ = self.submits.await;
        let queued = s.engine.begin_shutdown().await;
        tracing::info!(handed_back = queued.len(), "denoiser draining");
        s.hand_back(queued).await;
        self.engine_drained.wait().await;
        let _ = self.pump.await;
        self.background.cancel();
        for t in self.others {
            let _ = t.await;
        }
        let _ = s.client.flush().await;
        self.health.stop().await;
        tracing::info!("denoiser stopped");
        Ok(())
    }
}

/// A step-cost table from `path` (`--elastic-cost`).
fn read_cost_table(
    path: &Path,
) -> Result<diffmesh_sched::elastic::cost::MeasuredTable, DenoiserError> {
    let bad = |why: String| DenoiserError::Ranks(format!("elastic_cost {}: {why}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| bad(e.to_string()))
}

/// Load the model, start the engine thread, connect, subscribe, and serve in the background.
pub async fn start(config: DenoiserConfig) -> Result<DenoiserHandle, DenoiserError> {
    let worker_id = config.resolved_worker_id();
    if worker_id.is_empty() || worker_id.contains(['.', '*', '>', ' ']) {
        return Err(DenoiserError::WorkerId(worker_id));
    }
    let device = config.parse_device()?;
    let kind = config.parse_dtype(device)?;
    let cache_settings = config.cache_settings()?;
    let dir = config.resolved_model_dir();
    let model_id = config.model_id.clone().unwrap_or_else(|| {
        dir.file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "model".into())
    });
    let mut loaded = load_model(&config, &dir, device, kind, &model_id).await?;
    let gpu_copy = match &loaded {
        Loaded::Flux(model) => model.gpu_copy.clone(),
        Loaded::Unet(_) => None,
    };

    let registry = prometheus::Registry::new();
    let metrics = metrics::DenoiserMetrics::new(&registry)?;
    if let Loaded::Flux(model) = &loaded {
        if let Some(r) = &model.ranks {
            metrics.elastic.ranks.set(r.pool.size() as i64);
        }
        for (component, bytes) in model.model.resident_bytes() {
            metrics
                .model_resident_bytes
                .with_label_values(&[&model_id, component])
                .set(bytes as i64);
        }
    }
    // The ControlNets served from its folder are exported (at 0, free until one runs) before
    // a steered job measures them.
    for name in diffmesh_shared::wire::controlnet::served(config.controlnet_dir.as_deref()) {
        metrics
            .controlnet
            .step_seconds
            .with_label_values(&[&name])
            .set(0.0);
    }
    let client = config
        .common
        .connect_nats(&format!("diffmesh-denoiser-{worker_id}"))
        .await?;
    let js = diffmesh_shared::stores::jetstream_layout::context(
        &client,
        &config.common,
        diffmesh_shared::nats::auth::Role::Denoiser,
        None,
    )
    .await?;
    let blobs = BlobStore::open(&js).await?;

    let (events_tx, events_rx) = tokio::sync::mpsc::channel(1024);
    if !(0.0..=1.0).contains(&config.lora_async_fraction) {
        return Err(DenoiserError::Flag {
            flag: "lora-async-fraction",
            value: config.lora_async_fraction.to_string(),
            expected: "a share of the steps, from 0 to 1",
        });
    }
    let engine_config = EngineConfig {
        max_batch: config.max_batch.max(1),
        max_queue: config.max_queue,
        batching: config.batching,
        token_budget: config.token_budget,
        queue_order: config.queue_order,
        cache: cache_settings,
        conditioning_cache_bytes: config.conditioning_cache_bytes,
        lora_async_fraction: config.lora_async_fraction,
        lora_originals: config.lora_originals,
        controlnet_cache: config.controlnet_cache,
        cache_quality_floor: config.cache_quality_floor,
    };
    let cache_bucket =
        BlobStore::open_with(&js, &diffmesh_shared::stores::jetstream_layout::CACHES).await?;
    let device_memory = device_memory::MemorySource::for_device(device, gpu_copy.clone());
    let local = templates::LocalTier::new(config.local_cache_bytes, gpu_copy);
    let store =
        templates::store::CacheClient::new(client.clone(), cache_bucket, config.cachestore_timeout);
    let templates = service::Templates {
        fetcher: templates::CacheFetcher::new(
            store.clone(),
            local.clone(),
            Some(metrics.template_fetch_seconds.clone()),
        ),
        local,
        store,
        settings: cache_settings,
        pixels: templates::TemplatePixels::new(
            BlobStore::open_with(
                &js,
                &diffmesh_shared::stores::jetstream_layout::TEMPLATE_IMAGES,
            )
            .await?,
            config.template_pixels_bytes,
            service::MAX_INPUT_BYTES,
        ),
    };
    let loras = lora::LoraStore::new(
        Some(
            BlobStore::open_with(
                &js,
                &diffmesh_shared::stores::jetstream_layout::LORA_WEIGHTS,
            )
            .await?,
        ),
        config.lora_cache_bytes,
        config.max_lora_bytes,
        Some(metrics.clone()),
    );
    let background = CancellationToken::new();
    let mut follow_workers = None;
    let mut controlnet_workers = None;
    if config.controlnet_remote != controlnet_service::RemoteMode::Off {
        let network = match &loaded {
            Loaded::Flux(_) => controlnet_service::Network::Flux,
            Loaded::Unet(_) => controlnet_service::Network::Unet,
        };
        let mut mode = config.controlnet_remote;
        if network == controlnet_service::Network::Unet
            && mode == controlnet_service::RemoteMode::Pipelined
        {
            // One step behind is measured for Flux only (the default everywhere in compose).
            tracing::warn!("--controlnet-remote pipelined runs as sync on a UNet model");
            mode = controlnet_service::RemoteMode::Sync;
        }
        // A worker is gone after 4 missed heartbeats (at the period its heartbeats give).
        let workers = controlnet_service::ControlNetWorkers::new(4, network);
        controlnet_workers = Some(workers.clone());
        let (listen, nats, stop) = (workers.clone(), client.clone(), background.clone());
        follow_workers = Some(tokio::spawn(async move {
            listen.listen(nats, stop).await;
            Ok(())
        }));
        let remote = controlnet_service::RemoteControlNets::new(
            client.clone(),
            tokio::runtime::Handle::current(),
            workers,
            controlnet_service::RemoteSettings {
                mode,
                timeout: config.controlnet_timeout,
                attempts: 3,
                max_reply_bytes: 1 << 30,
            },
        );
        match &mut loaded {
            Loaded::Flux(model) => model.controlnet_service = Some(remote),
            Loaded::Unet(model) => model.controlnet_service = Some(remote),
        }
    }
    let (card, prompt_stage, spawned) = match loaded {
        Loaded::Flux(mut model) => {
            let card = model.card.clone();
            // Text encoding runs on the prompt stage's thread; the engine keeps a stand-in.
            let prompt_stage = prompt_stage::PromptStageHandle::start(
                model.split_text_encoder(),
                model_id.clone(),
                config.prompt_cache_bytes,
            );
            let spawned = spawn_engine(
                *model,
                engine_config,
                config.command_capacity,
                events_tx,
                Some(metrics.clone()),
            );
            (card, Some(prompt_stage), spawned)
        }
        Loaded::Unet(model) => {
            let card = model.card.clone();
            let spawned = unet_engine::spawn_unet_engine(
                model,
                engine_config,
                config.command_capacity,
                events_tx,
                Some(metrics.clone()),
            );
            (card, None, spawned)
        }
    };
    let (engine, engine_drained) = spawned.map_err(DenoiserError::Thread)?;
    let service = Arc::new(Service::new(service::ServiceParts {
        client: client.clone(),
        blobs,
        engine,
        metrics,
        config: config.clone(),
        worker_id: worker_id.clone(),
        model_id,
        card,
        templates,
        loras,
        controlnet_workers,
        prompt_stage,
        device_memory,
    }));
    let intake = CancellationToken::new();
    let captures = diffmesh_shared::stores::jetstream_layout::TEMPLATE_CAPTURES
        .get_or_create(&js)
        .await?;
    let submit_sub = service.subscribe_submits().await?;
    let submits = tokio::spawn(service.clone().submits(submit_sub, intake.clone()));
    let others = vec![
        tokio::spawn(service.clone().cancels(background.clone())),
        tokio::spawn(service.clone().evictions(background.clone())),
        tokio::spawn(
            service
                .clone()
                .capture_warmups(captures, background.clone()),
        ),
        tokio::spawn(service.clone().heartbeats(background.clone())),
        tokio::spawn(service.clone().recaptures(background.clone())),
        tokio::spawn(
            service
                .outcomes
                .clone()
                .serve(client.clone(), background.clone()),
        ),
    ];
    let mut others = others;
    others.extend(follow_workers);
    let pump = tokio::spawn(service.clone().pump(events_rx));
    client
        .flush()
        .await
        .map_err(|e| MeshError::Telemetry(format!("NATS flush: {e}")))?;

    // Ready while connected, not draining (a draining worker takes no new jobs) and not sick.
    let (nats, svc) = (client.clone(), service.clone());
    let ready: Readiness = Arc::new(move || {
        nats.connection_state() == async_nats::connection::State::Connected
            && !svc.draining.load(Ordering::SeqCst)
            && !svc.sickness.is_sick(std::time::Instant::now())
    });
    let addr = config.common.health_addr;
    let health = HealthServer::start(addr, registry, ready)
        .map_err(|source| DenoiserError::Health { addr, source })?;
    tracing::info!(%worker_id, health = %health.addr, "denoiser up");
    Ok(DenoiserHandle {
        health_addr: health.addr,
        worker_id,
        service,
        intake,
        background,
        submits,
        others,
        pump,
        engine_drained,
        health,
    })
}

/// Serve until `shutdown` is cancelled, then drain and stop.
/// Run until `shutdown`, or until the device faults (`sickness`): then drain (queued jobs go
/// back to the router) and fail, so the process exits non-zero and its supervisor restarts it
/// on a fresh CUDA context.
pub async fn run(config: DenoiserConfig, shutdown: CancellationToken) -> Result<(), DenoiserError> {
    let handle = start(config).await?;
    let fault = handle.service.sickness.device_fault();
    tokio::select! {
        _ = shutdown.cancelled() => handle.shutdown().await,
        _ = fault.cancelled() => {
            handle.shutdown().await?;
            Err(DenoiserError::DeviceFault)
        }
    }
}

/// `--cache-quality-floor`: an SSIM floor in 0..=1.
fn quality_floor(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("expected an SSIM between 0 and 1, got {value:?}")),
    }
}
