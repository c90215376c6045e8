//! diffmesh codec: CPU pre/post-processing of images for the mesh.
//!
//! Pre (`subjects::CODEC_PRE`, from the gateway): decode and validate the uploads, stretch the
//! template to the model resolution, turn the mask into a token mask. Post
//! (`subjects::CODEC_POST`, from the denoiser): stretch outputs back to the input size,
//! composite (unmasked pixels are the template's own bytes) and encode PNG. Replicas share the
//! work through one queue group.
pub mod decoded;
pub mod error;
pub mod image_workers;
pub mod imaging;
pub mod metrics;
pub mod processing;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::Message;
use diffmesh_shared::nats;
use diffmesh_shared::nats::serve::serve_subscription;
use diffmesh_shared::nats::trace_context::{job_id_of, set_parent_from};
use diffmesh_shared::process::config::duration;
use diffmesh_shared::process::health::HealthServer;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::wire::messages::{
    decode, PostprocessReply, PostprocessRequest, PreprocessReply, PreprocessRequest,
};
use diffmesh_shared::wire::subjects::{CODEC_POST, CODEC_PRE, CODEC_QUEUE};
use diffmesh_shared::{CommonConfig, MeshError};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use decoded::DecodedImages;
pub use error::CodecError;
use image_workers::ImageWorkers;
use imaging::TokenGrid;
use metrics::CodecMetrics;
use processing::Codec;

/// Codec flags.
#[derive(Debug, Clone, clap::Args)]
pub struct CodecConfig {
    #[command(flatten)]
    pub common: CommonConfig,
    /// Model input width in pixels, for requests that carry no model geometry (gateways send
    /// each job's model's, from its denoisers' announcement; these flags are for older ones).
    #[arg(long, env = "CODEC_MODEL_WIDTH", default_value_t = 64)]
    pub model_width: u32,
    /// Model input height in pixels, for requests that carry no model geometry.
    #[arg(long, env = "CODEC_MODEL_HEIGHT", default_value_t = 64)]
    pub model_height: u32,
    /// Pixels per image-token side, for requests that carry no model geometry: VAE downscale
    /// factor times the 2x2 patch packing (2 * 2 = 4 for the tiny model, 8 * 2 = 16 for FLUX).
    #[arg(long, env = "CODEC_TOKEN_PIXELS", default_value_t = 4)]
    pub token_pixels: u32,
    /// Largest accepted image or mask, in pixels (width * height).
    #[arg(long, env = "CODEC_MAX_PIXELS", default_value_t = 16_777_216)]
    pub max_pixels: u64,
    /// Largest upload the codec reads from the object store, in bytes.
    #[arg(long, env = "CODEC_MAX_BLOB_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub max_blob_bytes: usize,
    /// Decoded template images kept in memory, in bytes of pixels (0: decode every time).
    /// Each edit needs its template decoded twice (pre and post); edits of one template, or
    /// re-uploads of one image, then decode it once.
    #[arg(long, env = "CODEC_DECODED_CACHE_BYTES", default_value_t = 256 << 20)]
    pub decoded_cache_bytes: u64,
    /// Requests handled at once by this replica, and threads of image work (its image
    /// workers: `image_workers`).
    #[arg(long, env = "CODEC_CONCURRENCY", default_value_t = 4)]
    pub concurrency: usize,
    /// Deadline of one request's work; past it the caller gets `Failed`. Sooner when the
    /// caller waits less for the answer (its `diffmesh-answer-within-ms` header).
    #[arg(long, env = "CODEC_REQUEST_TIMEOUT", default_value = "60s", value_parser = duration)]
    pub request_timeout: Duration,
}

impl CodecConfig {
    /// Defaults for in-process tests against `nats_url`.
    pub fn for_tests(nats_url: impl Into<String>) -> Self {
        Self {
            common: CommonConfig::for_tests(nats_url),
            model_width: 64,
            model_height: 64,
            token_pixels: 4,
            max_pixels: 16_777_216,
            max_blob_bytes: 64 * 1024 * 1024,
            decoded_cache_bytes: 64 << 20,
            concurrency: 2,
            request_timeout: Duration::from_secs(30),
        }
    }

    fn grid(&self) -> Result<TokenGrid, CodecError> {
        let tp = self.token_pixels;
        if tp == 0 || self.model_width == 0 || self.model_height == 0 {
            return Err(CodecError::Config(
                "model size and token pixels must be > 0".into(),
            ));
        }
        if !self.model_width.is_multiple_of(tp) || !self.model_height.is_multiple_of(tp) {
            return Err(CodecError::Config(format!(
                "model size {}x{} is not a multiple of --token-pixels {tp}",
                self.model_width, self.model_height
            )));
        }
        if self.concurrency == 0 {
            return Err(CodecError::Config("--concurrency must be > 0".into()));
        }
        Ok(TokenGrid {
            model_width: self.model_width,
            model_height: self.model_height,
            token_pixels: tp,
        })
    }
}

