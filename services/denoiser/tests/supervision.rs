//! The engine actor's supervision: a panic of the engine itself in the middle of a batch fails
//! the jobs that were running (explicitly, with `EngineJobError::Restarted`), keeps the queued
//! ones, and a new engine, started by actix from the factory, runs them and every later job on
//! the same, intact weights. In a mesh, the denoiser places the cut-off jobs again.
mod common;

use common::engine::*;
use diffmesh_denoiser::engine::{EngineConfig, EngineEvent, EngineJobError};
use diffmesh_denoiser::metrics::DenoiserMetrics;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_mid_batch_fails_the_running_jobs_and_the_restarted_engine_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    write_random_model(dir.path());
    let registry = prometheus::Registry::new();
    let metrics = DenoiserMetrics::new(&registry).unwrap();
    let config = EngineConfig {
        max_batch: 2,
        max_queue: 8,
        ..Default::default()
    };
    let mut h = harness_on(dir.path(), config, Some(metrics.clone()));
    // Two long jobs run together; a third waits for a batch slot.
    submit(&h, job("run-a", "a red circle", 1, 200), None).await;
    submit(&h, job("run-b", "a blue square", 2, 200), None).await;
    submit(&h, job("queued", "a green triangle", 3, 3), None).await;
    // Both running jobs have stepped: the batch is mid-way.
    let mut stepped = std::collections::HashSet::new();
    while stepped.len() < 2 {
        let event = tokio::time::timeout(Duration::from_secs(60), h.events.recv())
            .await
            .expect("the engine stalled before the injected panic")
            .unwrap();
        if let EngineEvent::Step { job_id, step, .. } = event {
            if step >= 2 {
                stepped.insert(job_id);
            }
        }
    }
    h.engine.panic_mid_batch().await;

    let mut failed = Vec::new();
    let mut finished = Vec::new();
    while failed.len() + finished.len() < 3 {
        let event = tokio::time::timeout(Duration::from_secs(60), h.events.recv())
            .await
            .expect("no engine answered after the panic")
            .unwrap();
        match event {
            EngineEvent::Failed { job, error, .. } => {
                assert!(
                    matches!(error, EngineJobError::Restarted(ref m) if m.contains("injected")),
                    "{} failed for another reason: {error}",
                    job.job_id
                );
                failed.push(job.job_id);
            }
            EngineEvent::Finished { job, .. } => finished.push(job.job_id),
            _ => {}
        }
    }
    failed.sort();
    assert_eq!(
        failed,
        ["run-a", "run-b"],
        "the running jobs fail explicitly"
    );
    assert_eq!(
        finished,
        ["queued"],
        "the queued job runs on the restarted engine"
    );
    assert_eq!(metrics.engine_restarts.get(), 1);

    // The restarted engine serves new jobs on the same weights: the same job gives the same
    // image as on an engine that never panicked (same model folder).
    submit(&h, job("after", "a red circle", 1, 4), None).await;
    let (after, _) = drain(&mut h, &["after"]).await;
    let mut reference = harness_on(dir.path(), EngineConfig::default(), None);
    submit(&reference, job("ref", "a red circle", 1, 4), None).await;
    let (expected, _) = drain(&mut reference, &["ref"]).await;
    assert!(max_abs_diff(&after["after"], &expected["ref"]) <= 1);
    assert_eq!(metrics.engine_restarts.get(), 1);
}

/// The same in a small mesh (router + denoiser + a stand-in codec on a real nats-server): the
/// job the panic cut off is placed again through the router (a `Retrying` event) and finishes
/// on the restarted engine, as does the job that was queued; no accepted job is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cut_off_by_an_engine_restart_is_placed_again_and_finishes() {
    use diffmesh_denoiser::{start, DenoiserConfig};
    use diffmesh_router::RouterConfig;
    use diffmesh_shared::nats::request_msgpack;
    use diffmesh_shared::testing::NatsServer;
    use diffmesh_shared::wire::messages::{decode, JobEvent, SubmitReply};
    use diffmesh_shared::wire::subjects;
    use futures::StreamExt;

    let nats = NatsServer::start();
    let model_dir = tempfile::tempdir().unwrap();
    write_random_model(model_dir.path());
    let client = async_nats::connect(nats.url()).await.unwrap();
    common::stand_in_codec(&client).await;
    let mut events = client.subscribe(subjects::job_events("*")).await.unwrap();
    client.flush().await.unwrap();
    let router = diffmesh_router::start(RouterConfig::for_tests(nats.url()))
        .await
        .unwrap();
    let mut config = DenoiserConfig::for_tests(nats.url(), model_dir.path().to_path_buf(), "w1");
    config.max_batch = 1;
    let denoiser = start(config).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // the router heard w1

    for (id, steps) in [("running", 200), ("queued", 3)] {
        let j = diffmesh_shared::testing::generation_job(id, "a red circle", 4, steps);
        let reply: SubmitReply =
            request_msgpack(&client, subjects::ROUTER_SUBMIT, &j, Duration::from_secs(5))
                .await
                .unwrap();
        assert!(matches!(reply, SubmitReply::Accepted { .. }), "{reply:?}");
    }
    let mut retried = Vec::new();
    let mut done = Vec::new();
    let mut injected = false;
    tokio::time::timeout(Duration::from_secs(120), async {
        while done.len() < 2 {
            let msg = events.next().await.unwrap();
            let id = msg.subject.split('.').nth(2).unwrap().to_string();
            match decode::<JobEvent>(&msg.payload).unwrap() {
                JobEvent::Step { step: 3, .. } if id == "running" && !injected => {
                    denoiser.service.engine.panic_mid_batch().await;
                    injected = true;
                }
                JobEvent::Retrying { attempt, reason } => {
                    assert!(reason.contains("restarted"), "{reason}");
                    retried.push((id, attempt));
                }
                JobEvent::Done { .. } => done.push(id),
                JobEvent::Failed { message, .. } => panic!("{id} failed: {message}"),
                _ => {}
            }
        }
    })
    .await
    .expect("the jobs did not finish");
    assert_eq!(retried, [("running".to_string(), 1)]);
    done.sort();
    assert_eq!(done, ["queued", "running"]);
    assert_eq!(denoiser.service.metrics.engine_restarts.get(), 1);
    denoiser.shutdown().await.unwrap();
    router.shutdown().await.unwrap();
}
