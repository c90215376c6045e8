//! Router against a real nats-server with hand-driven fake denoisers: placement, rejection when
//! no denoiser is live, re-placement after a worker goes silent (on a restarted worker when it
//! was the only one, or the others were full), and failure when none is left for the failover
//! wait.
use diffmesh_router::{start, RouterConfig, RouterHandle};
use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::messages::{
    decode, encode, DenoiseJob, Heartbeat, JobEvent, SubmitReply,
};
use diffmesh_shared::wire::subjects;
use futures::StreamExt;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

fn job(id: &str) -> DenoiseJob {
    diffmesh_shared::testing::generation_job(id, "a red circle", 1, 4)
}

/// A fake denoiser: heartbeats until `stop`, accepts every submit and reports it on `jobs`.
async fn fake_worker(
    client: async_nats::Client,
    id: &str,
    jobs: mpsc::Sender<(String, DenoiseJob)>,
) -> CancellationToken {
    fake_worker_that(client, id, jobs, true).await
}

/// A fake denoiser that heartbeats until `stop` and accepts every submit when `accepts` (and
/// reports it on `jobs`), else refuses every one as full.
async fn fake_worker_that(
    client: async_nats::Client,
    id: &str,
    jobs: mpsc::Sender<(String, DenoiseJob)>,
    accepts: bool,
) -> CancellationToken {
    let stop = CancellationToken::new();
    let mut sub = client
        .subscribe(subjects::denoiser_submit(id))
        .await
        .unwrap();
    client.flush().await.unwrap();
    let (c, s, worker) = (client.clone(), stop.clone(), id.to_string());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = s.cancelled() => return,
                _ = tick.tick() => {
                    let hb = Heartbeat {
                        worker_id: worker.clone(), running: vec![], queued: 0, waiting: vec![], max_batch: 2,
                        model: "tiny".into(), card: None, draining: false, queue_capacity: 2, cached_templates: vec![], cached_loras: vec![], controlnets: vec![], recent_steps: vec![], controlnet_step_s: vec![],
                        interval_ms: 100,
                        ranks: 0,
                        free_ranks: 0,
                    };
                    c.publish(subjects::DENOISER_HEARTBEAT, encode(&hb).unwrap().into()).await.unwrap();
                }
                msg = sub.next() => {
                    let Some(msg) = msg else { return };
                    let job: DenoiseJob = decode(&msg.payload).unwrap();
                    let reply = if accepts {
                        SubmitReply::Accepted { worker_id: worker.clone() }
                    } else {
                        SubmitReply::Rejected { reason: "full".into(), retry_after_ms: 100 }
                    };
                    c.publish(msg.reply.unwrap(), encode(&reply).unwrap().into()).await.unwrap();
                    if accepts {
                        jobs.send((worker.clone(), job)).await.unwrap();
                    }
                }
            }
        }
    });
    stop
}

/// A router on `nats` that keeps a lost denoiser's job for `failover_wait`, and a client.
async fn router_with_failover_wait(
    nats: &NatsServer,
    failover_wait: Duration,
) -> (RouterHandle, async_nats::Client) {
    let router = start(RouterConfig {
        failover_wait,
        ..RouterConfig::for_tests(nats.url())
    })
    .await
    .unwrap();
    (router, async_nats::connect(nats.url()).await.unwrap())
}

async fn submit(client: &async_nats::Client, j: &DenoiseJob) -> SubmitReply {
    request_msgpack(client, subjects::ROUTER_SUBMIT, j, Duration::from_secs(5))
        .await
        .unwrap()
}

