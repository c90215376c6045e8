//! A UNet model in the mesh: a reduced SD 2.1 pipeline with random weights in the diffusers
//! layout (python/parity/gen_sd21_pipeline.py) on denoiser `sd`, beside the tiny Flux model on
//! denoiser `tiny`. `GET /v1/models` lists both with what they announce; a generation naming
//! the SD model is the pipeline's own image for the seed; a template captured with it takes
//! mask-aware edits (unmasked pixels exact, the masked region repainted, close to the same edit
//! computed in full: SSIM over the mask's box), stored in the cachestore like Flux captures.
//! LoRAs registered at the gateway in diffusers' and kohya's UNet layouts patch the served
//! UNet: a generation with both is the pipeline's own image with both patched in, and a Flux
//! transformer's LoRA named for the SD model is a 400 naming it. Generations steered by the
//! ControlNets of the SD denoiser's `--controlnet-dir` (diffusers' `ControlNetModel`, random, fit
//! to the served UNet), one or two at once, are the pipeline's own steered images; a ControlNet
//! named for the Flux model is a 400 naming `controlnet.name`.
use std::path::Path;

use diffmesh_model::lora::{LoraPatcher, OriginalsOn, WeightedLora};
use diffmesh_model::quality::{psnr, ssim};
use diffmesh_model::stable_diffusion::text_lora::{TextLora, TextLoraPatchers};
use diffmesh_model::stable_diffusion::{SdPipeline, SdRequest};
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::unet::lora::{read_unet_lora_bytes, LoraTargets, UNetLora};
use diffmesh_model::unet::ControlNetModel;
use diffmesh_shared::wire::lora::write_f32_safetensors;
use diffmesh_tests::harness::{
    generate, metric_sample, model_card, models_once_listed, post_form, scrape_metrics,
};
use diffmesh_tests::images::{
    changed_inside_only, decode_b64_images, png_b64, png_bytes, rect_mask, template,
};
use diffmesh_tests::mesh::{MeshBuilder, TestMesh};
use diffmesh_tests::sd;
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};

const SD: &str = "sd21-tiny";
const DENOISERS: [&str; 2] = ["tiny", "sd"];
const PROMPT: &str = "a photo of a cat, sitting on a red sofa";
const STEPS: usize = 3;
const SEED: u64 = 5;
const CAPTURES: &str = "diffmesh_denoiser_capture_duration_seconds_count";
const MASK_AWARE: &str = "diffmesh_denoiser_step_rows_total{mode=\"mask_aware\"}";

/// The generation the steered tests ask for, at `side`, with the seed's latents.
fn steered_request(side: u32) -> (SdRequest, u64) {
    let s = i64::from(side);
    (request(PROMPT, s, s, 4.0), SEED)
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

async fn on_sd(mesh: &TestMesh, series: &str) -> f64 {
    let page = scrape_metrics(mesh.denoiser("sd").addrs.health)
        .await
        .unwrap();
    metric_sample(&page, series)
}

/// A rank-4 LoRA of every third attention projection of the pipeline's UNet, pseudo-random from
/// `seed`: in diffusers' keys (`unet.<module>.lora_A.weight`), or in kohya's
/// (`lora_unet_<module with _>.lora_down.weight`, an `alpha` of 2 each, and one text-encoder
/// key, which is left out).
fn unet_lora(pipe: &SdPipeline, kohya: bool, seed: u64) -> Vec<u8> {
    let vs = pipe
        .unet
        .var_store()
        .expect("a loaded UNet has its variables");
    let weights = vs.variables();
    let modules: Vec<String> = pipe
        .unet
        .linear_modules()
        .into_iter()
        .filter(|m| m.contains(".attn1.to_") || m.contains(".attn2.to_"))
        .step_by(3)
        .collect();
    assert!(modules.len() >= 4, "{modules:?}");
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.8
    };
    let rank = 4;
    let mut tensors = Vec::new();
    for module in &modules {
        let size = weights[&format!("{module}.weight")].size();
        let (out, inp) = (size[0] as usize, size[1] as usize);
        let (down, up) = if kohya {
            let name = format!("lora_unet_{}", module.replace('.', "_"));
            tensors.push((format!("{name}.alpha"), vec![], vec![2.0]));
            (
                format!("{name}.lora_down.weight"),
                format!("{name}.lora_up.weight"),
            )
        } else {
            (
                format!("unet.{module}.lora_A.weight"),
                format!("unet.{module}.lora_B.weight"),
            )
        };
        for (key, shape) in [(down, vec![rank, inp]), (up, vec![out, rank])] {
            let values = (0..shape.iter().product::<usize>())
                .map(|_| next())
                .collect();
            tensors.push((key, shape, values));
        }
    }
    if kohya {
        // The text encoder's too: square layers of its width (SD's cross-attention width).
        let width = pipe.unet.context_dim() as usize;
        for layer in ["0_self_attn_q_proj", "1_self_attn_out_proj"] {
            let name = format!("lora_te_text_model_encoder_layers_{layer}");
            tensors.push((format!("{name}.alpha"), vec![], vec![4.0]));
            for (role, shape) in [("down", vec![rank, width]), ("up", vec![width, rank])] {
                let values = (0..rank * width).map(|_| next()).collect();
                tensors.push((format!("{name}.lora_{role}.weight"), shape, values));
            }
        }
    }
    write_f32_safetensors(&tensors, None).unwrap()
}

