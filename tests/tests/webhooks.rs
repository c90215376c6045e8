//! Webhooks on the whole mesh, with two gateways sharing the relay and the senders: every async
//! job's ending is posted once to its `callback_url`, whichever gateway accepted it, signed as
//! Standard Webhooks define (checked here with the signing key), with the job and signed
//! result URLs in the body; a receiver that fails first gets the same `webhook-id` again after
//! the backoff; one that always fails is given up after `--webhook-max-age`; the job view shows
//! each delivery, and the gateways' counters add up to the posts received. A synchronous request
//! or a refused URL with `callback_url` is a 400 naming it.
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use diffmesh_gateway::webhooks::signing::verify;
use diffmesh_gateway::GatewayConfig;
use diffmesh_shared::stores::job::now_ms;
use diffmesh_tests::harness::{metric_sample, scrape_metrics, start_gateway};
use diffmesh_tests::mesh::MeshBuilder;
use diffmesh_tests::webhook_receiver::{Received, WebhookReceiver};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// The signing key's bytes; the gateways take it as `whsec_<base64>`.
const KEY: &[u8] = b"the tests' webhook signing key";
const RETRY_BASE: Duration = Duration::from_millis(200);

fn webhooks_on(c: &mut GatewayConfig) {
    c.webhooks.webhook_signing_key = Some(format!("whsec_{}", B64.encode(KEY)));
    c.webhooks.webhook_allow_http = true;
    c.webhooks.webhook_allow_private_addresses = true;
    c.webhooks.webhook_retry_base = RETRY_BASE;
    c.webhooks.webhook_max_age = Duration::from_secs(12);
    // Whichever gateway posts signs the result URLs: gateways behind one address share it.
    c.result_url_key = Some("the tests' result URL key".into());
}