/// Stop fake denoiser w0 for well past the router's expiry (3 missed heartbeats of 100 ms),
/// start it again under the same id (a container restarted in place), and return the next
/// placement, which must come within 5 s (`why` says what it waited for).
async fn restart_w0_in_place(
    client: &async_nats::Client,
    w0: CancellationToken,
    jobs: &mpsc::Sender<(String, DenoiseJob)>,
    placed: &mut mpsc::Receiver<(String, DenoiseJob)>,
    why: &str,
) -> (String, DenoiseJob, CancellationToken) {
    w0.cancel();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let again = fake_worker(client.clone(), "w0", jobs.clone()).await;
    let (w, j) = tokio::time::timeout(Duration::from_secs(5), placed.recv())
        .await
        .expect(why)
        .unwrap();
    (w, j, again)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn places_fails_over_and_gives_up_cleanly() {
    let nats = NatsServer::start();
    let (router, client) = router_with_failover_wait(&nats, Duration::from_secs(1)).await;

    // No denoiser yet: rejected at once with a retry hint.
    match submit(&client, &job("early")).await {
        SubmitReply::Rejected {
            reason,
            retry_after_ms,
        } => {
            assert!(reason.contains("no denoiser"), "{reason}");
            assert!(retry_after_ms > 0);
        }
        other => panic!("expected rejection, got {other:?}"),
    }

    let (tx, mut placed) = mpsc::channel(16);
    let stop_a = fake_worker(client.clone(), "wa", tx.clone()).await;
    let stop_b = fake_worker(client.clone(), "wb", tx.clone()).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // both heartbeats seen

    let mut events = client.subscribe(subjects::job_events("j1")).await.unwrap();
    client.flush().await.unwrap();
    let SubmitReply::Accepted { worker_id: first } = submit(&client, &job("j1")).await else {
        panic!("not placed")
    };
    let (w, j) = placed.recv().await.unwrap();
    assert_eq!((w.as_str(), j.attempt), (first.as_str(), 0));

    // The chosen worker goes silent: the job is placed on the other one, attempt 1.
    let (lost, survivor_stop, other_stop) = if first == "wa" {
        ("wa", stop_b.clone(), stop_a.clone())
    } else {
        ("wb", stop_a.clone(), stop_b.clone())
    };
    other_stop.cancel();
    let (w2, j2) = tokio::time::timeout(Duration::from_secs(5), placed.recv())
        .await
        .expect("no re-placement")
        .unwrap();
    assert_ne!(w2, lost);
    assert_eq!((j2.job_id.as_str(), j2.attempt), ("j1", 1));
    let ev = tokio::time::timeout(Duration::from_secs(2), events.next())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(
        decode::<JobEvent>(&ev.payload).unwrap(),
        JobEvent::Retrying { attempt: 1, .. }
    ));

    // The survivor goes silent too and none comes back within the failover wait: the job
    // fails with a clear message.
    survivor_stop.cancel();
    let failed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let ev = events.next().await.unwrap();
            if let JobEvent::Failed {
                message,
                error_type,
            } = decode::<JobEvent>(&ev.payload).unwrap()
            {
                return (message, error_type);
            }
        }
    })
    .await
    .expect("job never failed");
    assert!(
        failed.0.contains("lost; no denoiser available within 1 s"),
        "{}",
        failed.0
    );
    assert_eq!(failed.1, "worker_lost");

    let metrics = http_get(router.health_addr, "/metrics").await;
    assert!(
        metrics.contains("diffmesh_router_replacements_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("diffmesh_router_decision_duration_seconds_count"),
        "{metrics}"
    );
    router.shutdown().await.unwrap();
}

/// The only denoiser dies with a job and a new one starts under the same id (a container
/// restarted in place): the job waits for it and is placed there again, instead of failing
/// because no other denoiser was live when the first was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waits_for_its_only_denoiser_to_restart() {
    let nats = NatsServer::start();
    let (router, client) = router_with_failover_wait(&nats, Duration::from_secs(10)).await;
    let (tx, mut placed) = mpsc::channel(16);
    let first = fake_worker(client.clone(), "w0", tx.clone()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut events = client.subscribe(subjects::job_events("j1")).await.unwrap();
    client.flush().await.unwrap();
    assert!(matches!(
        submit(&client, &job("j1")).await,
        SubmitReply::Accepted { .. }
    ));
    let (_, j) = placed.recv().await.unwrap();
    assert_eq!(j.attempt, 0);

    let (w, j, _second) = restart_w0_in_place(
        &client,
        first,
        &tx,
        &mut placed,
        "the job was not placed on the restarted denoiser",
    )
    .await;
    assert_eq!((w.as_str(), j.job_id.as_str(), j.attempt), ("w0", "j1", 1));
    // Its events: Retrying, and no Failed.
    let mut seen = Vec::new();
    while let Ok(Some(msg)) = tokio::time::timeout(Duration::from_millis(300), events.next()).await
    {
        seen.push(decode::<JobEvent>(&msg.payload).unwrap());
    }
    assert!(
        seen.iter()
            .any(|e| matches!(e, JobEvent::Retrying { attempt: 1, .. })),
        "{seen:?}"
    );
    assert!(
        !seen.iter().any(|e| matches!(e, JobEvent::Failed { .. })),
        "{seen:?}"
    );
    router.shutdown().await.unwrap();
}

/// A denoiser dies with a job and comes back under the same id while the other denoiser is live
/// but full: the job goes back to the restarted one at once instead of waiting for a slot on
/// the full one (up to the whole failover wait, after which it failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_job_goes_back_to_its_restarted_denoiser_when_the_other_is_full() {
    let nats = NatsServer::start();
    let (router, client) = router_with_failover_wait(&nats, Duration::from_secs(10)).await;
    let (tx, mut placed) = mpsc::channel(16);
    let _full = fake_worker_that(client.clone(), "w1", tx.clone(), false).await;
    let first = fake_worker(client.clone(), "w0", tx.clone()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(
        submit(&client, &job("j1")).await,
        SubmitReply::Accepted { .. }
    ));
    let (w, _) = placed.recv().await.unwrap();
    assert_eq!(w, "w0", "the full denoiser took the job");

    let (w, j, _second) = restart_w0_in_place(
        &client,
        first,
        &tx,
        &mut placed,
        "the job was not placed on the restarted denoiser while the other was full",
    )
    .await;
    assert_eq!((w.as_str(), j.job_id.as_str(), j.attempt), ("w0", "j1", 1));
    router.shutdown().await.unwrap();
}

/// Minimal HTTP GET over a TCP stream (keeps the test free of an HTTP client dependency).
async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}
