//! Capture preprocessing over a real nats-server: a template is prepared without a mask (every
//! token computed) and hashed exactly like an edit of the same image, so the capture's cache
//! and the template's edits share one `template_id`; a registered template's image and pixels
//! are read where the template keeps them, never copied per edit. A generation's ControlNet
//! control image is stretched to the model resolution. The job's model geometry, when the
//! gateway sends it, sets the resolution and token grid instead of the codec's flags.
use std::io::Cursor;

use diffmesh_codec::decoded::DecodedImages;
use diffmesh_codec::image_workers::ImageWorkers;
use diffmesh_codec::imaging::TokenGrid;
use diffmesh_codec::processing::{Codec, PREPARED_IMAGE};
use diffmesh_codec::CodecError;
use diffmesh_shared::stores::blob_store::{blob_key, BlobStore};
use diffmesh_shared::stores::jetstream_layout::TEMPLATE_IMAGES;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::messages::{
    DenoiseJob, GenerationParams, JobKind, PostprocessRequest, PreparedTemplate, PreprocessRequest,
    TemplateImage, TemplateRef,
};
use diffmesh_shared::wire::models::{ModelGeometry, Resolution};
use diffmesh_shared::wire::templates::{image_key, prepared_image_key};
use image::{DynamicImage, GrayImage, ImageFormat, Luma, Rgb, RgbImage};

fn png(img: &DynamicImage) -> Vec<u8> {
    let mut buf = Cursor::new(Vec::new());
    img.write_to(&mut buf, ImageFormat::Png).unwrap();
    buf.into_inner()
}

fn decoded_lookups() -> prometheus::IntCounterVec {
    prometheus::IntCounterVec::new(prometheus::Opts::new("lookups", "test"), &["outcome"]).unwrap()
}

fn request(job_id: &str, kind: JobKind, mask_key: Option<String>) -> PreprocessRequest {
    PreprocessRequest {
        job_id: job_id.into(),
        kind,
        image_key: Some("upload/image".into()),
        mask_key,
        params: GenerationParams {
            model: String::new(),
            prompt: String::new(),
            n: 1,
            num_inference_steps: 4,
            guidance_scale: 1.0,
            seed: 1,
            width: 30,
            height: 20,
            loras: Vec::new(),
            preview_steps: Vec::new(),
            strength: None,
            cache_threshold: None,
            cache_method: None,
            deadline_unix_ms: None,
            controlnet: None,
            extra_controlnets: Vec::new(),
            true_cfg: None,
        },
        template_image: None,
        control_image_key: None,
        extra_control_image_keys: Vec::new(),
        controlnets_listed: false,
        geometry: None,
    }
}

/// A codec with a 16x16 model resolution (4x4 tokens) over the two buckets.
fn codec(blobs: &BlobStore, templates: &BlobStore, lookups: &prometheus::IntCounterVec) -> Codec {
    Codec {
        blobs: blobs.clone(),
        templates: templates.clone(),
        fallback_grid: TokenGrid {
            model_width: 16,
            model_height: 16,
            token_pixels: 4,
        },
        max_pixels: 1 << 20,
        max_blob_bytes: 1 << 20,
        decoded: DecodedImages::new(1 << 20, lookups.clone()),
        workers: ImageWorkers::start(2),
    }
}

fn template_image() -> DynamicImage {
    DynamicImage::ImageRgb8(RgbImage::from_fn(30, 20, |x, y| {
        Rgb([(x * 8) as u8, (y * 12) as u8, (x ^ y) as u8])
    }))
}

/// Repaint the left 5 columns.
fn left_mask() -> DynamicImage {
    DynamicImage::ImageLuma8(GrayImage::from_fn(30, 20, |x, _| {
        Luma([if x < 5 { 255 } else { 0 }])
    }))
}

