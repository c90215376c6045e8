//! ControlNet-as-a-Service in the engine, with real ControlNet workers over a real NATS server:
//! `sync` makes the image the engine makes with its own ControlNet, bit for bit; `pipelined`
//! (residuals one step behind) stays close to it without being it; a worker that stops mid-job
//! hands its session to another worker, and with none left the denoiser computes the
//! residuals itself, the image still the same.
//!
//! It lives with the benches because it drives the engine through the ControlNet-service
//! bench's helpers (`diffmesh_benches::controlnet_service`), which need both programs' crates.
use diffmesh_benches::controlnet_service::{
    psnr, start_worker, steered_engine, steered_job, SteeredEngine,
};
use diffmesh_controlnet::{WorkerHandle, WorkerMetrics};
use diffmesh_denoiser::controlnet_service::RemoteMode;
use diffmesh_model::tiny::controlnet_train::save_random_model_and_controlnet;
use diffmesh_shared::testing::NatsServer;
use std::path::Path;
use std::time::Duration;

const STEPS: u32 = 8;

/// A random tiny model in `dir` and a random ControlNet of it in `dir/controlnets/rand`.
fn write_model_and_controlnet(dir: &Path) {
    save_random_model_and_controlnet(dir, "rand").unwrap();
}

/// A left-half-white control image at the model resolution.
fn control_rgb() -> Vec<u8> {
    (0..64 * 64)
        .flat_map(|i| if i % 64 < 32 { [255u8; 3] } else { [0; 3] })
        .collect()
}
/// Long enough that a worker stopped after the first step is gone before the last.
const LONG_STEPS: u32 = 20;

async fn engine(url: &str, dir: &Path, mode: RemoteMode) -> SteeredEngine {
    let e = steered_engine(url, dir, &dir.join("controlnets"), mode, 4)
        .await
        .unwrap();
    if mode != RemoteMode::Off {
        e.wait_for_workers("rand", true).await.unwrap();
    }
    e
}

/// Run one steered job of `steps` steps; once it has run `at` steps, stop `worker` (while
/// the job goes on). Returns the image.
async fn image(
    e: &mut SteeredEngine,
    id: &str,
    steps: u32,
    stop: Option<(u32, WorkerHandle)>,
) -> Vec<u8> {
    let job = steered_job(id, "a red circle", 5, steps, "rand", control_rgb());
    let Some((at, worker)) = stop else {
        return e.run(vec![job]).await.unwrap().0.remove(id).unwrap();
    };
    e.handle.submit(job, tracing::Span::none()).await.unwrap();
    let mut worker = Some(worker);
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), e.events.recv())
            .await
            .expect("engine stalled")
            .unwrap();
        match event {
            diffmesh_denoiser::engine::EngineEvent::Step { step, .. } if step >= at => {
                if let Some(w) = worker.take() {
                    w.shutdown().await;
                }
            }
            diffmesh_denoiser::engine::EngineEvent::Finished { mut images, .. } => {
                return images.remove(0)
            }
            diffmesh_denoiser::engine::EngineEvent::Failed { error, .. } => {
                panic!("job failed: {error}")
            }
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_controlnets_make_the_local_image() {
    let dir = tempfile::tempdir().unwrap();
    write_model_and_controlnet(dir.path());
    let nats = NatsServer::start();
    let url = nats.url();

    // The reference: residuals computed on the engine thread.
    let mut local = engine(&url, dir.path(), RemoteMode::Off).await;
    let reference = image(&mut local, "local", STEPS, None).await;
    assert_eq!(local.remote("remote"), 0);

    let controlnets = dir.path().join("controlnets");
    let a = start_worker(&url, &controlnets, "cn-a").await.unwrap();
    let b = start_worker(&url, &controlnets, "cn-b").await.unwrap();

    let mut sync = engine(&url, dir.path(), RemoteMode::Sync).await;
    let same = image(&mut sync, "sync", STEPS, None).await;
    assert_eq!(
        same, reference,
        "sync residuals from a worker changed the image"
    );
    assert_eq!(sync.remote("remote"), STEPS as u64);

    let mut pipelined = engine(&url, dir.path(), RemoteMode::Pipelined).await;
    let stale = image(&mut pipelined, "pipelined", STEPS, None).await;
    let close = psnr(&stale, &reference);
    assert!(
        stale != reference,
        "pipelined residuals were not one step behind"
    );
    assert!(
        close > 25.0,
        "pipelined image too far from the synchronous one: {close:.1} dB"
    );
    eprintln!("pipelined vs sync: PSNR {close:.1} dB");
    assert_eq!(pipelined.remote("remote"), STEPS as u64);
    assert_eq!(pipelined.remote("fallback_local"), 0);

    // Both workers are idle and nothing is loaded: sessions open on `cn-a` (ties go by id).
    // Stop it mid-job: `cn-b` takes the session over, the image unchanged.
    let (a_metrics, b_metrics) = (a.metrics.clone(), b.metrics.clone());
    let steps_on = |m: &WorkerMetrics| m.requests.with_label_values(&["step", "ok"]).get();
    let before = (steps_on(&a_metrics), steps_on(&b_metrics));
    let handed_over = image(&mut sync, "handed-over", LONG_STEPS, Some((1, a))).await;
    let (on_a, on_b) = (
        steps_on(&a_metrics) - before.0,
        steps_on(&b_metrics) - before.1,
    );
    assert!(on_a >= 1 && on_b >= 1, "steps on a / b: {on_a} / {on_b}");
    assert_eq!(sync.remote("remote"), (STEPS + LONG_STEPS) as u64);
    assert_eq!(sync.remote("fallback_local"), 0);

    // With no worker left, the denoiser computes the residuals itself.
    let fallen_back = image(&mut sync, "fallen-back", LONG_STEPS, Some((1, b))).await;
    assert!(sync.remote("fallback_local") > 0, "no step fell back");
    assert_eq!(sync.remote("failed"), 0);

    // Both match the job run wholly on the engine's own ControlNet.
    let long_reference = image(&mut local, "long-local", LONG_STEPS, None).await;
    assert_eq!(
        handed_over, long_reference,
        "the image changed when the worker did"
    );
    assert_eq!(
        fallen_back, long_reference,
        "the local fallback changed the image"
    );
}
