//! The official `openai` Python SDK (pinned in `xtask/src/toolchain.rs`) against an in-process
//! mesh, unchanged but for `base_url` (python/sdk/openai_images.py): generations with n = 2 (PNG,
//! and JPEG at size `auto` with `output_compression`, `quality`, `background` and `user`), WebP, a
//! signed result URL (`response_format="url"`) read without the key (a tampered one: 401),
//! edits with `image` and with `image=[...]` (the SDK's `image[]`), two variations
//! (`images.create_variation`), streamed answers
//! (`stream=True` with `partial_images`: a generation as JPEG and an edit, their partial images
//! then the completed image with `usage`), a 400 whose exception carries
//! `param`, `type` and `code`, and a 429 the SDK raises as `RateLimitError`.
use std::process::Command;

use diffmesh_tests::mesh::MeshBuilder;
use serde_json::{json, Value};

const KEY: &str = "sk-alice";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdk_generates_edits_and_reads_errors() {
    let mesh = MeshBuilder::new()
        .gateway(|g| {
            g.api_keys = Some(format!("alice:{KEY}"));
            // Ten image requests, then 429 (the SDK retries nothing: max_retries=0).
            g.rate_limit_per_s = 0.001;
            g.rate_limit_burst = 10;
        })
        .start()
        .await;
    let python = std::env::var("DIFFMESH_PYTHON")
        .unwrap_or_else(|_| "/root/.cache/diffmesh/venv/bin/python".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../python/sdk/openai_images.py"
    );
    let base = mesh.url("/v1");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(&python)
            .args([script, &base, KEY, "tiny"])
            .output()
            .expect("the venv's python")
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the SDK run failed: {stderr}");
    let seen: Value = serde_json::from_slice(&out.stdout).expect("one JSON line");
    assert_eq!(seen["generate"], json!([[64, 64], [64, 64]]), "{seen}");
    // Two 64x64 images of 4-pixel tokens out; "a red square" is three words in.
    assert_eq!(
        seen["usage"],
        json!({"input_tokens": 3, "output_tokens": 512, "total_tokens": 515,
            "input_tokens_details": {"text_tokens": 3, "image_tokens": 0}}),
        "{seen}"
    );
    assert_eq!(seen["generate_jpeg"], json!(["JPEG", "JPEG"]), "{seen}");
    assert_eq!(seen["generate_webp"], json!(["WEBP"]), "{seen}");
    assert_eq!(
        seen["url"],
        json!({"content_type": "image/png", "size": [64, 64], "tampered": 401}),
        "{seen}"
    );
    assert_eq!(seen["edit"], json!([[64, 64]]), "{seen}");
    assert_eq!(seen["edit_list"], json!([[64, 64]]), "{seen}");
    assert_eq!(seen["variation"], json!([[64, 64], [64, 64]]), "{seen}");
    // The tiny model's token is 4 pixels (its codec halves, then 2x2 packing): 256 at 64x64.
    let jpeg = |kind: &str, index: Option<u32>| match index {
        Some(i) => json!({"type": kind, "format": "JPEG", "size": [64, 64], "index": i}),
        None => json!({"type": kind, "format": "JPEG", "size": [64, 64], "output_tokens": 256}),
    };
    assert_eq!(
        seen["stream"],
        json!([
            jpeg("image_generation.partial_image", Some(0)),
            jpeg("image_generation.partial_image", Some(1)),
            jpeg("image_generation.completed", None),
        ]),
        "{seen}"
    );
    assert_eq!(
        seen["stream_edit"],
        json!([
            {"type": "image_edit.partial_image", "format": "PNG", "size": [64, 64], "index": 0},
            {"type": "image_edit.completed", "format": "PNG", "size": [64, 64], "output_tokens": 256},
        ]),
        "{seen}"
    );
    let bad = &seen["bad_size"];
    assert_eq!(bad["status"], 400, "{seen}");
    assert_eq!(bad["param"], "size", "{seen}");
    assert_eq!(bad["type"], "invalid_request_error", "{seen}");
    assert_eq!(bad["code"], "invalid_request_error", "{seen}");
    let limited = &seen["rate_limited"];
    assert_eq!(limited["status"], 429, "{seen}");
    assert_eq!(limited["type"], "rate_limit_error", "{seen}");
    assert_eq!(limited["code"], "rate_limited", "{seen}");
}
