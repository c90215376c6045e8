//! The gateway's product surface without denoisers (NATS, the codec, the gateway, a fake router
//! that never takes async jobs from the durable queue): API keys scope jobs to the key that
//! created them (another key gets 404), per-key rate, concurrency and async-queue limits answer
//! 429 with Retry-After naming the quota, the router's `Overloaded` is a 429 while an async job
//! waits in the queue through it, and every error is JSON naming the field.
use std::time::Duration;

use diffmesh_shared::stores::async_queue;
use diffmesh_shared::wire::messages::SubmitReply;
use diffmesh_tests::harness::{
    init_test_logging, start_codec, start_gateway, FakeRouter, NatsServer, Service, SseReader,
};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

struct Env {
    gateway: Service,
    _codec: Service,
    router: FakeRouter,
    http: reqwest::Client,
    nats: NatsServer,
}

async fn start(
    reply: SubmitReply,
    tweak: impl FnOnce(&mut diffmesh_gateway::GatewayConfig),
) -> Env {
    init_test_logging();
    let nats = NatsServer::start();
    let router = FakeRouter::start(&nats, reply).await.expect("fake router");
    let codec = start_codec(&nats, |_| {}).expect("codec");
    let gateway = start_gateway(&nats, |g| {
        // Jobs the fake router never finishes end by this deadline (shutdown waits for them).
        g.job_timeout = Duration::from_secs_f64(4.0);
        tweak(g)
    })
    .expect("gateway");
    for s in [&codec, &gateway] {
        s.wait_ready(Duration::from_secs(10)).await.expect("ready");
    }
    Env {
        gateway,
        _codec: codec,
        router,
        http: reqwest::Client::new(),
        nats,
    }
}

fn accepted() -> SubmitReply {
    SubmitReply::Accepted {
        worker_id: "w-fake".into(),
    }
}

struct Reply {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Env {
    /// Jobs waiting in the durable queue of async jobs.
    async fn queued_jobs(&self) -> u64 {
        let client = async_nats::connect(self.nats.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let mut stream = js.get_stream(async_queue::STREAM).await.unwrap();
        stream.info().await.unwrap().state.messages
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.gateway.addrs.api.unwrap())
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
        async_: bool,
    ) -> Reply {
        let mut req = self.http.request(method, self.url(path));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        if async_ {
            req = req.header("Prefer", "respond-async");
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.expect("request");
        let status = r.status();
        let headers = r.headers().clone();
        let body = r.json().await.unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            body,
        }
    }