#[derive(Clone, Copy)]
enum Op {
    Pre,
    Post,
}

impl Op {
    fn as_str(self) -> &'static str {
        match self {
            Op::Pre => "pre",
            Op::Post => "post",
        }
    }
}

struct Worker {
    client: async_nats::Client,
    request_timeout: Duration,
    codec: Codec,
    metrics: CodecMetrics,
}

/// A running codec replica.
pub struct CodecHandle {
    /// Where /healthz, /readyz and /metrics answer (the bound port when 0 was asked).
    pub health_addr: SocketAddr,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl CodecHandle {
    /// Stop taking requests, finish those in flight, stop the health server.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        if let Err(err) = self.task.await {
            tracing::error!(error = %err, "codec serve loop panicked");
        }
    }
}

/// Connect, subscribe and serve in the background (tests start replicas this way).
pub async fn start(config: CodecConfig) -> Result<CodecHandle, CodecError> {
    let grid = config.grid()?;
    let registry = prometheus::Registry::new();
    let metrics = CodecMetrics::register(&registry)?;
    let client = config.common.connect_nats("diffmesh-codec").await?;
    let js = diffmesh_shared::stores::jetstream_layout::context(
        &client,
        &config.common,
        diffmesh_shared::nats::auth::Role::Codec,
        None,
    )
    .await?;
    let blobs = BlobStore::open(&js).await?;
    let templates = BlobStore::open_with(
        &js,
        &diffmesh_shared::stores::jetstream_layout::TEMPLATE_IMAGES,
    )
    .await?;

    let pre = client
        .queue_subscribe(CODEC_PRE, CODEC_QUEUE.to_string())
        .await
        .map_err(MeshError::from)?;
    let post = client
        .queue_subscribe(CODEC_POST, CODEC_QUEUE.to_string())
        .await
        .map_err(MeshError::from)?;
    // Make sure the server registered the subscriptions before anyone is told we are up.
    client
        .flush()
        .await
        .map_err(|e| CodecError::Config(format!("NATS flush after subscribing: {e}")))?;

    let probe = client.clone();
    let health = HealthServer::start(
        config.common.health_addr,
        registry,
        Arc::new(move || probe.connection_state() == async_nats::connection::State::Connected),
    )?;
    tracing::info!(health = %health.addr, ?grid, "codec started");
    let decoded = DecodedImages::new(config.decoded_cache_bytes, metrics.decoded_cache.clone());
    let worker = Arc::new(Worker {
        client,
        request_timeout: config.request_timeout.max(Duration::from_millis(1)),
        codec: Codec {
            blobs,
            templates,
            fallback_grid: grid,
            max_pixels: config.max_pixels,
            max_blob_bytes: config.max_blob_bytes,
            decoded,
            workers: ImageWorkers::start(config.concurrency),
        },
        metrics,
    });
    let shutdown = CancellationToken::new();
    let health_addr = health.addr;
    let task = tokio::spawn(serve(
        worker,
        Subscriptions { pre, post },
        config.concurrency,
        health,
        shutdown.clone(),
    ));
    Ok(CodecHandle {
        health_addr,
        shutdown,
        task,
    })
}

/// Run a codec replica until `shutdown` is cancelled, then finish in-flight requests.
pub async fn run(config: CodecConfig, shutdown: CancellationToken) -> Result<(), CodecError> {
    let handle = start(config).await?;
    shutdown.cancelled().await;
    handle.shutdown().await;
    Ok(())
}

struct Subscriptions {
    pre: async_nats::Subscriber,
    post: async_nats::Subscriber,
}

async fn serve(
    worker: Arc<Worker>,
    subs: Subscriptions,
    concurrency: usize,
    health: HealthServer,
    shutdown: CancellationToken,
) {
    // One bound for both subjects: pre- and post-processing share the CPU cores.
    let limit = Arc::new(Semaphore::new(concurrency));
    let serve_op = |sub, op| {
        let worker = worker.clone();
        serve_subscription(sub, shutdown.clone(), limit.clone(), move |msg| {
            handle(worker.clone(), op, msg)
        })
    };
    // Each stops taking work on shutdown and finishes what it took.
    tokio::join!(serve_op(subs.pre, Op::Pre), serve_op(subs.post, Op::Post));
    tracing::info!("codec stopped taking work");
    // Bounded: with the server gone a flush would wait for a reconnect forever.
    let _ = tokio::time::timeout(Duration::from_secs(2), worker.client.flush()).await;
    health.stop().await;
}

