//! Router against a real nats-server with fake denoisers: the bounded admission queue (overflow
//! answered `Overloaded`), cancelling a queued job, placing queued jobs as capacity frees up,
//! answering queued jobs at shutdown with a retry hint, and switching the policy at run time.
mod common;

use common::{http, http_as, job, submit, wait_for_metric, FakeWorker};
use diffmesh_router::{start, RouterConfig};
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::messages::{decode, encode, CancelJob, JobEvent, SubmitReply};
use diffmesh_shared::wire::subjects;
use futures::StreamExt;
use std::time::Duration;
use tokio::sync::mpsc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_queue_overflows_cancels_places_and_drains() {
    let nats = NatsServer::start();
    let mut config = RouterConfig::for_tests(nats.url());
    config.max_queue = 2;
    // Long enough that nothing expires during the test.
    config.admission_wait = Duration::from_secs(20);
    let router = start(config).await.unwrap();
    let addr = router.health_addr;
    let client = async_nats::connect(nats.url()).await.unwrap();

    // One worker with room for exactly one job.
    let (tx, mut placed) = mpsc::channel(16);
    let _w = FakeWorker::new("w1", 1, 0).spawn(client.clone(), tx).await;
    wait_for_metric(addr, "diffmesh_router_live_workers 1").await;

    let first = submit(&client, &job("j1")).await;
    assert!(
        matches!(first, SubmitReply::Accepted { ref worker_id } if worker_id == "w1"),
        "{first:?}"
    );
    assert_eq!(placed.recv().await.unwrap().1.job_id, "j1");

    // The worker is full: the next two wait in the router, the fourth overflows.
    let c = client.clone();
    let j2 = tokio::spawn(async move { submit(&c, &job("j2")).await });
    wait_for_metric(addr, "diffmesh_router_admission_waiting 1").await;
    let c = client.clone();
    let j3 = tokio::spawn(async move { submit(&c, &job("j3")).await });
    wait_for_metric(addr, "diffmesh_router_admission_waiting 2").await;
    match submit(&client, &job("j4")).await {
        SubmitReply::Overloaded {
            queue_depth,
            retry_after_ms,
        } => {
            assert_eq!(queue_depth, 2);
            assert!(retry_after_ms > 0);
        }
        other => panic!("expected Overloaded, got {other:?}"),
    }

    // Cancelling a queued job answers its submit (no retry), frees its place and ends the
    // job for whoever follows its events.
    let mut j2_events = client.subscribe(subjects::job_events("j2")).await.unwrap();
    client.flush().await.unwrap();
    let cancel = CancelJob {
        job_id: "j2".into(),
    };
    client
        .publish(subjects::ROUTER_CANCEL, encode(&cancel).unwrap().into())
        .await
        .unwrap();
    match tokio::time::timeout(Duration::from_secs(5), j2)
        .await
        .unwrap()
        .unwrap()
    {
        SubmitReply::Rejected {
            reason,
            retry_after_ms,
        } => {
            assert!(reason.contains("cancelled"), "{reason}");
            assert_eq!(retry_after_ms, 0);
        }
        other => panic!("expected the cancelled submit to be rejected, got {other:?}"),
    }
    let ended = tokio::time::timeout(Duration::from_secs(5), j2_events.next())
        .await
        .expect("no event ended the cancelled job")
        .unwrap();
    match decode::<JobEvent>(&ended.payload).unwrap() {
        JobEvent::Failed { error_type, .. } => assert_eq!(error_type, "cancelled"),
        other => panic!("expected Failed (cancelled), got {other:?}"),
    }
    wait_for_metric(addr, "diffmesh_router_admission_waiting 1").await;

    // j1 finishes: the queued j3 is placed on the freed worker and its submit answered.
    let done = JobEvent::Done { png_keys: vec![] };
    client
        .publish(subjects::job_events("j1"), encode(&done).unwrap().into())
        .await
        .unwrap();
    let r3 = tokio::time::timeout(Duration::from_secs(5), j3)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(r3, SubmitReply::Accepted { ref worker_id } if worker_id == "w1"),
        "{r3:?}"
    );
    assert_eq!(placed.recv().await.unwrap().1.job_id, "j3");
    // The cancelled j2 never reached the worker.
    assert!(placed.try_recv().is_err());

    // A job still queued at shutdown is answered with a retry hint, not dropped.
    let c = client.clone();
    let j5 = tokio::spawn(async move { submit(&c, &job("j5")).await });
    wait_for_metric(addr, "diffmesh_router_admission_waiting 1").await;
    router.shutdown().await.unwrap();
    match tokio::time::timeout(Duration::from_secs(5), j5)
        .await
        .unwrap()
        .unwrap()
    {
        SubmitReply::Rejected {
            reason,
            retry_after_ms,
        } => {
            assert!(reason.contains("shutting down"), "{reason}");
            assert!(retry_after_ms > 0);
        }
        other => panic!("expected a retryable rejection at shutdown, got {other:?}"),
    }
}

