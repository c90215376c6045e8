//! The shared mesh layer against a real nats-server: object store blobs, KV job records, and
//! request/reply errors (timeouts and missing services are typed, never a hang).
use std::time::{Duration, Instant};

use diffmesh_shared::nats::{connect, reply_msgpack, request_msgpack};
use diffmesh_shared::process::metrics::NatsMetrics;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::job::{JobRecord, JobState, JobStore};
use diffmesh_shared::wire::messages::{CancelJob, JobKind};
use diffmesh_shared::MeshError;
use diffmesh_tests::harness::NatsServer;
use futures::StreamExt;

#[tokio::test]
async fn blobs_jobs_and_request_errors() {
    let nats = NatsServer::start();
    let client = connect(&nats.url(), "test", Duration::from_secs(5))
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client.clone());

    // Blobs: round trip, size guard, missing key, idempotent open and delete.
    let blobs = BlobStore::open(&js).await.unwrap();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    blobs.put("job-1/image", &data).await.unwrap();
    assert_eq!(blobs.get("job-1/image").await.unwrap(), data);
    assert!(matches!(
        blobs.get_limited("job-1/image", 1000).await,
        Err(MeshError::BlobTooLarge { size: 300_000, .. })
    ));
    assert!(matches!(
        blobs.get("nope").await,
        Err(MeshError::BlobNotFound { .. })
    ));
    let again = BlobStore::open(&js).await.unwrap();
    assert_eq!(again.get("job-1/image").await.unwrap(), data);
    blobs.delete("job-1/image").await.unwrap();
    blobs.delete("job-1/image").await.unwrap();
    assert!(matches!(
        blobs.get("job-1/image").await,
        Err(MeshError::BlobNotFound { .. })
    ));

    // Job records: create once, compare-and-set updates, missing jobs.
    let jobs = JobStore::open(&js).await.unwrap();
    let record = JobRecord::new("job-2", JobKind::Edit);
    jobs.create(&record).await.unwrap();
    let mut other = JobRecord::new("job-2", JobKind::Generate);
    other.created_at_ms = record.created_at_ms;
    assert!(
        jobs.create(&other).await.is_err(),
        "a job id is created once"
    );
    // The same record again (a create whose reply was lost, tried again) is no error.
    jobs.create(&record).await.unwrap();
    let updated = jobs
        .update("job-2", |r| r.mark_running("w1"))
        .await
        .unwrap();
    assert_eq!(updated.state, JobState::Running);
    let stored = jobs.get("job-2").await.unwrap().unwrap();
    assert_eq!(stored.worker_id.as_deref(), Some("w1"));
    assert!(jobs.get("job-3").await.unwrap().is_none());
    assert!(matches!(
        jobs.update("job-3", |_| {}).await,
        Err(MeshError::JobNotFound { .. })
    ));
    // Concurrent updates all land (CAS retries).
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let jobs = jobs.clone();
        tasks.push(tokio::spawn(async move {
            jobs.update("job-2", |r| r.attempt += 1).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(jobs.get("job-2").await.unwrap().unwrap().attempt, 8);
    // A change that changes nothing but the time (the router and the gateway both recording
    // one ending, or one placement) writes nothing and returns the record as it is.
    let kv = js
        .get_key_value(diffmesh_shared::wire::subjects::JOB_BUCKET)
        .await
        .unwrap();
    let revision = || async { kv.entry("job-2").await.unwrap().unwrap().revision };
    let before = revision().await;
    jobs.update("job-2", |r| r.mark_done(vec!["a".into()]))
        .await
        .unwrap();
    let done = revision().await;
    assert!(done > before, "the ending was not written");
    let again = jobs
        .update("job-2", |r| r.mark_done(vec!["b".into()]))
        .await
        .unwrap();
    assert_eq!(again.result_keys, vec!["a".to_string()]);
    assert_eq!(revision().await, done, "a change of nothing was written");
    assert!(JobStore::open(&js).await.is_ok());

    // Request/reply: nobody listening, a slow listener, a working one.
    let msg = CancelJob { job_id: "j".into() };
    let err = request_msgpack::<_, CancelJob>(&client, "svc.none", &msg, Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(matches!(err, MeshError::NoResponders { .. }), "{err}");

    let _silent = client.subscribe("svc.silent").await.unwrap();
    let start = Instant::now();
    let err =
        request_msgpack::<_, CancelJob>(&client, "svc.silent", &msg, Duration::from_millis(300))
            .await
            .unwrap_err();
    assert!(matches!(err, MeshError::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));

    let mut echo = client.subscribe("svc.echo").await.unwrap();
    let responder = client.clone();
    tokio::spawn(async move {
        while let Some(req) = echo.next().await {
            let got: CancelJob = diffmesh_shared::wire::messages::decode(&req.payload).unwrap();
            let reply = CancelJob {
                job_id: format!("{}-echo", got.job_id),
            };
            reply_msgpack(&responder, &req, &reply).await.unwrap();
        }
    });
    client.flush().await.unwrap();
    let back: CancelJob = request_msgpack(&client, "svc.echo", &msg, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(back.job_id, "j-echo");
}

/// A store that keeps its records' revisions (the gateway's) writes an update with one
/// request instead of a read and a write, and a guess made stale by another writer, or one
/// its change declines, is read again: no update is lost and no decision is made on it.
#[tokio::test]
async fn known_revisions_save_the_read_and_never_hide_another_writer() {
    let nats = NatsServer::start();
    let connect_as = |name| {
        let url = nats.url();
        async move { connect(&url, name, Duration::from_secs(5)).await.unwrap() }
    };
    let (driver_client, other_client) = (connect_as("driver").await, connect_as("other").await);
    let driver = JobStore::open(&async_nats::jetstream::new(driver_client.clone()))
        .await
        .unwrap()
        .with_known_revisions(100);
    let other = JobStore::open(&async_nats::jetstream::new(other_client))
        .await
        .unwrap();
    driver
        .create(&JobRecord::new("known", JobKind::Edit))
        .await
        .unwrap();
    let sent = || {
        driver_client
            .statistics()
            .out_messages
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = sent();
    driver
        .update("known", |r| r.mark_placed("w1"))
        .await
        .unwrap();
    assert_eq!(
        sent() - before,
        1,
        "an update of a known record is one request"
    );

    // Another writer gets in between: the stale guess fails and the record is read again.
    other.update("known", |r| r.attempt = 3).await.unwrap();
    let running = driver
        .update("known", |r| r.mark_running("w1"))
        .await
        .unwrap();
    assert_eq!((running.state, running.attempt), (JobState::Running, 3));

    // A change that declines on the guess is decided on the stored record.
    other.update("known", |r| r.attempt = 4).await.unwrap();
    let taken = driver
        .update_if("known", |r| {
            if r.attempt != 4 {
                return false;
            }
            r.attempt = 5;
            true
        })
        .await
        .unwrap();
    assert_eq!(taken.map(|r| r.attempt), Some(5));

    // Concurrent updates through one knowing store all land.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let driver = driver.clone();
        tasks.push(tokio::spawn(async move {
            driver.update("known", |r| r.attempt += 1).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(other.get("known").await.unwrap().unwrap().attempt, 13);
}

/// A job's record watch (the SSE events and the idempotent replay wait on it) goes on through
/// a NATS server restart: records written after it still arrive. Without reopening, the watch
/// failed with "missed idle heartbeat".
#[tokio::test]
async fn a_record_watch_outlives_a_server_restart() {
    let (mut nats, jobs) = server_and_job_store().await;
    jobs.create(&JobRecord::new("watched", JobKind::Edit))
        .await
        .unwrap();
    let mut records = jobs.watch("watched").await.unwrap();
    let first = records.next().await.unwrap().unwrap();
    assert_eq!(first.state, JobState::Queued);
    let drops = NatsMetrics::global()
        .connection_events
        .with_label_values(&["disconnected"]);
    let drops_before = drops.get();
    nats.restart();
    jobs.update("watched", |r| r.mark_running("w1"))
        .await
        .unwrap();
    // async-nats alone notices the lost consumer after 10 s without heartbeats; the watch
    // reopens on the client's reconnect instead, well within that.
    let next = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match records.next().await {
                Some(Ok(r)) if r.state == JobState::Running => return Ok(r),
                Some(Ok(_)) => continue,
                Some(Err(err)) => return Err(format!("watch failed: {err}")),
                None => return Err("watch ended".to_string()),
            }
        }
    })
    .await
    .expect("no record within 5 s of the restart (the 10 s heartbeat timeout, not the reconnect)");
    assert_eq!(next.unwrap().worker_id.as_deref(), Some("w1"));
    // Dashboards see the drop (`diffmesh_nats_connection_events_total`; process-wide, so
    // another test's restart may add to it, never take from it).
    assert!(drops.get() > drops_before, "the drop was not counted");
}

/// The router's watch of every record (it finds jobs that lost their gateway) goes on through
/// a server restart after the last record it gave, not from its hour of history again.
#[tokio::test]
async fn a_watch_of_all_records_resumes_after_a_restart_where_it_stopped() {
    let (mut nats, jobs) = server_and_job_store().await;
    for id in ["a", "b"] {
        jobs.create(&JobRecord::new(id, JobKind::Edit))
            .await
            .unwrap();
    }
    let mut records = jobs.watch_since(Duration::from_secs(3600)).await.unwrap();
    for id in ["a", "b"] {
        assert_eq!(records.next().await.unwrap().unwrap().job_id, id);
    }
    nats.restart();
    jobs.create(&JobRecord::new("c", JobKind::Edit))
        .await
        .unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), records.next())
        .await
        .expect("a record within 5 s of the restart")
        .unwrap()
        .unwrap();
    assert_eq!(next.job_id, "c", "the reopened watch replayed {next:?}");
}

/// A fresh server and a job store on it, for the restart tests.
async fn server_and_job_store() -> (NatsServer, JobStore) {
    let nats = NatsServer::start();
    let client = connect(&nats.url(), "test", Duration::from_secs(5))
        .await
        .unwrap();
    let jobs = JobStore::open(&async_nats::jetstream::new(client))
        .await
        .unwrap();
    (nats, jobs)
}

/// A request in flight when the connection drops is sent again on the reconnect, not left to
/// wait out its timeout: the responder here ignores the first copy, as a request written into
/// the dropped connection is lost (seen in the node-crash runs: a 10 s request).
#[tokio::test]
async fn a_request_lost_with_the_connection_is_sent_again_on_the_reconnect() {
    let mut nats = NatsServer::start();
    let responder = connect(&nats.url(), "responder", Duration::from_secs(5))
        .await
        .unwrap();
    let mut requests = responder.subscribe("svc.lossy").await.unwrap();
    responder.flush().await.unwrap();
    let (first_arrived, first_seen) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let mut first_arrived = Some(first_arrived);
        while let Some(msg) = requests.next().await {
            if let Some(arrived) = first_arrived.take() {
                let _ = arrived.send(()); // lost: never answered
                continue;
            }
            let _ = reply_msgpack(&responder, &msg, &"answered".to_string()).await;
        }
    });
    let requester = connect(&nats.url(), "requester", Duration::from_secs(5))
        .await
        .unwrap();
    let resends = NatsMetrics::global()
        .request_resends
        .with_label_values(&["svc.lossy", "reconnect"]);
    let resends_before = resends.get();
    let call = tokio::spawn(async move {
        request_msgpack::<_, String>(&requester, "svc.lossy", &"q", Duration::from_secs(30)).await
    });
    first_seen.await.unwrap();
    nats.restart();
    let reply = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("no answer within 10 s of the restart: the request waited out its 30 s timeout")
        .unwrap();
    assert_eq!(reply.unwrap(), "answered");
    assert!(resends.get() > resends_before, "the resend was not counted");
}

/// A request that finds no responder is sent again for a moment (responders resubscribe after
/// a reconnect, or come up): one that subscribes 300 ms later answers it; with nobody at all
/// the answer is `NoResponders` once the grace is over, never a hang.
#[tokio::test]
async fn a_responder_that_subscribes_a_moment_late_still_gets_the_request() {
    let nats = NatsServer::start();
    let client = connect(&nats.url(), "test", Duration::from_secs(5))
        .await
        .unwrap();
    let retried = NatsMetrics::global()
        .request_resends
        .with_label_values(&["svc.late", "no_responders"]);
    let retried_before = retried.get();
    let responder = client.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut requests = responder.subscribe("svc.late").await.unwrap();
        responder.flush().await.unwrap();
        if let Some(msg) = requests.next().await {
            let _ = reply_msgpack(&responder, &msg, &"late".to_string()).await;
        }
    });
    let reply = request_msgpack::<_, String>(&client, "svc.late", &"q", Duration::from_secs(10))
        .await
        .expect("the late responder answers");
    assert_eq!(reply, "late");
    assert!(
        retried.get() > retried_before,
        "the resends were not counted"
    );

    let start = Instant::now();
    let err = request_msgpack::<_, String>(&client, "svc.nobody", &"q", Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(matches!(err, MeshError::NoResponders { .. }), "{err}");
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(1500) && waited < Duration::from_secs(5),
        "NoResponders after {waited:?}, not after the grace"
    );
}

