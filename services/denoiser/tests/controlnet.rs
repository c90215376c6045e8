//! Steered generations in the engine (no NATS): a ControlNet from `--controlnet-dir` changes the
//! image, a steered job batched with a plain one makes the image it makes alone, the ControlNet
//! is loaded once and then hit, and a job naming a ControlNet that is not there fails alone.
mod common;

use common::{engine_job, job, write_model_and_controlnet};
use diffmesh_denoiser::engine::{spawn_engine, EngineConfig, EngineEvent};
use diffmesh_denoiser::metrics::DenoiserMetrics;
use diffmesh_denoiser::model::EngineModel;
use diffmesh_model::tch::{Device, Kind};
use diffmesh_shared::wire::messages::{ControlNetStepCost, DenoiseJob, StepSample};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::Span;

/// What [`run`] saw.
struct Ran {
    images: HashMap<String, Vec<u8>>,
    failures: HashMap<String, String>,
    steps: Vec<StepSample>,
    controlnet_step_s: Vec<ControlNetStepCost>,
}

/// Run `batches` one after another on one engine; returns images and failure messages by id,
/// the engine's step samples and its per-ControlNet step costs.
async fn run(dir: &Path, batches: Vec<Vec<DenoiseJob>>, metrics: Option<DenoiserMetrics>) -> Ran {
    let mut model =
        EngineModel::load(dir, Device::Cpu, Kind::Float, "tiny".into(), Some(64)).unwrap();
    model.controlnet_dir = Some(dir.join("controlnets"));
    let config = EngineConfig {
        max_batch: 4,
        controlnet_cache: 1,
        ..Default::default()
    };
    let (tx, mut events) = mpsc::channel(256);
    let (engine, drained) = spawn_engine(model, config, 16, tx, metrics).unwrap();
    let (mut images, mut failures) = (HashMap::new(), HashMap::new());
    for batch in batches {
        let mut left: Vec<String> = batch.iter().map(|j| j.job_id.clone()).collect();
        for j in batch {
            engine.submit(engine_job(j), Span::none()).await.unwrap();
        }
        while !left.is_empty() {
            let event = tokio::time::timeout(Duration::from_secs(120), events.recv())
                .await
                .expect("engine stalled")
                .unwrap();
            match event {
                EngineEvent::Finished {
                    job,
                    images: mut imgs,
                    ..
                } => {
                    left.retain(|id| id != &job.job_id);
                    images.insert(job.job_id, imgs.remove(0));
                }
                EngineEvent::Failed { job, error, .. } => {
                    left.retain(|id| id != &job.job_id);
                    // With the error type the job fails with (the gateway's status follows it).
                    failures.insert(job.job_id, format!("{error} [{}]", error.error_type()));
                }
                _ => {}
            }
        }
    }
    let steps = engine.take_step_samples();
    let controlnet_step_s = engine.status().controlnet_step_s;
    drop(engine);
    drained.wait().await;
    Ran {
        images,
        failures,
        steps,
        controlnet_step_s,
    }
}

#[tokio::test]
async fn steered_generations_in_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    write_model_and_controlnet(dir.path());
    let registry = prometheus::Registry::new();
    let metrics = DenoiserMetrics::new(&registry).unwrap();
    let Ran {
        images,
        failures,
        steps,
        controlnet_step_s,
    } = run(
        dir.path(),
        vec![
            vec![job("alone", Some("rand"))],
            vec![
                job("plain", None),
                job("batched", Some("rand")),
                job("missing", Some("nope")),
            ],
        ],
        Some(metrics.clone()),
    )
    .await;
    let diff = |a: &str, b: &str| {
        images[a]
            .iter()
            .zip(&images[b])
            .map(|(x, y)| x.abs_diff(*y))
            .max()
            .unwrap()
    };
    assert!(diff("alone", "plain") > 8, "the ControlNet changed nothing");
    assert!(
        diff("alone", "batched") <= 1,
        "batching changed a steered image"
    );
    // Held neither here nor by a worker: unavailable (503, a retry may be placed where it
    // is), not the model's fault.
    let error = &failures["missing"];
    assert!(
        error.contains("controlnet.name") && error.contains("nope"),
        "{error}"
    );
    assert!(error.ends_with("[service_unavailable]"), "{error}");
    assert_eq!(failures.len(), 1, "{failures:?}");
    let lookups = |outcome: &str| {
        metrics
            .controlnet
            .lookups
            .with_label_values(&[outcome])
            .get()
    };
    // Loaded once, then hit at every other step of both steered jobs (3 steps each).
    assert_eq!((lookups("loaded"), lookups("hit")), (1, 5));
    // The ControlNet's time on the step loop is reported per job and step and per ControlNet
    // (for the router's cost model); plain jobs report none.
    let control: Vec<(u32, f64)> = steps
        .iter()
        .flat_map(|s| s.jobs.iter().map(|j| (j.rows, j.control_s)))
        .collect();
    assert_eq!(
        control.iter().filter(|(_, c)| *c > 0.0).count(),
        6,
        "{control:?}"
    );
    let names: Vec<&str> = controlnet_step_s.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["rand"]);
    assert!(controlnet_step_s[0].seconds > 0.0);
    let gauge = metrics
        .controlnet
        .step_seconds
        .with_label_values(&["rand"])
        .get();
    // (The status snapshot may be a step older than the gauge.)
    assert!(gauge > 0.0, "{gauge}");
}
