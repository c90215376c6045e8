//! Test harness: a real `nats-server -js` per test (the shared fixture in
//! `diffmesh_shared::testing`), mesh services started in-process on their own threads and runtimes, and
//! health polling. Nothing here needs the network or a fixed port.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use tokio_util::sync::CancellationToken;

pub use diffmesh_shared::testing::{free_port, NatsServer};

/// Addresses a started service reports.
#[derive(Debug, Clone, Copy)]
pub struct Addrs {
    pub health: SocketAddr,
    /// The public API (gateway only).
    pub api: Option<SocketAddr>,
}

/// A service running in-process on its own thread and Tokio runtime.
pub struct Service {
    pub name: String,
    pub addrs: Addrs,
    graceful: CancellationToken,
    kill: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Service {
    /// Start a service: `start` builds and starts it (returning its handle and addresses),
    /// `stop` shuts the handle down gracefully.
    pub fn spawn<H, S, SF, T, TF>(name: &str, start: S, stop: T) -> Result<Service>
    where
        H: Send + 'static,
        S: FnOnce() -> SF + Send + 'static,
        SF: std::future::Future<Output = Result<(H, Addrs)>>,
        T: FnOnce(H) -> TF + Send + 'static,
        TF: std::future::Future<Output = ()>,
    {
        let graceful = CancellationToken::new();
        let kill = CancellationToken::new();
        let (tx, rx) = std::sync::mpsc::channel();
        let (g, k) = (graceful.clone(), kill.clone());
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(anyhow!("runtime: {e}")));
                        return;
                    }
                };
                let killed = rt.block_on(async move {
                    let handle = match start().await {
                        Ok((handle, addrs)) => {
                            let _ = tx.send(Ok(addrs));
                            handle
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return false;
                        }
                    };
                    tokio::select! {
                        _ = g.cancelled() => { stop(handle).await; false }
                        // Abrupt stop: drop everything (connections close, no goodbyes).
                        _ = k.cancelled() => { drop(handle); true }
                    }
                });
                if killed {
                    rt.shutdown_background();
                }
            })?;
        let addrs = rx
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| anyhow!("{name} did not start within 120s"))??;
        Ok(Service {
            name: name.to_string(),
            addrs,
            graceful,
            kill,
            thread: Some(thread),
        })
    }

    /// Kill without a graceful shutdown, as a crashed process would stop.
    pub fn kill(mut self) {
        self.kill.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Wait until `/readyz` answers 200.
    pub async fn wait_ready(&self, within: Duration) -> Result<()> {
        let url = format!("http://{}/readyz", self.addrs.health);
        let client = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(r) = client.get(&url).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("{} not ready at {url} within {within:?}", self.name);
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.graceful.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The tiny default model directory (trained by `python/` scripts), if present.
pub fn tiny_model_dir() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny");
    dir.join("model_index.json").exists().then_some(dir)
}

pub fn start_codec(
    nats: &NatsServer,
    tweak: impl FnOnce(&mut diffmesh_codec::CodecConfig),
) -> Result<Service> {
    let mut config = diffmesh_codec::CodecConfig::for_tests(&nats.url());
    tweak(&mut config);
    Service::spawn(
        "codec",
        move || async move {
            let h = diffmesh_codec::start(config).await?;
            let addrs = Addrs {
                health: h.health_addr,
                api: None,
            };
            Ok((h, addrs))
        },
        |h| h.shutdown(),
    )
}

pub fn start_gateway(
    nats: &NatsServer,
    tweak: impl FnOnce(&mut diffmesh_gateway::GatewayConfig),
) -> Result<Service> {
    let mut config = diffmesh_gateway::GatewayConfig::for_tests(&nats.url());
    tweak(&mut config);
    Service::spawn(
        "gateway",
        move || async move {
            let h = diffmesh_gateway::start(config).await?;
            let addrs = Addrs {
                health: h.health_addr,
                api: Some(h.addr),
            };
            Ok((h, addrs))
        },
        |h| h.shutdown(),
    )
}

pub fn start_router(
    nats: &NatsServer,
    tweak: impl FnOnce(&mut diffmesh_router::RouterConfig),
) -> Result<Service> {
    let mut config = diffmesh_router::RouterConfig::for_tests(&nats.url());
    tweak(&mut config);
    Service::spawn(
        "router",
        move || async move {
            let h = diffmesh_router::start(config).await?;
            let addrs = Addrs {
                health: h.health_addr,
                api: None,
            };
            Ok((h, addrs))
        },
        |h| async move {
            let _ = h.shutdown().await;
        },
    )
}

pub fn start_denoiser(
    nats: &NatsServer,
    model_dir: &Path,
    worker_id: &str,
    tweak: impl FnOnce(&mut diffmesh_denoiser::DenoiserConfig),
) -> Result<Service> {
    let mut config = diffmesh_denoiser::DenoiserConfig::for_tests(
        &nats.url(),
        model_dir.to_path_buf(),
        worker_id,
    );
    tweak(&mut config);
    Service::spawn(
        &format!("denoiser-{worker_id}"),
        move || async move {
            let h = diffmesh_denoiser::start(config).await?;
            let addrs = Addrs {
                health: h.health_addr,
                api: None,
            };
            Ok((h, addrs))
        },
        |h| async move {
            let _ = h.shutdown().await;
        },
    )
}

/// Log to the test output once (RUST_LOG picks the level; default warn).
pub fn init_test_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}
