//! LoRA generations through the whole mesh: a LoRA registered at the gateway reaches the
//! denoiser by id (read once from the LoRA store, then from its memory), changes the image, gives
//! the same image again for the same seed, and a deleted LoRA is refused at the edge.
use std::time::Duration;

use diffmesh_shared::wire::messages::{decode, Heartbeat};
use diffmesh_shared::wire::subjects;
use diffmesh_tests::harness::{generate, metric_sample, scrape_metrics};
use diffmesh_tests::mesh::MeshBuilder;
use futures::StreamExt;
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};

/// A rank-4 LoRA of the tiny model's attention and MLP layers, deterministic pseudo-random.
fn lora_file() -> Vec<u8> {
    let modules = [
        ("transformer_blocks.0.attn.to_q".to_string(), 192, 192),
        ("transformer_blocks.1.ff.net.2".to_string(), 768, 192),
        ("single_transformer_blocks.0.proj_mlp".to_string(), 192, 768),
        (
            "single_transformer_blocks.1.attn.to_v".to_string(),
            192,
            192,
        ),
    ];
    lora_file_of(&modules, 4, 0.6)
}

/// Every attention and MLP layer of the tiny model (30), as `(module, in, out)`.
fn all_layers() -> Vec<(String, usize, usize)> {
    let mut m = Vec::new();
    for i in 0..2 {
        for l in [
            "to_q",
            "to_k",
            "to_v",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_out.0",
            "to_add_out",
        ] {
            m.push((format!("transformer_blocks.{i}.attn.{l}"), 192, 192));
        }
        m.push((format!("transformer_blocks.{i}.ff.net.0.proj"), 192, 768));
        m.push((format!("transformer_blocks.{i}.ff.net.2"), 768, 192));
    }
    for j in 0..2 {
        for l in ["attn.to_q", "attn.to_k", "attn.to_v"] {
            m.push((format!("single_transformer_blocks.{j}.{l}"), 192, 192));
        }
        m.push((format!("single_transformer_blocks.{j}.proj_mlp"), 192, 768));
        m.push((format!("single_transformer_blocks.{j}.proj_out"), 960, 192));
    }
    m
}

/// A LoRA of `modules` at `rank`, values in +-amplitude/2.
fn lora_file_of(modules: &[(String, usize, usize)], rank: usize, amplitude: f32) -> Vec<u8> {
    diffmesh_shared::testing::lora_file(modules, rank, amplitude, 0x5eed)
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

    // The denoiser reports the adapter it holds, for the router's placement.
    let client = async_nats::connect(&mesh.nats.url()).await.unwrap();
    let mut beats = client
        .subscribe(subjects::DENOISER_HEARTBEAT)
        .await
        .unwrap();
    let reported = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(msg) = beats.next().await {
            let hb: Heartbeat = decode(&msg.payload).unwrap();
            if hb.cached_loras.contains(&id) {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(reported, Ok(true), "a heartbeat lists the LoRA");

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

/// Latency of a generation with a LoRA the denoiser does not hold yet (read from the LoRA store
/// at the job's start), synchronous loading against bounded asynchronous loading, and with the
/// LoRA in memory. A measurement, not a check: `cargo xtask test -p diffmesh-tests --test
/// lora_flow -- --ignored --nocapture cold_lora`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore]
async fn cold_lora_latency_sync_against_bounded_async_loading() {
    let rank: usize = std::env::var("DIFFMESH_BENCH_LORA_RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1024);
    let file = lora_file_of(&all_layers(), rank, 0.02);
    let steps = 20;
    for fraction in [0.0, 0.2, 0.5, 0.0, 0.2, 0.5] {
        let mesh = MeshBuilder::new()
            .denoiser(move |_, c| {
                c.lora_async_fraction = fraction;
                c.max_lora_bytes = 512 << 20;
            })
            .gateway(|g| g.max_lora_bytes = 512 << 20)
            .start()
            .await;
        let http = reqwest::Client::new();
        let form = Form::new().part(
            "weights",
            Part::bytes(file.clone()).file_name("big.safetensors"),
        );
        let r = http
            .post(mesh.url("/v1/loras"))
            .multipart(form)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);
        let id = r.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        let url = mesh.url("/v1/images/generations");
        let body = |seed: u64, lora: bool| {
            let mut b = json!({"prompt": "a red circle on the left on a blue background",
                "seed": seed, "num_inference_steps": steps});
            if lora {
                b["loras"] = json!([{"id": id}]);
            }
            b
        };
        // Warm the model and the path once without the LoRA.
        generate(&http, &url, body(1, false)).await;
        let mut times = Vec::new();
        for (seed, lora) in [(2, false), (3, true), (4, true)] {
            let start = std::time::Instant::now();
            let (s, b, _) = generate(&http, &url, body(seed, lora)).await;
            assert_eq!(s, 200, "{b}");
            times.push(start.elapsed().as_secs_f64());
        }
        let metrics = scrape_metrics(mesh.denoiser("d1").addrs.health)
            .await
            .unwrap();
        let fetch_sum = metric_sample(
            &metrics,
            "diffmesh_denoiser_lora_fetch_duration_seconds_sum",
        );
        let base_steps = metric_sample(
            &metrics,
            "diffmesh_denoiser_lora_steps_total{mode=\"base_while_loading\"}",
        );
        let waited = metric_sample(&metrics, "diffmesh_denoiser_lora_wait_duration_seconds_sum");
        println!(
            "rank {rank} ({:.1} MB), {steps} steps, fraction {fraction}: no LoRA {:.3} s, cold LoRA {:.3} s, warm LoRA {:.3} s; fetch {:.3} s; steps on the base model while loading {base_steps}, sat out past the bound {waited:.3} s",
            file.len() as f64 / 1e6, times[0], times[1], times[2], fetch_sum
        );
    }
}
