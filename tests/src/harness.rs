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
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny");
    dir.join("model_index.json").exists().then_some(dir)
}

pub fn start_codec(
    nats: &NatsServer,
    tweak: impl FnOnce(&mut diffmesh_codec::CodecConfig),
) -> Result<Service> {
    let mut config = diffmesh_codec::CodecConfig::for_tests(nats.url());
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
    let mut config = diffmesh_gateway::GatewayConfig::for_tests(nats.url());
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
    let mut config = diffmesh_router::RouterConfig::for_tests(nats.url());
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
        nats.url(),
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

/// Start a cachestore whose disk tier lives in `disk_dir`.
pub fn start_cachestore(
    nats: &NatsServer,
    disk_dir: &Path,
    tweak: impl FnOnce(&mut diffmesh_cachestore::CachestoreConfig),
) -> Result<Service> {
    let mut config =
        diffmesh_cachestore::CachestoreConfig::for_tests(nats.url(), disk_dir.to_path_buf());
    tweak(&mut config);
    Service::spawn(
        "cachestore",
        move || async move {
            let h = diffmesh_cachestore::start(config).await?;
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

/// The Prometheus text a service serves on `/metrics` at `health`.
pub async fn scrape_metrics(health: SocketAddr) -> Result<String> {
    let url = format!("http://{health}/metrics");
    let response = reqwest::get(&url).await?;
    if !response.status().is_success() {
        bail!("GET {url}: {}", response.status());
    }
    Ok(response.text().await?)
}

/// The value of the Prometheus sample line `series value` in `metrics`, where `series` is the
/// name with its labels as exported (`name{label="v"}`); 0 when absent.
pub fn metric_sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Whether the stream `subjects::TEMPLATE_CAPTURES_STREAM` keeps a capture announcement of
/// `cache_key` (what denoisers started later replay).
pub async fn capture_announced(client: &async_nats::Client, cache_key: &str) -> bool {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    use diffmesh_shared::wire::subjects::{template_captured, TEMPLATE_CAPTURES_STREAM};
    let stream = async_nats::jetstream::new(client.clone())
        .get_stream(TEMPLATE_CAPTURES_STREAM)
        .await
        .expect("the captures stream");
    match stream
        .get_last_raw_message_by_subject(&template_captured(cache_key))
        .await
    {
        Ok(_) => true,
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => false,
        Err(e) => panic!("reading the captures stream: {e}"),
    }
}

/// POST a multipart form to `url` (a capture or an edit may take a while): status and JSON body.
pub async fn post_form(
    http: &reqwest::Client,
    url: &str,
    form: reqwest::multipart::Form,
) -> (u16, serde_json::Value) {
    let r = http
        .post(url)
        .multipart(form)
        .timeout(Duration::from_secs(240))
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = r.status().as_u16();
    (status, r.json().await.expect("JSON body"))
}

/// POST a JSON generation: status, JSON body and (on 200) the first image's RGB pixels.
/// `GET url` (a gateway's `/v1/models`) once it lists `count` models; panics after 30 s.
/// Model `id`'s entry in a `GET /v1/models` answer; panics naming it when it is not listed.
pub fn model_card<'a>(models: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    models["data"]
        .as_array()
        .and_then(|d| d.iter().find(|m| m["id"] == id))
        .unwrap_or_else(|| panic!("{id} not listed: {models}"))
}

pub async fn models_once_listed(
    http: &reqwest::Client,
    url: &str,
    count: usize,
) -> serde_json::Value {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let body: serde_json::Value = http.get(url).send().await.unwrap().json().await.unwrap();
            if body["data"].as_array().is_some_and(|d| d.len() == count) {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{url} never listed {count} models"))
}

pub async fn generate(
    http: &reqwest::Client,
    url: &str,
    body: impl std::borrow::Borrow<serde_json::Value>,
) -> (u16, serde_json::Value, Vec<u8>) {
    let r = http
        .post(url)
        .json(body.borrow())
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("generation request");
    let status = r.status().as_u16();
    let body: serde_json::Value = r.json().await.expect("JSON body");
    let pixels = match status {
        200 => crate::images::decode_b64_images(&body).expect("images")[0]
            .to_rgb8()
            .into_raw(),
        _ => Vec::new(),
    };
    (status, body, pixels)
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

/// A stand-in for the router: answers every submit with `reply` and remembers the job ids of
/// the submits and cancels it saw, so gateway behaviour can be tested without denoisers.
pub struct FakeRouter {
    pub submits: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    pub cancels: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl FakeRouter {
    /// Subscribe on `diffmesh.router.submit` and `.cancel` (ready when this returns).
    pub async fn start(
        nats: &NatsServer,
        reply: diffmesh_shared::wire::messages::SubmitReply,
    ) -> Result<FakeRouter> {
        use diffmesh_shared::wire::messages::{decode, CancelJob, DenoiseJob};
        use diffmesh_shared::wire::subjects::{ROUTER_CANCEL, ROUTER_SUBMIT};
        use futures::StreamExt;
        let client = async_nats::connect(nats.url()).await?;
        let mut submit_sub = client.subscribe(ROUTER_SUBMIT).await?;
        let mut cancel_sub = client.subscribe(ROUTER_CANCEL).await?;
        client.flush().await?;
        let submits = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let cancels = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (seen, c) = (submits.clone(), client.clone());
        let submit_task = tokio::spawn(async move {
            while let Some(msg) = submit_sub.next().await {
                if let Ok(job) = decode::<DenoiseJob>(&msg.payload) {
                    seen.lock().unwrap().push(job.job_id);
                }
                let _ = diffmesh_shared::nats::reply_msgpack(&c, &msg, &reply).await;
            }
        });
        let seen = cancels.clone();
        let cancel_task = tokio::spawn(async move {
            while let Some(msg) = cancel_sub.next().await {
                if let Ok(cancel) = decode::<CancelJob>(&msg.payload) {
                    seen.lock().unwrap().push(cancel.job_id);
                }
            }
        });
        Ok(FakeRouter {
            submits,
            cancels,
            tasks: vec![submit_task, cancel_task],
        })
    }

    pub fn cancelled(&self, job_id: &str) -> bool {
        self.cancels.lock().unwrap().iter().any(|j| j == job_id)
    }
}

impl Drop for FakeRouter {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Reads a Server-Sent Events response event by event.
pub struct SseReader {
    response: reqwest::Response,
    buf: String,
    ended: bool,
}

impl SseReader {
    pub fn new(response: reqwest::Response) -> Self {
        Self {
            response,
            buf: String::new(),
            ended: false,
        }
    }

    /// The next `(event, data)` (keep-alive comments skipped); `None` once the stream ended.
    pub async fn next(&mut self, within: Duration) -> Result<Option<(String, serde_json::Value)>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            while let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                let mut name = None;
                let mut data = None;
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event: ") {
                        name = Some(v.to_string());
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data = Some(serde_json::from_str(v)?);
                    }
                }
                if let (Some(name), Some(data)) = (name, data) {
                    return Ok(Some((name, data)));
                }
            }
            if self.ended {
                return Ok(None);
            }
            match tokio::time::timeout_at(deadline, self.response.chunk()).await {
                Err(_) => bail!("no event within {within:?}; unread: {:?}", self.buf),
                Ok(Ok(Some(chunk))) => self.buf.push_str(&String::from_utf8_lossy(&chunk)),
                Ok(Ok(None)) => self.ended = true,
                Ok(Err(e)) => bail!("reading the event stream: {e}"),
            }
        }
    }

    /// Every remaining event until the stream ends (each within `within` of the last).
    pub async fn rest(&mut self, within: Duration) -> Result<Vec<(String, serde_json::Value)>> {
        let mut events = Vec::new();
        while let Some(e) = self.next(within).await? {
            events.push(e);
        }
        Ok(events)
    }
}

/// The form of `POST /v1/templates` with the 64x64 test template (`images::template`), its
/// prompt and `steps` denoising steps.
pub fn template_form(steps: u32) -> reqwest::multipart::Form {
    use reqwest::multipart::{Form, Part};
    let png = crate::images::png_bytes(&crate::images::template(64, 64));
    Form::new()
        .part("image", Part::bytes(png).file_name("t.png"))
        .text("prompt", "a blue background")
        .text("num_inference_steps", steps.to_string())
}
