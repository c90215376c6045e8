//! A sick denoiser takes itself out and the router places around it (issue 46, point 7): a
//! denoiser whose copy of a ControlNet is cut short fails every steered job; after
//! `--sick-after-failures` of them in a row it reports unready and draining, and once a
//! healthy denoiser joins, every steered job goes there and succeeds. Its device memory
//! (the host's, on the CPU) is on `/metrics`.
use std::time::Duration;

use base64::Engine;
use diffmesh_tests::harness::{
    generate, metric_sample, scrape_metrics, start_denoiser, tiny_model_dir,
};
use diffmesh_tests::mesh::MeshBuilder;
use diffmesh_tests::tools::repo_root;
use serde_json::json;

/// A white square on black, the kind of control image the silhouette ControlNet takes.
fn control_png() -> Vec<u8> {
    let img = image::RgbImage::from_fn(64, 64, |x, y| {
        let inside = (16..48).contains(&x) && (8..32).contains(&y);
        image::Rgb(if inside { [255; 3] } else { [0; 3] })
    });
    let mut buf = std::io::Cursor::new(Vec::new());
    image::DynamicImage::ImageRgb8(img)
        .write_to(&mut buf, image::ImageFormat::Png)
        .unwrap();
    buf.into_inner()
}

async fn readyz_status(health: std::net::SocketAddr) -> u16 {
    reqwest::get(format!("http://{health}/readyz"))
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

async fn wait_for(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} never happened"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_denoiser_failing_jobs_in_a_row_is_taken_out_and_the_router_places_around_it() {
    let good = repo_root().join("weights/tiny-controlnets");
    // d1's copy of the ControlNet: its config, and weights cut short as a failed copy leaves them.
    let broken = tempfile::tempdir().unwrap();
    let folder = broken.path().join("silhouette");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(
        good.join("silhouette/config.json"),
        folder.join("config.json"),
    )
    .unwrap();
    let weights =
        std::fs::read(good.join("silhouette/diffusion_pytorch_model.safetensors")).unwrap();
    std::fs::write(
        folder.join("diffusion_pytorch_model.safetensors"),
        &weights[..weights.len() / 2],
    )
    .unwrap();
    let broken_dir = broken.path().to_path_buf();
    let mut mesh = MeshBuilder::new()
        .denoisers(&["d1"])
        .denoiser(move |_, c| {
            c.controlnet_dir = Some(broken_dir.clone());
            c.sick_after_failures = 2;
            c.sick_cooldown = Duration::from_secs(300);
        })
        .start()
        .await;
    let http = reqwest::Client::new();
    let url = mesh.url("/v1/images/generations");
    let image = base64::engine::general_purpose::STANDARD.encode(control_png());
    let mut steered = json!({
        "prompt": "a red square on the top on a white background",
        "seed": 1, "num_inference_steps": 2,
        "controlnet": {"name": "silhouette", "image": image},
    });

    // Two steered jobs fail on d1 (its ControlNet cannot load): that is its threshold.
    for _ in 0..2 {
        let (status, body, _) = generate(&http, &url, &steered).await;
        assert!(status >= 500, "{status}: {body}");
    }
    let d1 = mesh.denoiser("d1").addrs.health;
    wait_for("d1 reporting unready", async || {
        readyz_status(d1).await == 503
    })
    .await;
    let metrics = scrape_metrics(d1).await.unwrap();
    assert_eq!(
        metric_sample(&metrics, "diffmesh_denoiser_sick_episodes_total"),
        1.0
    );
    wait_for("d1's sick gauge", async || {
        let m = scrape_metrics(d1).await.unwrap_or_default();
        metric_sample(&m, "diffmesh_denoiser_sick") == 1.0
    })
    .await;
    // The host's memory, as a CPU denoiser's device memory.
    for state in ["used", "free"] {
        let bytes = metric_sample(
            &metrics,
            &format!("diffmesh_denoiser_device_memory_bytes{{state=\"{state}\"}}"),
        );
        assert!(bytes > 0.0, "{state}: {bytes}");
    }

    // A healthy denoiser joins: the router places every steered job there, none on d1.
    let model = tiny_model_dir().expect("weights/tiny");
    let d2 = start_denoiser(&mesh.nats, &model, "d2", move |c| {
        c.controlnet_dir = Some(good.clone())
    })
    .expect("d2");
    d2.wait_ready(Duration::from_secs(30))
        .await
        .expect("d2 ready");
    mesh.denoisers.push(d2);
    let router = mesh.router.addrs.health;
    wait_for("the router seeing d2", async || {
        let m = scrape_metrics(router).await.unwrap_or_default();
        metric_sample(&m, "diffmesh_router_live_workers") >= 2.0
    })
    .await;
    for seed in 2..6 {
        steered["seed"] = json!(seed);
        let (status, body, _) = generate(&http, &url, &steered).await;
        assert_eq!(status, 200, "seed {seed}: {body}");
    }
    // d1 is still out and failed nothing more (any job placed there would have failed).
    assert_eq!(readyz_status(d1).await, 503);
    let metrics = scrape_metrics(d1).await.unwrap();
    assert_eq!(
        metric_sample(&metrics, "diffmesh_denoiser_sick_episodes_total"),
        1.0
    );
}
