//! The running gateway serves an OpenAPI 3 document at `/openapi.json` that documents every
//! route it serves, and each route answers a plain request with a status the document lists
//! for it (errors in the documented `{"error": {...}}` shape). Needs only NATS and the gateway
//! (image requests then fail for want of a codec: a documented 503).
use std::time::Duration;

use diffmesh_gateway::openapi::HEALTH_ROUTES;
use diffmesh_gateway::routes::routes;
use diffmesh_tests::harness::{init_test_logging, start_gateway, NatsServer};
use reqwest::Method;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_documents_every_route_and_matches_the_server() {
    init_test_logging();
    let nats = NatsServer::start();
    let gateway =
        start_gateway(&nats, |g| g.submit_wait = Duration::from_secs_f64(0.5)).expect("gateway");
    gateway.wait_ready(Duration::from_secs(10)).await.unwrap();
    let base = format!("http://{}", gateway.addrs.api.unwrap());
    let http = reqwest::Client::new();

    let r = http
        .get(format!("{base}/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    let doc: Value = r.json().await.expect("the document is JSON");
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3."),
        "{}",
        doc["openapi"]
    );
    let paths = doc["paths"].as_object().expect("paths");

    let mut served: Vec<(Method, String)> = routes()
        .into_iter()
        .map(|r| {
            (
                Method::from_bytes(r.method.as_str().as_bytes()).unwrap(),
                r.path.to_string(),
            )
        })
        .collect();
    served.extend(
        HEALTH_ROUTES
            .iter()
            .map(|(p, ..)| (Method::GET, p.to_string())),
    );
    let documented: usize = paths
        .values()
        .map(|item| item.as_object().unwrap().len())
        .sum();
    assert_eq!(
        documented,
        served.len(),
        "documented operations != served routes"
    );

    let job_id = "0b6f8f0e-9d1e-4c39-8d67-6a1f0c3b1f10";
    for (method, path) in &served {
        let op = &paths
            .get(path)
            .unwrap_or_else(|| panic!("{path} is not documented"))[method.as_str().to_lowercase()];
        let responses = op["responses"]
            .as_object()
            .unwrap_or_else(|| panic!("{method} {path} is not documented"));
        assert!(
            op["operationId"].is_string(),
            "{method} {path}: no operationId"
        );

        let url = format!("{base}{}", path.replace("{id}", job_id).replace("{n}", "0"));
        let mut req = http.request(method.clone(), &url);
        if path == "/v1/images/generations" {
            req =
                req.json(&serde_json::json!({"prompt": "a red circle", "num_inference_steps": 2}));
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16().to_string();
        assert!(
            responses.contains_key(&status),
            "{method} {path} answered {status}, not among the documented {:?}",
            responses.keys().collect::<Vec<_>>()
        );
        let is_json = r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json");
        if !r.status().is_success() {
            assert!(is_json, "{method} {path}: error is not JSON");
            let body: Value = r.json().await.unwrap();
            let err = &body["error"];
            assert!(
                err["message"].is_string() && err["error_type"].is_string(),
                "{body}"
            );
            assert!(err.get("field").is_some(), "{body}");
            let schema = &responses[&status]["content"]["application/json"]["schema"]["$ref"];
            assert_eq!(
                schema, "#/components/schemas/ErrorBody",
                "{method} {path} {status}"
            );
        }
    }
}
