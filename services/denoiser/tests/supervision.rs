//! The engine actor's supervision: a panic of the engine itself in the middle of a batch fails
//! the jobs that were running (explicitly, with `EngineJobError::Restarted`), keeps the queued
//! ones, and a new engine, started by actix from the factory, runs them and every later job on
//! the same, intact weights.
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
