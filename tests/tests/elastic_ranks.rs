//! A denoiser with elastic ranks in the mesh (issue 47): a generation through the REST API
//! steps on its ranks (each `step` event says on how many), the denoiser's `/metrics` counts
//! them, and a template registered through the REST API is edited mask-aware on the ranks,
//! its unmasked pixels exactly the template's.
use std::time::Duration;

use diffmesh_tests::harness::{metric_sample, scrape_metrics, SseReader};
use diffmesh_tests::images::{decode_b64_images, png_bytes, rect_mask, template};
use diffmesh_tests::mesh::MeshBuilder;
use reqwest::multipart::{Form, Part};
use reqwest::StatusCode;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_generation_steps_on_the_ranks_its_policy_gives_it() {
    let mesh = MeshBuilder::new()
        .cachestore(|c| c.memory_bytes = 16 << 20)
        .denoisers(&["ranked"])
        .denoiser(|_, c| {
            c.ranks = 2;
            c.elastic_policy = "static-sp2".into();
            c.rank_threads = Some(1);
        })
        .start()
        .await;
    let http = reqwest::Client::new();
    let r = http
        .post(mesh.url("/v1/images/generations"))
        .header("Prefer", "respond-async")
        .json(&json!({"prompt": "a red circle", "num_inference_steps": 3, "seed": 5}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let job: Value = r.json().await.unwrap();
    let events = job["links"]["events"].as_str().unwrap();
    let mut sse = SseReader::new(http.get(mesh.url(events)).send().await.unwrap());
    let events = sse.rest(Duration::from_secs(120)).await.unwrap();
    let steps: Vec<&Value> = events
        .iter()
        .filter(|(name, _)| name == "step")
        .map(|(_, data)| data)
        .collect();
    assert_eq!(steps.len(), 3, "{events:?}");
    assert!(steps.iter().all(|s| s["ranks"] == 2), "{steps:?}");
    assert_eq!(events.last().unwrap().0, "done", "{events:?}");

    let metrics = scrape_metrics(mesh.denoiser("ranked").addrs.health)
        .await
        .unwrap();
    assert_eq!(metric_sample(&metrics, "diffmesh_denoiser_ranks"), 2.0);
    assert_eq!(
        metric_sample(
            &metrics,
            "diffmesh_denoiser_elastic_steps_total{degree=\"2\"}"
        ),
        3.0
    );

    // A template's edits step mask-aware on the ranks (its capture runs on the engine's own
    // transformer); the unmasked pixels stay the template's.
    let picture = template(64, 64);
    let form = Form::new()
        .part("image", Part::bytes(png_bytes(&picture)).file_name("t.png"))
        .text("prompt", "a blue background")
        .text("seed", "7")
        .text("num_inference_steps", "3");
    let r = http
        .post(mesh.url("/v1/templates"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let created: Value = r.json().await.unwrap();
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let form = Form::new()
        .text("template_id", created["id"].as_str().unwrap().to_string())
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(64, 64, 0, 0, 32, 32))).file_name("m.png"),
        )
        .text("prompt", "a yellow square")
        .text("seed", "3");
    let r = http
        .post(mesh.url("/v1/images/edits"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, StatusCode::OK, "{body}");
    let edited = decode_b64_images(&body).unwrap().remove(0).to_rgb8();
    let original = picture.to_rgb8();
    for (x, y, pixel) in edited.enumerate_pixels() {
        if x >= 32 || y >= 32 {
            assert_eq!(pixel, original.get_pixel(x, y), "unmasked pixel ({x}, {y})");
        }
    }
    let metrics = scrape_metrics(mesh.denoiser("ranked").addrs.health)
        .await
        .unwrap();
    assert!(
        metric_sample(
            &metrics,
            "diffmesh_denoiser_step_rows_total{mode=\"mask_aware\"}"
        ) >= 3.0,
        "the edit's steps ran mask-aware"
    );
}
