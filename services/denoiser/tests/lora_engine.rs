//! LoRA jobs in the engine (no NATS), on a random-weights tiny model and a random LoRA:
//! a job with a LoRA gives what the model patched in advance gives, jobs with and without
//! LoRAs share steps and each gets its own weights, bounded asynchronous loading steps the base
//! model up to its bound and then waits, and a LoRA that cannot be had fails only its job.
use diffmesh_denoiser::engine::{
    spawn_engine, EngineConfig, EngineDrained, EngineEvent, EngineHandle, EngineJob,
};
use diffmesh_denoiser::lora::{LoadedLora, LoraBlob, LoraFailure, LoraSlot};
use diffmesh_denoiser::metrics::DenoiserMetrics;
use diffmesh_denoiser::model::EngineModel;
use diffmesh_model::lora::{LoraPatcher, WeightedLora};
use diffmesh_model::tch::{Device, Kind};
use diffmesh_model::tiny::model::TinyModel;
use diffmesh_shared::wire::messages::{error_types, DenoiseJob};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::Span;

/// Layers of the tiny model (width 192) the test LoRA adapts: attention and MLP, both kinds of
/// block.
const MODULES: [(&str, usize, usize); 4] = [
    ("transformer_blocks.0.attn.to_q", 192, 192),
    ("transformer_blocks.1.ff.net.2", 768, 192),
    ("single_transformer_blocks.0.proj_mlp", 192, 768),
    ("single_transformer_blocks.1.attn.to_v", 192, 192),
];

/// A rank-4 LoRA file for those layers with deterministic pseudo-random weights;
/// `first_module` overrides the first layer's path (to make one that does not fit).
fn lora_file(seed: u64, first_module: Option<&str>) -> Vec<u8> {
    let modules: Vec<(String, usize, usize)> = MODULES
        .iter()
        .enumerate()
        .map(|(i, (m, inp, out))| {
            let m = if i == 0 { first_module.unwrap_or(m) } else { m };
            (m.to_string(), *inp, *out)
        })
        .collect();
    diffmesh_shared::testing::lora_file(&modules, 4, 0.6, seed)
}

fn loaded(id: &str, bytes: Vec<u8>, weight: f64) -> LoadedLora {
    LoadedLora {
        blob: Arc::new(LoraBlob::new(id, bytes.into()).unwrap()),
        weight,
    }
}

fn filled(set: Vec<LoadedLora>) -> LoraSlot {
    let slot: LoraSlot = Default::default();
    slot.set(Ok(set)).unwrap();
    slot
}

struct Harness {
    engine: EngineHandle,
    drained: EngineDrained,
    events: mpsc::Receiver<EngineEvent>,
}

fn harness(dir: &Path, config: EngineConfig, metrics: Option<DenoiserMetrics>) -> Harness {
    let model = EngineModel::load(dir, Device::Cpu, Kind::Float, "tiny".into(), Some(64)).unwrap();
    harness_on(model, config, metrics)
}

fn harness_on(
    model: EngineModel,
    config: EngineConfig,
    metrics: Option<DenoiserMetrics>,
) -> Harness {
    let (tx, events) = mpsc::channel(256);
    let (engine, drained) = spawn_engine(model, config, 16, tx, metrics).unwrap();
    Harness {
        engine,
        drained,
        events,
    }
}

fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    TinyModel::random_for_tests(23, Device::Cpu)
        .unwrap()
        .save(dir.path(), None)
        .unwrap();
    dir
}

fn job(id: &str, seed: u64, steps: u32) -> DenoiseJob {
    diffmesh_shared::testing::generation_job(id, "a red circle on the left", seed, steps)
}

async fn submit(h: &Harness, job: DenoiseJob, lora: Option<LoraSlot>) {
    let mut j = EngineJob::new(job, None);
    j.lora = lora;
    h.engine.submit(j, Span::none()).await.unwrap();
}

