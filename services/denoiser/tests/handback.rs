//! Graceful shutdown in a small mesh (router + two denoisers + fake codec on a real nats-server):
//! the stopping denoiser finishes its running job and hands its queued job back to the router,
//! which places it on the other denoiser; both jobs end Done.
mod common;

use diffmesh_denoiser::{start, DenoiserConfig};
use diffmesh_model::tch::Device;
use diffmesh_model::tiny::model::TinyModel;
use diffmesh_router::RouterConfig;
use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::messages::{decode, DenoiseJob, JobEvent, SubmitReply};
use diffmesh_shared::wire::subjects;
use futures::StreamExt;
use std::collections::HashMap;
use std::time::Duration;

fn job(id: &str, steps: u32) -> DenoiseJob {
    diffmesh_shared::testing::generation_job(id, "a red circle", 4, steps)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_hands_queued_job_to_another_denoiser() {
    let nats = NatsServer::start();
    let model_dir = tempfile::tempdir().unwrap();
    let m = TinyModel::random_for_tests(5, Device::Cpu).unwrap();
    m.save(model_dir.path(), None).unwrap();

    let client = async_nats::connect(nats.url()).await.unwrap();
    common::stand_in_codec(&client).await;
    let mut events = client.subscribe(subjects::job_events("*")).await.unwrap();
    client.flush().await.unwrap();

    let router = diffmesh_router::start(RouterConfig::for_tests(nats.url()))
        .await
        .unwrap();
    let mut cfg1 = DenoiserConfig::for_tests(nats.url(), model_dir.path().to_path_buf(), "w1");
    cfg1.max_batch = 1;
    let w1 = start(cfg1).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // router saw w1

    // Long enough that "running" is still running when w1 begins to shut down.
    for (id, steps) in [("running", 300), ("queued", 3)] {
        let reply: SubmitReply = request_msgpack(
            &client,
            subjects::ROUTER_SUBMIT,
            &job(id, steps),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(
            matches!(reply, SubmitReply::Accepted { ref worker_id } if worker_id == "w1"),
            "{reply:?}"
        );
    }
    let w2 = start(DenoiserConfig::for_tests(
        nats.url(),
        model_dir.path().to_path_buf(),
        "w2",
    ))
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // router saw w2

    let stop = tokio::spawn(w1.shutdown());
    let mut started_on: HashMap<String, String> = HashMap::new();
    let mut done: Vec<String> = Vec::new();
    tokio::time::timeout(Duration::from_secs(120), async {
        while done.len() < 2 {
            let msg = events.next().await.unwrap();
            let id = msg.subject.split('.').nth(2).unwrap().to_string();
            match decode::<JobEvent>(&msg.payload).unwrap() {
                JobEvent::Started { worker_id } => {
                    started_on.insert(id, worker_id);
                }
                JobEvent::Done { .. } => done.push(id),
                JobEvent::Failed { message, .. } => panic!("{id} failed: {message}"),
                _ => {}
            }
        }
    })
    .await
    .expect("jobs did not finish");
    stop.await.unwrap().unwrap();
    assert_eq!(
        started_on.get("running").map(String::as_str),
        Some("w1"),
        "{started_on:?}"
    );
    assert_eq!(
        started_on.get("queued").map(String::as_str),
        Some("w2"),
        "{started_on:?}"
    );
    w2.shutdown().await.unwrap();
    router.shutdown().await.unwrap();
}
