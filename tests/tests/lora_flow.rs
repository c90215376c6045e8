//! LoRA generations through the whole mesh: a LoRA registered at the gateway reaches the
//! denoiser by id (read once from the LoRA store, then from its memory), changes the image, gives
//! the same image again for the same seed, and a deleted LoRA is refused at the edge.
use std::time::Duration;

use diffmesh_tests::harness::{metric_sample, scrape_metrics};
use diffmesh_tests::images::decode_b64_images;
use diffmesh_tests::mesh::MeshBuilder;
use reqwest::multipart::{Form, Part};
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};

/// A rank-4 LoRA of the tiny model's attention and MLP layers, deterministic pseudo-random.
fn lora_file() -> Vec<u8> {
    let modules = [
        ("transformer_blocks.0.attn.to_q", 192, 192),
        ("transformer_blocks.1.ff.net.2", 768, 192),
        ("single_transformer_blocks.0.proj_mlp", 192, 768),
        ("single_transformer_blocks.1.attn.to_v", 192, 192),
    ];
    let mut state: u64 = 0x5eed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.6
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (module, inp, out) in modules {
        for (suffix, shape) in [("lora_A", vec![4, inp]), ("lora_B", vec![out, 4])] {
            let n: usize = shape.iter().product();
            let data: Vec<u8> = (0..n).flat_map(|_| next().to_le_bytes()).collect();
            tensors.push((format!("transformer.{module}.{suffix}.weight"), shape, data));
        }
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(k, s, d)| {
            (
                k.clone(),
                TensorView::new(Dtype::F32, s.clone(), d).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// The RGB pixels of a generation's single image.
async fn generate(http: &reqwest::Client, url: &str, body: Value) -> (u16, Value, Vec<u8>) {
    let r = http
        .post(url)
        .json(&body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("generation request");
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    let pixels = match status {
        200 => decode_b64_images(&body).unwrap()[0].to_rgb8().into_raw(),
        _ => Vec::new(),
    };
    (status, body, pixels)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_registered_lora_changes_generations_and_is_read_once() {
    // Synchronous loading, so the first image with the LoRA does not depend on fetch timing.
    let mesh = MeshBuilder::new()
        .denoiser(|_, c| c.lora_async_fraction = 0.0)
        .start()
        .await;
    let http = reqwest::Client::new();
    let form = Form::new()
        .part(
            "weights",
            Part::bytes(lora_file()).file_name("style.safetensors"),
        )
        .text("name", "style");
    let r = http
        .post(mesh.url("/v1/loras"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let record: Value = r.json().await.unwrap();
    let id = record["id"].as_str().unwrap().to_string();
    assert_eq!(record["modules"], 4);

    let url = mesh.url("/v1/images/generations");
    let prompt = "a red circle on the left on a blue background";
    let base = json!({"prompt": prompt, "seed": 11, "num_inference_steps": 8});
    let mut with_lora = base.clone();
    with_lora["loras"] = json!([{"id": id, "scale": 1.0}]);
    let (s, _, plain) = generate(&http, &url, base).await;
    assert_eq!(s, 200);
    let (s, body, styled) = generate(&http, &url, with_lora.clone()).await;
    assert_eq!(s, 200, "{body}");
    let differ = plain
        .iter()
        .zip(&styled)
        .filter(|(a, b)| a.abs_diff(**b) > 8)
        .count();
    assert!(
        differ > plain.len() / 20,
        "the LoRA changed only {differ} values"
    );
    let (s, _, again) = generate(&http, &url, with_lora).await;
    assert_eq!(s, 200);
    assert_eq!(again, styled, "same seed and LoRA, same image");

    let metrics = scrape_metrics(mesh.denoiser("d1").addrs.health)
        .await
        .unwrap();
    let lookups = |r: &str| {
        metric_sample(
            &metrics,
            &format!("diffmesh_denoiser_lora_cache_lookups_total{{result=\"{r}\"}}"),
        )
    };
    assert_eq!(lookups("miss"), 1.0, "read from the LoRA store once");
    assert_eq!(lookups("hit"), 1.0);
    let patched = metric_sample(
        &metrics,
        "diffmesh_denoiser_lora_steps_total{mode=\"patched\"}",
    );
    assert_eq!(
        patched, 16.0,
        "every step of both jobs ran on the patched weights"
    );

    let r = http
        .delete(mesh.url(&format!("/v1/loras/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let (s, body, _) = generate(
        &http,
        &url,
        json!({"prompt": prompt, "loras": [{"id": id}]}),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(body["error"]["field"], "loras[0].id", "{body}");
}