/// The next event (a stall is a failure).
async fn next(h: &mut Harness) -> EngineEvent {
    tokio::time::timeout(Duration::from_secs(120), h.events.recv())
        .await
        .expect("engine stalled")
        .unwrap()
}

/// Events until every id ended: images of the finished, errors of the failed, and a log.
async fn drain(
    h: &mut Harness,
    ids: &[&str],
) -> (
    HashMap<String, Vec<u8>>,
    HashMap<String, String>,
    Vec<String>,
) {
    let (mut images, mut errors, mut log) = (HashMap::new(), HashMap::new(), Vec::new());
    let mut left: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    while !left.is_empty() {
        match next(h).await {
            EngineEvent::Step { job_id, step, .. } => log.push(format!("step {job_id} {step}")),
            EngineEvent::Finished {
                job,
                images: mut imgs,
                ..
            } => {
                log.push(format!("finished {}", job.job_id));
                left.retain(|j| j != &job.job_id);
                images.insert(job.job_id, imgs.remove(0));
            }
            EngineEvent::Failed { job, error, .. } => {
                left.retain(|j| j != &job.job_id);
                // The error type the job fails with (the gateway's status follows it).
                errors.insert(job.job_id, format!("{error} [{}]", error.error_type()));
            }
            _ => {}
        }
    }
    (images, errors, log)
}

fn max_abs_diff(a: &[u8], b: &[u8]) -> u8 {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0)
}