async fn handle(worker: Arc<Worker>, op: Op, msg: Message) {
    let job_id = job_id_of(msg.headers.as_ref()).unwrap_or_default();
    let span = tracing::info_span!("codec", op = op.as_str(), job_id = %job_id);
    set_parent_from(&span, msg.headers.as_ref());
    async move {
        let start = Instant::now();
        let (outcome, sent) = match op {
            Op::Pre => {
                let reply = pre_reply(&worker, &msg).await;
                let outcome = match &reply {
                    PreprocessReply::Prepared(p) => {
                        worker
                            .metrics
                            .mask_ratio
                            .with_label_values(&[] as &[&str])
                            .observe(f64::from(p.mask_ratio));
                        "ok"
                    }
                    PreprocessReply::Invalid(_) => "invalid",
                    PreprocessReply::Failed { .. } => "failed",
                };
                (
                    outcome,
                    nats::reply_msgpack(&worker.client, &msg, &reply).await,
                )
            }
            Op::Post => {
                let reply = post_reply(&worker, &msg).await;
                let outcome = match &reply {
                    PostprocessReply::Done { .. } => "ok",
                    PostprocessReply::Failed { .. } => "failed",
                };
                (
                    outcome,
                    nats::reply_msgpack(&worker.client, &msg, &reply).await,
                )
            }
        };
        if let Err(err) = sent {
            tracing::warn!(error = %err, "sending the reply failed");
            worker.metrics.failures.inc("reply");
        }
        worker
            .metrics
            .requests
            .with_label_values(&[op.as_str(), outcome])
            .inc();
        worker
            .metrics
            .duration
            .with_label_values(&[op.as_str()])
            .observe(start.elapsed().as_secs_f64());
    }
    .instrument(span)
    .await
}

/// Run one request's work under its deadline: the codec's own, or sooner when the caller waits
/// less for this send of the request (it sends again after a first short wait), since the
/// answer would go unread past that and the work would only hold a slot.
async fn within<T>(
    worker: &Worker,
    msg: &Message,
    work: impl std::future::Future<Output = Result<T, CodecError>>,
) -> Result<T, CodecError> {
    let budget = work_budget(
        worker.request_timeout,
        nats::answer_within(msg.headers.as_ref()),
    );
    tokio::time::timeout(budget, work)
        .await
        .unwrap_or(Err(CodecError::Timeout(budget)))
}

fn work_budget(own: Duration, caller_waits: Option<Duration>) -> Duration {
    caller_waits.map_or(own, |waits| waits.min(own))
}

async fn pre_reply(worker: &Worker, msg: &Message) -> PreprocessReply {
    let result = match decode::<PreprocessRequest>(&msg.payload) {
        Ok(req) => within(worker, msg, worker.codec.preprocess(&req)).await,
        Err(err) => Err(MeshError::from(err).into()),
    };
    match result {
        Ok(prepared) => PreprocessReply::Prepared(prepared),
        Err(CodecError::Invalid(field)) => {
            tracing::info!(field = %field.field, message = %field.message, "rejected input");
            PreprocessReply::Invalid(field)
        }
        Err(err) => {
            tracing::error!(error = %err, "preprocess failed");
            worker.metrics.failures.inc(err.reason());
            PreprocessReply::Failed {
                message: err.to_string(),
            }
        }
    }
}

async fn post_reply(worker: &Worker, msg: &Message) -> PostprocessReply {
    let result = match decode::<PostprocessRequest>(&msg.payload) {
        Ok(req) => within(worker, msg, worker.codec.postprocess(&req)).await,
        Err(err) => Err(MeshError::from(err).into()),
    };
    match result {
        Ok(png_keys) => PostprocessReply::Done { png_keys },
        Err(err) => {
            tracing::error!(error = %err, "postprocess failed");
            worker.metrics.failures.inc(err.reason());
            PostprocessReply::Failed {
                message: err.to_string(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_stops_when_the_caller_stops_waiting_or_at_the_codecs_own_deadline() {
        let own = Duration::from_secs(60);
        assert_eq!(work_budget(own, None), own);
        assert_eq!(
            work_budget(own, Some(Duration::from_secs(5))),
            Duration::from_secs(5)
        );
        assert_eq!(work_budget(own, Some(Duration::from_secs(90))), own);
    }
}
