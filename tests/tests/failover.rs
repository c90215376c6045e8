//! A denoiser killed in the middle of a job: the job is placed again on the other denoiser and
//! succeeds, or fails with a clear error; the request never hangs. The only codec stopped while
//! a job runs, or when a request arrives: both wait for the next codec and succeed.
use std::time::{Duration, Instant};

use diffmesh_shared::wire::messages::{decode, JobEvent};
use diffmesh_tests::harness::{
    init_test_logging, start_codec, start_denoiser, start_gateway, start_router, tiny_model_dir,
    NatsServer, Service,
};
use diffmesh_tests::images::decode_b64_images;
use futures::StreamExt;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_denoiser_mid_job_is_retried_or_fails_clearly() {
    init_test_logging();
    let model = tiny_model_dir().expect("weights/tiny (the default model) is missing");
    let nats = NatsServer::start();
    let codec = start_codec(&nats, |_| {}).expect("codec");
    let router = start_router(&nats, |_| {}).expect("router");
    let mut denoisers = vec![
        start_denoiser(&nats, &model, "d1", |_| {}).expect("denoiser d1"),
        start_denoiser(&nats, &model, "d2", |_| {}).expect("denoiser d2"),
    ];
    let gateway =
        start_gateway(&nats, |g| g.job_timeout = Duration::from_secs_f64(90.0)).expect("gateway");
    for s in [&codec, &router, &gateway]
        .into_iter()
        .chain(denoisers.iter())
    {
        s.wait_ready(Duration::from_secs(30)).await.expect("ready");
    }
    // Give the router a heartbeat from both denoisers.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let events_client = async_nats::connect(&nats.url()).await.unwrap();
    let mut events = events_client
        .subscribe(diffmesh_shared::wire::subjects::job_events("*"))
        .await
        .unwrap();
    events_client.flush().await.unwrap();

    // A long job: many steps so it is surely still running when its denoiser dies.
    let api = gateway.addrs.api.unwrap();
    let request = tokio::spawn(async move {
        let start = Instant::now();
        let r = reqwest::Client::new()
            .post(format!("http://{api}/v1/images/generations"))
            .json(&json!({"prompt": "a cat", "n": 4, "num_inference_steps": 100, "seed": 1}))
            .timeout(Duration::from_secs(150))
            .send()
            .await
            .expect("the request must get an answer, not hang");
        let status = r.status().as_u16();
        let body: Value = r.json().await.expect("JSON body");
        (status, body, start.elapsed())
    });

    // Wait until the job is running (a step done) and learn on which denoiser.
    let mut worker = None;
    let mut stepped = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !(stepped && worker.is_some()) {
        let msg = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("the job never started")
            .expect("event stream ended");
        match decode::<JobEvent>(&msg.payload).expect("event decodes") {
            JobEvent::Started { worker_id } => worker = Some(worker_id),
            JobEvent::Step { .. } => stepped = true,
            JobEvent::Done { .. } => panic!("the job finished before the kill; make it longer"),
            _ => {}
        }
    }
    let worker = worker.unwrap();
    let idx = denoisers
        .iter()
        .position(|d| d.name == format!("denoiser-{worker}"))
        .expect("started on a known denoiser");
    let victim: Service = denoisers.remove(idx);
    tokio::task::spawn_blocking(move || victim.kill())
        .await
        .unwrap();

    let mut retried = false;
    let watch = async {
        while let Some(msg) = events.next().await {
            if let Ok(JobEvent::Retrying { .. }) = decode::<JobEvent>(&msg.payload) {
                retried = true;
            }
        }
    };
    let (status, body, took) = tokio::select! {
        r = request => r.expect("request task"),
        _ = watch => unreachable!("event stream ended"),
    };
    eprintln!("failover outcome: HTTP {status} after {took:?}, re-placed: {retried}");
    assert!(took < Duration::from_secs(120), "took {took:?}");
    match status {
        200 => {
            assert!(
                retried,
                "a 200 after the kill needs a re-placement (Retrying event)"
            );
            let images = decode_b64_images(&body).unwrap();
            assert_eq!(images.len(), 4);
        }
        _ => {
            assert!(status >= 500, "{status}: {body}");
            let message = body["error"]["message"].as_str().unwrap_or_default();
            assert!(!message.is_empty(), "unclear error: {body}");
            assert!(body["error"]["error_type"].is_string(), "{body}");
        }
    }
}