/// The admin key of the policy test.
const KEY: &str = "admin-key-for-the-policy-test";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_switches_at_run_time_through_the_admin_endpoint() {
    let nats = NatsServer::start();
    let mut config = RouterConfig::for_tests(nats.url());
    // Too short a key is refused before anything starts.
    config.admin_addr = Some(([127, 0, 0, 1], 0).into());
    config.admin_key = Some("short".into());
    let refused = start(config.clone())
        .await
        .err()
        .expect("a short admin key must be refused");
    assert!(
        refused.to_string().contains("ROUTER_ADMIN_KEY"),
        "{refused}"
    );
    config.admin_key = Some(KEY.into());
    let router = start(config).await.unwrap();
    let addr = router.health_addr;
    let admin = router.admin_addr.expect("admin API bound");
    assert_ne!(
        admin, addr,
        "the admin API listens apart from the health address"
    );
    // Without the key, with another, or on the health address: no policy to read or switch.
    for (at, key) in [
        (admin, None),
        (admin, Some("not-the-admin-key-at-all")),
        (addr, Some(KEY)),
    ] {
        let (status, body) = http_as(
            at,
            "POST",
            "/admin/policy",
            r#"{"policy":"round-robin"}"#,
            key,
        )
        .await;
        let wanted = if at == admin { 401 } else { 404 };
        assert_eq!(status, wanted, "{at} {key:?}: {body}");
    }
    let client = async_nats::connect(nats.url()).await.unwrap();

    // wa runs a full-image job with 20 steps left (placed by someone else); wb is idle.
    let (tx, mut placed) = mpsc::channel(16);
    let busy = FakeWorker::new("wa", 4, 4).running_foreign(256, 20);
    let _a = busy.spawn(client.clone(), tx.clone()).await;
    let _b = FakeWorker::new("wb", 4, 4).spawn(client.clone(), tx).await;
    wait_for_metric(addr, "diffmesh_router_live_workers 2").await;

    let (status, body) = http_as(admin, "GET", "/admin/policy", "", Some(KEY)).await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["policy"], "mask-aware");
    assert!(v["known"].as_array().unwrap().len() >= 4);
    // The built-in tiny-cpu profile's fit, every term shown.
    let compute = &v["cost_models"]["compute"];
    for term in [
        "slope",
        "intercept",
        "per_request",
        "per_cached_request",
        "r2",
    ] {
        assert!(compute[term].as_f64().is_some(), "{term} missing: {body}");
    }
    assert!(compute["slope"].as_f64().unwrap() > 0.0, "{body}");
    wait_for_metric(addr, "diffmesh_router_policy{name=\"mask-aware\"} 1").await;

    // Mask-aware sends the job to the idle worker.
    let SubmitReply::Accepted { worker_id } = submit(&client, &job("j1")).await else {
        panic!("not placed")
    };
    assert_eq!(worker_id, "wb");
    placed.recv().await.unwrap();

    // Switched to round-robin, the next job goes to the first worker in turn, busy or not.
    let (status, body) = http_as(
        admin,
        "POST",
        "/admin/policy",
        r#"{"policy":"round-robin"}"#,
        Some(KEY),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["policy"].as_str(), v["previous"].as_str()),
        (Some("round-robin"), Some("mask-aware"))
    );
    wait_for_metric(addr, "diffmesh_router_policy{name=\"round-robin\"} 1").await;
    let SubmitReply::Accepted { worker_id } = submit(&client, &job("j2")).await else {
        panic!("not placed")
    };
    assert_eq!(worker_id, "wa");

    // Bad bodies are 400s naming the field; the policy stays.
    for body in [r#"{"policy":"fastest"}"#, r#"{"name":"x"}"#, "not json"] {
        let (status, answer) = http_as(admin, "POST", "/admin/policy", body, Some(KEY)).await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(answer.contains("\"field\":\"policy\""), "{answer}");
    }
    let (_, body) = http_as(admin, "GET", "/admin/policy", "", Some(KEY)).await;
    assert!(body.contains("\"policy\":\"round-robin\""), "{body}");
    let metrics = http(addr, "GET", "/metrics", "").await.1;
    assert!(
        metrics.contains("diffmesh_router_decision_seconds_count"),
        "{metrics}"
    );
    router.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferring_holds_jobs_in_the_queue_until_a_worker_drains_or_half_their_wait() {
    // medium-cpu: a batch costs the sum of its rows, so mask-aware-deferring keeps a job
    // waiting rather than share a busy worker's steps.
    let nats = NatsServer::start();
    let mut config = RouterConfig::for_tests(nats.url());
    config.profile = Some("medium-cpu".into());
    config.policy = "mask-aware-deferring".into();
    config.admission_wait = Duration::from_secs(4);
    let router = start(config).await.unwrap();
    let addr = router.health_addr;
    let client = async_nats::connect(nats.url()).await.unwrap();

    // wa is in the last step of a job placed by someone else.
    let (tx, mut placed) = mpsc::channel(16);
    let busy = FakeWorker::new("wa", 4, 4).running_foreign(256, 1);
    let _a = busy.spawn(client.clone(), tx.clone()).await;
    wait_for_metric(addr, "diffmesh_router_live_workers 1").await;

    // wa would take j1, but the policy holds it; an idle worker that joins gets it.
    let c = client.clone();
    let j1 = tokio::spawn(async move { submit(&c, &job("j1")).await });
    wait_for_metric(addr, "diffmesh_router_admission_waiting 1").await;
    assert!(placed.try_recv().is_err());
    let _b = FakeWorker::new("wb", 4, 4).spawn(client.clone(), tx).await;
    let r1 = tokio::time::timeout(Duration::from_secs(5), j1)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(r1, SubmitReply::Accepted { ref worker_id } if worker_id == "wb"),
        "{r1:?}"
    );
    assert_eq!(placed.recv().await.unwrap().1.job_id, "j1");

    // Both busy now: j2 is held, but not past half its allowed wait (2 s of 4): it is then
    // placed where it can go rather than expire.
    let started = std::time::Instant::now();
    let c = client.clone();
    let j2 = tokio::spawn(async move { submit(&c, &job("j2")).await });
    wait_for_metric(addr, "diffmesh_router_admission_waiting 1").await;
    let r2 = tokio::time::timeout(Duration::from_secs(8), j2)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(r2, SubmitReply::Accepted { .. }), "{r2:?}");
    let held = started.elapsed();
    assert!(held >= Duration::from_millis(1_900), "{held:?}");
    assert_eq!(placed.recv().await.unwrap().1.job_id, "j2");
    router.shutdown().await.unwrap();
}