/// Submit an async generation through `api` posting to `callback`; answers its job id.
async fn submit(http: &reqwest::Client, api: &str, callback: &str) -> String {
    let r = http
        .post(format!("{api}/v1/images/generations"))
        .header("Prefer", "respond-async")
        .json(
            &json!({"prompt": "a red circle", "num_inference_steps": 2, "callback_url": callback}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let job: Value = r.json().await.unwrap();
    job["id"].as_str().unwrap().to_string()
}

async fn job_view(http: &reqwest::Client, api: &str, id: &str) -> Value {
    http.get(format!("{api}/v1/jobs/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A post's signature holds under the key, its timestamp is now, its body names `job`.
fn check_signed(post: &Received, job: &str) -> Value {
    assert_eq!(post.id, job);
    assert!(
        verify(KEY, &post.id, post.timestamp, &post.body, &post.signature),
        "bad signature {:?}",
        post.signature
    );
    let now_s = now_ms() / 1000;
    assert!(
        post.timestamp.abs_diff(now_s) < 120,
        "timestamp {}",
        post.timestamp
    );
    let event = post.json();
    assert_eq!(
        (event["id"].as_str(), event["object"].as_str()),
        (Some(job), Some("event"))
    );
    assert_eq!(event["data"]["id"], job);
    event
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_jobs_post_their_ending_once_signed_retried_and_given_up() {
    let receiver = WebhookReceiver::start();
    let mesh = MeshBuilder::new().gateway(webhooks_on).start().await;
    let second = start_gateway(&mesh.nats, webhooks_on).expect("a second gateway");
    second.wait_ready(Duration::from_secs(30)).await.unwrap();
    let apis = [
        mesh.url(""),
        format!("http://{}", second.addrs.api.unwrap()),
    ];
    let http = reqwest::Client::new();

    // Refused by name: a synchronous request, and a scheme no gateway posts to.
    for (body, prefer) in [
        (
            json!({"prompt": "x", "callback_url": receiver.url("/ok")}),
            None,
        ),
        (
            json!({"prompt": "x", "callback_url": "ftp://example.com/h"}),
            Some("respond-async"),
        ),
    ] {
        let mut request = http
            .post(format!("{}/v1/images/generations", apis[0]))
            .json(&body);
        if let Some(prefer) = prefer {
            request = request.header("Prefer", prefer);
        }
        let r = request.send().await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let error: Value = r.json().await.unwrap();
        assert_eq!(error["error"]["param"], "callback_url", "{error}");
    }

    // Jobs through both gateways: four to a receiver that answers 200, one that fails its
    // first post, one that always fails.
    let mut ok = Vec::new();
    for i in 0..4 {
        ok.push(submit(&http, &apis[i % 2], &receiver.url("/ok")).await);
    }
    let flaky = submit(&http, &apis[0], &receiver.url("/flaky")).await;
    let down = submit(&http, &apis[1], &receiver.url("/down")).await;

    for job in &ok {
        let posts = receiver.wait_for(job, 1, Duration::from_secs(60)).await;
        assert_eq!(posts.len(), 1, "job {job}: {posts:?}");
        let event = check_signed(&posts[0], job);
        assert_eq!(event["type"], "job.done");
        assert_eq!(event["data"]["status"], "done");
        assert!(event["data"].get("webhook").is_none(), "{event}");
        // The result link is signed: readable as it is.
        let link = event["data"]["results"][0]["url"].as_str().unwrap();
        assert!(link.contains("signature="), "{link}");
        let png = http.get(format!("{}{link}", apis[0])).send().await.unwrap();
        assert_eq!(png.status(), StatusCode::OK);
        assert_eq!(png.headers()["content-type"], "image/png");
    }

    let posts = receiver.wait_for(&flaky, 2, Duration::from_secs(60)).await;
    assert_eq!(posts.len(), 2, "{posts:?}");
    for post in &posts {
        check_signed(post, &flaky);
    }
    let waited = posts[1].at.duration_since(posts[0].at);
    assert!(
        waited >= RETRY_BASE.mul_f64(0.75),
        "retried after {waited:?}"
    );

    // The always-failing receiver: retried, then given up once the max age passed.
    let until = Instant::now() + Duration::from_secs(60);
    let view = loop {
        let view = job_view(&http, &apis[0], &down).await;
        if view["webhook"]["status"] == "failed" || Instant::now() > until {
            break view;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let hook = &view["webhook"];
    assert_eq!(hook["status"], "failed", "{view}");
    assert_eq!(hook["last_status"], 500, "{view}");
    let attempts = hook["attempts"].as_u64().unwrap();
    assert!(attempts >= 2, "{view}");
    assert_eq!(receiver.posts_of(&down).len() as u64, attempts, "{view}");

    // Settled: no job was posted twice by the two gateways, and each view shows its delivery.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for job in &ok {
        assert_eq!(receiver.posts_of(job).len(), 1, "job {job}");
        let view = job_view(&http, &apis[1], job).await;
        let hook = &view["webhook"];
        assert_eq!(hook["status"], "delivered", "{view}");
        assert_eq!(
            (hook["attempts"].as_u64(), hook["last_status"].as_u64()),
            (Some(1), Some(200))
        );
        assert_eq!(hook["url"], receiver.url("/ok"));
    }
    let view = job_view(&http, &apis[0], &flaky).await;
    assert_eq!(view["webhook"]["attempts"], 2, "{view}");
    assert_eq!(view["webhook"]["status"], "delivered", "{view}");
    assert_eq!(receiver.posts_of(&flaky).len(), 2);

    // The two gateways' senders together: five deliveries (four jobs and the flaky one), one
    // given up, and every post they counted is one the receiver saw.
    let mut counted = [0.0; 3];
    for health in [mesh.gateway.addrs.health, second.addrs.health] {
        let metrics = scrape_metrics(health).await.unwrap();
        for (i, outcome) in ["delivered", "failed_attempt", "gave_up"]
            .iter()
            .enumerate()
        {
            counted[i] += metric_sample(
                &metrics,
                &format!("diffmesh_gateway_webhooks_total{{outcome=\"{outcome}\"}}"),
            );
        }
    }
    assert_eq!(counted[0], 5.0, "{counted:?}");
    assert_eq!(counted[2], 1.0, "{counted:?}");
    assert_eq!(
        counted.iter().sum::<f64>() as usize,
        receiver.posts().len(),
        "{counted:?}"
    );
}