/// Requests wait out a codec restart instead of failing: a job whose denoising finished while
/// no codec ran waits for one (the denoiser sends its post-processing again for
/// `--post-retry-window`), so its steps are not thrown away; a request that arrives while no
/// codec runs has its pre-processing sent again for `--submit-wait`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_wait_out_a_codec_restart() {
    init_test_logging();
    let model = tiny_model_dir().expect("weights/tiny (the default model) is missing");
    let nats = NatsServer::start();
    let codec = start_codec(&nats, |_| {}).expect("codec");
    let router = start_router(&nats, |_| {}).expect("router");
    let denoiser = start_denoiser(&nats, &model, "d1", |_| {}).expect("denoiser");
    let gateway = start_gateway(&nats, |g| {
        g.job_timeout = Duration::from_secs_f64(60.0);
        g.submit_wait = Duration::from_secs_f64(10.0);
    })
    .expect("gateway");
    for s in [&codec, &router, &denoiser, &gateway] {
        s.wait_ready(Duration::from_secs(30)).await.expect("ready");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let events_client = async_nats::connect(&nats.url()).await.unwrap();
    let mut events = events_client
        .subscribe(diffmesh_shared::wire::subjects::job_events("*"))
        .await
        .unwrap();
    events_client.flush().await.unwrap();
    let api = gateway.addrs.api.unwrap();
    let generate = move |seed: u64| {
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("http://{api}/v1/images/generations"))
                .json(&json!({"prompt": "a cat", "num_inference_steps": 10, "seed": seed}))
                .timeout(Duration::from_secs(90))
                .send()
                .await
                .expect("the request must get an answer")
        })
    };
    let answered = |r: reqwest::Response| async move {
        let status = r.status().as_u16();
        let body: Value = r.json().await.expect("JSON body");
        assert_eq!(status, 200, "{body}");
        assert_eq!(decode_b64_images(&body).unwrap().len(), 1);
    };
    // Long enough that the job ends, and its first post-processing request gives up after the
    // request helper's own 2 s grace for a missing responder, while no codec runs (the
    // resends asserted below show it did).
    let codec_down = Duration::from_secs(6);

    // The job is with the denoiser (pre-processing behind it): stop the only codec.
    let request = generate(3);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let msg = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("the job never reached the denoiser")
            .expect("event stream ended");
        match decode::<JobEvent>(&msg.payload).expect("event decodes") {
            JobEvent::Queued { .. } | JobEvent::Started { .. } => break,
            JobEvent::Done { .. } => panic!("the job finished before the codec stopped"),
            _ => {}
        }
    }
    tokio::task::spawn_blocking(move || codec.kill())
        .await
        .unwrap();
    tokio::time::sleep(codec_down).await;
    let codec = start_codec(&nats, |_| {}).expect("codec again");
    answered(request.await.expect("request task")).await;

    // A request that arrives while no codec runs.
    tokio::task::spawn_blocking(move || codec.kill())
        .await
        .unwrap();
    let request = generate(4);
    tokio::time::sleep(codec_down).await;
    let _codec = start_codec(&nats, |_| {}).expect("codec a third time");
    answered(request.await.expect("request task")).await;

    // Each service counts its resends in the process-wide NATS metrics (one process here).
    let metrics = diffmesh_tests::harness::scrape_metrics(denoiser.addrs.health)
        .await
        .expect("scrape the denoiser");
    for subject in ["diffmesh.codec.post", "diffmesh.codec.pre"] {
        let resends: u64 = metrics
            .lines()
            .find(|l| {
                l.starts_with("diffmesh_nats_request_resends_total{")
                    && l.contains(&format!("subject=\"{subject}\""))
                    && l.contains("reason=\"unanswered\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no unanswered resends of {subject} on /metrics"));
        assert!(resends > 0, "{subject} was never sent again");
    }
}

