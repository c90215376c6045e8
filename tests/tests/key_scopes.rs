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

/// `GET /v1/jobs` lists the caller's jobs alone, newest first, a page at a time, filtered by
/// status on request; bad parameters are 400s naming them, and another key's job id is no
/// page mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_lists_its_own_jobs_newest_first() {
    let mesh = MeshBuilder::new()
        .gateway(|g| g.api_keys = Some(format!("alice:{ALICE},bob:{BOB}")))
        .start()
        .await;
    let http = reqwest::Client::new();
    let submit = |key: &'static str, seed: u64| {
        let (http, url) = (http.clone(), mesh.url("/v1/images/generations"));
        async move {
            let r = http
                .post(url)
                .bearer_auth(key)
                .header("Prefer", "respond-async")
                .json(&json!({"prompt": "a red circle", "seed": seed, "num_inference_steps": 2}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 202);
            let body: Value = r.json().await.unwrap();
            body["id"].as_str().unwrap().to_string()
        }
    };
    let mut alice = Vec::new();
    for seed in 0..3 {
        alice.push(submit(ALICE, seed).await);
        // Distinct creation times, so newest-first is one order.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let bob = submit(BOB, 9).await;
    let list = |key: &'static str, query: &'static str| {
        let (http, url) = (http.clone(), mesh.url(&format!("/v1/jobs{query}")));
        async move { call(&http, Method::GET, url, key, None, None).await }
    };
    let ids = |page: &Value| -> Vec<String> {
        page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_str().unwrap().to_string())
            .collect()
    };
    let newest_first: Vec<String> = alice.iter().rev().cloned().collect();
    let (status, all) = list(ALICE, "").await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(
        (all["object"].as_str(), ids(&all)),
        (Some("list"), newest_first.clone())
    );
    let (_, first) = list(ALICE, "?limit=2").await;
    assert_eq!(ids(&first), newest_first[..2]);
    assert_eq!(
        (first["has_more"].as_bool(), first["last_id"].as_str()),
        (Some(true), Some(newest_first[1].as_str()))
    );
    let next = format!("?limit=2&after={}", newest_first[1]);
    let (_, second) = call(
        &http,
        Method::GET,
        mesh.url(&format!("/v1/jobs{next}")),
        ALICE,
        None,
        None,
    )
    .await;
    assert_eq!(ids(&second), newest_first[2..]);
    assert_eq!(second["has_more"], false);
    let (_, theirs) = list(BOB, "").await;
    assert_eq!(ids(&theirs), std::slice::from_ref(&bob));

    // Once they are done, a status filter keeps them or leaves them out.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (_, done) = list(ALICE, "?status=done").await;
        if ids(&done).len() == 3 {
            assert_eq!(ids(&done), newest_first);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "alice's jobs never all finished: {done}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let (_, failed) = list(ALICE, "?status=failed").await;
    assert!(ids(&failed).is_empty(), "{failed}");

    for (query, param) in [("?limit=0", "limit"), ("?status=finished", "status")] {
        let (status, body) = list(ALICE, query).await;
        assert_eq!(
            (status, body["error"]["param"].as_str()),
            (400, Some(param)),
            "{body}"
        );
    }
    let url = mesh.url(&format!("/v1/jobs?after={bob}"));
    let (status, body) = call(&http, Method::GET, url, ALICE, None, None).await;
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (400, Some("after")),
        "{body}"
    );
}
