//! diffmesh cachestore: activation caches of templates in tiers (host memory, local disk,
//! JetStream object store), served over NATS request/reply.
//!
//! Start it in-process with [`start`] (tests) or run it until a signal with [`run`] (the binary).
pub mod cluster_lru;
pub mod disk;
pub mod memory;
pub mod metrics;
pub mod promoter;
pub mod service;
pub mod store;
pub mod transfers;

use diffmesh_shared::process::health::{HealthServer, Readiness};
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::jetstream_layout;
use diffmesh_shared::wire::cachestore::{self as proto, CACHE_BUCKET, DEFAULT_INLINE_LIMIT};
use diffmesh_shared::{CommonConfig, MeshError};
use service::{Handler, Op};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Cachestore flags (every one also from the environment).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "diffmesh-cachestore", about = "Tiered activation cache store")]
pub struct CachestoreConfig {
    #[command(flatten)]
    pub common: CommonConfig,
    /// Capacity of the host-memory tier in bytes (values plus keys).
    #[arg(long, env = "CACHESTORE_MEMORY_BYTES", default_value_t = 1 << 30)]
    pub memory_bytes: u64,
    /// Directory of the local disk tier (created if missing).
    #[arg(long, env = "CACHESTORE_DISK_DIR", default_value = "run/cachestore")]
    pub disk_dir: PathBuf,
    /// Capacity of the local disk tier in bytes.
    #[arg(long, env = "CACHESTORE_DISK_BYTES", default_value_t = 8 << 30)]
    pub disk_bytes: u64,
    /// Largest value carried inline in a NATS message; larger ones go through the object store.
    #[arg(long, env = "CACHESTORE_INLINE_LIMIT", default_value_t = DEFAULT_INLINE_LIMIT)]
    pub inline_limit: usize,
    /// JetStream object store bucket of the cluster tier.
    #[arg(long, env = "CACHESTORE_BUCKET", default_value = CACHE_BUCKET)]
    pub bucket: String,
    /// Bytes the cluster tier keeps: past them the least recently used template caches are
    /// deleted from it (a later edit of such a template captures it again). 0: 90% of the
    /// cache bucket's bound (its share of JS_MAX_BYTES); with no bound either, none.
    #[arg(long, env = "CACHESTORE_CLUSTER_BYTES", default_value_t = 0)]
    pub cluster_bytes: u64,
    /// Run without the cluster tier (memory and disk only; large values cannot be served).
    #[arg(long, env = "CACHESTORE_NO_CLUSTER_TIER", default_value_t = false)]
    pub no_cluster_tier: bool,
    /// Requests handled at once per subject.
    #[arg(long, env = "CACHESTORE_MAX_IN_FLIGHT", default_value_t = 64)]
    pub max_in_flight: usize,
    /// Keys promoted into memory at once by prefetches (they run in the background).
    #[arg(long, env = "CACHESTORE_PREFETCH_CONCURRENCY", default_value_t = 4)]
    pub prefetch_concurrency: usize,
    /// Bytes of large values held for readers reading them in ranges straight from this
    /// instance (each held until 30 s after its last range; one read from the memory tier
    /// shares the tier's buffer). A value above half of this goes through the object store.
    #[arg(long, env = "CACHESTORE_TRANSFER_BYTES", default_value_t = 4 << 30)]
    pub transfer_bytes: u64,
}

impl CachestoreConfig {
    /// In-process test config: health on a free port, the given disk dir, small tiers.
    pub fn for_tests(nats_url: impl Into<String>, disk_dir: PathBuf) -> Self {
        Self {
            common: CommonConfig::for_tests(nats_url),
            memory_bytes: 4 << 20,
            disk_dir,
            disk_bytes: 64 << 20,
            inline_limit: DEFAULT_INLINE_LIMIT,
            bucket: CACHE_BUCKET.to_string(),
            cluster_bytes: 0,
            no_cluster_tier: false,
            max_in_flight: 16,
            prefetch_concurrency: 2,
            transfer_bytes: 256 << 20,
        }
    }
}