/// A codec that takes a request (queue group `codec`) and never answers it (killed while it
/// held it): the request is sent again once the first attempt's deadline passes (1 s here),
/// not after the whole codec deadline (40 s here), for pre-processing (gateway) and
/// post-processing (denoiser). The stand-in codec answers the copy sent again with `Failed`
/// naming it, which ends the request at once. (Every connection of this process is opened
/// first: in one process any client's connect makes requests in flight start over.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_codec_dying_with_a_request_costs_the_first_attempts_deadline() {
    use diffmesh_shared::wire::messages::{encode, PostprocessReply, PreprocessReply};
    use diffmesh_shared::wire::subjects::{CODEC_POST, CODEC_PRE};
    init_test_logging();
    let model = tiny_model_dir().expect("weights/tiny (the default model) is missing");
    let nats = NatsServer::start();
    let router = start_router(&nats, |_| {}).expect("router");
    let denoiser = start_denoiser(&nats, &model, "d1", |d| {
        d.codec_timeout = Duration::from_secs(40);
        d.codec_first_attempt = Duration::from_secs(1);
    })
    .expect("denoiser");
    let gateway = start_gateway(&nats, |g| {
        g.job_timeout = Duration::from_secs_f64(90.0);
        // The window in which pre-processing is sent again.
        g.submit_wait = Duration::from_secs_f64(30.0);
        g.codec_timeout = Duration::from_secs_f64(40.0);
        g.codec_first_attempt = Duration::from_secs_f64(1.0);
        g.max_steps = g.max_steps.max(200);
    })
    .expect("gateway");
    let codec = start_codec(&nats, |_| {}).expect("codec");
    for s in [&router, &denoiser, &gateway, &codec] {
        s.wait_ready(Duration::from_secs(30)).await.expect("ready");
    }
    let client = async_nats::connect(&nats.url()).await.unwrap();
    let api = gateway.addrs.api.unwrap();
    let generate = move |seed: u64, steps: u32| {
        tokio::spawn(async move {
            let start = Instant::now();
            let r = reqwest::Client::new()
                .post(format!("http://{api}/v1/images/generations"))
                .json(&json!({"prompt": "a cat", "num_inference_steps": steps, "seed": seed}))
                .timeout(Duration::from_secs(90))
                .send()
                .await
                .expect("the request must get an answer");
            let status = r.status().as_u16();
            let body: Value = r.json().await.expect("JSON body");
            (status, body, start.elapsed())
        })
    };
    let answered_again = |body: &Value| {
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("sent again"), "{body}");
    };

    // Pre-processing: the real codec stops; the stand-in takes the request and its copy.
    tokio::task::spawn_blocking(move || codec.kill())
        .await
        .unwrap();
    let failed = PreprocessReply::Failed {
        message: "sent again".into(),
    };
    let stood_in = stand_in(&client, CODEC_PRE, encode(&failed).unwrap()).await;
    let (status, body, took) = generate(5, 4).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), stood_in)
        .await
        .unwrap_or_else(|_| panic!("pre-processing was not sent again: {status} {body}"))
        .unwrap();
    assert_eq!(status, 500, "{body}");
    answered_again(&body);
    assert!(
        took < Duration::from_secs(20),
        "pre-processing resent only after {took:?}"
    );

    // Post-processing: a real codec prepares the job; once the job steps it stops, and the
    // stand-in takes the post-processing request and its copy.
    let codec = start_codec(&nats, |_| {}).expect("codec again");
    codec
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("ready");
    let mut events = client
        .subscribe(diffmesh_shared::wire::subjects::job_events("*"))
        .await
        .unwrap();
    client.flush().await.unwrap();
    let request = generate(6, 200);
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .expect("the job never stepped")
            .expect("event stream ended");
        match decode::<JobEvent>(&msg.payload).expect("event decodes") {
            JobEvent::Step { .. } => break,
            JobEvent::Done { .. } => panic!("the job finished before the codec stopped"),
            _ => {}
        }
    }
    tokio::task::spawn_blocking(move || codec.kill())
        .await
        .unwrap();
    let failed = PostprocessReply::Failed {
        message: "sent again".into(),
    };
    let stood_in = stand_in(&client, CODEC_POST, encode(&failed).unwrap()).await;
    let posted = Instant::now();
    let (status, body, _) = request.await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), stood_in)
        .await
        .unwrap_or_else(|_| panic!("post-processing was not sent again: {status} {body}"))
        .unwrap();
    assert!(status >= 500, "{status}: {body}");
    answered_again(&body);
    let took = posted.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "post-processing resent only after {took:?}"
    );
}

/// A stand-in codec (queue group `codec`) that takes the first request on `subject` and never
/// answers it, then answers the next with `reply` and goes away.
async fn stand_in(
    client: &async_nats::Client,
    subject: &'static str,
    reply: Vec<u8>,
) -> tokio::task::JoinHandle<()> {
    let mut sub = client
        .queue_subscribe(subject, diffmesh_shared::wire::subjects::CODEC_QUEUE.into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    let client = client.clone();
    tokio::spawn(async move {
        sub.next().await.expect("a request");
        let again = sub.next().await.expect("the request again");
        client
            .publish(again.reply.unwrap(), reply.into())
            .await
            .unwrap();
        sub.unsubscribe().await.unwrap();
    })
}
