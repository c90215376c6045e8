//! Several models in one mesh: the tiny model (denoiser `tiny`, the gateway's default) beside
//! reduced FLUX.1-dev and FLUX.1-Fill directories with random weights in the diffusers layout
//! (denoisers `flux` and `fill`, written by python/parity/gen_flux_pipelines.py).
//! `GET /v1/models` lists them with what they announce; each request lands on a denoiser holding
//! its model, at the resolution the model announced (no codec flag set); the FLUX.1 image is the
//! pipeline's own for the same prompt and seed; an unknown `model` is a 400 naming the field, as
//! is a generation on the Fill model; a template captured with either FLUX.1 model takes
//! mask-aware edits on it (unmasked pixels exact) and refuses edits naming another model.
use std::path::{Path, PathBuf};

use diffmesh_model::model_dir::LoadedModel;
use diffmesh_model::pipeline::{text_to_image, GenerateOptions, GenerationRequest};
use diffmesh_model::tch::{Device, Kind};
use diffmesh_tests::harness::{
    generate, metric_sample, models_once_listed, post_form, scrape_metrics,
};
use diffmesh_tests::images::{
    changed_inside_only, decode_b64_images, png_bytes, rect_mask, template,
};
use diffmesh_tests::mesh::{MeshBuilder, TestMesh};
use image::GenericImageView;
use reqwest::multipart::{Form, Part};
use serde_json::json;

const FLUX: &str = "flux-dev";
const FILL: &str = "flux-fill";
const DENOISERS: [&str; 3] = ["tiny", "flux", "fill"];
const PROMPT: &str = "a photo of a cat, sitting on a red sofa";
const STEPS: usize = 3;
const SEED: u64 = 5;
const DONE: &str = "diffmesh_denoiser_jobs_done_total";
const CAPTURES: &str = "diffmesh_denoiser_capture_duration_seconds_count";
const MASK_AWARE: &str = "diffmesh_denoiser_step_rows_total{mode=\"mask_aware\"}";

/// The reduced FLUX.1 directories (`dev` and `fill`).
fn flux_fixture() -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("several-models-flux");
    diffmesh_shared::testing::parity_fixture("gen_flux_pipelines.py", &out)
}

/// The pipeline's own image for the test's prompt and seed (RGB u8, 64x64).
fn reference_pixels(dir: &Path) -> Vec<u8> {
    let model = LoadedModel::load(dir, Device::Cpu, Kind::Float).unwrap();
    let opts = GenerateOptions {
        height: 64,
        width: 64,
        steps: STEPS,
        guidance_scale: 1.0,
        ..GenerateOptions::default()
    };
    let request = GenerationRequest {
        prompt: PROMPT.into(),
        seed: SEED,
    };
    let out = text_to_image(&model.pipeline(), &[request], &opts, None).unwrap();
    diffmesh_denoiser::model::tensor_to_rgb(&out.images).unwrap()
}

/// `series` on each denoiser, in `DENOISERS` order.
async fn sample(mesh: &TestMesh, series: &str) -> [f64; 3] {
    let mut values = [0.0; 3];
    for (i, id) in DENOISERS.into_iter().enumerate() {
        let page = scrape_metrics(mesh.denoiser(id).addrs.health)
            .await
            .unwrap();
        values[i] = metric_sample(&page, series);
    }
    values
}

/// What `series` grew by on each denoiser since `before`.
async fn grown(mesh: &TestMesh, series: &str, before: [f64; 3]) -> [f64; 3] {
    let now = sample(mesh, series).await;
    [now[0] - before[0], now[1] - before[1], now[2] - before[2]]
}

