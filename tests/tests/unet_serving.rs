//! A UNet model in the mesh: a reduced SD 2.1 pipeline with random weights in the diffusers
//! layout (python/parity/gen_sd21_pipeline.py) on denoiser `sd`, beside the tiny Flux model on
//! denoiser `tiny`. `GET /v1/models` lists both with what they announce; a generation naming
//! the SD model is the pipeline's own image for the seed; a template captured with it takes
//! mask-aware edits (unmasked pixels exact, the masked region repainted, close to the same edit
//! computed in full: SSIM over the mask's box), stored in the cachestore like Flux captures.
use std::path::{Path, PathBuf};
use std::time::Duration;

use diffmesh_model::pipeline::noise::seeded_noise;
use diffmesh_model::quality::{psnr, ssim};
use diffmesh_model::stable_diffusion::inpaint::InpaintInputs;
use diffmesh_model::stable_diffusion::stepper::SdState;
use diffmesh_model::stable_diffusion::{SdPipeline, SdRequest};
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_tests::harness::{generate, metric_sample, post_form, scrape_metrics};
use diffmesh_tests::images::{decode_b64_images, png_bytes, rect_mask, template};
use diffmesh_tests::mesh::{MeshBuilder, TestMesh};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};

const SD: &str = "sd21-tiny";
const DENOISERS: [&str; 2] = ["tiny", "sd"];
const PROMPT: &str = "a photo of a cat, sitting on a red sofa";
const STEPS: usize = 3;
const SEED: u64 = 5;
const CAPTURES: &str = "diffmesh_denoiser_capture_duration_seconds_count";
const MASK_AWARE: &str = "diffmesh_denoiser_step_rows_total{mode=\"mask_aware\"}";

fn sd_fixture() -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("unet-serving-sd21");
    diffmesh_shared::testing::parity_fixture("gen_sd21_pipeline.py", &out).join("sd21")
}

/// `state` stepped to its end alone.
fn finish(pipe: &SdPipeline, state: &mut SdState) {
    while !state.done() {
        let mut none = |_: usize, _: usize, _: &[i64]| -> diffmesh_model::Result<Tensor> {
            unreachable!("the checkpoint's DDIM draws no noise")
        };
        pipe.step_batch(&mut [state], &mut none).unwrap();
    }
}

/// `state` stepped to its end alone and decoded (`[1, 3, H, W]` in [0, 1]).
fn run_alone(pipe: &SdPipeline, mut state: SdState) -> Tensor {
    finish(pipe, &mut state);
    pipe.decode(&state).unwrap()
}

fn to_rgb(image01: &Tensor) -> Vec<u8> {
    let signed = image01
        .f_mul_scalar(2.0)
        .unwrap()
        .f_sub_scalar(1.0)
        .unwrap();
    diffmesh_denoiser::model::tensor_to_rgb(&signed).unwrap()
}

fn latents(pipe: &SdPipeline, seed: u64, height: i64, width: i64) -> Tensor {
    let f = pipe.vae.config.downscale_factor();
    let shape = [1, pipe.vae.config.latent_channels, height / f, width / f];
    seeded_noise(seed, &shape, Device::Cpu, Kind::Float).unwrap()
}

fn request(prompt: &str, height: i64, width: i64, guidance: f64) -> SdRequest {
    SdRequest {
        prompt: prompt.into(),
        negative_prompt: None,
        height,
        width,
        steps: STEPS,
        guidance_scale: guidance,
        scheduler: None,
    }
}

