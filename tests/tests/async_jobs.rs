//! Async jobs on the whole mesh (NATS, codec, router, a denoiser with the tiny model, gateway):
//! `Prefer: respond-async` answers 202 at once, the job's event stream shows queued (with its
//! position), started, step k of N and done with result links, the results download, an
//! `Idempotency-Key` returns the same job, `DELETE` stops a running job at a step boundary, a
//! synchronous client that disconnects has its job cancelled the same way, and an async job
//! still ends `done` when the gateway that accepted it dies, whether it had placed it or not,
//! as does a synchronous one sent with an `Idempotency-Key` (for the client's repeat).
use std::time::Duration;

use diffmesh_shared::stores::job::{now_ms, JobRecord, JobState, JobStore};
use diffmesh_shared::wire::messages::{decode, JobEvent, JobKind};
use diffmesh_tests::harness::{
    init_test_logging, start_codec, start_denoiser, start_gateway, start_router, tiny_model_dir,
    NatsServer, Service, SseReader,
};
use diffmesh_tests::images::{decode_b64_images, png_bytes, rect_mask, template};
use futures::StreamExt;
use image::GenericImageView;
use reqwest::multipart::{Form, Part};
use reqwest::StatusCode;
use serde_json::{json, Value};

const LONG_JOB_STEPS: u32 = 5000;

struct Mesh {
    gateway: Option<Service>,
    services: Vec<Service>,
    api: std::net::SocketAddr,
    http: reqwest::Client,
    nats_url: String,
    // Last: fields drop in order, and services must stop before their NATS server.
    nats: NatsServer,
}

/// One denoiser running one job at a time, so a second job waits in its queue. Jobs may take
/// up to `LONG_JOB_STEPS` steps: the tiny model's steps take milliseconds, and a job that is
/// cancelled mid-way must still be running when the cancel arrives.
async fn start_mesh() -> Mesh {
    let mut mesh = start_mesh_without_denoiser(|g| g.max_steps = LONG_JOB_STEPS).await;
    mesh.add_denoiser("d1").await;
    mesh
}

/// NATS, codec, router and a gateway (`tweak` adjusts its config), no denoiser yet.
async fn start_mesh_without_denoiser(
    tweak: impl FnOnce(&mut diffmesh_gateway::GatewayConfig),
) -> Mesh {
    init_test_logging();
    let nats = NatsServer::start();
    let codec = start_codec(&nats, |_| {}).expect("codec");
    let router = start_router(&nats, |_| {}).expect("router");
    let gateway = start_gateway(&nats, tweak).expect("gateway");
    for s in [&codec, &router, &gateway] {
        s.wait_ready(Duration::from_secs(30)).await.expect("ready");
    }
    Mesh {
        api: gateway.addrs.api.unwrap(),
        nats_url: nats.url(),
        gateway: Some(gateway),
        nats,
        services: vec![router, codec],
        http: reqwest::Client::new(),
    }
}

impl Mesh {
    /// Start a denoiser of the tiny model that runs one job at a time.
    async fn add_denoiser(&mut self, worker_id: &str) {
        let model = tiny_model_dir().expect("weights/tiny (the default model) is missing");
        let denoiser =
            start_denoiser(&self.nats, &model, worker_id, |d| d.max_batch = 1).expect("denoiser");
        denoiser
            .wait_ready(Duration::from_secs(30))
            .await
            .expect("ready");
        // Stopped before the others (fields drop in order; the list drops front to back).
        self.services.insert(0, denoiser);
    }

    /// Kill the gateway as a crashed process stops, then start another one in its place.
    async fn replace_gateway_after_a_crash(&mut self) {
        self.gateway.take().expect("a gateway").kill();
        let gateway = start_gateway(&self.nats, |_| {}).expect("second gateway");
        gateway.wait_ready(Duration::from_secs(30)).await.unwrap();
        self.api = gateway.addrs.api.unwrap();
        self.gateway = Some(gateway);
    }

