//! The denoiser's engine serving a FLUX.1 directory in the layout people download (reduced, random
//! weights, written by diffusers' `save_pretrained`: python/parity/gen_flux_pipelines.py), its
//! prompts encoded by the prompt stage: the image is the pipeline's own for the same prompt and
//! seed. A FLUX.1-Fill directory loads and says so in its announcement.
use diffmesh_denoiser::engine::{spawn_engine, EngineConfig, EngineEvent, EngineJob};
use diffmesh_denoiser::model::{job_prompts, tensor_to_rgb, EngineModel};
use diffmesh_denoiser::prompt_stage::{PromptSlot, PromptStageHandle};
use diffmesh_model::model_dir::LoadedModel;
use diffmesh_model::pipeline::{text_to_image, GenerateOptions, GenerationRequest};
use diffmesh_model::tch::{Device, Kind};
use diffmesh_shared::wire::models::Resolution;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::Span;

const STEPS: u32 = 3;
const PROMPT: &str = "a photo of a cat, sitting on a red sofa";

/// The reduced FLUX.1 directories (the script the model crate's parity test runs).
fn fixture() -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("denoiser-flux-model");
    diffmesh_shared::testing::parity_fixture("gen_flux_pipelines.py", &out)
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

    let mut model =
        EngineModel::load(&dev, Device::Cpu, Kind::Float, "dev".into(), Some(64)).unwrap();
    // What heartbeats announce: the reduced VAE halves each side, so a token is 4 pixels; the
    // resolution follows the input; the text side is the pipeline's T5 length.
    let card = &model.card;
    assert_eq!(
        (
            card.id.as_str(),
            card.family.as_str(),
            card.pipeline.as_str()
        ),
        ("dev", "flux.1", "FluxPipeline")
    );
    assert_eq!(card.geometry.token_pixels, 4);
    assert!(matches!(
        card.geometry.resolution,
        Resolution::Scaled { .. }
    ));
    assert_eq!(card.geometry.default_width, 64);
    assert!(card.features.edit && !card.features.fill);
    assert!(card.features.max_sequence_length > 0);
    let stage = PromptStageHandle::start(model.split_text_encoder(), "dev".into(), 1 << 24);
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

    // A Fill directory loads and announces itself as one (its edits run in the mesh test).
    let fill = EngineModel::load(
        &dir.join("fill"),
        Device::Cpu,
        Kind::Float,
        "fill".into(),
        None,
    )
    .expect("a Fill directory loads");
    assert_eq!(fill.card.pipeline, "FluxFillPipeline");
    assert!(fill.card.features.fill && fill.card.features.edit);
    assert_eq!(
        fill.card.geometry.default_width, 1024,
        "FLUX.1's default size"
    );
}
