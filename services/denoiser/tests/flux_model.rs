//! The denoiser's engine serving a FLUX.1 directory in the layout people download (reduced, random
//! weights, written by diffusers' `save_pretrained`: python/parity/gen_flux_pipelines.py), its
//! prompts encoded by the prompt stage: the image is the pipeline's own for the same prompt and
//! seed. A FLUX.1-Fill directory is refused at load, naming the pipeline.
use diffmesh_denoiser::engine::{spawn_engine, EngineConfig, EngineEvent, EngineJob};
use diffmesh_denoiser::model::{job_prompts, tensor_to_rgb, EngineModel};
use diffmesh_denoiser::prompt_stage::{split_text_encoder, PromptSlot, PromptStageHandle};
use diffmesh_model::model_dir::LoadedModel;
use diffmesh_model::pipeline::{text_to_image, GenerateOptions, GenerationRequest};
use diffmesh_model::tch::{Device, Kind};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::Span;

const STEPS: u32 = 3;
const PROMPT: &str = "a photo of a cat, sitting on a red sofa";

/// The reduced FLUX.1 directories (the script the model crate's parity test runs).
fn fixture() -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("denoiser-flux-model");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let python = std::env::var("DIFFMESH_PYTHON")
        .unwrap_or_else(|_| "/root/.cache/diffmesh/venv/bin/python".into());
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/parity/gen_flux_pipelines.py");
    let status = Command::new(&python)
        .arg(&script)
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {python} (set DIFFMESH_PYTHON): {e}"));
    assert!(status.success(), "{} failed: {status}", script.display());
    out
}

#[tokio::test]
async fn the_engine_serves_a_flux_directory_with_its_prompt_stage() {
    let dir = fixture();
    let dev = dir.join("dev");

    let reference = LoadedModel::load(&dev, Device::Cpu, Kind::Float).unwrap();
    let opts = GenerateOptions {
        height: 64,
        width: 64,
        steps: STEPS as usize,
        guidance_scale: 1.0,
        ..GenerateOptions::default()
    };
    let request = GenerationRequest {
        prompt: PROMPT.into(),
        seed: 5,
    };
    let out = text_to_image(&reference.pipeline(), &[request], &opts, None).unwrap();
    let want = tensor_to_rgb(&out.images).unwrap();
    assert!(
        want.iter().min() < want.iter().max(),
        "a flat reference image would prove nothing"
    );

    let mut model = EngineModel::load(&dev, Device::Cpu, Kind::Float, "dev".into(), 64).unwrap();
    let stage = PromptStageHandle::start(split_text_encoder(&mut model), "dev".into(), 1 << 24);
    let (tx, mut events) = mpsc::channel(256);
    let (engine, _drained) = spawn_engine(model, EngineConfig::default(), 16, tx, None).unwrap();
    let job = diffmesh_shared::testing::generation_job("flux", PROMPT, 5, STEPS);
    let slot = PromptSlot::default();
    let mut ej = EngineJob::new(job.clone(), None);
    ej.prompts = Some(slot.clone());
    engine.submit(ej, Span::none()).await.unwrap();
    stage.encode(job_prompts(&job), slot);
    let got = loop {
        let event = tokio::time::timeout(Duration::from_secs(120), events.recv())
            .await
            .expect("engine stalled")
            .unwrap();
        match event {
            EngineEvent::Finished { mut images, .. } => break images.remove(0),
            EngineEvent::Failed { error, .. } => panic!("the FLUX.1 job failed: {error}"),
            _ => {}
        }
    };
    assert_eq!(got.len(), 64 * 64 * 3);
    assert_eq!(got, want, "the engine's pixels are the pipeline's");

    let err = EngineModel::load(
        &dir.join("fill"),
        Device::Cpu,
        Kind::Float,
        "fill".into(),
        64,
    )
    .err()
    .expect("a Fill directory is refused")
    .to_string();
    assert!(err.contains("FluxFillPipeline"), "{err}");
}