    /// Wait (at most `within`) for the job's record to end; it must end `done`, with a PNG
    /// this gateway serves.
    async fn expect_done_with_result(&self, id: &str, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        let view = loop {
            let (_, view) = self.get(&format!("/v1/jobs/{id}")).await;
            if view["status"] != "queued" && view["status"] != "running" {
                break view;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the job record stayed {} for {within:?}: {view}",
                view["status"]
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(view["status"], "done", "{view}");
        let url = view["results"][0]["url"].as_str().unwrap();
        let png = self.http.get(self.url(url)).send().await.unwrap();
        assert_eq!(png.status(), StatusCode::OK);
        let image = image::load_from_memory(&png.bytes().await.unwrap()).unwrap();
        assert!(image.width() > 0 && image.height() > 0);
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.api)
    }

    async fn generate_async(&self, body: Value) -> Value {
        let r = self
            .http
            .post(self.url("/v1/images/generations"))
            .header("Prefer", "respond-async")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::ACCEPTED);
        r.json().await.unwrap()
    }

    /// A synchronous generation request, with `key` as its `Idempotency-Key`.
    fn generation(&self, key: Option<&str>, body: &Value) -> reqwest::RequestBuilder {
        let request = self
            .http
            .post(self.url("/v1/images/generations"))
            .json(body);
        match key {
            Some(key) => request.header("Idempotency-Key", key),
            None => request,
        }
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        let r = self.http.get(self.url(path)).send().await.unwrap();
        (r.status(), r.json().await.unwrap_or(Value::Null))
    }

    async fn events(&self, job: &Value) -> SseReader {
        let path = job["links"]["events"].as_str().unwrap();
        SseReader::new(self.http.get(self.url(path)).send().await.unwrap())
    }
}