/// Register a LoRA file; its record.
async fn register_lora(mesh: &TestMesh, http: &reqwest::Client, file: Vec<u8>) -> Value {
    let form = Form::new().part("weights", Part::bytes(file).file_name("l.safetensors"));
    let (status, record) = post_form(http, &mesh.url("/v1/loras"), form).await;
    assert_eq!(status, 201, "{record}");
    record
}

/// Generations steered by the SD denoiser's ControlNets are the pipeline's own steered images,
/// pixel for pixel, and not the plain one: one ControlNet (`controlnet`), and two at once
/// (`controlnets`, residuals summed). The ControlNet named for the Flux model, and both fields
/// at once, are refused at the gateway, naming the field.
async fn controlnets_steer_the_served_unet(
    mesh: &TestMesh,
    http: &reqwest::Client,
    pipe: &SdPipeline,
    controlnets: &Path,
    plain: &[u8],
) {
    let side = 32u32;
    let control = template(side, side);
    let second = rect_mask(side, side, 4, 6, 20, 28);
    let url = mesh.url("/v1/images/generations");
    let mut body = json!({"prompt": PROMPT, "model": SD, "seed": SEED,
        "num_inference_steps": STEPS, "guidance_scale": 4.0,
        "controlnet": {"name": "edges", "image": png_b64(&control), "scale": 0.8}});
    let loaded = "diffmesh_denoiser_controlnet_lookups_total{outcome=\"loaded\"}";
    let before = on_sd(mesh, loaded).await;
    let (status, out, one) = generate(http, &url, &body).await;
    assert_eq!(status, 200, "{out}");
    assert_ne!(one, plain, "the ControlNet did not steer");
    assert_eq!(on_sd(mesh, loaded).await, before + 1.0);
    let load = |name: &str| {
        ControlNetModel::load(&controlnets.join(name), Device::Cpu, Kind::Float).unwrap()
    };
    let (edges, depth) = (load("edges"), load("depth"));
    assert_eq!(
        one,
        sd::steered(pipe, &steered_request(side), &[(&control, 0.8, &edges)]),
        "the steered image is not the pipeline's own"
    );

    let both = json!({"prompt": PROMPT, "model": SD, "seed": SEED,
        "num_inference_steps": STEPS, "guidance_scale": 4.0,
        "controlnets": [{"name": "edges", "image": png_b64(&control), "scale": 0.7},
                        {"name": "depth", "image": png_b64(&second), "scale": 0.4}]});
    let (status, out, two) = generate(http, &url, &both).await;
    assert_eq!(status, 200, "{out}");
    assert_ne!(two, one);
    assert_eq!(
        two,
        sd::steered(
            pipe,
            &steered_request(side),
            &[(&control, 0.7, &edges), (&second, 0.4, &depth)]
        ),
        "the image steered by two ControlNets is not the pipeline's own"
    );

    let mut twice = both.clone();
    twice["controlnet"] = body["controlnet"].clone();
    let (status, out, _) = generate(http, &url, &twice).await;
    assert_eq!(
        (status, &out["error"]["param"]),
        (400, &json!("controlnets")),
        "{out}"
    );
    body["model"] = json!("tiny");
    let (status, out, _) = generate(http, &url, &body).await;
    assert_eq!(status, 400, "{out}");
    assert_eq!(out["error"]["param"], "controlnet.name", "{out}");
}

