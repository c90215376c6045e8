//! UNet ControlNets on a ControlNet worker (Katz's ControlNet-as-a-Service, for SD 2.x and SDXL).
//!
//! One worker's folder holds the tiny Flux model's `silhouette` and two random UNet ControlNets
//! (`edges`, `depth`) fit to the reduced SD 2.1 pipeline of gen_sd21_pipeline.py. The SD denoiser
//! (which also holds `edges` and `depth` itself, for the fallback) and the tiny Flux denoiser (no
//! `--controlnet-dir`) run `--controlnet-remote pipelined` as compose does (the SD one runs it as
//! `sync`, so its images are exact): each lists only the worker's ControlNets
//! of its own network, and a UNet ControlNet named for the Flux model is a 400. A generation of
//! the SD model steered by one UNet ControlNet, and by two at once, is the pipeline's own steered
//! image, pixel for pixel, with every (image, ControlNet) pair's residuals from the worker; once
//! the worker is gone, the same generation is computed on the denoiser, the same image.
use std::path::Path;
use std::time::Duration;

use diffmesh_controlnet::{start, WorkerConfig};
use diffmesh_denoiser::controlnet_service::RemoteMode;
use diffmesh_model::stable_diffusion::{SdPipeline, SdRequest};
use diffmesh_model::tch::{Device, Kind};
use diffmesh_model::unet::ControlNetModel;
use diffmesh_tests::harness::{generate, metric_sample, scrape_metrics};
use diffmesh_tests::images::{png_b64, rect_mask, template};
use diffmesh_tests::mesh::MeshBuilder;
use diffmesh_tests::sd;
use diffmesh_tests::tools::repo_root;
use futures::StreamExt;
use serde_json::json;