    /// An async generation for `key`; returns the job id.
    async fn submit(&self, key: &str) -> String {
        let r = self
            .call(
                Method::POST,
                "/v1/images/generations",
                Some(key),
                Some(gen_body()),
                true,
            )
            .await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
        r.body["id"].as_str().unwrap().to_string()
    }
}

fn gen_body() -> Value {
    json!({"prompt": "a red circle", "num_inference_steps": 2})
}

#[track_caller]
fn assert_error(r: &Reply, status: u16, error_type: &str, field: Option<&str>) {
    assert_eq!(r.status.as_u16(), status, "{}", r.body);
    let e = &r.body["error"];
    assert_eq!(e["error_type"], error_type, "{}", r.body);
    assert!(
        !e["message"].as_str().unwrap_or_default().is_empty(),
        "{}",
        r.body
    );
    match field {
        Some(f) => assert_eq!(e["field"], f, "{}", r.body),
        None => assert!(e["field"].is_null(), "{}", r.body),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_scope_jobs_to_their_creator() {
    let dir = tempfile::tempdir().unwrap();
    let keys_file = dir.path().join("keys");
    std::fs::write(&keys_file, "# ops\ncarol:sk-carol\n").unwrap();
    let env = start(accepted(), |g| {
        g.api_keys_file = Some(keys_file.clone());
        g.api_keys = Some("alice:sk-alice,bob:sk-bob".into());
    })
    .await;

    // No key, a malformed header, an unknown key: 401 naming the Authorization header.
    let r = env
        .call(
            Method::POST,
            "/v1/images/generations",
            None,
            Some(gen_body()),
            false,
        )
        .await;
    assert_error(&r, 401, "authentication_error", Some("Authorization"));
    assert!(r.headers.contains_key("www-authenticate"));
    let r = env
        .call(
            Method::POST,
            "/v1/images/generations",
            Some("sk-nobody"),
            Some(gen_body()),
            false,
        )
        .await;
    assert_error(&r, 401, "authentication_error", Some("Authorization"));
    let some_id = "0b6f8f0e-9d1e-4c39-8d67-6a1f0c3b1f10";
    let r = env
        .call(
            Method::GET,
            &format!("/v1/jobs/{some_id}"),
            None,
            None,
            false,
        )
        .await;
    assert_error(&r, 401, "authentication_error", Some("Authorization"));

    // Alice's job: visible and cancellable by Alice only.
    let job = env.submit("sk-alice").await;
    let path = format!("/v1/jobs/{job}");
    let r = env
        .call(Method::GET, &path, Some("sk-alice"), None, false)
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["id"], job.as_str());
    assert_eq!(r.body["links"]["self"], path.as_str());
    for other in ["sk-bob", "sk-carol"] {
        for (method, p) in [
            (Method::GET, path.clone()),
            (Method::DELETE, path.clone()),
            (Method::GET, format!("{path}/events")),
            (Method::GET, format!("{path}/result/0")),
        ] {
            let r = env.call(method.clone(), &p, Some(other), None, false).await;
            assert_error(&r, 404, "not_found_error", Some("id"));
        }
    }
    // Unknown and malformed ids.
    let r = env
        .call(
            Method::GET,
            &format!("/v1/jobs/{some_id}"),
            Some("sk-alice"),
            None,
            false,
        )
        .await;
    assert_error(&r, 404, "not_found_error", Some("id"));
    let r = env
        .call(
            Method::GET,
            "/v1/jobs/not-a-job",
            Some("sk-alice"),
            None,
            false,
        )
        .await;
    assert_error(&r, 400, "invalid_request_error", Some("id"));
    // No result before the job is done; a bad index names `n`.
    let r = env
        .call(
            Method::GET,
            &format!("{path}/result/0"),
            Some("sk-alice"),
            None,
            false,
        )
        .await;
    assert_error(&r, 409, "conflict_error", None);
    let r = env
        .call(
            Method::GET,
            &format!("{path}/result/x"),
            Some("sk-alice"),
            None,
            false,
        )
        .await;
    assert_error(&r, 400, "invalid_request_error", Some("n"));

    // It waits in the durable queue; Alice cancels it: the record says so, the routers are
    // told, and it leaves the queue.
    assert_eq!(env.queued_jobs().await, 1);
    let r = env
        .call(Method::DELETE, &path, Some("sk-alice"), None, false)
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["status"], "cancelled");
    assert_eq!(r.body["error"]["error_type"], "cancelled");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !env.router.cancelled(&job) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no CancelJob reached the router"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        env.queued_jobs().await,
        0,
        "the cancelled job is still queued"
    );
    // Cancelling again is harmless; the event stream of a cancelled job is just its ending.
    let r = env
        .call(Method::DELETE, &path, Some("sk-alice"), None, false)
        .await;
    assert_eq!(
        (r.status, r.body["status"].as_str()),
        (StatusCode::OK, Some("cancelled"))
    );
    let events = env
        .http
        .get(env.url(&format!("{path}/events")))
        .bearer_auth("sk-alice")
        .send()
        .await
        .unwrap();
    assert_eq!(events.headers()["content-type"], "text/event-stream");
    let events = SseReader::new(events)
        .rest(Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].0, "cancelled");
    assert_eq!(events[0].1["id"], job.as_str());

    // Idempotency keys are per API key: the same key from Alice and Bob makes two jobs.
    let idem = |key: &'static str| {
        env.http
            .post(env.url("/v1/images/generations"))
            .bearer_auth(key)
            .header("Prefer", "respond-async")
            .header("Idempotency-Key", "order-1")
            .json(&gen_body())
    };
    let a1: Value = idem("sk-alice").send().await.unwrap().json().await.unwrap();
    assert_eq!(a1["status"], "queued", "{a1}");
    assert_eq!(env.queued_jobs().await, 1);
    let a2 = idem("sk-alice").send().await.unwrap();
    assert_eq!(a2.status(), StatusCode::ACCEPTED);
    assert_eq!(a2.headers()["idempotent-replayed"], "true");
    let a2: Value = a2.json().await.unwrap();
    let b1: Value = idem("sk-bob").send().await.unwrap().json().await.unwrap();
    assert_eq!(a1["id"], a2["id"]);
    assert_ne!(a1["id"], b1["id"]);
    // The same key with another request is refused.
    let r = env
        .http
        .post(env.url("/v1/images/generations"))
        .bearer_auth("sk-alice")
        .header("Idempotency-Key", "order-1")
        .json(&json!({"prompt": "something else", "num_inference_steps": 2}))
        .send()
        .await
        .unwrap();
    let r = Reply {
        status: r.status(),
        headers: r.headers().clone(),
        body: r.json().await.unwrap(),
    };
    assert_error(&r, 422, "idempotency_error", Some("Idempotency-Key"));
    // The replays did not queue the job again: Alice's and Bob's jobs wait, once each.
    assert_eq!(env.queued_jobs().await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_rate_and_concurrency_limits_answer_429() {
    let env = start(accepted(), |g| {
        g.api_keys = Some("alice:sk-alice,bob:sk-bob".into());
        g.rate_limit_per_s = 0.5;
        g.rate_limit_burst = 2;
    })
    .await;
    // Rejected requests count too: the budget is taken before the body is read.
    for _ in 0..2 {
        let r = env
            .call(
                Method::POST,
                "/v1/images/generations",
                Some("sk-alice"),
                Some(json!({"prompt": ""})),
                false,
            )
            .await;
        assert_error(&r, 400, "invalid_request_error", Some("prompt"));
    }
    let r = env
        .call(
            Method::POST,
            "/v1/images/generations",
            Some("sk-alice"),
            Some(gen_body()),
            false,
        )
        .await;
    assert_error(&r, 429, "rate_limited", None);
    assert_eq!(r.headers["retry-after"], "2", "{:?}", r.headers);
    // Bob has his own bucket.
    let r = env
        .call(
            Method::POST,
            "/v1/images/generations",
            Some("sk-bob"),
            Some(json!({"prompt": ""})),
            false,
        )
        .await;
    assert_error(&r, 400, "invalid_request_error", Some("prompt"));
    drop(env);

    let env = start(accepted(), |g| {
        g.api_keys = Some("alice:sk-alice,bob:sk-bob".into());
        g.max_concurrent_per_key = 1;
        g.async_queue_per_key = 1;
    })
    .await;
    // Async jobs do not hold a slot once queued; the durable queue's per-key bound holds them:
    // nobody takes Alice's first from the queue, so her second is refused, naming the quota.
    let first = env.submit("sk-alice").await;
    let r = env
        .call(
            Method::POST,
            "/v1/images/generations",
            Some("sk-alice"),
            Some(gen_body()),
            true,
        )
        .await;
    assert_error(&r, 429, "rate_limited", None);
    assert_eq!(r.headers["retry-after"], "5", "{:?}", r.headers);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("async_queue_per_key"),
        "{}",
        r.body
    );
    // A synchronous request holds Alice's only slot while it runs (the fake router never
    // finishes it: it ends at the job deadline).
    let held = {
        let (http, url) = (env.http.clone(), env.url("/v1/images/generations"));
        tokio::spawn(async move {
            let r = http.post(url).bearer_auth("sk-alice").json(&gen_body());
            r.send().await.map(|r| r.status())
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while env.router.submits.lock().unwrap().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "never submitted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = env
        .call(
            Method::POST,
            "/v1/images/generations",
            Some("sk-alice"),
            Some(gen_body()),
            false,
        )
        .await;
    assert_error(&r, 429, "rate_limited", None);
    assert!(r.headers.contains_key("retry-after"));
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("in flight"),
        "{}",
        r.body
    );
    let status = held.await.unwrap().unwrap();
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    env.submit("sk-bob").await;
    // Cancelling frees the slot.
    let r = env
        .call(
            Method::DELETE,
            &format!("/v1/jobs/{first}"),
            Some("sk-alice"),
            None,
            false,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let r = env
            .call(
                Method::POST,
                "/v1/images/generations",
                Some("sk-alice"),
                Some(gen_body()),
                true,
            )
            .await;
        if r.status == StatusCode::ACCEPTED {
            break;
        }
        assert_error(&r, 429, "rate_limited", None);
        assert!(
            tokio::time::Instant::now() < deadline,
            "the queue's room was not freed by the cancel"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_overload_is_a_429_with_retry_after() {
    let env = start(
        SubmitReply::Overloaded {
            queue_depth: 7,
            retry_after_ms: 2500,
        },
        |_| {},
    )
    .await;
    // Without keys configured, authentication is off: no header needed.
    let r = env
        .call(
            Method::POST,
            "/v1/images/generations",
            None,
            Some(gen_body()),
            false,
        )
        .await;
    assert_error(&r, 429, "rate_limited", None);
    assert_eq!(r.headers["retry-after"], "3");
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("7 jobs waiting"),
        "{}",
        r.body
    );

    // An async job is accepted and waits in the durable queue through the overload, first in
    // line: no router refusal can fail it.
    let r = env
        .call(
            Method::POST,
            "/v1/images/generations",
            None,
            Some(gen_body()),
            true,
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    let id = r.body["id"].as_str().unwrap().to_string();
    assert_eq!(r.headers["location"], format!("/v1/jobs/{id}").as_str());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let r = env
        .call(Method::GET, &format!("/v1/jobs/{id}"), None, None, false)
        .await;
    assert_eq!(r.body["status"], "queued", "{}", r.body);
    assert_eq!(r.body["queue_position"], 0, "{}", r.body);
    assert_eq!(env.queued_jobs().await, 1);
}