/// Register a template with `model`, edit it by `template_id` (the edit names no model: the
/// template's), check the unmasked pixels are the template's; an edit naming another model is
/// refused. Returns what the capture and the edit ran on each denoiser: (captures, done jobs,
/// mask-aware rows).
async fn template_edit(mesh: &TestMesh, http: &reqwest::Client, model: &str) -> [[f64; 3]; 3] {
    let series = [CAPTURES, DONE, MASK_AWARE];
    let mut before = [[0.0; 3]; 3];
    for (b, s) in before.iter_mut().zip(series) {
        *b = sample(mesh, s).await;
    }
    let (w, h) = (80, 48);
    let image = template(w, h);
    let form = Form::new()
        .part("image", Part::bytes(png_bytes(&image)).file_name("t.png"))
        .text("prompt", "a sofa")
        .text("model", model.to_string())
        .text("seed", "3")
        .text("num_inference_steps", STEPS.to_string())
        .text("guidance_scale", "1.0");
    let (status, created) = post_form(http, &mesh.url("/v1/templates"), form).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["model"], model, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let (x0, y0, x1, y1) = (16, 8, 48, 32);
    let edit = |named: Option<&str>| {
        let mut form = Form::new()
            .text("template_id", id.clone())
            .part(
                "mask",
                Part::bytes(png_bytes(&rect_mask(w, h, x0, y0, x1, y1))).file_name("m.png"),
            )
            .text("prompt", "a cat on a sofa")
            .text("seed", "9");
        if let Some(m) = named {
            form = form.text("model", m.to_string());
        }
        form
    };
    let (status, body) = post_form(http, &mesh.url("/v1/images/edits"), edit(None)).await;
    assert_eq!(status, 200, "{model}: {body}");
    let out = decode_b64_images(&body).unwrap().remove(0);
    assert_eq!(out.dimensions(), (w, h));
    let (out, tmpl) = (out.to_rgb8(), image.to_rgb8());
    let changed = changed_inside_only(&out, &tmpl, (x0, y0, x1, y1), &format!("{model}: "));
    assert!(changed > 0, "{model}: the masked region was not repainted");
    let (status, body) = post_form(http, &mesh.url("/v1/images/edits"), edit(Some("tiny"))).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["field"], "model", "{body}");
    let mut ran = [[0.0; 3]; 3];
    for ((r, s), b) in ran.iter_mut().zip(series).zip(before) {
        *r = grown(mesh, s, b).await;
    }
    ran
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_models_serve_side_by_side_each_on_its_own_denoisers() {
    let fixture = flux_fixture();
    let want = reference_pixels(&fixture.join("dev"));
    let dirs = fixture.clone();
    let mesh = MeshBuilder::new()
        .denoisers(&DENOISERS)
        .denoiser(move |id, c| match id {
            "flux" => {
                c.model_dir = dirs.join("dev");
                c.model_id = Some(FLUX.into());
            }
            "fill" => {
                c.model_dir = dirs.join("fill");
                c.model_id = Some(FILL.into());
            }
            _ => {}
        })
        .gateway(|g| g.default_model = Some("tiny".into()))
        .start()
        .await;
    let http = reqwest::Client::new();

    let models = models_once_listed(&http, &mesh.url("/v1/models"), DENOISERS.len()).await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [FLUX, FILL, "tiny"], "{models}");
    let [flux, fill, tiny] = [0, 1, 2].map(|i| &models["data"][i]);
    assert_eq!(flux["denoisers"], json!(["flux"]), "{models}");
    assert_eq!(flux["family"], "flux.1", "{models}");
    assert_eq!(flux["pipeline"], "FluxPipeline", "{models}");
    assert_eq!(flux["resolution"], "scaled", "{models}");
    assert_eq!(fill["pipeline"], "FluxFillPipeline", "{models}");
    assert!(
        fill["features"]
            .as_array()
            .unwrap()
            .contains(&json!("fill")),
        "{models}"
    );
    assert_eq!(tiny["family"], "tiny", "{models}");
    assert_eq!(tiny["resolution"], "fixed", "{models}");

    // An unknown model names the field and the models served; a Fill model takes no generation.
    let url = mesh.url("/v1/images/generations");
    let (status, body, _) = generate(&http, &url, json!({"prompt": "x", "model": "sdxl"})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["field"], "model", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(FLUX) && message.contains("tiny"),
        "{message}"
    );
    let (status, body, _) = generate(&http, &url, json!({"prompt": "x", "model": FILL})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["field"], "model", "{body}");

    // The FLUX.1 model: its own image, on its own denoiser, at the size asked for.
    let before = sample(&mesh, DONE).await;
    let (status, body, got) = generate(
        &http,
        &url,
        json!({"prompt": PROMPT, "model": FLUX, "size": "64x64", "seed": SEED,
               "num_inference_steps": STEPS, "guidance_scale": 1.0}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(got, want, "the mesh's pixels are the FLUX.1 pipeline's");
    assert_eq!(grown(&mesh, DONE, before).await, [0.0, 1.0, 0.0]);

    // No model: the default (tiny), on the tiny denoiser, at its 64x64 stretched to the size.
    let before = sample(&mesh, DONE).await;
    let (status, body, pixels) = generate(
        &http,
        &url,
        json!({"prompt": "a red circle on the left", "size": "48x40", "num_inference_steps": 2}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(pixels.len(), 48 * 40 * 3);
    assert_eq!(grown(&mesh, DONE, before).await, [1.0, 0.0, 0.0]);

    // Templates of each FLUX.1 model: captured and edited (mask-aware, every step) on it alone.
    let steps = STEPS as f64;
    let [captures, done, mask_aware] = template_edit(&mesh, &http, FLUX).await;
    assert_eq!(captures, [0.0, 1.0, 0.0]);
    assert_eq!(done, [0.0, 1.0, 0.0]);
    assert_eq!(mask_aware, [0.0, steps, 0.0]);
    let [captures, done, mask_aware] = template_edit(&mesh, &http, FILL).await;
    assert_eq!(captures, [0.0, 0.0, 1.0]);
    assert_eq!(done, [0.0, 0.0, 1.0]);
    assert_eq!(mask_aware, [0.0, 0.0, steps]);
}
