//! The whole mesh on one machine (NATS, codec, router, a denoiser with the tiny model,
//! gateway): an edit comes back at the input's size with unmasked pixels exactly the
//! template's, and a generation comes back at the requested size.
use std::time::Duration;

use diffmesh_tests::images::{decode_b64_images, png_bytes, rect_mask, template};
use diffmesh_tests::mesh::{MeshBuilder, TestMesh};
use image::GenericImageView;
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};

struct Mesh {
    api: std::net::SocketAddr,
    health: std::net::SocketAddr,
    http: reqwest::Client,
    _mesh: TestMesh,
}

async fn start_mesh() -> Mesh {
    let mesh = MeshBuilder::new().without_cachestore().start().await;
    Mesh {
        api: mesh.api(),
        health: mesh.gateway.addrs.health,
        http: reqwest::Client::new(),
        _mesh: mesh,
    }
}

fn edit_form(image: Vec<u8>, mask: Vec<u8>, format: &str) -> Form {
    Form::new()
        .part("image", Part::bytes(image).file_name("image.png"))
        .part("mask", Part::bytes(mask).file_name("mask.png"))
        .text("prompt", "a red square")
        .text("num_inference_steps", "4")
        .text("seed", "7")
        .text("response_format", format.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edit_keeps_unmasked_pixels_and_generation_returns_images() {
    let mesh = start_mesh().await;

    // The gateway lists the model its denoiser announces, OpenAI's way (once it has heard the
    // denoiser's heartbeat).
    let models = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let body: serde_json::Value = mesh
                .http
                .get(format!("http://{}/v1/models", mesh.api))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if body["data"].as_array().is_some_and(|d| !d.is_empty()) {
                return body;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the gateway never listed the denoiser's model");
    assert_eq!(models["object"], "list", "{models}");
    assert_eq!(models["data"][0]["id"], "tiny", "{models}");
    assert_eq!(models["data"][0]["object"], "model", "{models}");
    assert_eq!(
        models["data"][0]["denoisers"].as_array().map(Vec::len),
        Some(1),
        "{models}"
    );

    // A non-square input that is not a multiple of the model resolution.
    let (w, h) = (100, 60);
    let tmpl = template(w, h);
    let (x0, y0, x1, y1) = (30, 10, 70, 40);
    let mask = rect_mask(w, h, x0, y0, x1, y1);
    let r = mesh
        .http
        .post(format!("http://{}/v1/images/edits", mesh.api))
        .multipart(edit_form(png_bytes(&tmpl), png_bytes(&mask), "b64_json"))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("edit request");
    assert_eq!(r.status().as_u16(), 200);
    let body: Value = r.json().await.unwrap();
    assert!(body["created"].as_u64().is_some(), "{body}");
    let images = decode_b64_images(&body).unwrap();
    assert_eq!(images.len(), 1);
    let out = &images[0];
    assert_eq!(out.dimensions(), (w, h));
    let (out, tmpl) = (out.to_rgb8(), tmpl.to_rgb8());
    let mut changed_inside = 0;
    for (x, y, p) in out.enumerate_pixels() {
        let inside = (x0..x1).contains(&x) && (y0..y1).contains(&y);
        if inside {
            changed_inside += usize::from(p != tmpl.get_pixel(x, y));
        } else {
            assert_eq!(p, tmpl.get_pixel(x, y), "unmasked pixel ({x},{y}) differs");
        }
    }
    // The model repainted the masked region (a textured template is not reproduced exactly).
    assert!(changed_inside > 0, "the masked region was not repainted");

    // response_format=png returns the raw PNG.
    let r = mesh
        .http
        .post(format!("http://{}/v1/images/edits", mesh.api))
        .multipart(edit_form(
            png_bytes(&template(w, h)),
            png_bytes(&mask),
            "png",
        ))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("edit request");
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["content-type"], "image/png");
    let png = r.bytes().await.unwrap();
    let img = image::load_from_memory(&png).unwrap();
    assert_eq!(img.dimensions(), (w, h));

    // Generation: two images at the requested size.
    let r = mesh
        .http
        .post(format!("http://{}/v1/images/generations", mesh.api))
        .json(&json!({"prompt": "a blue circle", "size": "48x40", "n": 2, "num_inference_steps": 4, "seed": 3}))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("generation request");
    assert_eq!(r.status().as_u16(), 200);
    let body: Value = r.json().await.unwrap();
    let images = decode_b64_images(&body).unwrap();
    assert_eq!(images.len(), 2);
    for img in &images {
        assert_eq!(img.dimensions(), (48, 40));
    }

    // True CFG steers the same prompt and seed elsewhere; an edit with it keeps its unmasked
    // pixels.
    let r = mesh
        .http
        .post(format!("http://{}/v1/images/generations", mesh.api))
        .json(
            &json!({"prompt": "a blue circle", "size": "48x40", "num_inference_steps": 4,
            "seed": 3, "true_cfg_scale": 4.0, "negative_prompt": ""}),
        )
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("guided generation request");
    assert_eq!(r.status().as_u16(), 200);
    let guided = decode_b64_images(&r.json::<Value>().await.unwrap()).unwrap();
    assert_eq!(guided[0].dimensions(), (48, 40));
    assert_ne!(guided[0].to_rgb8(), images[0].to_rgb8());
    let r = mesh
        .http
        .post(format!("http://{}/v1/images/edits", mesh.api))
        .multipart(
            edit_form(png_bytes(&template(w, h)), png_bytes(&mask), "png")
                .text("true_cfg_scale", "3"),
        )
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("guided edit request");
    assert_eq!(r.status().as_u16(), 200);
    let out = image::load_from_memory(&r.bytes().await.unwrap())
        .unwrap()
        .to_rgb8();
    for (x, y, p) in out.enumerate_pixels() {
        if !((x0..x1).contains(&x) && (y0..y1).contains(&y)) {
            assert_eq!(
                p,
                tmpl.get_pixel(x, y),
                "guided edit: unmasked pixel ({x},{y})"
            );
        }
    }

    let metrics = mesh
        .http
        .get(format!("http://{}/metrics", mesh.health))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("diffmesh_gateway_requests_total{endpoint=\"edits\",status=\"200\"} 3"),
        "{metrics}"
    );
}
