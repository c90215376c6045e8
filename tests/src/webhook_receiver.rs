//! A webhook receiver for tests: an HTTP server on a free local port that records every post
//! and answers by its path: `/ok` 200, `/flaky` 500 to each webhook id's first post and 200
//! after, `/down` always 500.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};

/// One post as received.
#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub id: String,
    pub timestamp: u64,
    pub signature: String,
    pub body: Vec<u8>,
    pub at: Instant,
}

impl Received {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a webhook body is JSON")
    }
}

#[derive(Default)]
struct Log {
    posts: Vec<Received>,
    /// Posts per webhook id, for `/flaky`.
    seen: HashMap<String, u32>,
}

/// The running receiver; stopped when dropped.
pub struct WebhookReceiver {
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    log: Arc<Mutex<Log>>,
    server: actix_web::dev::ServerHandle,
}

async fn receive(req: HttpRequest, body: web::Bytes, log: web::Data<Mutex<Log>>) -> HttpResponse {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let post = Received {
        path: req.path().to_string(),
        id: header("webhook-id"),
        timestamp: header("webhook-timestamp").parse().unwrap_or(0),
        signature: header("webhook-signature"),
        body: body.to_vec(),
        at: Instant::now(),
    };
    let mut log = log.lock().expect("the log's lock");
    let count = log.seen.entry(post.id.clone()).or_default();
    *count += 1;
    let ok = match post.path.as_str() {
        "/ok" => true,
        "/flaky" => *count > 1,
        _ => false,
    };
    log.posts.push(post);
    match ok {
        true => HttpResponse::Ok().finish(),
        false => HttpResponse::InternalServerError().finish(),
    }
}

impl WebhookReceiver {
    pub fn start() -> Self {
        let log = Arc::new(Mutex::new(Log::default()));
        let data = web::Data::from(log.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let server = HttpServer::new(move || {
                    App::new()
                        .app_data(data.clone())
                        .default_service(web::post().to(receive))
                })
                .workers(1)
                .disable_signals()
                .bind(("127.0.0.1", 0))
                .expect("bind the receiver");
                let addr = server.addrs()[0];
                let server = server.run();
                tx.send((addr, server.handle())).expect("the test waits");
                let _ = server.await;
            })
        });
        let (addr, server) = rx.recv().expect("the receiver starts");
        Self {
            base: format!("http://{addr}"),
            log,
            server,
        }
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Every post so far, in order.
    pub fn posts(&self) -> Vec<Received> {
        self.log.lock().expect("the log's lock").posts.clone()
    }

    /// The posts with webhook id `id`.
    pub fn posts_of(&self, id: &str) -> Vec<Received> {
        self.posts().into_iter().filter(|p| p.id == id).collect()
    }

    /// Wait until `id` has `count` posts (or `within` passed); answers its posts.
    pub async fn wait_for(&self, id: &str, count: usize, within: Duration) -> Vec<Received> {
        let until = Instant::now() + within;
        loop {
            let posts = self.posts_of(id);
            if posts.len() >= count || Instant::now() > until {
                return posts;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for WebhookReceiver {
    fn drop(&mut self) {
        // Stops the server; its thread ends with it.
        drop(self.server.stop(false));
    }
}