/// A blob read whose request went into the dropped connection goes on after the reconnect
/// instead of waiting out its timeout. The restart blocks this test's only runtime thread, so
/// the client has not seen the drop when the read is sent.
#[tokio::test]
async fn a_blob_read_across_a_server_restart_does_not_wait_out_its_timeout() {
    let mut nats = NatsServer::start();
    let client = connect(&nats.url(), "test", Duration::from_secs(5))
        .await
        .unwrap();
    let blobs = BlobStore::open(&async_nats::jetstream::new(client))
        .await
        .unwrap();
    blobs.put("job-r/mask", b"small mask").await.unwrap();
    nats.restart();
    let read = tokio::time::timeout(Duration::from_secs(4), blobs.get("job-r/mask"))
        .await
        .expect("the read waited for an answer that never comes");
    assert_eq!(read.unwrap(), b"small mask");
}

/// A gateway whose copy of a job's terminal event or capture report was lost learns it from
/// the denoiser that ended the job; denoisers that do not know the job stay silent, so the
/// answer for an unknown job is "nothing", quickly.
#[tokio::test]
async fn a_lost_terminal_event_is_learned_from_the_denoiser_that_ended_the_job() {
    use diffmesh_denoiser::outcomes::RecentOutcomes;
    use diffmesh_gateway::lost_events::{captured, ended_as};
    use diffmesh_shared::stores::job::CaptureReport;
    use diffmesh_shared::wire::messages::JobEvent;
    let nats = NatsServer::start();
    let client = connect(&nats.url(), "test", Duration::from_secs(5))
        .await
        .unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let (ended_here, ended_elsewhere) = (RecentOutcomes::default(), RecentOutcomes::default());
    let done = JobEvent::Done {
        png_keys: vec!["job-d/result-0.png".into()],
    };
    ended_here.note(
        "job-d",
        &JobEvent::Step {
            step: 4,
            total: 4,
            ranks: None,
        },
    );
    ended_here.note("job-d", &done);
    ended_elsewhere.note("job-other", &done);
    let report = CaptureReport {
        cache_key: "cache-c".into(),
        steps: 4,
        blocks: 2,
        bytes: 4096,
        quality: None,
    };
    ended_elsewhere.note(
        "job-c",
        &JobEvent::Captured {
            cache_key: report.cache_key.clone(),
            steps: report.steps,
            blocks: report.blocks,
            bytes: report.bytes,
            quality: report.quality,
        },
    );
    ended_elsewhere.note("job-c", &JobEvent::Done { png_keys: vec![] });
    for outcomes in [ended_here, ended_elsewhere] {
        tokio::spawn(outcomes.serve(client.clone(), shutdown.clone()));
    }
    // Asked until the serving tasks have subscribed (each unanswered query takes 0.5 s).
    let mut learned = None;
    for _ in 0..10 {
        learned = ended_as(&client, "job-d").await;
        if learned.is_some() {
            break;
        }
    }
    assert_eq!(learned, Some(done));
    assert_eq!(captured(&client, "job-c").await, Some(report));
    assert_eq!(
        ended_as(&client, "job-c").await,
        Some(JobEvent::Done { png_keys: vec![] })
    );
    let start = Instant::now();
    assert_eq!(ended_as(&client, "job-running").await, None);
    // A job that captured nothing has no report to give.
    assert_eq!(captured(&client, "job-d").await, None);
    assert!(start.elapsed() < Duration::from_secs(2));
    shutdown.cancel();
}
