//! The denoiser service against a real nats-server: a submitted job runs, its outputs land in
//! the object store, the (fake) codec is asked to post-process them, and Done is published;
//! heartbeats announce the worker; shutdown is clean.
use diffmesh_denoiser::{start, DenoiserConfig};
use diffmesh_model::tch::Device;
use diffmesh_model::tiny::model::TinyModel;
use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::messages::{
    decode, encode, DenoiseJob, Heartbeat, JobEvent, PostprocessReply, PostprocessRequest,
    SubmitReply,
};
use diffmesh_shared::wire::subjects;
use futures::StreamExt;
use std::time::Duration;

/// A two-image job, so outputs of a batch of n come back in order.
fn job(id: &str, steps: u32) -> DenoiseJob {
    let mut job = diffmesh_shared::testing::generation_job(id, "a red circle", 9, steps);
    job.params.n = 2;
    job
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_runs_to_done_over_nats() {
    let nats = NatsServer::start();
    let model_dir = tempfile::tempdir().unwrap();
    let m = TinyModel::random_for_tests(3, Device::Cpu).unwrap();
    m.save(model_dir.path(), None).unwrap();

    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut heartbeats = client
        .subscribe(subjects::DENOISER_HEARTBEAT)
        .await
        .unwrap();
    let mut events = client.subscribe(subjects::job_events("j1")).await.unwrap();
    // Fake codec: checks the outputs exist at model resolution, answers with PNG keys.
    let mut codec = client.subscribe(subjects::CODEC_POST).await.unwrap();
    let blobs = BlobStore::open(&async_nats::jetstream::new(client.clone()))
        .await
        .unwrap();
    let (c, b) = (client.clone(), blobs.clone());
    tokio::spawn(async move {
        while let Some(msg) = codec.next().await {
            let req: PostprocessRequest = decode(&msg.payload).unwrap();
            let mut png_keys = Vec::new();
            for key in &req.output_keys {
                let rgb = b.get(key).await.unwrap();
                assert_eq!(rgb.len() as u32, req.model_width * req.model_height * 3);
                png_keys.push(format!("{key}.png"));
            }
            let reply = PostprocessReply::Done { png_keys };
            c.publish(msg.reply.unwrap(), encode(&reply).unwrap().into())
                .await
                .unwrap();
        }
    });
    client.flush().await.unwrap();

    let denoiser = start(DenoiserConfig::for_tests(
        nats.url(),
        model_dir.path().to_path_buf(),
        "w1",
    ))
    .await
    .unwrap();
    let hb = tokio::time::timeout(Duration::from_secs(5), heartbeats.next())
        .await
        .unwrap()
        .unwrap();
    let hb: Heartbeat = decode(&hb.payload).unwrap();
    assert_eq!(
        (hb.worker_id.as_str(), hb.model.as_str(), hb.draining),
        ("w1", "tiny", false)
    );

    let reply: SubmitReply = request_msgpack(
        &client,
        &subjects::denoiser_submit("w1"),
        &job("j1", 3),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(
        matches!(reply, SubmitReply::Accepted { ref worker_id } if worker_id == "w1"),
        "{reply:?}"
    );

    let mut seen = Vec::new();
    let done = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let ev: JobEvent = decode(&events.next().await.unwrap().payload).unwrap();
            seen.push(format!("{ev:?}"));
            match ev {
                JobEvent::Done { png_keys } => return png_keys,
                JobEvent::Failed { message, .. } => panic!("job failed: {message}"),
                _ => {}
            }
        }
    })
    .await
    .expect("job did not finish");
    assert_eq!(
        done,
        vec![
            "j1/output-0.rgb.png".to_string(),
            "j1/output-1.rgb.png".to_string()
        ]
    );
    assert!(seen.iter().any(|e| e.starts_with("Queued")), "{seen:?}");
    assert!(seen.iter().any(|e| e.starts_with("Started")), "{seen:?}");
    assert!(
        seen.iter()
            .any(|e| e == "Step { step: 3, total: 3, ranks: None }"),
        "{seen:?}"
    );

    denoiser.shutdown().await.unwrap();
    // After shutdown nobody answers on the worker's submit subject.
    let after: Result<SubmitReply, _> = request_msgpack(
        &client,
        &subjects::denoiser_submit("w1"),
        &job("j2", 1),
        Duration::from_millis(500),
    )
    .await;
    assert!(after.is_err());
}
