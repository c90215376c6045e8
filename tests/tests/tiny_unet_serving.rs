//! The tiny trained UNet (`weights/tiny-unet`, an SD pipeline over the tiny model's text encoder
//! and pixel codec) served on denoiser `unet` beside the tiny Flux model on `tiny`:
//! `GET /v1/models` lists both; a generation is the pipeline's own image for the seed and draws
//! what a held-out prompt asks (read back by the tiny model's checker); a rendered scene captured
//! as a template takes a mask-aware edit to another shape that keeps every unmasked pixel and,
//! over the mask's box, is close to the same edit computed in full (SSIM).
use std::path::{Path, PathBuf};

use diffmesh_model::quality::{psnr, ssim};
use diffmesh_model::stable_diffusion::{SdPipeline, SdRequest};
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::tiny::check::{detect, judge};
use diffmesh_model::tiny::data::{render_rgb, Generator, SceneKey, Split};
use diffmesh_model::tiny::unet_eval::{next_shape, object_box_in_tokens};
use diffmesh_tests::harness::{generate, model_card, models_once_listed, post_form};
use diffmesh_tests::images::{changed_inside_only, decode_b64_images, png_bytes, rect_mask};
use diffmesh_tests::mesh::MeshBuilder;
use diffmesh_tests::sd;
use image::{DynamicImage, RgbImage};
use reqwest::multipart::{Form, Part};
use serde_json::json;

const UNET: &str = "tiny-unet";
const DENOISERS: [&str; 2] = ["tiny", "unet"];
const STEPS: usize = 20;
const GUIDANCE: f64 = 4.0;
const SIDE: i64 = 64;

fn unet_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny-unet")
}

fn request(prompt: &str) -> SdRequest {
    SdRequest {
        prompt: prompt.into(),
        negative_prompt: None,
        height: SIDE,
        width: SIDE,
        steps: STEPS,
        guidance_scale: GUIDANCE,
        scheduler: None,
    }
}

/// RGB8 `[H][W][3]` as `[1, 3, H, W]` in `[0, 1]`.
fn unit_tensor(rgb: &[u8]) -> Tensor {
    Tensor::from_slice(rgb)
        .view([SIDE, SIDE, 3])
        .permute([2, 0, 1])
        .to_kind(Kind::Float)
        .f_div_scalar(255.0)
        .unwrap()
        .unsqueeze(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tiny_unet_serves_generations_and_mask_aware_edits_beside_the_tiny_flux_model() {
    let dir = unet_dir();
    let pipe = SdPipeline::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let mesh = MeshBuilder::new()
        .denoisers(&DENOISERS)
        .denoiser(move |id, c| {
            if id == "unet" {
                c.model_dir = dir.clone();
                c.model_id = Some(UNET.into());
                // Exact caches: the served edit must be the in-process mask-aware one.
                c.cache_dtype = "f32".into();
            }
        })
        .gateway(|g| g.default_model = Some("tiny".into()))
        .start()
        .await;
    let http = reqwest::Client::new();

    let models = models_once_listed(&http, &mesh.url("/v1/models"), DENOISERS.len()).await;
    let card = model_card(&models, UNET);
    assert_eq!(card["family"], "sd", "{models}");
    assert_eq!(card["default_size"], "64x64", "{models}");
    assert_eq!(card["token_pixels"], 8, "{models}");

    // A held-out prompt (never trained on): the pipeline's own image, drawn as asked.
    let key = Split::new().held_out[0];
    let seed = 1;
    let body = json!({"prompt": key.prompt(), "model": UNET, "seed": seed,
        "num_inference_steps": STEPS, "guidance_scale": GUIDANCE});
    let (status, out, pixels) = generate(&http, &mesh.url("/v1/images/generations"), &body).await;
    assert_eq!(status, 200, "{out}");
    let own = pipe
        .prepare(
            &request(&key.prompt()),
            &sd::latents(&pipe, seed, SIDE, SIDE),
            None,
        )
        .unwrap();
    assert_eq!(
        pixels,
        sd::to_rgb(&sd::run_alone(&pipe, own)),
        "the mesh's image is not the pipeline's own for the seed"
    );
    let verdict = judge(&detect(&pixels).unwrap(), &key);
    assert!(verdict.all(), "{:?} for \"{}\"", verdict, key.prompt());

    // A rendered scene as a template, edited to another shape inside the object's box.
    let key = Split::new().held_out[1];
    let scene = Generator::new(vec![key], 4).next_scene();
    let rgb = render_rgb(&scene);
    let tmpl = DynamicImage::ImageRgb8(RgbImage::from_raw(64, 64, rgb.clone()).unwrap());
    let template_seed = 3u64;
    let form = Form::new()
        .part("image", Part::bytes(png_bytes(&tmpl)).file_name("t.png"))
        .text("prompt", key.prompt())
        .text("model", UNET)
        .text("seed", template_seed.to_string())
        .text("num_inference_steps", STEPS.to_string())
        .text("guidance_scale", GUIDANCE.to_string());
    let (status, created) = post_form(&http, &mesh.url("/v1/templates"), form).await;
    assert_eq!(status, 201, "{created}");
    // The object's box (+ 4 px), widened to whole tokens (the pixels a latent pixel of the
    // UNet's coarsest level covers), so the mask the mesh applies is this one.
    let token = card["token_pixels"].as_u64().unwrap() as usize;
    let (x0, y0, x1, y1) = object_box_in_tokens(&scene, 4.0, token);
    let (x0, y0, x1, y1) = (x0 as u32, y0 as u32, x1 as u32, y1 as u32);
    let next = next_shape(key.shape);
    let edit_prompt = SceneKey { shape: next, ..key }.prompt();
    let edit_seed = 9u64;
    let form = Form::new()
        .text("template_id", created["id"].as_str().unwrap().to_string())
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(64, 64, x0, y0, x1, y1))).file_name("m.png"),
        )
        .text("prompt", edit_prompt.clone())
        .text("seed", edit_seed.to_string());
    let (status, body) = post_form(&http, &mesh.url("/v1/images/edits"), form).await;
    assert_eq!(status, 200, "{body}");
    let edited = decode_b64_images(&body).unwrap().remove(0).to_rgb8();
    let original = tmpl.to_rgb8();
    let changed = changed_inside_only(&edited, &original, (x0, y0, x1, y1), "");
    assert!(changed > 0, "the masked region was not repainted");

    // The same edit in full compute, and mask-aware in process.
    let image = unit_tensor(&rgb)
        .f_mul_scalar(2.0)
        .unwrap()
        .f_sub_scalar(1.0)
        .unwrap();
    let rect = (i64::from(x0), i64::from(y0), i64::from(x1), i64::from(y1));
    let (full, aware) = sd::template_edit(
        &pipe,
        &image,
        rect,
        (&request(&key.prompt()), template_seed),
        (&request(&edit_prompt), edit_seed),
    );
    let in_process = sd::to_rgb(&aware);
    let differing = edited
        .as_raw()
        .iter()
        .zip(&in_process)
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(
        differing, 0,
        "{differing} bytes of the served edit are not the in-process mask-aware edit's"
    );
    let boxed = |t: &Tensor| sd::crop(t, rect);
    let served = unit_tensor(edited.as_raw());
    let score = ssim(&boxed(&served), &boxed(&full)).unwrap();
    let db = psnr(&boxed(&served), &boxed(&full)).unwrap();
    eprintln!("tiny UNet, mask-aware edit vs full compute over the mask's box: SSIM {score:.4}, PSNR {db:.1} dB");
    assert!(score >= 0.90, "SSIM {score:.4} below 0.90");
}