const SD: &str = "sd21-tiny";
const PROMPT: &str = "a photo of a cat, sitting on a red sofa";
const STEPS: usize = 3;
const SEED: u64 = 5;
const REMOTE: &str = "diffmesh_denoiser_controlnet_remote_total{outcome=\"remote\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_controlnet_worker_steers_unet_generations_and_each_network_sees_its_own() {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let sd_dir = sd::sd21_fixture(&tmp.join("unet-worker-sd21"));
    let unet_nets = sd::controlnets_fixture(&sd_dir, &tmp.join("unet-worker-controlnets"));
    let served = tempfile::tempdir().unwrap();
    let flux_nets = repo_root().join("weights/tiny-controlnets");
    for (name, from) in [
        ("edges", unet_nets.join("edges")),
        ("depth", unet_nets.join("depth")),
        ("silhouette", flux_nets.join("silhouette")),
    ] {
        std::os::unix::fs::symlink(from, served.path().join(name)).unwrap();
    }
    let (model_dir, local_nets) = (sd_dir.clone(), unet_nets.clone());
    let mesh = MeshBuilder::new()
        .denoisers(&["tiny", "sd"])
        .denoiser(move |id, c| {
            c.controlnet_dir = None;
            // As compose starts them; a UNet model runs it as `sync`.
            c.controlnet_remote = RemoteMode::Pipelined;
            if id == "sd" {
                c.model_dir = model_dir.clone();
                c.model_id = Some(SD.into());
                c.controlnet_dir = Some(local_nets.clone());
            }
        })
        .gateway(|g| g.default_model = Some("tiny".into()))
        .start()
        .await;
    let client = async_nats::connect(mesh.nats.url()).await.unwrap();
    let mut beats = client
        .subscribe(diffmesh_shared::wire::subjects::DENOISER_HEARTBEAT)
        .await
        .unwrap();
    let worker = start(WorkerConfig::for_tests(
        mesh.nats.url(),
        served.path().to_path_buf(),
        "cn1",
    ))
    .await
    .unwrap();

    // Each denoiser lists the worker's ControlNets of its own network, and only those.
    tokio::time::timeout(Duration::from_secs(15), async {
        let (mut sd_ok, mut tiny_ok) = (false, false);
        while let Some(m) = beats.next().await {
            let hb: diffmesh_shared::wire::messages::Heartbeat =
                diffmesh_shared::wire::messages::decode(&m.payload).unwrap();
            match hb.worker_id.as_str() {
                "sd" if !hb.controlnets.is_empty() => {
                    assert_eq!(hb.controlnets, ["depth", "edges"], "sd lists");
                    sd_ok = true;
                }
                "tiny" if !hb.controlnets.is_empty() => {
                    assert_eq!(hb.controlnets, ["silhouette"], "tiny lists");
                    tiny_ok = true;
                }
                _ => {}
            }
            if sd_ok && tiny_ok {
                return;
            }
        }
    })
    .await
    .expect("the denoisers never listed the worker's ControlNets");
    let http = reqwest::Client::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let resp = http.get(mesh.url("/v1/controlnets")).send().await.unwrap();
            let body: serde_json::Value = resp.json().await.unwrap();
            if body["data"].as_array().is_some_and(|d| d.len() == 3) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the gateway never listed the worker's ControlNets");

    let side = 32u32;
    let control = template(side, side);
    let second = rect_mask(side, side, 4, 6, 20, 28);
    let url = mesh.url("/v1/images/generations");
    let pipe = SdPipeline::load(&sd_dir, Device::Cpu, Kind::Float).unwrap();
    let load = |name: &str| {
        ControlNetModel::load(&unet_nets.join(name), Device::Cpu, Kind::Float).unwrap()
    };
    let (edges, depth) = (load("edges"), load("depth"));
    let s = i64::from(side);
    let reference = (
        SdRequest {
            prompt: PROMPT.into(),
            negative_prompt: None,
            height: s,
            width: s,
            steps: STEPS,
            guidance_scale: 4.0,
            scheduler: None,
        },
        SEED,
    );
    let sd_metrics = || async {
        let page = scrape_metrics(mesh.denoiser("sd").addrs.health)
            .await
            .unwrap();
        metric_sample(&page, REMOTE)
    };
    let local_forwards = || async {
        let page = scrape_metrics(mesh.denoiser("sd").addrs.health)
            .await
            .unwrap();
        metric_sample(&page, "diffmesh_denoiser_controlnet_duration_seconds_count")
    };

    let one = json!({"prompt": PROMPT, "model": SD, "seed": SEED,
        "num_inference_steps": STEPS, "guidance_scale": 4.0,
        "controlnet": {"name": "edges", "image": png_b64(&control), "scale": 0.8}});
    let (status, out, pixels) = generate(&http, &url, &one).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        pixels,
        sd::steered(&pipe, &reference, &[(&control, 0.8, &edges)]),
        "the image steered through the worker is not the pipeline's own"
    );
    assert_eq!(sd_metrics().await, STEPS as f64, "pairs from the worker");
    assert_eq!(
        local_forwards().await,
        0.0,
        "nothing computed on the denoiser"
    );

    let two = json!({"prompt": PROMPT, "model": SD, "seed": SEED,
        "num_inference_steps": STEPS, "guidance_scale": 4.0,
        "controlnets": [{"name": "edges", "image": png_b64(&control), "scale": 0.7},
                        {"name": "depth", "image": png_b64(&second), "scale": 0.4}]});
    let (status, out, both) = generate(&http, &url, &two).await;
    assert_eq!(status, 200, "{out}");
    assert_ne!(both, pixels);
    assert_eq!(
        both,
        sd::steered(
            &pipe,
            &reference,
            &[(&control, 0.7, &edges), (&second, 0.4, &depth)]
        ),
        "the image steered by two ControlNets on the worker is not the pipeline's own"
    );
    assert_eq!(
        sd_metrics().await,
        3.0 * STEPS as f64,
        "pairs from the worker"
    );
    let steps = worker
        .metrics
        .requests
        .with_label_values(&["step", "ok"])
        .get();
    assert_eq!(steps, 3 * STEPS as u64, "steps the worker ran");

    // A UNet ControlNet named for the Flux model: no Flux denoiser lists it.
    let mut flux = one.clone();
    flux["model"] = json!("tiny");
    let (status, out, _) = generate(&http, &url, &flux).await;
    assert_eq!(status, 400, "{out}");
    assert_eq!(out["error"]["param"], "controlnet.name", "{out}");

    // The worker gone: the denoiser computes the residuals itself, the same image.
    worker.shutdown().await;
    let (status, out, again) = generate(&http, &url, &one).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        again, pixels,
        "computed here, the image differs from the worker's"
    );
    assert_eq!(local_forwards().await, STEPS as f64, "pairs computed here");
    assert_eq!(
        sd_metrics().await,
        3.0 * STEPS as f64,
        "nothing more from the worker"
    );
}
