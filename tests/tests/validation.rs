//! Bad inputs are rejected with a 4xx JSON error naming the field, at the gateway or by the
//! codec (which decodes the uploads). Needs only NATS, the codec and the gateway.
use std::time::Duration;

use diffmesh_tests::harness::{init_test_logging, start_codec, start_gateway, NatsServer, Service};
use diffmesh_tests::images::{png_bytes, rect_mask, template};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};

struct Mesh {
    _codec: Service,
    gateway: Service,
    http: reqwest::Client,
    // Last: fields drop in order, and services must stop before their NATS server.
    _nats: NatsServer,
}

impl Mesh {
    async fn start() -> Mesh {
        init_test_logging();
        let nats = NatsServer::start();
        // The codec's pixel limit is below the gateway's, so both checks can be exercised.
        let codec = start_codec(&nats, |c| c.max_pixels = 100 * 100).expect("codec");
        let gateway = start_gateway(&nats, |g| {
            g.max_pixels = 200 * 200;
            g.max_body_bytes = 512 * 1024;
        })
        .expect("gateway");
        codec
            .wait_ready(Duration::from_secs(10))
            .await
            .expect("codec ready");
        gateway
            .wait_ready(Duration::from_secs(10))
            .await
            .expect("gateway ready");
        Mesh {
            _nats: nats,
            _codec: codec,
            gateway,
            http: reqwest::Client::new(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!(
            "http://{}{path}",
            self.gateway.addrs.api.expect("gateway api addr")
        )
    }

    async fn edit(&self, form: Form) -> (u16, Value) {
        let r = self
            .http
            .post(self.url("/v1/images/edits"))
            .multipart(form)
            .send()
            .await
            .expect("request");
        let status = r.status().as_u16();
        (status, r.json().await.expect("JSON error body"))
    }

    async fn generate(&self, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(self.url("/v1/images/generations"))
            .json(&body)
            .send()
            .await
            .expect("request");
        let status = r.status().as_u16();
        (status, r.json().await.expect("JSON error body"))
    }
}

fn file(bytes: Vec<u8>, name: &str) -> Part {
    Part::bytes(bytes).file_name(name.to_string())
}

fn edit_form(image: Vec<u8>, mask: Vec<u8>) -> Form {
    Form::new()
        .part("image", file(image, "image.png"))
        .part("mask", file(mask, "mask.png"))
        .text("prompt", "a red square")
        .text("num_inference_steps", "2")
}

#[track_caller]
fn assert_field_error(status: u16, body: &Value, expected_status: u16, field: &str) {
    assert_eq!(status, expected_status, "body: {body}");
    let err = &body["error"];
    assert_eq!(err["field"], field, "body: {body}");
    assert!(
        !err["message"].as_str().unwrap_or_default().is_empty(),
        "error message missing: {body}"
    );
    assert!(err["error_type"].is_string(), "error_type missing: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_field_errors() {
    let mesh = Mesh::start().await;
    let img = png_bytes(&template(32, 32));
    let mask = png_bytes(&rect_mask(32, 32, 8, 8, 16, 16));

    // Bytes that are not an image (caught from the header at the gateway).
    let (s, b) = mesh
        .edit(edit_form(b"definitely not a png".to_vec(), mask.clone()))
        .await;
    assert_field_error(s, &b, 400, "image");

    // A mask that is an image but not the image's size (caught by the codec).
    let small_mask = png_bytes(&rect_mask(16, 16, 0, 0, 8, 8));
    let (s, b) = mesh.edit(edit_form(img.clone(), small_mask)).await;
    assert_field_error(s, &b, 400, "mask");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("16x16"),
        "{b}"
    );

    // A mask that is not an image at all (only the codec decodes masks).
    let (s, b) = mesh.edit(edit_form(img.clone(), b"junk".to_vec())).await;
    assert_field_error(s, &b, 400, "mask");

    // Above the gateway's pixel limit (200x200): 250x250.
    let big = png_bytes(&template(250, 250));
    let big_mask = png_bytes(&rect_mask(250, 250, 0, 0, 10, 10));
    let (s, b) = mesh.edit(edit_form(big, big_mask)).await;
    assert_field_error(s, &b, 400, "image");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("40000"),
        "{b}"
    );

    // Above the codec's pixel limit (100x100) but within the gateway's: 150x150.
    let mid = png_bytes(&template(150, 150));
    let mid_mask = png_bytes(&rect_mask(150, 150, 0, 0, 10, 10));
    let (s, b) = mesh.edit(edit_form(mid, mid_mask)).await;
    assert_field_error(s, &b, 400, "image");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("10000"),
        "{b}"
    );

    // A mask that repaints nothing.
    let empty = png_bytes(&rect_mask(32, 32, 0, 0, 0, 0));
    let (s, b) = mesh.edit(edit_form(img.clone(), empty)).await;
    assert_field_error(s, &b, 400, "mask");

    // Steps out of range, on both endpoints.
    for steps in ["0", "101"] {
        let form = Form::new()
            .part("image", file(img.clone(), "i.png"))
            .part("mask", file(mask.clone(), "m.png"))
            .text("prompt", "x")
            .text("num_inference_steps", steps);
        let (s, b) = mesh.edit(form).await;
        assert_field_error(s, &b, 400, "num_inference_steps");
    }
    let (s, b) = mesh
        .generate(json!({"prompt": "x", "num_inference_steps": 500}))
        .await;
    assert_field_error(s, &b, 400, "num_inference_steps");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("100"),
        "{b}"
    );

    // Missing prompt, on both endpoints.
    let form = Form::new()
        .part("image", file(img.clone(), "i.png"))
        .part("mask", file(mask.clone(), "m.png"));
    let (s, b) = mesh.edit(form).await;
    assert_field_error(s, &b, 400, "prompt");
    let (s, b) = mesh.generate(json!({"n": 1})).await;
    assert_field_error(s, &b, 400, "prompt");

    // Missing image, n out of range, a wrongly typed field, an unsupported format.
    let (s, b) = mesh.edit(Form::new().text("prompt", "x")).await;
    assert_field_error(s, &b, 400, "image");
    let (s, b) = mesh.generate(json!({"prompt": "x", "n": 9})).await;
    assert_field_error(s, &b, 400, "n");
    let (s, b) = mesh.generate(json!({"prompt": "x", "seed": "abc"})).await;
    assert_field_error(s, &b, 400, "seed");
    let (s, b) = mesh
        .generate(json!({"prompt": "x", "response_format": "gif"}))
        .await;
    assert_field_error(s, &b, 400, "response_format");
    // A result URL serves the stored PNG: no other output format with it.
    let (s, b) = mesh
        .generate(json!({"prompt": "x", "response_format": "url", "output_format": "jpeg"}))
        .await;
    assert_field_error(s, &b, 400, "output_format");

    // A body above the limit (512 KiB) is a 413 naming the part.
    let huge = vec![0u8; 600 * 1024];
    let (s, b) = mesh.edit(edit_form(huge, mask.clone())).await;
    assert_field_error(s, &b, 413, "image");

    // Every rejection was counted by reason.
    let metrics = mesh
        .http
        .get(format!("http://{}/metrics", mesh.gateway.addrs.health))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("diffmesh_gateway_failures_total{reason=\"invalid_request\"}"),
        "{metrics}"
    );
}
