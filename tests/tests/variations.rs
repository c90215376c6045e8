//! Variations (`POST /v1/images/variations`, OpenAI's `images.create_variation`) on the whole
//! mesh with the tiny model: n variations at the image's size, each its own (seed + i), closer
//! to the image at a low `strength` than at 1 (where nothing of it is kept), with no prompt
//! needed; a mask, a strength out of range, one that runs no step, streaming, an image over the
//! pixel limit, and a strength on an edit are 400s naming the field.
use diffmesh_tests::images::{decode_b64_images, png_bytes};
use diffmesh_tests::mesh::MeshBuilder;
use image::{DynamicImage, GenericImageView};
use reqwest::multipart::{Form, Part};
use reqwest::StatusCode;
use serde_json::Value;

/// The example template of the README: shapes on a background, the tiny model's world.
fn example() -> DynamicImage {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/examples/template.png");
    image::open(path).expect("docs/examples/template.png")
}

fn mean_abs_diff(a: &DynamicImage, b: &DynamicImage) -> f64 {
    let (a, b) = (a.to_rgb8(), b.to_rgb8());
    let total: u64 = a
        .as_raw()
        .iter()
        .zip(b.as_raw())
        .map(|(x, y)| u64::from(x.abs_diff(*y)))
        .sum();
    total as f64 / a.as_raw().len() as f64
}

fn form(image: &[u8], fields: &[(&str, &str)]) -> Form {
    let mut form = Form::new().part(
        "image",
        Part::bytes(image.to_vec())
            .file_name("t.png")
            .mime_str("image/png")
            .unwrap(),
    );
    for (name, value) in fields {
        form = form.text(name.to_string(), value.to_string());
    }
    form
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variations_keep_the_image_in_proportion_to_strength() {
    let mesh = MeshBuilder::new().start().await;
    let http = reqwest::Client::new();
    let image = example();
    let (width, height) = image.dimensions();
    let png = png_bytes(&image);
    let vary = |fields: Vec<(&'static str, String)>, extra: Option<Part>| {
        let fields: Vec<(&str, String)> = fields;
        let mut form = form(
            &png,
            &fields
                .iter()
                .map(|(k, v)| (*k, v.as_str()))
                .collect::<Vec<_>>(),
        );
        if let Some(part) = extra {
            form = form.part("mask", part);
        }
        http.post(mesh.url("/v1/images/variations"))
            .multipart(form)
            .send()
    };

    let mut distance = Vec::new();
    for strength in ["0.3", "1"] {
        let r = vary(
            vec![
                ("strength", strength.into()),
                ("n", "2".into()),
                ("seed", "7".into()),
                ("num_inference_steps", "10".into()),
            ],
            None,
        )
        .await
        .unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        let body: Value = r.json().await.unwrap();
        let images = decode_b64_images(&body).unwrap();
        assert_eq!(images.len(), 2);
        for out in &images {
            assert_eq!(out.dimensions(), (width, height));
        }
        assert_ne!(
            images[0].to_rgb8().as_raw(),
            images[1].to_rgb8().as_raw(),
            "each variation has its own seed"
        );
        let d = (mean_abs_diff(&images[0], &image) + mean_abs_diff(&images[1], &image)) / 2.0;
        assert!(
            d > 0.5,
            "strength {strength}: the image came back unchanged ({d})"
        );
        distance.push(d);
    }
    assert!(
        distance[0] < distance[1] * 0.8,
        "strength 0.3 should keep more of the image than 1: {distance:?}"
    );

    for (fields, mask, field) in [
        (vec![("strength", "1.5".to_string())], false, "strength"),
        (
            vec![
                ("strength", "0.3".to_string()),
                ("num_inference_steps", "2".to_string()),
            ],
            false,
            "strength",
        ),
        (Vec::new(), true, "mask"),
        (vec![("stream", "true".to_string())], false, "stream"),
    ] {
        let mask = mask.then(|| Part::bytes(png.clone()).file_name("m.png"));
        let r = vary(fields, mask).await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let error: Value = r.json().await.unwrap();
        assert_eq!(error["error"]["param"], field, "{error}");
    }

    // An image beyond the pixel limit is refused from its header, before its mask is made.
    let huge = png_bytes(&DynamicImage::new_luma8(2048, 2048));
    let r = http
        .post(mesh.url("/v1/images/variations"))
        .multipart(form(&huge, &[]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let error: Value = r.json().await.unwrap();
    assert_eq!(error["error"]["param"], "image", "{error}");
    // Edits do not take a strength: they repaint their mask in full.
    let r = http
        .post(mesh.url("/v1/images/edits"))
        .multipart(form(&png, &[("prompt", "x"), ("strength", "0.5")]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let error: Value = r.json().await.unwrap();
    assert_eq!(error["error"]["param"], "strength", "{error}");
}
