//! With no denoiser (or no router) running, a request fails with a clear 503 and a
//! Retry-After header after a bounded wait, instead of hanging.
use std::time::{Duration, Instant};

use diffmesh_tests::harness::{
    init_test_logging, start_codec, start_gateway, start_router, NatsServer,
};
use serde_json::{json, Value};

async fn post_generation(
    http: &reqwest::Client,
    api: std::net::SocketAddr,
) -> (u16, Option<String>, Value, Duration) {
    let start = Instant::now();
    let r = http
        .post(format!("http://{api}/v1/images/generations"))
        .json(&json!({"prompt": "a cat", "num_inference_steps": 2}))
        .send()
        .await
        .expect("request");
    let status = r.status().as_u16();
    let retry_after = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body: Value = r.json().await.expect("JSON error body");
    (status, retry_after, body, start.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_denoiser_gives_a_clear_503_after_a_bounded_wait() {
    init_test_logging();
    let nats = NatsServer::start();
    let codec = start_codec(&nats, |_| {}).expect("codec");
    let gateway =
        start_gateway(&nats, |g| g.submit_wait = Duration::from_secs_f64(1.5)).expect("gateway");
    codec.wait_ready(Duration::from_secs(10)).await.unwrap();
    gateway.wait_ready(Duration::from_secs(10)).await.unwrap();
    let api = gateway.addrs.api.unwrap();
    let http = reqwest::Client::new();

    // No router at all.
    let (status, retry_after, body, took) = post_generation(&http, api).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["error_type"], "service_unavailable", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no router"),
        "{body}"
    );
    assert!(retry_after.is_some(), "Retry-After missing");
    assert!(
        took >= Duration::from_millis(1000),
        "gave up too early: {took:?}"
    );
    assert!(took < Duration::from_secs(10), "waited too long: {took:?}");

    // A router without any denoiser.
    let router = start_router(&nats, |_| {}).expect("router");
    router.wait_ready(Duration::from_secs(10)).await.unwrap();
    let (status, retry_after, body, took) = post_generation(&http, api).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["error_type"], "service_unavailable", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("no denoiser could take the job"), "{body}");
    assert!(retry_after.is_some(), "Retry-After missing");
    assert!(took < Duration::from_secs(10), "waited too long: {took:?}");
}
