//! ControlNet generations through the whole mesh with the shipped silhouette ControlNet of the
//! default model: the control image goes gateway -> codec (stretched to the model resolution) ->
//! denoiser, the drawn object follows the silhouette (more of it overlaps than without), the same
//! request gives the same image, the ControlNet is loaded once, and bad requests are refused
//! naming the field.

use base64::Engine;
use diffmesh_tests::harness::{generate, metric_sample, scrape_metrics};
use diffmesh_tests::mesh::MeshBuilder;
use diffmesh_tests::tools::repo_root;
use serde_json::json;

/// The silhouette at the model's 64x64: a square of half-size 13 px centred at (34, 19), where
/// "on the top" puts an object (anchor (32, 17), up to 2 px off, half-size 9 to 13).
fn in_silhouette(x: i32, y: i32) -> bool {
    (x * 2 + 1 - 68).abs() < 26 && (y * 2 + 1 - 38).abs() < 26
}

/// The control image: that silhouette, white on black, at 128x128 (the codec scales it down).
fn silhouette_png() -> Vec<u8> {
    let img = image::RgbImage::from_fn(128, 128, |x, y| {
        if in_silhouette(x as i32 / 2, y as i32 / 2) {
            image::Rgb([255, 255, 255])
        } else {
            image::Rgb([0, 0, 0])
        }
    });
    let mut buf = std::io::Cursor::new(Vec::new());
    image::DynamicImage::ImageRgb8(img)
        .write_to(&mut buf, image::ImageFormat::Png)
        .unwrap();
    buf.into_inner()
}

/// Intersection over union of the drawn object (pixels nearer red than the white background)
/// with the silhouette.
fn silhouette_iou(rgb: &[u8]) -> f64 {
    let (mut inter, mut union) = (0, 0);
    for y in 0..64i32 {
        for x in 0..64i32 {
            let p = &rgb[((y * 64 + x) * 3) as usize..][..3];
            let d = |c: [i32; 3]| (0..3).map(|i| (p[i] as i32 - c[i]).pow(2)).sum::<i32>();
            let drawn = d([220, 40, 40]) < d([240, 240, 240]);
            let sil = in_silhouette(x, y);
            inter += usize::from(drawn && sil);
            union += usize::from(drawn || sil);
        }
    }
    inter as f64 / union.max(1) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_controlnet_steers_generations_through_the_mesh() {
    let dir = repo_root().join("weights/tiny-controlnets");
    // Guided by default, as `cargo xtask up`'s gateway is: steered generations too.
    let mesh = MeshBuilder::new()
        .denoiser(move |_, c| c.controlnet_dir = Some(dir.clone()))
        .gateway(|c| c.default_true_cfg_scale = 4.0)
        .start()
        .await;
    let http = reqwest::Client::new();
    let url = mesh.url("/v1/images/generations");
    let image = base64::engine::general_purpose::STANDARD.encode(silhouette_png());
    let plain = json!({
        "prompt": "a red square on the top on a white background",
        "seed": 4, "num_inference_steps": 20,
    });
    let mut steered = plain.clone();
    steered["controlnet"] = json!({"name": "silhouette", "image": image});

    let (s, body, without) = generate(&http, &url, &plain).await;
    assert_eq!(s, 200, "{body}");
    let (s, body, with) = generate(&http, &url, &steered).await;
    assert_eq!(s, 200, "{body}");
    let (a, b) = (silhouette_iou(&without), silhouette_iou(&with));
    println!("object/silhouette IoU: {a:.3} without the ControlNet, {b:.3} with");
    assert!(b > a && b > 0.85, "IoU {a:.3} without, {b:.3} with");
    let (s, body, again) = generate(&http, &url, &steered).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(again, with, "same request, same image");

    let metrics = scrape_metrics(mesh.denoiser("d1").addrs.health)
        .await
        .unwrap();
    let lookups = |o: &str| {
        metric_sample(
            &metrics,
            &format!("diffmesh_denoiser_controlnet_lookups_total{{outcome=\"{o}\"}}"),
        )
    };
    assert_eq!((lookups("loaded"), lookups("hit")), (1.0, 39.0));

    // Refused at the edge, naming the field: a bad scale, and a ControlNet no live denoiser offers.
    let mut bad = steered.clone();
    bad["controlnet"]["scale"] = json!(5);
    let (s, body, _) = generate(&http, &url, &bad).await;
    assert_eq!(
        (s, body["error"]["field"].as_str()),
        (400, Some("controlnet.scale")),
        "{body}"
    );
    let mut unknown = steered.clone();
    unknown["controlnet"]["name"] = json!("canny");
    let (s, body, _) = generate(&http, &url, &unknown).await;
    assert_eq!(
        (s, body["error"]["field"].as_str()),
        (400, Some("controlnet.name")),
        "{body}"
    );
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("canny") && message.contains("silhouette"),
        "{body}"
    );
}

