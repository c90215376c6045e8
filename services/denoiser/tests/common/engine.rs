//! The engine tests' harness: an engine on a random-weights tiny model, its events collected
//! per job.
use diffmesh_denoiser::engine::{
    spawn_engine, EngineConfig, EngineDrained, EngineEvent, EngineHandle, EngineJob,
};
use diffmesh_denoiser::metrics::DenoiserMetrics;
use diffmesh_denoiser::model::{EditInputs, EngineModel};
use diffmesh_model::tch::{Device, Kind};
use diffmesh_model::tiny::model::TinyModel;
use diffmesh_shared::wire::messages::DenoiseJob;
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::Span;

/// A tiny model folder with random (non-zero) weights, so outputs depend on prompt and seed.
pub fn write_random_model(dir: &Path) {
    let m = TinyModel::random_for_tests(11, Device::Cpu).unwrap();
    m.save(dir, None).unwrap();
}

pub fn job(id: &str, prompt: &str, seed: u64, steps: u32) -> DenoiseJob {
    diffmesh_shared::testing::generation_job(id, prompt, seed, steps)
}

pub struct Harness {
    pub engine: EngineHandle,
    pub drained: EngineDrained,
    pub events: mpsc::Receiver<EngineEvent>,
    pub _dir: Option<tempfile::TempDir>,
}

pub fn harness(max_batch: usize, max_queue: usize) -> Harness {
    harness_with(EngineConfig {
        max_batch,
        max_queue,
        ..Default::default()
    })
}

pub fn harness_with(config: EngineConfig) -> Harness {
    harness_with_metrics(config, None)
}

pub fn harness_with_metrics(config: EngineConfig, metrics: Option<DenoiserMetrics>) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    write_random_model(dir.path());
    let mut h = harness_on(dir.path(), config, metrics);
    h._dir = Some(dir);
    h
}

/// An engine on the model in `dir` (tests that compare two engines load one model folder: the
/// random weights depend on the torch RNG, which tests running in parallel share).
pub fn harness_on(dir: &Path, config: EngineConfig, metrics: Option<DenoiserMetrics>) -> Harness {
    harness_of(load_model(dir), config, metrics)
}

/// The tiny model in `dir`, at 64x64.
pub fn load_model(dir: &Path) -> EngineModel {
    EngineModel::load(dir, Device::Cpu, Kind::Float, "tiny".into(), Some(64)).unwrap()
}

/// An engine on `model`.
pub fn harness_of(
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
        _dir: None,
    }
}

/// Collect events until every id in `ids` finished, failed or was cancelled.
pub async fn drain(h: &mut Harness, ids: &[&str]) -> (HashMap<String, Vec<u8>>, Vec<String>) {
    let mut images = HashMap::new();
    let mut log = Vec::new();
    let mut left: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    while !left.is_empty() {
        let event = tokio::time::timeout(Duration::from_secs(120), h.events.recv())
            .await
            .expect("engine stalled")
            .unwrap();
        match event {
            EngineEvent::Started { job_id } => log.push(format!("started {job_id}")),
            EngineEvent::Step {
                job_id,
                step,
                total,
                ..
            } => log.push(format!("step {job_id} {step}/{total}")),
            EngineEvent::Finished {
                job,
                images: mut imgs,
                width,
                height,
                ..
            } => {
                assert_eq!((width, height), (64, 64));
                assert_eq!(imgs.len(), 1);
                assert_eq!(imgs[0].len(), 64 * 64 * 3);
                log.push(format!("finished {}", job.job_id));
                left.retain(|j| j != &job.job_id);
                images.insert(job.job_id, imgs.remove(0));
            }
            EngineEvent::Failed { job, error, .. } => {
                log.push(format!("failed {}: {error}", job.job_id));
                left.retain(|j| j != &job.job_id);
            }
            EngineEvent::Cancelled { job_id } => {
                log.push(format!("cancelled {job_id}"));
                left.retain(|j| j != &job_id);
            }
            EngineEvent::Captured { job, .. } => {
                log.push(format!("captured {}", job.job_id));
                left.retain(|j| j != &job.job_id);
            }
            EngineEvent::Preview {
                job_id,
                step,
                width,
                height,
                rgb,
                ..
            } => {
                assert_eq!(rgb.len(), (width * height * 3) as usize);
                log.push(format!("preview {job_id} {step} {width}x{height}"));
            }
        }
    }
    (images, log)
}

pub async fn submit(h: &Harness, j: DenoiseJob, edit: Option<EditInputs>) {
    h.engine
        .submit(EngineJob::new(j, edit), Span::none())
        .await
        .unwrap();
}

pub fn max_abs_diff(a: &[u8], b: &[u8]) -> u8 {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0)
}
