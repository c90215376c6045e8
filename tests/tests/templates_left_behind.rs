//! Templates a stopped gateway left half-way, settled by another gateway: a delete left
//! pending is finished by the next gateway to start (removing the cache its capture job
//! reported), and a registration left `capturing` past the job deadline reads as `ready` when
//! its capture job reported a cache, else `failed`. Only NATS, a gateway and a stand-in
//! cachestore run: no model is needed.
use std::time::Duration;

use diffmesh_gateway::templates::record::{TemplateRecord, TemplateState, TemplateStore};
use diffmesh_shared::stores::job::{CaptureReport, JobRecord, JobStore};
use diffmesh_shared::wire::cachestore::{
    delete_subject, template_keys, CacheDelete, CacheDeleteReply,
};
use diffmesh_shared::wire::messages::{decode, encode, JobKind};
use diffmesh_tests::harness::{init_test_logging, start_gateway, NatsServer};
use futures::StreamExt;
use reqwest::multipart::Form;
use serde_json::Value;

const STEPS: u32 = 4;

/// A capture job's record as the router leaves it once the denoiser stored `cache_key`.
async fn captured_job(jobs: &JobStore, job_id: &str, cache_key: &str) {
    let mut job = JobRecord::new(job_id, JobKind::Capture);
    job.mark_captured(CaptureReport {
        cache_key: cache_key.into(),
        steps: STEPS,
        blocks: 4,
        bytes: 4096,
        quality: None,
    });
    job.mark_done(Vec::new());
    jobs.create(&job).await.unwrap();
}

/// Answers cachestore deletes (every key existed) and passes on the keys asked for.
async fn stand_in_cachestore(
    client: async_nats::Client,
) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut sub = client.subscribe(delete_subject()).await.unwrap();
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            let req: CacheDelete = decode(&msg.payload).unwrap();
            let _ = tx.send(req.key);
            let reply = encode(&CacheDeleteReply::Deleted { existed: true }).unwrap();
            if let Some(inbox) = msg.reply {
                client.publish(inbox, reply.into()).await.unwrap();
            }
        }
    });
    rx
}

/// What a gateway that stopped left behind is settled by the others: a delete left pending
/// (record still `deleting`) is finished by the next gateway to start (record, image, and the
/// cache its capture job reported though the record never got its key, go), and a
/// registration left `capturing` past the job deadline reads as `ready` when its capture job
/// reported a cache, else as `failed` (edits get 409 saying why; it can be deleted), while a
/// recent one stays `capturing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_settles_what_a_stopped_gateway_left() {
    init_test_logging();
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut cache_deletes = stand_in_cachestore(client.clone()).await;
    let js = async_nats::jetstream::new(client);
    let store = TemplateStore::open(&js).await.unwrap();
    let jobs = JobStore::open(&js).await.unwrap();
    let record = |id: &str, state: TemplateState, age_ms: u64, capture_job: Option<&str>| {
        let template = diffmesh_shared::wire::messages::TemplateRef {
            template_id: id.into(),
            prompt: String::new(),
            seed: 1,
            steps: STEPS,
            guidance_scale: 1.0,
            cache_key: String::new(),
        };
        let mut r = TemplateRecord::new(id.into(), None, &template);
        r.state = state;
        r.updated_at_ms -= age_ms;
        r.capture_job_id = capture_job.map(str::to_string);
        r
    };
    let deleting = "5b9d6c1e-3f2a-4e8b-a7c6-1d0e9f8a7b6c";
    let abandoned = "5b9d6c1e-3f2a-4e8b-a7c6-1d0e9f8a7b6d";
    let capturing = "5b9d6c1e-3f2a-4e8b-a7c6-1d0e9f8a7b6e";
    let recovered = "5b9d6c1e-3f2a-4e8b-a7c6-1d0e9f8a7b6f";
    // Deleted while capturing, then its gateway stopped: only the job record has the key.
    captured_job(&jobs, "capture-of-deleting", "tpl-orphan").await;
    store
        .create(&record(
            deleting,
            TemplateState::Deleting,
            0,
            Some("capture-of-deleting"),
        ))
        .await
        .unwrap();
    store.put_image(deleting, b"png bytes").await.unwrap();
    // The test gateway's job deadline is far below ten minutes.
    store
        .create(&record(abandoned, TemplateState::Capturing, 600_000, None))
        .await
        .unwrap();
    store
        .create(&record(capturing, TemplateState::Capturing, 0, None))
        .await
        .unwrap();
    captured_job(&jobs, "capture-of-recovered", "tpl-recovered").await;
    store
        .create(&record(
            recovered,
            TemplateState::Capturing,
            600_000,
            Some("capture-of-recovered"),
        ))
        .await
        .unwrap();

    let gateway =
        start_gateway(&nats, |c| c.job_timeout = Duration::from_secs_f64(60.0)).expect("gateway");
    gateway
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("ready");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while store.get(deleting).await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pending delete was not finished"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        store.image(deleting).await.is_err(),
        "the image is still there"
    );
    let mut deleted_keys = Vec::new();
    while let Ok(key) = cache_deletes.try_recv() {
        deleted_keys.push(key);
    }
    assert_eq!(deleted_keys, template_keys("tpl-orphan", STEPS));

    let http = reqwest::Client::new();
    let api = gateway.addrs.api.unwrap();
    let get = |id: &str| {
        let url = format!("http://{api}/v1/templates/{id}");
        let http = http.clone();
        async move {
            let r = http.get(url).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (status, got) = get(abandoned).await;
    assert_eq!(
        (status, &got["status"]),
        (200, &Value::from("failed")),
        "{got}"
    );
    assert!(
        got["error"].as_str().unwrap().contains("interrupted"),
        "{got}"
    );
    let (status, got) = get(recovered).await;
    assert_eq!(
        (status, &got["status"], &got["cache_key"]),
        (200, &Value::from("ready"), &Value::from("tpl-recovered")),
        "{got}"
    );
    let (status, got) = get(capturing).await;
    assert_eq!(
        (status, &got["status"]),
        (200, &Value::from("capturing")),
        "{got}"
    );
    let form = Form::new()
        .text("template_id", abandoned.to_string())
        .text("prompt", "a red square");
    let r = http
        .post(format!("http://{api}/v1/images/edits"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("interrupted"),
        "{body}"
    );
    let r = http
        .delete(format!("http://{api}/v1/templates/{abandoned}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(store.get(abandoned).await.unwrap().is_none());
}