impl CachestoreConfig {
    /// The cluster tier's budget: `--cluster-bytes`, else 90% of the bucket's bound.
    pub fn cluster_budget(&self) -> u64 {
        if self.cluster_bytes > 0 {
            return self.cluster_bytes;
        }
        match u64::try_from(jetstream_layout::CACHES.max_bytes(self.common.js_max_bytes)) {
            Ok(bound) => bound / 10 * 9,
            Err(_) => 0, // -1: the bucket has no bound
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CachestoreError {
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("subscribing failed: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
    #[error("health server on {addr}: {source}")]
    Health {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics registration: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// A running cachestore.
pub struct CachestoreHandle {
    /// Where /healthz, /readyz and /metrics answer (the bound port when 0 was asked).
    pub health_addr: SocketAddr,
    pub store: Arc<store::TieredStore>,
    shutdown: CancellationToken,
    tasks: JoinSet<Result<(), async_nats::SubscribeError>>,
    health: HealthServer,
    client: async_nats::Client,
}

impl CachestoreHandle {
    /// Stop taking requests, let those in flight finish, flush NATS, stop the health server.
    pub async fn shutdown(mut self) -> Result<(), CachestoreError> {
        self.shutdown.cancel();
        while let Some(r) = self.tasks.join_next().await {
            if let Ok(Err(e)) = r {
                tracing::warn!(error = %e, "handler ended with an error");
            }
        }
        let _ = self.client.flush().await;
        self.health.stop().await;
        Ok(())
    }
}

/// Connect, open the tiers, subscribe, and serve in the background.
pub async fn start(config: CachestoreConfig) -> Result<CachestoreHandle, CachestoreError> {
    let registry = prometheus::Registry::new();
    let metrics = metrics::CacheMetrics::new(&registry)?;
    let client = config.common.connect_nats("diffmesh-cachestore").await?;
    let cluster = if config.no_cluster_tier {
        None
    } else {
        // Cache entries are managed by the cachestore itself: no server-side expiry.
        let bucket = jetstream_layout::CACHES.renamed(config.bucket.clone());
        let js = jetstream_layout::context(
            &client,
            &config.common,
            diffmesh_shared::nats::auth::Role::Cachestore,
            Some(std::slice::from_ref(&bucket)),
        )
        .await?;
        Some(BlobStore::open_with(&js, &bucket).await?)
    };
    let store = Arc::new(
        store::TieredStore::new(
            config.memory_bytes,
            config.disk_dir.clone(),
            config.disk_bytes,
            cluster,
            metrics,
        )?
        .with_cluster_budget(config.cluster_budget())
        .await,
    );
    let handler = Arc::new(Handler {
        client: client.clone(),
        store: store.clone(),
        inline_limit: config.inline_limit,
        in_flight: Arc::new(tokio::sync::Semaphore::new(config.max_in_flight.max(1))),
        prefetch: promoter::Promoter::start(store.clone(), config.prefetch_concurrency),
        transfers: transfers::Transfers::new(config.transfer_bytes),
        range_subject: proto::range_subject(&uuid::Uuid::new_v4().simple().to_string()),
    });
    let shutdown = CancellationToken::new();
    let mut tasks = JoinSet::new();
    for (subject, op) in [
        (proto::get_subject(), Op::Get),
        (proto::put_subject(), Op::Put),
        (proto::delete_subject(), Op::Delete),
        (proto::stats_subject(), Op::Stats),
        (proto::locate_subject(), Op::Locate),
        (proto::prefetch_subject(), Op::Prefetch),
        (handler.range_subject.clone(), Op::Range),
    ] {
        let sub = handler
            .subscribe(&subject, op)
            .await
            .map_err(MeshError::from)?;
        tasks.spawn(
            handler
                .clone()
                .serve(subject, sub, op, shutdown.child_token()),
        );
    }
    // Every replica drops its local copies of deleted templates (no queue group).
    let evictions = client
        .subscribe(diffmesh_shared::wire::subjects::TEMPLATES_EVICT)
        .await
        .map_err(MeshError::from)?;
    tasks.spawn(service::serve_evictions(
        store.clone(),
        evictions,
        shutdown.child_token(),
    ));
    // Subscriptions must reach the server before callers are told we are up.
    client
        .flush()
        .await
        .map_err(|e| MeshError::Telemetry(format!("NATS flush: {e}")))?;
    let nats = client.clone();
    let ready: Readiness =
        Arc::new(move || nats.connection_state() == async_nats::connection::State::Connected);
    let addr = config.common.health_addr;
    let health = HealthServer::start(addr, registry, ready)
        .map_err(|source| CachestoreError::Health { addr, source })?;
    tracing::info!(health = %health.addr, disk = %config.disk_dir.display(), "cachestore up");
    Ok(CachestoreHandle {
        health_addr: health.addr,
        store,
        shutdown,
        tasks,
        health,
        client,
    })
}

/// Serve until `shutdown` is cancelled, then stop cleanly.
pub async fn run(
    config: CachestoreConfig,
    shutdown: CancellationToken,
) -> Result<(), CachestoreError> {
    let handle = start(config).await?;
    shutdown.cancelled().await;
    handle.shutdown().await
}
