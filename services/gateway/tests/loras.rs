//! The LoRA registry of a running gateway against a real JetStream: register a LoRA file
//! (written with `shared::wire::lora::write_f32_safetensors`, laid out as diffusers'
//! `save_lora_weights` does), list it, get it, refuse broken or oversized files naming
//! `weights`, refuse image requests naming LoRAs that are not registered (`loras[i].id`) or with bad entries, pass a registered one
//! into the job's `GenerationParams`, and delete it (record and weights); with API keys, each
//! key sees and uses only its own LoRAs. Only NATS and the gateway run; the test answers the
//! codec's subject itself where a request gets that far.
mod common;

use std::time::Duration;

use common::{answer_codec_once, field, png};
use diffmesh_gateway::{start, GatewayConfig, GatewayHandle};
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::jetstream_layout::LORA_WEIGHTS;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::lora::{weights_key, LoraRef};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const Q: &str = "transformer.transformer_blocks.0.attn.to_q";
/// The test gateway's `--max-lora-bytes`.
const MAX_LORA_BYTES: usize = 64 * 1024;

/// A LoRA file of f32 tensors `(key, shape)`.
fn lora_file(tensors: &[(String, Vec<usize>)]) -> Vec<u8> {
    let data: Vec<(String, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .map(|(key, shape)| {
            let n: usize = shape.iter().product();
            (
                key.clone(),
                shape.clone(),
                (0..n).map(|i| i as f32 * 1e-3).collect(),
            )
        })
        .collect();
    diffmesh_shared::wire::lora::write_f32_safetensors(&data, None).unwrap()
}

/// The file the brief asks for: one rank-4 adapter of `to_q` (192 features).
fn tiny_lora(rank: usize, features: usize) -> Vec<u8> {
    lora_file(&[
        (format!("{Q}.lora_A.weight"), vec![rank, features]),
        (format!("{Q}.lora_B.weight"), vec![features, rank]),
    ])
}

struct Api {
    base: String,
    http: reqwest::Client,
    /// The Bearer token sent with every request (none: authentication is off).
    key: Option<&'static str>,
}

impl Api {
    fn new(gateway: &GatewayHandle, key: Option<&'static str>) -> Self {
        Self {
            base: format!("http://{}", gateway.addr),
            http: reqwest::Client::new(),
            key,
        }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, format!("{}{path}", self.base));
        match self.key {
            Some(key) => builder.bearer_auth(key),
            None => builder,
        }
    }

    async fn register(&self, weights: Vec<u8>, name: Option<&str>) -> (u16, Value) {
        let mut form = Form::new().part(
            "weights",
            Part::bytes(weights).file_name("pytorch_lora_weights.safetensors"),
        );
        if let Some(name) = name {
            form = form.text("name", name.to_string());
        }
        let r = self
            .request(reqwest::Method::POST, "/v1/loras")
            .multipart(form)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    async fn call(&self, method: reqwest::Method, path: &str) -> (u16, Value) {
        let r = self.request(method, path).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    async fn generate(&self, body: Value) -> (u16, Value) {
        let r = self
            .request(reqwest::Method::POST, "/v1/images/generations")
            .json(&body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    async fn edit(&self, form: Form) -> (u16, Value) {
        let r = self
            .request(reqwest::Method::POST, "/v1/images/edits")
            .multipart(form)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }
}

/// The field a 4xx names, after checking the body is the documented error.
async fn gateway(
    nats: &NatsServer,
    api_keys: Option<&str>,
    spool: &std::path::Path,
) -> GatewayHandle {
    let mut config = GatewayConfig::for_tests(nats.url());
    config.upload_spool_dir = Some(spool.to_path_buf());
    config.max_lora_bytes = MAX_LORA_BYTES;
    config.api_keys = api_keys.map(str::to_string);
    // No codec runs: a request that gets past validation ends quickly.
    config.submit_wait = Duration::from_secs_f64(0.5);
    start(config).await.expect("gateway")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loras_are_registered_listed_checked_in_requests_and_deleted() {
    let nats = NatsServer::start();
    let spool = tempfile::tempdir().unwrap();
    let gateway = gateway(&nats, None, spool.path()).await;
    let api = Api::new(&gateway, None);

    // Register: 201 with the record.
    let file = tiny_lora(4, 192);
    let (status, ink) = api.register(file.clone(), Some("ink")).await;
    assert_eq!(status, 201, "{ink}");
    let id = ink["id"].as_str().unwrap().to_string();
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
    assert_eq!(ink["object"], "lora");
    assert_eq!(ink["name"], "ink");
    assert_eq!(
        (&ink["modules"], &ink["max_rank"], &ink["parameters"]),
        (&json!(1), &json!(4), &json!(2 * 4 * 192))
    );
    assert_eq!(
        (&ink["dtype"], &ink["bytes"]),
        (&json!("F32"), &json!(file.len()))
    );
    let sha: String = Sha256::digest(&file)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(ink["sha256"], sha);
    let created = ink["created_at"].as_str().unwrap();
    assert!(
        created.len() == 24 && created.ends_with('Z') && created.as_bytes()[10] == b'T',
        "{created}"
    );

    // Its weights are stored as uploaded.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let weights = BlobStore::open_with(&js, &LORA_WEIGHTS).await.unwrap();
    assert_eq!(weights.get(&weights_key(&id)).await.unwrap(), file);

    // A second one, unnamed, registered later: listed after the first.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let (status, plain) = api.register(tiny_lora(2, 192), None).await;
    assert_eq!(status, 201, "{plain}");
    assert_eq!(plain["name"], Value::Null);
    let plain_id = plain["id"].as_str().unwrap().to_string();
    let (status, list) = api.call(reqwest::Method::GET, "/v1/loras").await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["object"], "list");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [id.as_str(), plain_id.as_str()]);

    // Get: the same record; an unknown id (or no UUID at all) is a 404 naming `lora_id`.
    let (status, got) = api
        .call(reqwest::Method::GET, &format!("/v1/loras/{id}"))
        .await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got, ink);
    let unknown = uuid::Uuid::new_v4().to_string();
    for path in [
        format!("/v1/loras/{unknown}"),
        "/v1/loras/not-an-id".to_string(),
    ] {
        let (status, body) = api.call(reqwest::Method::GET, &path).await;
        assert_eq!(field(status, &body, 404), "lora_id", "{path}");
        assert_eq!(body["error"]["error_type"], "not_found_error");
    }

    // Broken files are refused naming `weights`, and the message names the key at fault.
    let half = lora_file(&[(format!("{Q}.lora_A.weight"), vec![4, 192])]);
    let (status, body) = api.register(half, None).await;
    assert_eq!(field(status, &body, 400), "weights");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("{Q}: needs both lora_A.weight and lora_B.weight")),
        "{message}"
    );
    let text_encoder = lora_file(&[("text_encoder.x.lora_A.weight".into(), vec![4, 8])]);
    let (status, body) = api.register(text_encoder, None).await;
    assert_eq!(field(status, &body, 400), "weights");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("text_encoder.x.lora_A.weight"));
    // Too large (rank 8 of 1024 features: 64 KiB of A and as much of B), no file, long name.
    let (status, body) = api.register(tiny_lora(8, 1024), None).await;
    assert_eq!(field(status, &body, 413), "weights");
    let r = api
        .http
        .post(format!("{}/v1/loras", api.base))
        .multipart(Form::new().text("name", "no file"))
        .send()
        .await
        .unwrap();
    let (status, body) = (r.status().as_u16(), r.json::<Value>().await.unwrap());
    assert_eq!(field(status, &body, 400), "weights");
    let (status, body) = api
        .register(tiny_lora(4, 192), Some(&"n".repeat(201)))
        .await;
    assert_eq!(field(status, &body, 400), "name");
    let (_, list) = api.call(reqwest::Method::GET, "/v1/loras").await;
    assert_eq!(
        list["data"].as_array().unwrap().len(),
        2,
        "refused uploads left nothing"
    );
    // Uploads were streamed through the spool directory, and none is left there.
    let spooled: Vec<_> = std::fs::read_dir(spool.path()).unwrap().collect();
    assert!(spooled.is_empty(), "spool files left behind: {spooled:?}");

    // Generations: unknown ids, bad scales, duplicates and too many are 400s naming the entry.
    let gen = |loras: Value| json!({"prompt": "a red circle", "loras": loras});
    let five: Vec<Value> = [&id, &plain_id, &unknown, &unknown, &unknown]
        .iter()
        .map(|id| json!({"id": id}))
        .collect();
    let cases = [
        (json!([{"id": unknown}]), "loras[0].id"),
        (
            json!([{"id": id}, {"id": unknown, "scale": 0.5}]),
            "loras[1].id",
        ),
        (json!([{"id": id, "scale": 8.5}]), "loras[0].scale"),
        (json!([{"id": id}, {"id": id}]), "loras[1].id"),
        (json!([{"id": id, "weight": 1}]), "loras[0].weight"),
        (json!([{"id": "lora-1"}]), "loras[0].id"),
        (json!({"id": id}), "loras"),
        (Value::Array(five), "loras"),
    ];
    for (loras, want) in cases {
        let (status, body) = api.generate(gen(loras.clone())).await;
        assert_eq!(field(status, &body, 400), want, "{loras}");
    }
    let (status, body) = api.generate(gen(json!([{"id": unknown}]))).await;
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&unknown),
        "{body}"
    );

    // Registered LoRAs pass and reach the codec's request in `params.loras`: the test answers
    // as the codec, with a field error of its own so the request ends there.
    let seen = answer_codec_once(client).await;
    let (status, body) = api
        .generate(gen(json!([{"id": plain_id, "scale": -0.5}, {"id": id}])))
        .await;
    assert_eq!(field(status, &body, 400), "codec");
    let want = vec![
        LoraRef {
            id: plain_id.clone(),
            scale: -0.5,
        },
        LoraRef {
            id: id.clone(),
            scale: 1.0,
        },
    ];
    assert_eq!(seen.await.unwrap().params.loras, want);

    // Edits take the same array as a text field; not with a registered template.
    let edit = |loras: String| {
        Form::new()
            .part("image", Part::bytes(png(8, 8)).file_name("i.png"))
            .text("prompt", "a red circle")
            .text("loras", loras)
    };
    let (status, body) = api.edit(edit(format!(r#"[{{"id": "{unknown}"}}]"#))).await;
    assert_eq!(field(status, &body, 400), "loras[0].id");
    let (status, body) = api.edit(edit("[{".into())).await;
    assert_eq!(field(status, &body, 400), "loras");
    let by_template = Form::new()
        .text("template_id", uuid::Uuid::new_v4().to_string())
        .text("prompt", "a red circle")
        .text("loras", format!(r#"[{{"id": "{id}"}}]"#));
    let (status, body) = api.edit(by_template).await;
    assert_eq!(field(status, &body, 400), "loras");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("activation cache"));

    // Delete: record and weights go; then it is unknown everywhere.
    let (status, body) = api
        .call(reqwest::Method::DELETE, &format!("/v1/loras/{id}"))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"id": id, "object": "lora", "deleted": true}));
    assert!(
        weights.get(&weights_key(&id)).await.is_err(),
        "the weights are gone"
    );
    let (status, body) = api
        .call(reqwest::Method::GET, &format!("/v1/loras/{id}"))
        .await;
    assert_eq!(field(status, &body, 404), "lora_id");
    let (status, body) = api
        .call(reqwest::Method::DELETE, &format!("/v1/loras/{id}"))
        .await;
    assert_eq!(field(status, &body, 404), "lora_id");
    let (status, body) = api.generate(gen(json!([{"id": id}]))).await;
    assert_eq!(field(status, &body, 400), "loras[0].id");
    let (_, list) = api.call(reqwest::Method::GET, "/v1/loras").await;
    assert_eq!(list["data"][0]["id"], plain_id);
    assert_eq!(list["data"].as_array().unwrap().len(), 1);

    // Counted like the template endpoints: by endpoint and status.
    let metrics = api
        .http
        .get(format!("http://{}/metrics", gateway.health_addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for series in [
        r#"endpoint="loras_create",status="201"} 2"#,
        r#"endpoint="loras_create",status="413"} 1"#,
        r#"endpoint="lora_delete",status="200"} 1"#,
        r#"endpoint="lora_delete",status="404"} 1"#,
    ] {
        assert!(metrics.contains(series), "{series} not in\n{metrics}");
    }
    gateway.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loras_are_scoped_to_the_api_key_that_registered_them() {
    let nats = NatsServer::start();
    let spool = tempfile::tempdir().unwrap();
    let gateway = gateway(&nats, Some("alice:sk-alice,bob:sk-bob"), spool.path()).await;
    let alice = Api::new(&gateway, Some("sk-alice"));
    let bob = Api::new(&gateway, Some("sk-bob"));
    let nobody = Api::new(&gateway, None);

    let (status, body) = nobody.register(tiny_lora(4, 192), None).await;
    assert_eq!(status, 401, "{body}");
    let (status, a) = alice.register(tiny_lora(4, 192), Some("alice's")).await;
    assert_eq!(status, 201, "{a}");
    let a_id = a["id"].as_str().unwrap().to_string();
    assert!(a.get("owner").is_none(), "the owner is not shown: {a}");
    let (status, b) = bob.register(tiny_lora(2, 192), Some("bob's")).await;
    assert_eq!(status, 201, "{b}");
    let b_id = b["id"].as_str().unwrap().to_string();

    // The record keeps the key that registered it.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let records = diffmesh_shared::stores::jetstream_layout::LORA_RECORDS
        .open_kv(&js)
        .await
        .unwrap();
    let stored: diffmesh_shared::wire::lora::LoraRecord =
        serde_json::from_slice(&records.get(&a_id).await.unwrap().unwrap()).unwrap();
    assert_eq!(stored.owner.as_deref(), Some("alice"));

    // Each key lists only its own.
    let ids = |list: &Value| -> Vec<String> {
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_str().unwrap().to_string())
            .collect()
    };
    let (status, list) = alice.call(reqwest::Method::GET, "/v1/loras").await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(ids(&list), [a_id.as_str()]);
    let (_, list) = bob.call(reqwest::Method::GET, "/v1/loras").await;
    assert_eq!(ids(&list), [b_id.as_str()]);
    let (status, body) = nobody.call(reqwest::Method::GET, "/v1/loras").await;
    assert_eq!(status, 401, "{body}");

    // Another key's LoRA is a 404 naming `lora_id`, as one that does not exist.
    let a_path = format!("/v1/loras/{a_id}");
    let (status, body) = bob.call(reqwest::Method::GET, &a_path).await;
    assert_eq!(field(status, &body, 404), "lora_id");
    assert_eq!(body["error"]["error_type"], "not_found_error");
    let (status, got) = alice.call(reqwest::Method::GET, &a_path).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got, a);

    // ... and using it is refused as for an unregistered one: 400 naming the entry.
    let gen = |loras: Value| json!({"prompt": "a red circle", "loras": loras});
    let (status, body) = bob.generate(gen(json!([{"id": a_id}]))).await;
    assert_eq!(field(status, &body, 400), "loras[0].id");
    let (status, body) = bob
        .generate(gen(json!([{"id": b_id}, {"id": a_id, "scale": 0.5}])))
        .await;
    assert_eq!(field(status, &body, 400), "loras[1].id");
    let edit = |loras: String| {
        Form::new()
            .part("image", Part::bytes(png(8, 8)).file_name("i.png"))
            .text("prompt", "a red circle")
            .text("loras", loras)
    };
    let (status, body) = bob.edit(edit(format!(r#"[{{"id": "{a_id}"}}]"#))).await;
    assert_eq!(field(status, &body, 400), "loras[0].id");

    // Its owner's requests carry it to the codec.
    let seen = answer_codec_once(client.clone()).await;
    let (status, body) = alice.generate(gen(json!([{"id": a_id}]))).await;
    assert_eq!(field(status, &body, 400), "codec");
    let want = vec![LoraRef {
        id: a_id.clone(),
        scale: 1.0,
    }];
    assert_eq!(seen.await.unwrap().params.loras, want);
    let seen = answer_codec_once(client.clone()).await;
    let (status, body) = alice
        .edit(edit(format!(r#"[{{"id": "{a_id}", "scale": 2}}]"#)))
        .await;
    assert_eq!(field(status, &body, 400), "codec");
    let want = vec![LoraRef {
        id: a_id.clone(),
        scale: 2.0,
    }];
    assert_eq!(seen.await.unwrap().params.loras, want);

    // Another key cannot delete it: 404, and it stays.
    let (status, body) = bob.call(reqwest::Method::DELETE, &a_path).await;
    assert_eq!(field(status, &body, 404), "lora_id");
    let (status, body) = alice.call(reqwest::Method::GET, &a_path).await;
    assert_eq!(status, 200, "{body}");
    let weights = BlobStore::open_with(&js, &LORA_WEIGHTS).await.unwrap();
    assert!(weights.get(&weights_key(&a_id)).await.is_ok());

    // Its owner can.
    let (status, body) = alice.call(reqwest::Method::DELETE, &a_path).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"id": a_id, "object": "lora", "deleted": true}));
    let (status, body) = alice.call(reqwest::Method::GET, &a_path).await;
    assert_eq!(field(status, &body, 404), "lora_id");
    let (_, list) = bob.call(reqwest::Method::GET, "/v1/loras").await;
    assert_eq!(ids(&list), [b_id.as_str()]);
    gateway.shutdown().await;
}
