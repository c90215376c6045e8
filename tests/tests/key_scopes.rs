//! With API keys on, a template and a LoRA belong to the key that registered them: another key
//! cannot read, list, use, or delete them, and is told 404 as for one that does not exist (so it
//! cannot even confirm the id); their owner can.
use diffmesh_tests::harness::template_form;
use diffmesh_tests::images::{png_bytes, rect_mask};
use diffmesh_tests::mesh::MeshBuilder;
use reqwest::multipart::{Form, Part};
use reqwest::Method;
use serde_json::{json, Value};

const ALICE: &str = "sk-alice";
const BOB: &str = "sk-bob";

async fn call(
    http: &reqwest::Client,
    method: Method,
    url: String,
    key: &str,
    form: Option<Form>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = http.request(method, url).bearer_auth(key);
    if let Some(form) = form {
        r = r.multipart(form);
    }
    if let Some(body) = body {
        r = r.json(&body);
    }
    let r = r.send().await.expect("request");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

#[track_caller]
fn assert_not_found(answer: &(u16, Value), field: &str) {
    assert_eq!(answer.0, 404, "{}", answer.1);
    assert_eq!(
        answer.1["error"]["error_type"], "not_found_error",
        "{}",
        answer.1
    );
    assert_eq!(answer.1["error"]["field"], field, "{}", answer.1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_key_cannot_see_use_or_delete_a_template_or_a_lora() {
    let mesh = MeshBuilder::new()
        .gateway(|g| g.api_keys = Some(format!("alice:{ALICE},bob:{BOB}")))
        .start()
        .await;
    let http = reqwest::Client::new();
    let (w, h) = (64, 64);

    let form = template_form(4);
    let (status, created) = call(
        &http,
        Method::POST,
        mesh.url("/v1/templates"),
        ALICE,
        Some(form),
        None,
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let template_id = created["id"].as_str().unwrap().to_string();

    let lora = diffmesh_shared::testing::lora_file(
        &[("transformer_blocks.0.attn.to_q".to_string(), 192, 192)],
        4,
        0.5,
        7,
    );
    let form = Form::new()
        .part("weights", Part::bytes(lora).file_name("style.safetensors"))
        .text("name", "style");
    let (status, lora) = call(
        &http,
        Method::POST,
        mesh.url("/v1/loras"),
        ALICE,
        Some(form),
        None,
    )
    .await;
    assert_eq!(status, 201, "{lora}");
    let lora_id = lora["id"].as_str().unwrap().to_string();

    // Bob: neither shows in his lists, and every read, use or delete is a 404.
    let template_url = mesh.url(&format!("/v1/templates/{template_id}"));
    let lora_url = mesh.url(&format!("/v1/loras/{lora_id}"));
    for (list, id) in [("/v1/templates", &template_id), ("/v1/loras", &lora_id)] {
        let (status, listed) = call(&http, Method::GET, mesh.url(list), BOB, None, None).await;
        assert_eq!(status, 200, "{listed}");
        assert!(!listed.to_string().contains(id.as_str()), "{listed}");
    }
    for method in [Method::GET, Method::DELETE] {
        let answer = call(&http, method.clone(), template_url.clone(), BOB, None, None).await;
        assert_not_found(&answer, "template_id");
        let answer = call(&http, method, lora_url.clone(), BOB, None, None).await;
        assert_not_found(&answer, "lora_id");
    }
    let edit = Form::new()
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(w, h, 10, 10, 30, 30))).file_name("m.png"),
        )
        .text("template_id", template_id.clone())
        .text("prompt", "a red square");
    let answer = call(
        &http,
        Method::POST,
        mesh.url("/v1/images/edits"),
        BOB,
        Some(edit),
        None,
    )
    .await;
    assert_not_found(&answer, "template_id");
    let generation = json!({"prompt": "a red circle", "num_inference_steps": 2,
        "loras": [{"id": lora_id, "scale": 1.0}]});
    let answer = call(
        &http,
        Method::POST,
        mesh.url("/v1/images/generations"),
        BOB,
        None,
        Some(generation.clone()),
    )
    .await;
    assert_eq!(answer.0 / 100, 4, "{}", answer.1);
    assert!(
        answer.1["error"]["field"]
            .as_str()
            .is_some_and(|f| f.starts_with("loras")),
        "{}",
        answer.1
    );

    // Alice still has both, and uses and deletes them.
    let (status, _) = call(&http, Method::GET, template_url.clone(), ALICE, None, None).await;
    assert_eq!(status, 200);
    let (status, body) = call(
        &http,
        Method::POST,
        mesh.url("/v1/images/generations"),
        ALICE,
        None,
        Some(generation),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = call(&http, Method::DELETE, lora_url, ALICE, None, None).await;
    assert_eq!(status / 100, 2, "{body}");
    let (status, body) = call(&http, Method::DELETE, template_url, ALICE, None, None).await;
    assert_eq!(status / 100, 2, "{body}");
}