fn steps_of(events: &[(String, Value)]) -> Vec<(u64, u64)> {
    events
        .iter()
        .filter(|(n, _)| n == "step")
        .map(|(_, d)| (d["step"].as_u64().unwrap(), d["total"].as_u64().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_jobs_report_progress_results_and_repeat_by_idempotency_key() {
    let mesh = start_mesh().await;
    let wait = Duration::from_secs(120);

    // A long job (100 steps: over a second on CPU) occupies the only batch slot, so the edit
    // below waits in the queue.
    let long = mesh
        .generate_async(json!({"prompt": "a red circle", "num_inference_steps": 100, "seed": 1}))
        .await;
    assert_eq!(long["status"], "queued");

    let (w, h) = (100, 60);
    let tmpl = template(w, h);
    let form = Form::new()
        .part(
            "image",
            Part::bytes(png_bytes(&tmpl)).file_name("image.png"),
        )
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(w, h, 30, 10, 70, 40))).file_name("mask.png"),
        )
        .text("prompt", "a red square")
        .text("num_inference_steps", "4")
        .text("preview_every", "2")
        .text("seed", "7");
    let r = mesh
        .http
        .post(mesh.url("/v1/images/edits"))
        .header("Prefer", "respond-async")
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    assert_eq!(r.headers()["preference-applied"], "respond-async");
    let location = r.headers()["location"].to_str().unwrap().to_string();
    let edit: Value = r.json().await.unwrap();
    let id = edit["id"].as_str().unwrap().to_string();
    assert_eq!(location, format!("/v1/jobs/{id}"));
    assert_eq!(edit["links"]["self"], location.as_str());
    assert_eq!(edit["kind"], "edit");

    let events = mesh.events(&edit).await.rest(wait).await.unwrap();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    // Queued behind the long job with a position, then started, every step, done.
    assert_eq!(names[0], "queued", "{events:?}");
    assert!(
        events
            .iter()
            .any(|(n, d)| n == "queued" && d["position"].is_u64()),
        "no queue position: {events:?}"
    );
    let started = names.iter().position(|n| *n == "started").expect("started");
    assert_eq!(
        steps_of(&events),
        vec![(1, 4), (2, 4), (3, 4), (4, 4)],
        "{events:?}"
    );
    assert!(names.iter().position(|n| *n == "step").unwrap() > started);
    // One preview every 2 steps, never after the last (the image ends the job): step 2 only,
    // right after its step event, a PNG of the size it says.
    let previews: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "preview")
        .map(|(_, d)| d)
        .collect();
    assert_eq!(previews.len(), 1, "{names:?}");
    assert_eq!(
        (previews[0]["step"].as_u64(), previews[0]["total"].as_u64()),
        (Some(2), Some(4))
    );
    let at = names.iter().position(|n| *n == "preview").unwrap();
    assert_eq!(events[at - 1].1["step"], 2, "{names:?}");
    let b64 = previews[0]["b64_png"].as_str().unwrap();
    let preview = image::load_from_memory(
        &base64::Engine::decode(&base64::engine::general_purpose::STANDARD, b64).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (u64::from(preview.width()), u64::from(preview.height())),
        (
            previews[0]["width"].as_u64().unwrap(),
            previews[0]["height"].as_u64().unwrap()
        )
    );
    let (last, done) = events.last().unwrap();
    assert_eq!(last, "done", "{events:?}");
    assert_eq!(done["status"], "done");
    let result_url = done["results"][0]["url"].as_str().unwrap().to_string();
    assert_eq!(result_url, format!("/v1/jobs/{id}/result/0"));

    // The job resource agrees; the timings add up.
    let (status, job) = mesh.get(&location).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(job["status"], "done");
    assert_eq!(job["progress"], json!({"step": 4, "total": 4}));
    let t = &job["timings"];
    assert!(t["queued_ms"].as_u64().unwrap() > 0, "{job}");
    assert!(t["total_ms"].as_u64().unwrap() >= t["queued_ms"].as_u64().unwrap());
    assert!(t["running_ms"].as_u64().is_some(), "{job}");

    // The result: the input's size, unmasked pixels exactly the template's.
    let png = mesh.http.get(mesh.url(&result_url)).send().await.unwrap();
    assert_eq!(png.headers()["content-type"], "image/png");
    let out = image::load_from_memory(&png.bytes().await.unwrap()).unwrap();
    assert_eq!(out.dimensions(), (w, h));
    let (out, tmpl) = (out.to_rgb8(), tmpl.to_rgb8());
    for (x, y, p) in out.enumerate_pixels() {
        if !((30..70).contains(&x) && (10..40).contains(&y)) {
            assert_eq!(p, tmpl.get_pixel(x, y), "unmasked pixel ({x},{y}) differs");
        }
    }
    let (status, body) = mesh.get(&format!("{location}/result/1")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["field"], "n");

    // The long job is done by now too.
    let (_, long_job) = mesh.get(long["links"]["self"].as_str().unwrap()).await;
    assert_eq!(long_job["status"], "done", "{long_job}");

    // Idempotency-Key: the repeat returns the same job; a synchronous repeat returns its images.
    let gen =
        json!({"prompt": "a blue circle", "size": "48x40", "num_inference_steps": 3, "seed": 5});
    let send = |prefer_async: bool| {
        let mut req = mesh
            .http
            .post(mesh.url("/v1/images/generations"))
            .header("Idempotency-Key", "request-42")
            .json(&gen);
        if prefer_async {
            req = req.header("Prefer", "respond-async");
        }
        req.send()
    };
    let first: Value = send(true).await.unwrap().json().await.unwrap();
    let again: Value = send(true).await.unwrap().json().await.unwrap();
    assert_eq!(first["id"], again["id"]);
    let sync = send(false).await.unwrap();
    assert_eq!(sync.status(), StatusCode::OK);
    assert_eq!(sync.headers()["idempotent-replayed"], "true");
    let images = decode_b64_images(&sync.json().await.unwrap()).unwrap();
    assert_eq!(images.len(), 1);
    let stored = mesh
        .http
        .get(mesh.url(&format!(
            "/v1/jobs/{}/result/0",
            first["id"].as_str().unwrap()
        )))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(images[0], image::load_from_memory(&stored).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_running_job_and_a_disconnect_cancels_a_sync_one() {
    let mesh = start_mesh().await;
    let client = async_nats::connect(&mesh.nats_url).await.unwrap();
    let mut all_events = client.subscribe("diffmesh.job.*.events").await.unwrap();
    client.flush().await.unwrap();
    let jobs = JobStore::open(&async_nats::jetstream::new(client.clone()))
        .await
        .unwrap();

    // DELETE a running async job.
    let job = mesh
        .generate_async(json!({"prompt": "a red circle", "num_inference_steps": LONG_JOB_STEPS}))
        .await;
    let id = job["id"].as_str().unwrap().to_string();
    let mut stream = mesh.events(&job).await;
    loop {
        let (name, _) = stream
            .next(Duration::from_secs(60))
            .await
            .unwrap()
            .expect("an event");
        if name == "step" {
            break;
        }
    }
    let cancelled_at = std::time::Instant::now();
    let r = mesh
        .http
        .delete(mesh.url(&format!("/v1/jobs/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["status"], "cancelled");
    let rest = stream.rest(Duration::from_secs(30)).await.unwrap();
    assert_eq!(rest.last().unwrap().0, "cancelled", "{rest:?}");
    // The denoiser dropped it at a step boundary, long before its last step.
    let last_step = wait_for_cancelled(&mut all_events, &id).await;
    assert!(
        last_step < LONG_JOB_STEPS,
        "ran to the end ({last_step} steps)"
    );
    eprintln!(
        "DELETE -> denoiser dropped the job: {:?} (at step {last_step})",
        cancelled_at.elapsed()
    );
    let (status, body) = mesh.get(&format!("/v1/jobs/{id}/result/0")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let r = mesh
        .http
        .delete(mesh.url(&format!("/v1/jobs/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK, "cancelling twice is harmless");

    // A synchronous request whose client goes away mid-job.
    let http = mesh.http.clone();
    let url = mesh.url("/v1/images/generations");
    let request = tokio::spawn(async move {
        http.post(url)
            .json(&json!({"prompt": "a green square", "num_inference_steps": LONG_JOB_STEPS}))
            .send()
            .await
    });
    let sync_id = loop {
        let msg = tokio::time::timeout(Duration::from_secs(60), all_events.next())
            .await
            .expect("the sync job started")
            .unwrap();
        if let Ok(JobEvent::Step { .. }) = decode::<JobEvent>(&msg.payload) {
            let id = msg.subject.as_str().split('.').nth(2).unwrap().to_string();
            if id != job["id"] {
                break id;
            }
        }
    };
    request.abort();
    let last_step = wait_for_cancelled(&mut all_events, &sync_id).await;
    assert!(
        last_step < LONG_JOB_STEPS,
        "ran to the end ({last_step} steps)"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let record = jobs.get(&sync_id).await.unwrap().expect("record");
        if record.state == JobState::Cancelled {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "record stayed {:?}",
            record.state
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The freed slot serves the next job.
    let r = mesh
        .http
        .post(mesh.url("/v1/images/generations"))
        .json(&json!({"prompt": "a blue circle", "num_inference_steps": 2}))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

/// Wait for the denoiser's `Failed { error_type: "cancelled" }` for `job_id` (and no `Done`);
/// returns the last step it reported.
async fn wait_for_cancelled(events: &mut async_nats::Subscriber, job_id: &str) -> u32 {
    let mut last_step = 0;
    loop {
        match next_event(events, job_id, Duration::from_secs(30)).await {
            JobEvent::Step { step, .. } => last_step = step,
            JobEvent::Failed { error_type, .. } => {
                assert_eq!(error_type, "cancelled");
                return last_step;
            }
            JobEvent::Done { .. } => panic!("job {job_id} finished despite the cancel"),
            _ => {}
        }
    }
}

/// A job accepted asynchronously still ends `done`, with its result, when the gateway that
/// accepted it dies mid-job: the router records the ending, and any other gateway serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_job_outlives_the_gateway_that_accepted_it() {
    let mut mesh = start_mesh().await;
    let client = async_nats::connect(&mesh.nats_url).await.unwrap();
    let mut all_events = client.subscribe("diffmesh.job.*.events").await.unwrap();
    client.flush().await.unwrap();
    let job = mesh
        .generate_async(json!({"prompt": "a red circle", "num_inference_steps": 400, "seed": 3}))
        .await;
    let id = job["id"].as_str().unwrap().to_string();

    // Running on the denoiser: the gateway dies the way a crashed process does, another starts.
    while !matches!(
        next_event(&mut all_events, &id, EVENT_WAIT).await,
        JobEvent::Step { .. }
    ) {}
    mesh.replace_gateway_after_a_crash().await;
    // Still running after the gateway was gone (a step event came after the kill).
    loop {
        match next_event(&mut all_events, &id, EVENT_WAIT).await {
            JobEvent::Step { .. } => break,
            JobEvent::Done { .. } => {
                panic!("the job ended before the gateway died; use more steps")
            }
            other => assert!(!matches!(other, JobEvent::Failed { .. }), "{other:?}"),
        }
    }

    mesh.expect_done_with_result(&id, Duration::from_secs(60))
        .await;
}

/// An async job whose gateway dies before it was placed (no denoiser is up yet) waits in the
/// durable queue, is placed by the router when a denoiser joins, and ends `done` with its
/// result; the router writes its progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_job_whose_gateway_died_before_placing_it_still_runs() {
    let mut mesh = start_mesh_without_denoiser(|g| {
        g.router_timeout = Duration::from_secs_f64(1.0);
        g.submit_wait = Duration::from_secs_f64(2.0);
    })
    .await;
    let job = mesh
        .generate_async(json!({"prompt": "a blue square", "num_inference_steps": 4, "seed": 5}))
        .await;
    let id = job["id"].as_str().unwrap().to_string();
    mesh.replace_gateway_after_a_crash().await;
    let (_, view) = mesh.get(&format!("/v1/jobs/{id}")).await;
    assert_eq!(view["status"], "queued", "{view}");
    mesh.add_denoiser("d1").await;

    mesh.expect_done_with_result(&id, Duration::from_secs(60))
        .await;
    let client = async_nats::connect(&mesh.nats_url).await.unwrap();
    let jobs = JobStore::open(&async_nats::jetstream::new(client))
        .await
        .unwrap();
    let record = jobs.get(&id).await.unwrap().unwrap();
    assert!(
        record.queue_seq.is_some() && record.detached && !record.adopted,
        "not placed from the durable queue: {record:?}"
    );
    assert_eq!(record.worker_id.as_deref(), Some("d1"));
    // Its progress was written by the router that placed it (only `Started` sets this).
    assert!(
        record.started_at_ms.is_some(),
        "no progress written: {record:?}"
    );
}

/// A synchronous job sent with an `Idempotency-Key` whose gateway dies before placing it (no
/// denoiser is up yet) is placed by the router all the same, and the client's repeat of the
/// request through another gateway is answered with its image. The same job sent without a key
/// is cancelled: no client can come back for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronous_job_with_a_key_outlives_its_gateway_for_the_repeat() {
    let mut mesh = start_mesh_without_denoiser(|g| {
        g.router_timeout = Duration::from_secs_f64(1.0);
        // Time to see both jobs submitted and crash the gateway before it gives up on them.
        g.submit_wait = Duration::from_secs_f64(8.0);
    })
    .await;
    let client = async_nats::connect(&mesh.nats_url).await.unwrap();
    let jobs = JobStore::open(&async_nats::jetstream::new(client))
        .await
        .unwrap();
    let mut records = jobs.watch_since(Duration::from_secs(60)).await.unwrap();
    let keyed = json!({"prompt": "a green circle", "num_inference_steps": 4, "seed": 8});
    let plain = json!({"prompt": "a red square", "num_inference_steps": 4, "seed": 9});
    // Both wait on the gateway, which resubmits them while no denoiser is up.
    let first_try = tokio::spawn(mesh.generation(Some("sync-repeat-1"), &keyed).send());
    let unkeyed = tokio::spawn(mesh.generation(None, &plain).send());
    let (mut keyed_id, mut plain_id) = (None, None);
    while keyed_id.is_none() || plain_id.is_none() {
        let record = tokio::time::timeout(Duration::from_secs(30), records.next())
            .await
            .expect("both jobs submitted within 30 s")
            .unwrap()
            .unwrap();
        let Some(job) = &record.submitted else {
            continue;
        };
        match job.params.prompt.as_str() {
            "a green circle" => keyed_id = Some(record.job_id.clone()),
            "a red square" => plain_id = Some(record.job_id.clone()),
            _ => {}
        }
    }
    mesh.replace_gateway_after_a_crash().await;
    assert!(
        first_try.await.unwrap().is_err(),
        "answered by a dead gateway"
    );
    assert!(
        unkeyed.await.unwrap().is_err(),
        "answered by a dead gateway"
    );
    mesh.add_denoiser("d1").await;

    let repeat = mesh
        .generation(Some("sync-repeat-1"), &keyed)
        .send()
        .await
        .unwrap();
    assert_eq!(repeat.status(), StatusCode::OK);
    assert_eq!(repeat.headers()["idempotent-replayed"], "true");
    let images = decode_b64_images(&repeat.json().await.unwrap()).unwrap();
    assert_eq!(images.len(), 1);
    let keyed = jobs.get(&keyed_id.unwrap()).await.unwrap().unwrap();
    assert_eq!(keyed.state, JobState::Done, "{keyed:?}");
    assert!(
        keyed.adopted,
        "placed by its gateway, not adopted: {keyed:?}"
    );

    let plain_id = plain_id.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let plain = loop {
        let record = jobs.get(&plain_id).await.unwrap().unwrap();
        if record.state.is_terminal() {
            break record;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the unkeyed job stayed {:?} for 30 s",
            record.state
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(plain.state, JobState::Cancelled, "{plain:?}");
}

/// A gateway that dies while preparing a job (before any answer) leaves a queued record with no
/// prepared job; past its deadline the router fails it, and leaves alone one whose deadline has
/// not passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_gateway_died_while_preparing_it_is_failed() {
    let mesh = start_mesh_without_denoiser(|_| {}).await;
    let client = async_nats::connect(&mesh.nats_url).await.unwrap();
    let jobs = JobStore::open(&async_nats::jetstream::new(client))
        .await
        .unwrap();
    // As a gateway writes them at creation; neither is ever prepared.
    let lost_id = "6f1c2a34-58d0-4c8e-9b1e-0d6a5e7f2a01";
    let mut lost = JobRecord::new(lost_id, JobKind::Generate);
    lost.place_by_ms = Some(now_ms().saturating_sub(1_000));
    jobs.create(&lost).await.unwrap();
    let pending_id = "6f1c2a34-58d0-4c8e-9b1e-0d6a5e7f2a02";
    let mut pending = JobRecord::new(pending_id, JobKind::Generate);
    pending.place_by_ms = Some(now_ms() + 600_000);
    jobs.create(&pending).await.unwrap();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let record = loop {
        let record = jobs.get(lost_id).await.unwrap().unwrap();
        if record.state != JobState::Queued {
            break record;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the record stayed queued for 30s: {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(record.state, JobState::Failed, "{record:?}");
    let error = record.error.unwrap();
    assert_eq!(error.error_type, "service_unavailable");
    assert!(
        error.message.contains("before preparing"),
        "{}",
        error.message
    );
    let pending = jobs.get(pending_id).await.unwrap().unwrap();
    assert_eq!(pending.state, JobState::Queued, "{pending:?}");
}

/// Longest wait for a job's next event in the gateway-crash test.
const EVENT_WAIT: Duration = Duration::from_secs(60);

/// The next event of `job_id` on a subscription to every job's events, each message awaited at
/// most `within`.
async fn next_event(
    events: &mut async_nats::Subscriber,
    job_id: &str,
    within: Duration,
) -> JobEvent {
    let subject = format!("diffmesh.job.{job_id}.events");
    loop {
        let msg = tokio::time::timeout(within, events.next())
            .await
            .unwrap_or_else(|_| panic!("no event of job {job_id} within {within:?}"))
            .unwrap();
        if msg.subject.as_str() == subject {
            return decode::<JobEvent>(&msg.payload).unwrap();
        }
    }
}
