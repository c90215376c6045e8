//! Helpers of the router's integration tests: fake denoisers driven by hand and a minimal HTTP
//! client (keeps the tests free of an HTTP client dependency).
#![allow(dead_code)]
use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::wire::messages::{
    decode, encode, DenoiseJob, Heartbeat, RunningJob, SubmitReply,
};
use diffmesh_shared::wire::subjects;
use futures::StreamExt;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub fn job(id: &str) -> DenoiseJob {
    diffmesh_shared::testing::generation_job(id, "a red circle", 1, 4)
}

/// What a fake denoiser reports in its heartbeats.
#[derive(Clone)]
pub struct FakeWorker {
    pub id: String,
    pub max_batch: u32,
    pub queue_capacity: u32,
    /// Jobs it reports running (as if placed by someone else).
    pub running: Vec<RunningJob>,
}

impl FakeWorker {
    pub fn new(id: &str, max_batch: u32, queue_capacity: u32) -> Self {
        Self {
            id: id.into(),
            max_batch,
            queue_capacity,
            running: vec![],
        }
    }

    /// Also reporting one job placed by someone else: `masked_tokens`, `remaining_steps` left.
    pub fn running_foreign(mut self, masked_tokens: u32, remaining_steps: u32) -> Self {
        self.running = vec![RunningJob {
            job_id: "foreign".into(),
            masked_tokens,
            remaining_steps,
            rows: 1,
            images: 1,
            control_s: 0.0,
        }];
        self
    }

    /// Heartbeat every 100 ms until the token is cancelled; accept every submit and report it
    /// on `jobs`.
    pub async fn spawn(
        self,
        client: async_nats::Client,
        jobs: mpsc::Sender<(String, DenoiseJob)>,
    ) -> CancellationToken {
        let stop = CancellationToken::new();
        let mut sub = client
            .subscribe(subjects::denoiser_submit(&self.id))
            .await
            .unwrap();
        client.flush().await.unwrap();
        let s = stop.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tokio::select! {
                    _ = s.cancelled() => return,
                    _ = tick.tick() => {
                        let hb = Heartbeat {
                            worker_id: self.id.clone(),
                            running: self.running.clone(),
                            queued: 0,
                            waiting: vec![],
                            max_batch: self.max_batch,
                            model: "tiny".into(),
                            card: None,
                            draining: false,
                            queue_capacity: self.queue_capacity,
                            cached_templates: vec![],
                            cached_loras: vec![],
                            controlnets: vec![],
                            recent_steps: vec![],
                            controlnet_step_s: vec![],
                            interval_ms: 100,
                            ranks: 0,
                            free_ranks: 0,
                        };
                        let _ = client.publish(subjects::DENOISER_HEARTBEAT, encode(&hb).unwrap().into()).await;
                    }
                    msg = sub.next() => {
                        let Some(msg) = msg else { return };
                        let job: DenoiseJob = decode(&msg.payload).unwrap();
                        let reply = SubmitReply::Accepted { worker_id: self.id.clone() };
                        let _ = client.publish(msg.reply.unwrap(), encode(&reply).unwrap().into()).await;
                        let _ = jobs.send((self.id.clone(), job)).await;
                    }
                }
            }
        });
        stop
    }
}

pub async fn submit(client: &async_nats::Client, j: &DenoiseJob) -> SubmitReply {
    request_msgpack(client, subjects::ROUTER_SUBMIT, j, Duration::from_secs(10))
        .await
        .unwrap()
}

/// A minimal HTTP/1.0 request; returns (status, body).
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String) {
    http_as(addr, method, path, body, None).await
}

/// [`http`] with `Authorization: Bearer <key>` when a key is given.
pub async fn http_as(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    key: Option<&str>,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

/// Poll the router's `/metrics` until `line` appears (or panic after 5 s).
pub async fn wait_for_metric(addr: std::net::SocketAddr, line: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (_, body) = http(addr, "GET", "/metrics", "").await;
        if body.lines().any(|l| l == line) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "metric `{line}` never appeared:\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