async fn stop(h: Harness) {
    h.engine.begin_shutdown().await;
    h.drained.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_job_equals_the_model_patched_in_advance_and_shares_steps_with_base_jobs() {
    let dir = model_dir();
    let bytes = lora_file(7, None);
    // Reference: the weights patched before the engine starts, a plain job.
    let model = EngineModel::load(
        dir.path(),
        Device::Cpu,
        Kind::Float,
        "tiny".into(),
        Some(64),
    )
    .unwrap();
    let adapter = LoraBlob::new("style", bytes.clone().into())
        .unwrap()
        .adapter()
        .unwrap();
    LoraPatcher::new(&model.model.transformer_store)
        .apply(&[WeightedLora {
            adapter: &adapter,
            weight: 0.8,
        }])
        .unwrap();
    let mut pre = harness_on(model, EngineConfig::default(), None);
    submit(&pre, job("p", 5, 6), None).await;
    let (patched, _, _) = drain(&mut pre, &["p"]).await;
    stop(pre).await;

    let mut h = harness(dir.path(), EngineConfig::default(), None);
    submit(&h, job("base", 5, 6), None).await;
    let (base, _, _) = drain(&mut h, &["base"]).await;
    assert!(
        max_abs_diff(&base["base"], &patched["p"]) > 10,
        "the LoRA must change the image"
    );
    submit(
        &h,
        job("l", 5, 6),
        Some(filled(vec![loaded("style", bytes.clone(), 0.8)])),
    )
    .await;
    let (alone, _, _) = drain(&mut h, &["l"]).await;
    assert_eq!(
        alone["l"], patched["p"],
        "patched in the engine = patched in advance"
    );

    // Together: the weights switch between the two every step; each job gets its own.
    submit(&h, job("b2", 5, 6), None).await;
    submit(
        &h,
        job("l2", 5, 6),
        Some(filled(vec![loaded("style", bytes, 0.8)])),
    )
    .await;
    let (both, _, log) = drain(&mut h, &["b2", "l2"]).await;
    let first_done = log.iter().position(|l| l.starts_with("finished")).unwrap();
    assert!(
        log[..first_done].iter().any(|l| l.starts_with("step b2")),
        "{log:?}"
    );
    assert!(
        log[..first_done].iter().any(|l| l.starts_with("step l2")),
        "{log:?}"
    );
    assert_eq!(both["b2"], base["base"]);
    assert_eq!(both["l2"], patched["p"]);
    stop(h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_async_loading_steps_the_base_model_up_to_the_bound_then_waits() {
    let dir = model_dir();
    let bytes = lora_file(9, None);
    let registry = prometheus::Registry::new();
    let metrics = DenoiserMetrics::new(&registry).unwrap();
    let config = EngineConfig {
        lora_async_fraction: 0.25,
        ..Default::default()
    };
    let mut h = harness(dir.path(), config, Some(metrics.clone()));
    submit(
        &h,
        job("sync", 3, 8),
        Some(filled(vec![loaded("s", bytes.clone(), 1.0)])),
    )
    .await;
    let (sync, _, _) = drain(&mut h, &["sync"]).await;
    submit(&h, job("base", 3, 8), None).await;
    let (base, _, _) = drain(&mut h, &["base"]).await;

    let slot: LoraSlot = Default::default();
    submit(&h, job("bal", 3, 8), Some(slot.clone())).await;
    // 8 steps x 0.25: two steps on the base model, then nothing until the adapter is there.
    let mut steps = 0;
    while steps < 2 {
        if let EngineEvent::Step { .. } = next(&mut h).await {
            steps += 1;
        }
    }
    let quiet = tokio::time::timeout(Duration::from_millis(400), h.events.recv()).await;
    assert!(
        quiet.is_err(),
        "stepped past its bound without its LoRA: {quiet:?}"
    );
    slot.set(Ok(vec![loaded("s", bytes, 1.0)])).unwrap();
    let (bal, _, log) = drain(&mut h, &["bal"]).await;
    assert_eq!(
        log.iter().filter(|l| l.starts_with("step")).count(),
        6,
        "{log:?}"
    );
    // Two early steps without the LoRA change the image, but less than no LoRA at all.
    let (to_sync, to_base) = (
        max_abs_diff(&bal["bal"], &sync["sync"]),
        max_abs_diff(&bal["bal"], &base["base"]),
    );
    assert!(to_sync > 0 && to_base > 0, "{to_sync} {to_base}");
    let steps = |mode: &str| metrics.lora.lora_steps.with_label_values(&[mode]).get();
    assert_eq!(steps("base_while_loading"), 2);
    assert_eq!(steps("patched"), 8 + 6);
    let waited = &metrics.lora.lora_wait_seconds;
    assert_eq!(waited.get_sample_count(), 1, "one job waited, once");
    assert!(
        waited.get_sample_sum() >= 0.4,
        "{}",
        waited.get_sample_sum()
    );
    assert!(metrics.lora.lora_patch_seconds.get_sample_count() >= 2);
    stop(h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_that_cannot_be_had_fails_its_job_alone() {
    let dir = model_dir();
    let mut h = harness(dir.path(), EngineConfig::default(), None);
    submit(&h, job("base", 4, 5), None).await;
    let (base, _, _) = drain(&mut h, &["base"]).await;

    let gone: LoraSlot = Default::default();
    gone.set(Err(LoraFailure {
        message: "LoRA x was deleted after the request was accepted (not found)".into(),
        error_type: error_types::INVALID_REQUEST,
    }))
    .unwrap();
    let misfit = filled(vec![loaded(
        "m",
        lora_file(3, Some("transformer_blocks.9.attn.to_q")),
        1.0,
    )]);
    submit(&h, job("gone", 4, 5), Some(gone)).await;
    submit(&h, job("misfit", 4, 5), Some(misfit)).await;
    submit(&h, job("base2", 4, 5), None).await;
    let (images, errors, _) = drain(&mut h, &["gone", "misfit", "base2"]).await;
    // Deleted since the gateway checked it: the client's request, not a fault of the mesh.
    assert!(errors["gone"].contains("not found"), "{errors:?}");
    assert!(
        errors["gone"].ends_with("[invalid_request_error]"),
        "{errors:?}"
    );
    assert!(
        errors["misfit"].contains("transformer_blocks.9.attn.to_q"),
        "{errors:?}"
    );
    assert_eq!(
        images["base2"], base["base"],
        "the base weights are untouched"
    );
    stop(h).await;
}
