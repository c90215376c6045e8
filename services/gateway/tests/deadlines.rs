//! A request's `deadline_ms` through a running gateway: JSON and multipart requests carry it
//! into the job's `params.deadline_unix_ms` (acceptance time plus the deadline), a request
//! without one carries none, and a bad value is refused naming `deadline_ms`. Only NATS and the
//! gateway run; the test answers the codec's subject itself.
mod common;

use std::time::{SystemTime, UNIX_EPOCH};

use common::{answer_codec_once, field, png};
use diffmesh_gateway::{start, GatewayConfig, GatewayHandle};
use diffmesh_shared::testing::NatsServer;
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Status and JSON body of the answer to `req`.
async fn answer(req: reqwest::RequestBuilder) -> (u16, Value) {
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// The deadline the job the codec saw carried.
async fn seen_deadline(
    seen: tokio::task::JoinHandle<diffmesh_shared::wire::messages::PreprocessRequest>,
) -> Option<u64> {
    seen.await.unwrap().params.deadline_unix_ms
}

async fn gateway(nats: &NatsServer) -> GatewayHandle {
    let mut config = GatewayConfig::for_tests(nats.url());
    // No codec runs: a request that gets past validation ends quickly.
    config.submit_wait = std::time::Duration::from_millis(500);
    start(config).await.expect("gateway")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_ms_reaches_the_job_as_a_unix_deadline_and_bad_values_name_the_field() {
    let nats = NatsServer::start();
    let gateway = gateway(&nats).await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let http = reqwest::Client::new();
    let base = format!("http://{}", gateway.addr);
    let generate = |body: Value| {
        answer(
            http.post(format!("{base}/v1/images/generations"))
                .json(&body),
        )
    };
    let edit = |form: Form| answer(http.post(format!("{base}/v1/images/edits")).multipart(form));

    let seen = answer_codec_once(client.clone()).await;
    let before = now_ms();
    let (status, body) = generate(json!({"prompt": "a red circle", "deadline_ms": 5000})).await;
    let after = now_ms();
    assert_eq!(field(status, &body, 400), "codec");
    let at = seen_deadline(seen)
        .await
        .expect("the job carries a deadline");
    assert!(
        (before + 5000..=after + 5000).contains(&at),
        "{at} not in {before}+5000..={after}+5000"
    );

    let seen = answer_codec_once(client.clone()).await;
    let (status, body) = generate(json!({"prompt": "a red circle"})).await;
    assert_eq!(field(status, &body, 400), "codec");
    assert_eq!(
        seen_deadline(seen).await,
        None,
        "best effort without deadline_ms"
    );

    // Edits take it as a text field.
    let form = |deadline: &str| {
        Form::new()
            .part("image", Part::bytes(png(8, 8)).file_name("i.png"))
            .text("prompt", "a red circle")
            .text("deadline_ms", deadline.to_string())
    };
    let seen = answer_codec_once(client.clone()).await;
    let before = now_ms();
    let (status, body) = edit(form("60000")).await;
    assert_eq!(field(status, &body, 400), "codec");
    let at = seen_deadline(seen)
        .await
        .expect("the edit carries a deadline");
    assert!(at >= before + 60_000 && at <= now_ms() + 60_000, "{at}");

    for bad in [
        json!(0),
        json!(-5),
        json!(86_400_001),
        json!("soon"),
        json!(1.5),
    ] {
        let (status, body) = generate(json!({"prompt": "x", "deadline_ms": bad})).await;
        assert_eq!(field(status, &body, 400), "deadline_ms", "{bad}: {body}");
    }
    let (status, body) = edit(form("soon")).await;
    assert_eq!(field(status, &body, 400), "deadline_ms", "{body}");
    gateway.shutdown().await;
}