/// ControlNet-as-a-Service: a denoiser that holds no ControlNet of its own
/// (`--controlnet-remote pipelined`, no `--controlnet-dir`) serves steered generations through a
/// ControlNet worker: its heartbeats list the worker's ControlNets, so the router places the
/// job there, and every step's residuals come from the worker, one step behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_controlnet_worker_steers_a_denoiser_without_controlnets() {
    use diffmesh_controlnet::{start, WorkerConfig};
    use diffmesh_denoiser::controlnet_service::RemoteMode;
    use futures::StreamExt;

    let mesh = MeshBuilder::new()
        .denoiser(|_, c| {
            c.controlnet_dir = None;
            c.controlnet_remote = RemoteMode::Pipelined;
        })
        .start()
        .await;
    let client = async_nats::connect(mesh.nats.url()).await.unwrap();
    let mut beats = client
        .subscribe(diffmesh_shared::wire::subjects::DENOISER_HEARTBEAT)
        .await
        .unwrap();
    let dir = repo_root().join("weights/tiny-controlnets");
    let worker = start(WorkerConfig::for_tests(mesh.nats.url(), dir, "cn1"))
        .await
        .unwrap();
    // The denoiser lists the worker's ControlNets once it has heard it.
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while let Some(m) = beats.next().await {
            let hb: diffmesh_shared::wire::messages::Heartbeat =
                diffmesh_shared::wire::messages::decode(&m.payload).unwrap();
            if hb.controlnets.iter().any(|n| n == "silhouette") {
                return;
            }
        }
    })
    .await
    .expect("the denoiser never listed the worker's ControlNet");
    // The gateway refuses a ControlNet no denoiser offers: wait until it has heard the same.
    let http = reqwest::Client::new();
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let resp = http.get(mesh.url("/v1/controlnets")).send().await.unwrap();
            let body: serde_json::Value = resp.json().await.unwrap();
            if body["data"][0]["id"] == json!("silhouette") {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the gateway never listed the worker's ControlNet");

    let url = mesh.url("/v1/images/generations");
    let image = base64::engine::general_purpose::STANDARD.encode(silhouette_png());
    let steered = json!({
        "prompt": "a red square on the top on a white background",
        "seed": 4, "num_inference_steps": 20,
        "controlnet": {"name": "silhouette", "image": image},
    });
    let (s, body, with) = generate(&http, &url, &steered).await;
    assert_eq!(s, 200, "{body}");
    let iou = silhouette_iou(&with);
    println!("object/silhouette IoU through a pipelined ControlNet worker: {iou:.3}");
    assert!(iou > 0.85, "IoU {iou:.3}");
    let steps = worker
        .metrics
        .requests
        .with_label_values(&["step", "ok"])
        .get();
    // Pipelined: the first step's residuals serve the first two steps, the last is not asked.
    assert_eq!(steps, 19, "steps the worker ran");
    let metrics = scrape_metrics(mesh.denoiser("d1").addrs.health)
        .await
        .unwrap();
    let remote = metric_sample(
        &metrics,
        "diffmesh_denoiser_controlnet_remote_total{outcome=\"remote\"}",
    );
    assert_eq!(remote, 20.0, "steps with residuals from the worker");

    // The gateway lists the ControlNet, who steers with it and that the worker has it loaded
    // (heartbeats come every second: wait for the one after the generation).
    let listed = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let resp = http.get(mesh.url("/v1/controlnets")).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            let body: serde_json::Value = resp.json().await.unwrap();
            if body["data"][0]["workers"][0]["resident"] == json!(true) {
                return body;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the gateway never listed the worker's ControlNet as loaded");
    assert_eq!(
        listed,
        json!({"object": "list", "data": [{
            "id": "silhouette", "object": "controlnet", "denoisers": ["d1"],
            "workers": [{"id": "cn1", "resident": true}],
        }]})
    );
    worker.shutdown().await;
}
