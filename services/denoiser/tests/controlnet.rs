//! Steered generations in the engine (no NATS): a ControlNet from `--controlnet-dir` changes the
//! image, a steered job batched with a plain one makes the image it makes alone, the ControlNet
//! is loaded once and then hit, and a job naming a ControlNet that is not there fails alone.
use diffmesh_denoiser::engine::{spawn_engine, EngineConfig, EngineEvent, EngineJob};
use diffmesh_denoiser::metrics::DenoiserMetrics;
use diffmesh_denoiser::model::EngineModel;
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use diffmesh_model::tiny::controlnet_train::{controlnet_from_transformer, save_controlnet};
use diffmesh_model::tiny::model::TinyModel;
use diffmesh_shared::controlnet::ControlNetRef;
use diffmesh_shared::messages::DenoiseJob;
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::Span;

/// A random tiny model in `dir` and a random ControlNet of it in `dir/controlnets/rand`.
fn write_model_and_controlnet(dir: &Path) {
    let m = TinyModel::random_for_tests(11, Device::Cpu).unwrap();
    m.save(dir, None).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = controlnet_from_transformer(&vs, &m.transformer, &m.transformer_vs, 1, 1).unwrap();
    tch::manual_seed(3);
    tch::no_grad(|| {
        for (name, mut v) in vs.variables() {
            if name.starts_with("controlnet_") {
                v.copy_(&(Tensor::randn(v.size(), (Kind::Float, Device::Cpu)) * 0.05));
            }
        }
    });
    save_controlnet(&net, &vs, &dir.join("controlnets").join("rand")).unwrap();
}

fn job(id: &str, controlnet: Option<&str>) -> DenoiseJob {
    let mut j = diffmesh_shared::testing::generation_job(id, "a red circle", 5, 3);
    j.params.controlnet = controlnet.map(|name| ControlNetRef {
        name: name.into(),
        scale: 1.0,
    });
    j
}

/// A left-half-white control image at the model resolution.
fn control_rgb() -> Vec<u8> {
    (0..64 * 64)
        .flat_map(|i| if i % 64 < 32 { [255u8; 3] } else { [0; 3] })
        .collect()
}

fn engine_job(j: DenoiseJob) -> EngineJob {
    let steered = j.params.controlnet.is_some();
    let mut e = EngineJob::new(j, None);
    e.control_rgb = steered.then(control_rgb);
    e
}

/// Run `batches` one after another on one engine; returns images and failure messages by id.
async fn run(
    dir: &Path,
    batches: Vec<Vec<DenoiseJob>>,
    metrics: Option<DenoiserMetrics>,
) -> (HashMap<String, Vec<u8>>, HashMap<String, String>) {
    let mut model = EngineModel::load(dir, Device::Cpu, Kind::Float, "tiny".into(), 64).unwrap();
    model.controlnet_dir = Some(dir.join("controlnets"));
    let config = EngineConfig {
        max_batch: 4,
        controlnet_cache: 1,
        ..Default::default()
    };
    let (tx, mut events) = mpsc::channel(256);
    let (engine, thread) = spawn_engine(model, config, 16, tx, metrics).unwrap();
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
                    failures.insert(job.job_id, error.to_string());
                }
                _ => {}
            }
        }
    }
    drop(engine);
    thread.join().await;
    (images, failures)
}

#[tokio::test]
async fn steered_generations_in_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    write_model_and_controlnet(dir.path());
    let registry = prometheus::Registry::new();
    let metrics = DenoiserMetrics::new(&registry).unwrap();
    let (images, failures) = run(
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
    let error = &failures["missing"];
    assert!(
        error.contains("controlnet.name") && error.contains("nope"),
        "{error}"
    );
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
}
