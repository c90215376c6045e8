//! A denoiser with elastic ranks in the mesh (issue 47): a generation through the REST API
//! steps on its ranks (each `step` event says on how many), the denoiser's `/metrics` counts
//! them, its heartbeat announces what it serves, and an edit (which ranks do not run) is
//! refused by the gateway naming the field.
use std::time::Duration;

use diffmesh_tests::harness::{metric_sample, scrape_metrics, SseReader};
use diffmesh_tests::images::{png_bytes, rect_mask, template};
use diffmesh_tests::mesh::MeshBuilder;
use reqwest::multipart::{Form, Part};
use reqwest::StatusCode;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_generation_steps_on_the_ranks_its_policy_gives_it() {
    let mesh = MeshBuilder::new()
        .without_cachestore()
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

    // Ranks run generations only: the model's card says so, and the gateway refuses an edit.
    let models: Value = http
        .get(mesh.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let form = Form::new()
        .part(
            "image",
            Part::bytes(png_bytes(&template(64, 64))).file_name("t.png"),
        )
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(64, 64, 0, 0, 32, 32))).file_name("m.png"),
        )
        .text("prompt", "a blue square");
    let r = http
        .post(mesh.url("/v1/images/edits"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body} (models: {models})");
}
