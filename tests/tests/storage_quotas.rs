//! Per-key storage quotas (`services/gateway/src/quotas.rs`): a key that keeps as many
//! templates or LoRAs as its quota allows gets 429 `quota_exceeded` naming the quota's flag, an
//! upload that would take its stored bytes past their quota 413; another key is not held back
//! by the first one's, and deleting makes room again.
use diffmesh_tests::harness::template_form;
use diffmesh_tests::mesh::MeshBuilder;
use reqwest::multipart::{Form, Part};
use serde_json::Value;

const KEYS: &str = "alice:sk-alice,bob:sk-bob,carol:sk-carol,dave:sk-dave";

async fn post(http: &reqwest::Client, url: String, key: &str, form: Form) -> (u16, Value) {
    let r = http
        .post(url)
        .bearer_auth(key)
        .multipart(form)
        .send()
        .await
        .expect("request");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

fn lora_form(rank: usize) -> Form {
    let weights = diffmesh_shared::testing::lora_file(
        &[("transformer_blocks.0.attn.to_q".to_string(), 192, 192)],
        rank,
        0.5,
        7,
    );
    Form::new().part(
        "weights",
        Part::bytes(weights).file_name("style.safetensors"),
    )
}

#[track_caller]
fn assert_quota(answer: &(u16, Value), status: u16, flag: &str) {
    assert_eq!(answer.0, status, "{}", answer.1);
    assert_eq!(
        answer.1["error"]["error_type"], "quota_exceeded",
        "{}",
        answer.1
    );
    let message = answer.1["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(flag), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_answer_their_status_naming_the_quota() {
    let mesh = MeshBuilder::new()
        .gateway(|g| {
            g.api_keys = Some(KEYS.into());
            g.max_templates_per_key = 1;
            g.max_loras_per_key = 1;
            // A template (its 64x64 PNG, about 11 KB) or a rank-4 LoRA of one 192x192 module (about
            // 6 KB) fits; a rank-16 one (about 25 KB) does not.
            g.max_stored_bytes_per_key = 20_000;
        })
        .start()
        .await;
    let http = reqwest::Client::new();
    let templates = mesh.url("/v1/templates");
    let loras = mesh.url("/v1/loras");

    // Templates: one each; alice's second is over her count, bob's first is not.
    let first = post(&http, templates.clone(), "sk-alice", template_form(2)).await;
    assert_eq!(first.0, 201, "{}", first.1);
    let again = post(&http, templates.clone(), "sk-alice", template_form(2)).await;
    assert_quota(&again, 429, "--max-templates-per-key");
    let bob = post(&http, templates.clone(), "sk-bob", template_form(2)).await;
    assert_eq!(bob.0, 201, "{}", bob.1);

    // LoRAs: carol's second is over her count; dave's first is over his bytes.
    let one = post(&http, loras.clone(), "sk-carol", lora_form(4)).await;
    assert_eq!(one.0, 201, "{}", one.1);
    let two = post(&http, loras.clone(), "sk-carol", lora_form(4)).await;
    assert_quota(&two, 429, "--max-loras-per-key");
    let big = post(&http, loras.clone(), "sk-dave", lora_form(16)).await;
    assert_quota(&big, 413, "--max-stored-bytes-per-key");

    // Deleting makes room.
    let id = first.1["id"].as_str().expect("template id");
    let deleted = http
        .delete(mesh.url(&format!("/v1/templates/{id}")))
        .bearer_auth("sk-alice")
        .send()
        .await
        .unwrap();
    assert!(deleted.status().is_success(), "{}", deleted.status());
    let after = post(&http, templates, "sk-alice", template_form(2)).await;
    assert_eq!(after.0, 201, "{}", after.1);
}
