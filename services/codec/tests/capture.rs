//! Capture preprocessing over a real nats-server: a template is prepared without a mask (every
//! token computed) and hashed exactly like an edit of the same image, so the capture's cache
//! and the template's edits share one `template_id`.
use std::io::Cursor;

use diffmesh_codec::decoded::DecodedImages;
use diffmesh_codec::handlers::{Codec, PREPARED_IMAGE};
use diffmesh_codec::imaging::TokenGrid;
use diffmesh_codec::CodecError;
use diffmesh_shared::messages::{GenerationParams, JobKind, PreprocessRequest};
use diffmesh_shared::nats::{blob_key, BlobStore};
use diffmesh_shared::testing::NatsServer;
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
            prompt: String::new(),
            n: 1,
            num_inference_steps: 4,
            guidance_scale: 1.0,
            seed: 1,
            width: 30,
            height: 20,
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture_is_prepared_without_mask_and_hashed_like_edits() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let blobs = BlobStore::open(&async_nats::jetstream::new(client))
        .await
        .unwrap();
    let lookups = decoded_lookups();
    let codec = Codec {
        blobs: blobs.clone(),
        grid: TokenGrid {
            model_width: 16,
            model_height: 16,
            token_pixels: 4,
        },
        max_pixels: 1 << 20,
        max_blob_bytes: 1 << 20,
        decoded: DecodedImages::new(1 << 20, lookups.clone()),
    };
    let image = DynamicImage::ImageRgb8(RgbImage::from_fn(30, 20, |x, y| {
        Rgb([(x * 8) as u8, (y * 12) as u8, (x ^ y) as u8])
    }));
    let mask = DynamicImage::ImageLuma8(GrayImage::from_fn(30, 20, |x, _| {
        Luma([if x < 5 { 255 } else { 0 }])
    }));
    blobs.put("upload/image", &png(&image)).await.unwrap();
    blobs.put("upload/mask", &png(&mask)).await.unwrap();

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