/// The same generation streamed with one partial image: a preview (the UNet's latents
/// projected) then the completed image, which is the plain answer's pixel for pixel.
async fn streamed_with_a_preview(mesh: &TestMesh, http: &reqwest::Client, plain: &[u8]) {
    let body = json!({"prompt": PROMPT, "model": SD, "seed": SEED,
        "num_inference_steps": STEPS, "guidance_scale": 4.0, "stream": true, "partial_images": 1});
    let r = http
        .post(mesh.url("/v1/images/generations"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "image_generation.partial_image",
            "image_generation.completed"
        ],
        "{text:.300}"
    );
    let completed = json!({"data": [{"b64_json": events[1]["b64_json"]}]});
    let image = decode_b64_images(&completed).unwrap().remove(0).to_rgb8();
    assert_eq!(
        image.into_raw(),
        plain,
        "the streamed image is not the plain one"
    );
}

/// LoRAs of both layouts on the SD model: the served image is the pipeline's own with both
/// patched in (and not the base image), and a transformer's LoRA is refused by name.
async fn loras_patch_the_served_unet(
    mesh: &TestMesh,
    http: &reqwest::Client,
    pipe: &SdPipeline,
    base: &[u8],
) {
    let files = [unet_lora(pipe, false, 7), unet_lora(pipe, true, 8)];
    let mut ids = Vec::new();
    for (file, (text_keys, kohya)) in files.iter().zip([(0, false), (6, true)]) {
        let record = register_lora(mesh, http, file.clone()).await;
        assert_eq!(record["target"], "unet", "{record}");
        assert_eq!(
            record["text_encoder_keys"], text_keys,
            "kohya {kohya}: {record}"
        );
        ids.push(record["id"].as_str().unwrap().to_string());
    }
    let scales = [0.75f32, 0.5];
    let side = 32;
    let body = json!({"prompt": PROMPT, "model": SD, "seed": SEED,
        "num_inference_steps": STEPS, "guidance_scale": 4.0,
        "loras": [{"id": ids[0], "scale": scales[0]}, {"id": ids[1], "scale": scales[1]}]});
    let (status, out, pixels) = generate(http, &mesh.url("/v1/images/generations"), &body).await;
    assert_eq!(status, 200, "{out}");

    let unet = &pipe.unet;
    let modules = unet.linear_modules();
    let text_modules = pipe.text_linear_modules();
    let targets = LoraTargets {
        config: &unet.config,
        unet_modules: &modules,
        text_modules: &text_modules,
    };
    let loras: Vec<UNetLora> = files
        .iter()
        .zip(&ids)
        .map(|(f, id)| read_unet_lora_bytes(id, f.clone(), targets).unwrap())
        .collect();
    let mut patcher = LoraPatcher::new(unet.var_store().unwrap());
    let set: Vec<WeightedLora<'_>> = loras
        .iter()
        .zip(scales)
        .map(|(l, s)| WeightedLora {
            adapter: &l.adapter,
            weight: f64::from(s),
        })
        .collect();
    patcher.apply(&set).unwrap();
    let text_set: Vec<TextLora<'_>> = loras
        .iter()
        .zip(scales)
        .map(|(l, s)| TextLora {
            adapters: &l.text_encoders,
            weight: f64::from(s),
        })
        .collect();
    assert!(
        TextLoraPatchers::adapts_any(&text_set),
        "the kohya file adapts the text encoder"
    );
    let own = |text: Option<&mut TextLoraPatchers>| {
        let prepare = || {
            pipe.prepare(
                &request(PROMPT, side, side, 4.0),
                &sd::latents(pipe, SEED, side, side),
                None,
            )
        };
        let state = match text {
            Some(text) => text.with_patched(&text_set, prepare).unwrap().0,
            None => prepare().unwrap(),
        };
        sd::to_rgb(&sd::run_alone(pipe, state))
    };
    let expected = own(Some(&mut TextLoraPatchers::new(pipe, OriginalsOn::Host)));
    let unet_only = own(None);
    patcher.apply(&[]).unwrap();
    assert_ne!(
        unet_only, expected,
        "the text encoder's adapters change nothing: a test of nothing"
    );
    let differ = base
        .iter()
        .zip(&expected)
        .filter(|(a, b)| a.abs_diff(**b) > 4)
        .count();
    assert!(
        differ > base.len() / 20,
        "the LoRAs changed only {differ} values: a test of nothing"
    );
    assert_eq!(
        pixels, expected,
        "the mesh's image is not the pipeline's own with the LoRAs patched in"
    );

    // A Flux transformer's LoRA on the SD model: refused at the edge, by name.
    let flux = diffmesh_shared::testing::lora_file(&[("x_embedder".into(), 8, 8)], 2, 0.5, 1);
    let record = register_lora(mesh, http, flux).await;
    assert_eq!(record["target"], "transformer", "{record}");
    let body = json!({"prompt": PROMPT, "model": SD, "seed": SEED,
        "num_inference_steps": STEPS, "loras": [{"id": record["id"]}]});
    let (status, out, _) = generate(http, &mesh.url("/v1/images/generations"), &body).await;
    assert_eq!(status, 400, "{out}");
    assert_eq!(out["error"]["param"], "loras[0].id", "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unet_model_serves_generations_and_mask_aware_template_edits_beside_flux() {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = sd::sd21_fixture(&tmp.join("unet-serving-sd21"));
    let controlnets = sd::controlnets_fixture(&dir, &tmp.join("unet-serving-controlnets"));
    let pipe = SdPipeline::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let model_dir = dir.clone();
    let controlnet_dir = controlnets.clone();
    let mesh = MeshBuilder::new()
        .denoisers(&DENOISERS)
        .denoiser(move |id, c| {
            if id == "sd" {
                c.model_dir = model_dir.clone();
                c.model_id = Some(SD.into());
                c.controlnet_dir = Some(controlnet_dir.clone());
                // Exact caches: the served edit must be the in-process mask-aware one.
                c.cache_dtype = "f32".into();
                // LoRAs patched from the first step, so the image does not hang on fetch timing.
                c.lora_async_fraction = 0.0;
            }
        })
        .gateway(|g| g.default_model = Some("tiny".into()))
        .start()
        .await;
    let http = reqwest::Client::new();

    let models = models_once_listed(&http, &mesh.url("/v1/models"), DENOISERS.len()).await;
    let sd = model_card(&models, SD);
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
            &sd::latents(&pipe, SEED, side, side),
            None,
        )
        .unwrap();
    assert_eq!(
        pixels,
        sd::to_rgb(&sd::run_alone(&pipe, own)),
        "the mesh's image is not the pipeline's own for the seed"
    );
    streamed_with_a_preview(&mesh, &http, &pixels).await;
    loras_patch_the_served_unet(&mesh, &http, &pipe, &pixels).await;
    controlnets_steer_the_served_unet(&mesh, &http, &pipe, &controlnets, &pixels).await;

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
    let changed = changed_inside_only(&edited, &original, (x0, y0, x1, y1), "");
    assert!(changed > 0, "the masked region was not repainted");

    // The same edit in full compute and mask-aware, in process (latents carrying the
    // template's noise outside the mask, as the engine's).
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
    let rect = (i64::from(x0), i64::from(y0), i64::from(x1), i64::from(y1));
    let (full, masked) = sd::template_edit(
        &pipe,
        &image,
        rect,
        (&request("a sofa", hh, ww, guidance), template_seed),
        (&request(edit_prompt, hh, ww, guidance), edit_seed),
    );
    let boxed = |t: &Tensor| sd::crop(t, rect);
    let served = Tensor::from_slice(edited.as_raw())
        .view([hh, ww, 3])
        .permute([2, 0, 1])
        .to_kind(Kind::Float)
        .f_div_scalar(255.0)
        .unwrap()
        .unsqueeze(0);
    let in_process = sd::to_rgb(&masked);
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