async fn buckets(nats: &NatsServer) -> (BlobStore, BlobStore) {
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let blobs = BlobStore::open(&js).await.unwrap();
    let templates = BlobStore::open_with(&js, &TEMPLATE_IMAGES).await.unwrap();
    (blobs, templates)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture_is_prepared_without_mask_and_hashed_like_edits() {
    let nats = NatsServer::start();
    let (blobs, templates) = buckets(&nats).await;
    let lookups = decoded_lookups();
    let codec = codec(&blobs, &templates, &lookups);
    blobs
        .put("upload/image", &png(&template_image()))
        .await
        .unwrap();
    blobs.put("upload/mask", &png(&left_mask())).await.unwrap();

    let capture = codec
        .preprocess(&request("cap", JobKind::Capture, None))
        .await
        .unwrap();
    assert_eq!(capture.token_mask_key, None);
    assert_eq!((capture.mask_ratio, capture.masked_tokens), (1.0, 16));
    assert_eq!((capture.input_width, capture.input_height), (30, 20));
    assert_eq!(capture.image_key.as_deref(), Some("cap/prepared-image.rgb"));
    let prepared = blobs.get(&blob_key("cap", PREPARED_IMAGE)).await.unwrap();
    assert_eq!(prepared.len(), 16 * 16 * 3);

    let edit = codec
        .preprocess(&request("edit", JobKind::Edit, Some("upload/mask".into())))
        .await
        .unwrap();
    assert!(edit.template_id.is_some());
    assert_eq!(edit.template_id, capture.template_id);
    assert!(edit.mask_ratio < 1.0);
    // The edit took the image the capture decoded.
    let count = |outcome: &str| lookups.with_label_values(&[outcome]).get();
    assert_eq!((count("miss"), count("hit")), (1, 1));

    // A capture with a mask is a malformed request; a capture of a non-image names `image`.
    let err = codec
        .preprocess(&request(
            "bad",
            JobKind::Capture,
            Some("upload/mask".into()),
        ))
        .await
        .unwrap_err();
    assert!(matches!(err, CodecError::BadMessage { .. }), "{err}");
    blobs.put("upload/image", b"not an image").await.unwrap();
    match codec
        .preprocess(&request("bad2", JobKind::Capture, None))
        .await
    {
        Err(CodecError::Invalid(field)) => assert_eq!(field.field, "image"),
        other => panic!("expected an invalid image, got {other:?}"),
    }
}

/// A FLUX-style geometry runs the input at its own size in whole tokens; a fixed one stretches
/// it; the token mask follows the grid; a geometry beyond the codec's pixel limit is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jobs_model_geometry_sets_resolution_and_grid() {
    let nats = NatsServer::start();
    let (blobs, templates) = buckets(&nats).await;
    let codec = codec(&blobs, &templates, &decoded_lookups());
    blobs
        .put("upload/image", &png(&template_image()))
        .await
        .unwrap();
    blobs.put("upload/mask", &png(&left_mask())).await.unwrap();
    let with = |job_id: &str, kind, resolution, token_pixels| PreprocessRequest {
        geometry: Some(ModelGeometry {
            token_pixels,
            resolution,
            default_width: 64,
            default_height: 64,
        }),
        ..request(job_id, kind, Some("upload/mask".into()))
    };
    let scaled = Resolution::Scaled {
        max_pixels: 1 << 20,
    };
    // 30x20 in 4-pixel tokens: 28x20, 5 rows of 7.
    let edit = codec
        .preprocess(&with("e1", JobKind::Edit, scaled, 4))
        .await
        .unwrap();
    assert_eq!((edit.model_width, edit.model_height), (28, 20));
    assert_eq!((edit.token_rows, edit.token_cols), (5, 7));
    let mask = blobs
        .get(edit.token_mask_key.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(mask.len(), 35);
    // The left 5 of 30 columns cover the first 2 of 7 token columns (5/30 of 28 px = 4.7 px).
    assert_eq!(&mask[..7], &[1, 1, 0, 0, 0, 0, 0]);
    let rgb = blobs.get(edit.image_key.as_deref().unwrap()).await.unwrap();
    assert_eq!(rgb.len(), 28 * 20 * 3);

    let fixed = Resolution::Fixed {
        width: 8,
        height: 24,
    };
    let capture = codec
        .preprocess(&PreprocessRequest {
            mask_key: None,
            ..with("c1", JobKind::Capture, fixed, 4)
        })
        .await
        .unwrap();
    assert_eq!((capture.model_width, capture.model_height), (8, 24));
    assert_eq!(
        (
            capture.token_rows,
            capture.token_cols,
            capture.masked_tokens
        ),
        (6, 2, 12)
    );

    // A generation's size is its input size.
    let generation = codec
        .preprocess(&PreprocessRequest {
            mask_key: None,
            image_key: None,
            ..with("g1", JobKind::Generate, scaled, 16)
        })
        .await
        .unwrap();
    // 30x20 floors to one 16-pixel token a side.
    assert_eq!((generation.model_width, generation.model_height), (16, 16));

    let huge = Resolution::Fixed {
        width: 1 << 15,
        height: 1 << 15,
    };
    let err = codec
        .preprocess(&with("h1", JobKind::Edit, huge, 16))
        .await
        .unwrap_err();
    assert!(matches!(err, CodecError::BadMessage { .. }), "{err}");
}

/// A registered template (its image in the template bucket): the capture keeps its
/// model-resolution pixels there; an edit names them and reads the image through the decoded
/// cache by the template's id, so it neither copies nor re-reads either. A template captured
/// before the pixels were kept still edits (they are made for the job), with the same hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_templates_jobs_read_its_image_where_it_is_kept() {
    let nats = NatsServer::start();
    let (blobs, templates) = buckets(&nats).await;
    let lookups = decoded_lookups();
    let codec = codec(&blobs, &templates, &lookups);
    let count = |outcome: &str| lookups.with_label_values(&[outcome]).get();
    let image = template_image();
    templates.put(&image_key("t1"), &png(&image)).await.unwrap();
    blobs.put("e1/mask", &png(&left_mask())).await.unwrap();
    let on_template = |job_id: &str, kind, mask: Option<&str>, prepared| PreprocessRequest {
        image_key: None,
        template_image: Some(TemplateImage {
            template_id: "t1".into(),
            prepared,
        }),
        ..request(job_id, kind, mask.map(str::to_string))
    };

    let capture = codec
        .preprocess(&on_template("cap", JobKind::Capture, None, None))
        .await
        .unwrap();
    let kept_key = prepared_image_key("t1");
    assert_eq!(capture.image_key, None);
    assert_eq!(
        capture.template_image_key.as_deref(),
        Some(kept_key.as_str())
    );
    let kept = templates.get(&kept_key).await.unwrap();
    assert_eq!(kept.len(), 16 * 16 * 3);
    assert!(blobs.get(&blob_key("cap", PREPARED_IMAGE)).await.is_err());
    let content_hash = capture.template_id.clone().unwrap();
    assert_eq!((count("miss"), count("hit")), (1, 0));

    // Templates' images are never re-read while cached: remove it from the bucket to prove it.
    templates.delete(&image_key("t1")).await.unwrap();
    let prepared = PreparedTemplate {
        key: kept_key.clone(),
        content_hash: content_hash.clone(),
    };
    let edit = codec
        .preprocess(&on_template(
            "e1",
            JobKind::Edit,
            Some("e1/mask"),
            Some(prepared),
        ))
        .await
        .unwrap();
    assert_eq!(
        edit.image_key, None,
        "an edit of a kept template copies no pixels"
    );
    assert_eq!(edit.template_image_key.as_deref(), Some(kept_key.as_str()));
    assert_eq!(edit.template_id.as_deref(), Some(content_hash.as_str()));
    assert_eq!((edit.input_width, edit.input_height), (30, 20));
    assert!(edit.mask_ratio > 0.0 && edit.mask_ratio < 1.0);
    assert_eq!((count("miss"), count("hit")), (1, 1));

    // Captured before the pixels were kept: the edit makes them, hashed as the capture's were.
    let legacy = codec
        .preprocess(&on_template("e2", JobKind::Edit, Some("e1/mask"), None))
        .await
        .unwrap();
    assert_eq!(legacy.template_image_key, None);
    let made = blobs
        .get(legacy.image_key.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(made, kept);
    assert_eq!(legacy.template_id.as_deref(), Some(content_hash.as_str()));
    assert_eq!((count("miss"), count("hit")), (1, 2));

    // Post: the edit is composited onto the template's own pixels, read from the cache.
    let output = vec![7u8; 16 * 16 * 3];
    blobs.put("e1/out-0", &output).await.unwrap();
    let template = TemplateRef {
        template_id: "t1".into(),
        prompt: String::new(),
        seed: 1,
        steps: 4,
        guidance_scale: 1.0,
        cache_key: String::new(),
    };
    let job = DenoiseJob {
        job_id: "e1".into(),
        kind: JobKind::Edit,
        params: request("e1", JobKind::Edit, None).params,
        inputs: edit,
        raw_image_key: None,
        raw_mask_key: Some("e1/mask".into()),
        attempt: 0,
        template: Some(template),
    };
    let keys = codec
        .postprocess(&PostprocessRequest {
            job,
            output_keys: vec!["e1/out-0".into()],
            model_width: 16,
            model_height: 16,
        })
        .await
        .unwrap();
    let result = image::load_from_memory(&blobs.get(&keys[0]).await.unwrap())
        .unwrap()
        .to_rgb8();
    let original = image.to_rgb8();
    assert_eq!(result.dimensions(), (30, 20));
    for (x, y, pixel) in result.enumerate_pixels() {
        if x >= 5 {
            assert_eq!(pixel, original.get_pixel(x, y), "unmasked pixel ({x}, {y})");
        }
    }
    assert_eq!(result.get_pixel(0, 0), &Rgb([7, 7, 7]), "a repainted pixel");
    assert_eq!((count("miss"), count("hit")), (1, 3));

    // The same image uploaded with the same mask prepares the same tokens and hash.
    blobs.put("upload/image", &png(&image)).await.unwrap();
    let upload = codec
        .preprocess(&request("u1", JobKind::Edit, Some("e1/mask".into())))
        .await
        .unwrap();
    assert_eq!(upload.masked_tokens, legacy.masked_tokens);
    assert_eq!(upload.template_id.as_deref(), Some(content_hash.as_str()));
    let tokens =
        |p: &diffmesh_shared::wire::messages::PreparedInputs| p.token_mask_key.clone().unwrap();
    assert_eq!(
        blobs.get(&tokens(&upload)).await.unwrap(),
        blobs.get(&tokens(&legacy)).await.unwrap()
    );
}

/// A generation's control image is stretched to the model resolution (RGB u8) and named in the
/// prepared inputs; a generation without one prepares nothing; a non-image names its field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generations_control_image_is_prepared_at_the_model_resolution() {
    let nats = NatsServer::start();
    let (blobs, templates) = buckets(&nats).await;
    let codec = codec(&blobs, &templates, &decoded_lookups());
    let generation = |job_id: &str, control: Option<&str>| PreprocessRequest {
        image_key: None,
        control_image_key: control.map(str::to_string),
        ..request(job_id, JobKind::Generate, None)
    };
    let plain = codec.preprocess(&generation("g0", None)).await.unwrap();
    assert_eq!(plain.control_image_key, None);

    // 30x20, left half white: at 16x16 the left columns stay white, the right black.
    let mut img = RgbImage::new(30, 20);
    for (x, _, p) in img.enumerate_pixels_mut() {
        *p = if x < 15 {
            Rgb([255, 255, 255])
        } else {
            Rgb([0, 0, 0])
        };
    }
    blobs
        .put("upload/control", &png(&DynamicImage::ImageRgb8(img)))
        .await
        .unwrap();
    let steered = codec
        .preprocess(&generation("g1", Some("upload/control")))
        .await
        .unwrap();
    let key = steered.control_image_key.expect("a prepared control image");
    let rgb = blobs.get(&key).await.unwrap();
    assert_eq!(rgb.len(), 16 * 16 * 3);
    let pixel = |x: usize, y: usize| rgb[(y * 16 + x) * 3];
    assert_eq!((pixel(1, 8), pixel(14, 8)), (255, 0));

    blobs.put("upload/control", b"not an image").await.unwrap();
    match codec
        .preprocess(&generation("g2", Some("upload/control")))
        .await
    {
        Err(CodecError::Invalid(field)) => assert_eq!(field.field, "controlnet.image"),
        other => panic!("expected an invalid control image, got {other:?}"),
    }
    // A request that listed its one ControlNet (`controlnets`) hears of the list's item.
    let listed = PreprocessRequest {
        controlnets_listed: true,
        ..generation("g3", Some("upload/control"))
    };
    match codec.preprocess(&listed).await {
        Err(CodecError::Invalid(field)) => assert_eq!(field.field, "controlnets[0].image"),
        other => panic!("expected an invalid control image, got {other:?}"),
    }
}
