//! Jobs whose events never reach the gateway (core NATS publishes are lost while its
//! subscription is away, as on a server restart) still end with their result: the gateway asks
//! the denoiser that ended them (`gateway::lost_events`). The mesh here is NATS, the codec, the
//! gateway, a fake router that accepts every job and a denoiser's store of endings: nobody
//! publishes a single job event, as if every one was lost.
use std::time::{Duration, Instant};

use diffmesh_denoiser::outcomes::RecentOutcomes;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::wire::messages::{decode, DenoiseJob, JobEvent, SubmitReply};
use diffmesh_shared::wire::subjects::ROUTER_SUBMIT;
use diffmesh_tests::harness::{
    init_test_logging, scrape_metrics, start_codec, start_gateway, FakeRouter, NatsServer, Service,
};
use diffmesh_tests::images::{png_bytes, template};
use futures::StreamExt;
use reqwest::multipart::{Form, Part};
use tokio_util::sync::CancellationToken;

struct Env {
    gateway: Service,
    _codec: Service,
    _router: FakeRouter,
    nats: NatsServer,
    client: async_nats::Client,
    /// Jobs the fake router accepted, as submitted.
    submitted: futures::stream::BoxStream<'static, DenoiseJob>,
    /// The ending denoiser's store, served on `DENOISER_OUTCOME`.
    outcomes: RecentOutcomes,
    shutdown: CancellationToken,
}

impl Env {
    async fn start() -> Env {
        init_test_logging();
        let nats = NatsServer::start();
        let router = FakeRouter::start(
            &nats,
            SubmitReply::Accepted {
                worker_id: "w-fake".into(),
            },
        )
        .await
        .expect("fake router");
        let codec = start_codec(&nats, |_| {}).expect("codec");
        let gateway = start_gateway(&nats, |g| g.job_timeout = Duration::from_secs_f64(30.0))
            .expect("gateway");
        for s in [&codec, &gateway] {
            s.wait_ready(Duration::from_secs(10)).await.expect("ready");
        }
        let client = async_nats::connect(nats.url()).await.expect("NATS");
        // A copy of every submit the fake router answers.
        let submitted = client
            .subscribe(ROUTER_SUBMIT)
            .await
            .expect("subscribe")
            .filter_map(|msg| async move { decode::<DenoiseJob>(&msg.payload).ok() })
            .boxed();
        client.flush().await.expect("flush");
        let outcomes = RecentOutcomes::default();
        let shutdown = CancellationToken::new();
        tokio::spawn(outcomes.clone().serve(client.clone(), shutdown.clone()));
        Env {
            gateway,
            _codec: codec,
            _router: router,
            nats,
            client,
            submitted,
            outcomes,
            shutdown,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.gateway.addrs.api.unwrap())
    }

    async fn next_submitted(&mut self) -> DenoiseJob {
        tokio::time::timeout(Duration::from_secs(20), self.submitted.next())
            .await
            .expect("no job was submitted")
            .expect("submit subscription closed")
    }

    /// `diffmesh_gateway_recovered_outcomes_total{outcome}` as the gateway exports it.
    async fn recovered(&self, outcome: &str) -> u64 {
        let page = scrape_metrics(self.gateway.addrs.health)
            .await
            .expect("scrape");
        let label = format!("outcome=\"{outcome}\"");
        page.lines()
            .find(|l| {
                l.starts_with("diffmesh_gateway_recovered_outcomes_total") && l.contains(&label)
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no recovered_outcomes series for {outcome}"))
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A generation whose `Done` never arrives is answered with its image a few seconds after the
/// job went silent, not when its 30 s deadline passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_whose_done_was_lost_is_answered_with_its_image() {
    let mut env = Env::start().await;
    let http = reqwest::Client::new();
    let started = Instant::now();
    let request = http
        .post(env.url("/v1/images/generations"))
        .json(&serde_json::json!({
            "prompt": "a red circle",
            "num_inference_steps": 2,
            "response_format": "png",
        }))
        .timeout(Duration::from_secs(60))
        .send();
    let request = tokio::spawn(request);
    let job = env.next_submitted().await;
    // The denoiser ran it and stored its image; its `Done` went out while nobody listened.
    let js = async_nats::jetstream::new(env.client.clone());
    let blobs = BlobStore::open(&js).await.expect("blob store");
    let image = png_bytes(&template(64, 64));
    let key = format!("{}/result-0.png", job.job_id);
    blobs.put(&key, &image).await.expect("store the result");
    env.outcomes.note(
        &job.job_id,
        &JobEvent::Done {
            png_keys: vec![key],
        },
    );

    let response = request.await.unwrap().expect("the generation request");
    let waited = started.elapsed();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.bytes().await.unwrap().as_ref(), image.as_slice());
    assert!(
        waited < Duration::from_secs(15),
        "answered after {waited:?}: the gateway waited for the lost event"
    );
    assert_eq!(env.recovered("done").await, 1);
    let _ = &env.nats;
}

/// A template registration whose capture job's `Captured` and `Done` both never arrive still
/// ends `ready` with the cache the capturing denoiser reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_whose_capture_events_were_lost_still_ends_ready() {
    let mut env = Env::start().await;
    let http = reqwest::Client::new();
    let form = Form::new()
        .part(
            "image",
            Part::bytes(png_bytes(&template(64, 64))).file_name("template.png"),
        )
        .text("prompt", "a blue background")
        .text("num_inference_steps", "3");
    let request = tokio::spawn(
        http.post(env.url("/v1/templates"))
            .multipart(form)
            .timeout(Duration::from_secs(60))
            .send(),
    );
    let job = env.next_submitted().await;
    let steps = job.params.num_inference_steps;
    assert_eq!(steps, 3);
    env.outcomes.note(
        &job.job_id,
        &JobEvent::Captured {
            cache_key: "tpl-lost-events".into(),
            steps,
            blocks: 4,
            bytes: 8192,
            quality: None,
        },
    );
    env.outcomes
        .note(&job.job_id, &JobEvent::Done { png_keys: vec![] });

    let response = request.await.unwrap().expect("the registration request");
    let status = response.status().as_u16();
    let created: serde_json::Value = response.json().await.expect("JSON body");
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["status"], "ready", "{created}");
    assert_eq!(created["cache_key"], "tpl-lost-events", "{created}");
    assert_eq!(created["cache_bytes"], 8192, "{created}");
    assert_eq!(env.recovered("done").await, 1);
    assert_eq!(env.recovered("captured").await, 1);
}