/// `GET /v1/models` once both models are listed.
async fn all_models(mesh: &TestMesh, http: &reqwest::Client) -> Value {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let body: Value = http
                .get(mesh.url("/v1/models"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if body["data"]
                .as_array()
                .is_some_and(|d| d.len() == DENOISERS.len())
            {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the gateway never listed both models")
}

async fn on_sd(mesh: &TestMesh, series: &str) -> f64 {
    let page = scrape_metrics(mesh.denoiser("sd").addrs.health)
        .await
        .unwrap();
    metric_sample(&page, series)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unet_model_serves_generations_and_mask_aware_template_edits_beside_flux() {
    let dir = sd_fixture();
    let pipe = SdPipeline::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let model_dir = dir.clone();
    let mesh = MeshBuilder::new()
        .denoisers(&DENOISERS)
        .denoiser(move |id, c| {
            if id == "sd" {
                c.model_dir = model_dir.clone();
                c.model_id = Some(SD.into());
                // Exact caches: the served edit must be the in-process mask-aware one.
                c.cache_dtype = "f32".into();
            }
        })
        .gateway(|g| g.default_model = Some("tiny".into()))
        .start()
        .await;
    let http = reqwest::Client::new();

    let models = all_models(&mesh, &http).await;
    let sd = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == SD)
        .unwrap_or_else(|| panic!("{SD} not listed: {models}"));
    assert_eq!(sd["denoisers"], json!(["sd"]), "{models}");
    assert_eq!(sd["family"], "sd", "{models}");
    assert_eq!(sd["pipeline"], "StableDiffusionPipeline", "{models}");
    assert!(models["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["id"] == "tiny"));

    // A generation at the model's default size (diffusers': unet.sample_size latents).
    assert_eq!(sd["default_size"], "32x32", "{models}");
    assert_eq!(sd["token_pixels"], 8, "{models}");
    let side = 32;
    let body = json!({"prompt": PROMPT, "model": SD, "seed": SEED,
        "num_inference_steps": STEPS, "guidance_scale": 4.0});
    let (status, out, pixels) = generate(&http, &mesh.url("/v1/images/generations"), &body).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(pixels.len(), (side * side * 3) as usize);
    let own = pipe
        .prepare(
            &request(PROMPT, side, side, 4.0),
            &latents(&pipe, SEED, side, side),
            None,
        )
        .unwrap();
    assert_eq!(
        pixels,
        to_rgb(&run_alone(&pipe, own)),
        "the mesh's image is not the pipeline's own for the seed"
    );

    // A template captured with the SD model, edited mask-aware.
    let (captures, mask_aware) = (on_sd(&mesh, CAPTURES).await, on_sd(&mesh, MASK_AWARE).await);
    let (w, h) = (80u32, 48u32);
    let tmpl = template(w, h);
    let (template_seed, guidance) = (3, 5.0);
    let form = Form::new()
        .part("image", Part::bytes(png_bytes(&tmpl)).file_name("t.png"))
        .text("prompt", "a sofa")
        .text("model", SD)
        .text("seed", template_seed.to_string())
        .text("num_inference_steps", STEPS.to_string())
        .text("guidance_scale", guidance.to_string());
    let (status, created) = post_form(&http, &mesh.url("/v1/templates"), form).await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let (x0, y0, x1, y1) = (16, 8, 48, 32);
    let (edit_prompt, edit_seed) = ("a cat on a sofa", 9u64);
    let form = Form::new()
        .text("template_id", id)
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(w, h, x0, y0, x1, y1))).file_name("m.png"),
        )
        .text("prompt", edit_prompt)
        .text("seed", edit_seed.to_string());
    let (status, body) = post_form(&http, &mesh.url("/v1/images/edits"), form).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        on_sd(&mesh, CAPTURES).await > captures,
        "no capture ran on the SD denoiser"
    );
    assert!(
        on_sd(&mesh, MASK_AWARE).await > mask_aware,
        "the edit did not run mask-aware"
    );
    let edited = decode_b64_images(&body).unwrap().remove(0).to_rgb8();
    assert_eq!(edited.dimensions(), (w, h));
    let original = tmpl.to_rgb8();
    let mut changed = 0;
    for (x, y, p) in edited.enumerate_pixels() {
        if (x0..x1).contains(&x) && (y0..y1).contains(&y) {
            changed += usize::from(p != original.get_pixel(x, y));
        } else {
            assert_eq!(
                p,
                original.get_pixel(x, y),
                "unmasked pixel ({x},{y}) differs"
            );
        }
    }
    assert!(changed > 0, "the masked region was not repainted");

    // The same edit in full compute: inpainting whose latents carry the template's noise
    // outside the mask, as the engine's.
    let (hh, ww) = (i64::from(h), i64::from(w));
    let image = Tensor::from_slice(original.as_raw())
        .view([hh, ww, 3])
        .permute([2, 0, 1])
        .to_kind(Kind::Float)
        .f_div_scalar(127.5)
        .unwrap()
        .f_sub_scalar(1.0)
        .unwrap()
        .unsqueeze(0);
    let mask = Tensor::zeros([1, 1, hh, ww], (Kind::Float, Device::Cpu));
    let _ = mask
        .narrow(2, i64::from(y0), i64::from(y1 - y0))
        .narrow(3, i64::from(x0), i64::from(x1 - x0))
        .fill_(1.0);
    let (noise, own) = (
        latents(&pipe, template_seed, hh, ww),
        latents(&pipe, edit_seed, hh, ww),
    );
    let m = mask.upsample_nearest2d([noise.size()[2], noise.size()[3]], None, None);
    let mixed = &noise + (&own - &noise) * &m;
    let inputs = InpaintInputs {
        image: &image,
        mask: &mask,
        strength: 1.0,
    };
    let full = pipe
        .prepare(
            &request(edit_prompt, hh, ww, guidance),
            &mixed,
            Some(&inputs),
        )
        .unwrap();
    let full = run_alone(&pipe, full);
    // The same edit mask-aware in process, on a capture made in process.
    let capture_request = SdRequest {
        negative_prompt: None,
        ..request("a sofa", hh, ww, guidance)
    };
    let mut capture = pipe
        .prepare_capture(&capture_request, &noise, &image, 1.0)
        .unwrap();
    finish(&pipe, &mut capture);
    let captured = std::sync::Arc::new(capture.into_template().unwrap());
    let masked = pipe
        .prepare_edit(
            &request(edit_prompt, hh, ww, guidance),
            &mixed,
            &inputs,
            captured,
        )
        .unwrap();
    let masked = run_alone(&pipe, masked);
    let boxed = |t: &Tensor| {
        t.narrow(2, i64::from(y0), i64::from(y1 - y0))
            .narrow(3, i64::from(x0), i64::from(x1 - x0))
    };
    let served = Tensor::from_slice(edited.as_raw())
        .view([hh, ww, 3])
        .permute([2, 0, 1])
        .to_kind(Kind::Float)
        .f_div_scalar(255.0)
        .unwrap()
        .unsqueeze(0);
    let in_process = to_rgb(&masked);
    for (x, y, p) in edited.enumerate_pixels() {
        if (x0..x1).contains(&x) && (y0..y1).contains(&y) {
            let at = ((y * w + x) * 3) as usize;
            assert_eq!(
                p.0[..],
                in_process[at..at + 3],
                "masked pixel ({x},{y}) is not the in-process mask-aware edit's"
            );
        }
    }
    let score = ssim(&boxed(&served), &boxed(&full)).unwrap();
    let db = psnr(&boxed(&served), &boxed(&full)).unwrap();
    eprintln!(
        "mask-aware edit vs full compute over the mask's box: SSIM {score:.4}, PSNR {db:.1} dB"
    );
    assert!(score >= 0.95, "SSIM {score:.4} below 0.95");
    // Random weights barely tell images apart by SSIM: full compute from the edit's own noise
    // alone (not the template's outside the mask) still scores 0.97 here, but 23.6 dB.
    assert!(db >= 26.0, "PSNR {db:.1} dB below 26");
}
