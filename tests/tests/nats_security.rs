//! The mesh on a NATS server that refuses anonymous connections, each service connected as its
//! own user with only the subjects its role needs (`shared::nats::auth`): an anonymous client
//! is refused; sync and async generations and a template edit run end to end with no
//! permission violation anywhere; and a client holding one service's credentials cannot
//! publish outside them (the gateway's cannot hand a denoiser work or fake a heartbeat, the
//! codec's cannot submit to the router, the router's cannot fake a heartbeat).
use std::time::Duration;

use diffmesh_shared::nats::auth::{mesh_users, server_config, Role, User};
use diffmesh_shared::testing::NatsServer;
use diffmesh_tests::harness::{
    init_test_logging, scrape_metrics, start_cachestore, start_codec, start_denoiser,
    start_gateway, start_router, tiny_model_dir,
};
use diffmesh_tests::images::{png_bytes, rect_mask, template};
use futures::StreamExt;
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};

fn creds(users: &[User], role: Role) -> (Option<String>, Option<String>) {
    let u = users
        .iter()
        .find(|u| u.name == role.name())
        .expect("a user per role");
    (Some(u.name.clone()), Some(u.password.clone()))
}

/// A client connected as `name`, with the server errors it is told (permission violations).
async fn connect_as(
    nats: &NatsServer,
    users: &[User],
    name: &str,
) -> (
    async_nats::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let u = users.iter().find(|u| u.name == name).unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let client =
        async_nats::ConnectOptions::with_user_and_password(u.name.clone(), u.password.clone())
            .event_callback(move |event| {
                let tx = tx.clone();
                async move {
                    if let async_nats::Event::ServerError(e) = event {
                        let _ = tx.send(e.to_string());
                    }
                }
            })
            .connect(nats.url())
            .await
            .expect("connect with credentials");
    (client, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_connect_as_their_role_and_nothing_else_gets_through() {
    init_test_logging();
    let users = mesh_users().unwrap();
    let nats = NatsServer::start_with_config(&server_config(&users));

    // Anonymous: refused.
    let anonymous = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(nats.url())
        .await;
    assert!(anonymous.is_err(), "an anonymous client was let in");

    let (u, p) = creds(&users, Role::Codec);
    let codec = start_codec(&nats, |c| {
        (c.common.nats_user, c.common.nats_password) = (u, p)
    })
    .expect("codec");
    let (u, p) = creds(&users, Role::Cachestore);
    let disk = tempfile::tempdir().unwrap();
    let cachestore = start_cachestore(&nats, disk.path(), |c| {
        (c.common.nats_user, c.common.nats_password) = (u, p)
    })
    .expect("cachestore");
    let (u, p) = creds(&users, Role::Router);
    let router = start_router(&nats, |c| {
        (c.common.nats_user, c.common.nats_password) = (u, p)
    })
    .expect("router");
    let (u, p) = creds(&users, Role::Gateway);
    let gateway = start_gateway(&nats, |c| {
        (c.common.nats_user, c.common.nats_password) = (u, p)
    })
    .expect("gateway");
    let model = tiny_model_dir().expect("weights/tiny (the default model) is missing");
    let (u, p) = creds(&users, Role::Denoiser);
    let denoiser = start_denoiser(&nats, &model, "d1", |c| {
        (c.common.nats_user, c.common.nats_password) = (u, p)
    })
    .expect("denoiser");
    for s in [&codec, &cachestore, &router, &gateway, &denoiser] {
        s.wait_ready(Duration::from_secs(30)).await.expect("ready");
    }
    let api = gateway.addrs.api.unwrap();
    let url = |path: &str| format!("http://{api}{path}");
    let http = reqwest::Client::new();

    // The mesh works: a generation, an async one, a template and an edit of it.
    let r = http
        .post(url("/v1/images/generations"))
        .json(&json!({"prompt": "a red circle", "num_inference_steps": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let r = http
        .post(url("/v1/images/generations"))
        .header("Prefer", "respond-async")
        .json(&json!({"prompt": "a red circle", "num_inference_steps": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let job: Value = r.json().await.unwrap();
    let job_url = url(&format!("/v1/jobs/{}", job["id"].as_str().unwrap()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let view: Value = http
            .get(&job_url)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if view["status"] == "done" {
            break;
        }
        assert!(
            view["status"] == "queued" || view["status"] == "running",
            "{view}"
        );
        assert!(tokio::time::Instant::now() < deadline, "{view}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (w, h) = (64, 64);
    let form = Form::new()
        .part(
            "image",
            Part::bytes(png_bytes(&template(w, h))).file_name("t.png"),
        )
        .text("prompt", "a blue background")
        .text("num_inference_steps", "4");
    let r = http
        .post(url("/v1/templates"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let created: Value = r.json().await.unwrap();
    let form = Form::new()
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(w, h, 10, 10, 30, 30))).file_name("m.png"),
        )
        .text("template_id", created["id"].as_str().unwrap().to_string())
        .text("prompt", "a red square");
    let r = http
        .post(url("/v1/images/edits"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    // No service was refused anything on the way (the services share this process's counter).
    let metrics = scrape_metrics(gateway.addrs.health).await.unwrap();
    let refused = metrics
        .lines()
        .filter(|l| {
            l.starts_with("diffmesh_nats_connection_events_total") && l.contains("server_error")
        })
        .filter(|l| !l.ends_with(" 0"))
        .collect::<Vec<_>>();
    assert!(
        refused.is_empty(),
        "server errors (permissions?): {refused:?}"
    );

    // Credentials do not reach beyond their role.
    let (admin, _) = connect_as(&nats, &users, "admin").await;
    let mut watched = admin.subscribe("diffmesh.denoiser.>").await.unwrap();
    let mut submits = admin.subscribe("diffmesh.router.submit").await.unwrap();
    admin.flush().await.unwrap();
    for (who, subject) in [
        ("gateway", "diffmesh.denoiser.d1.submit"),
        ("gateway", "diffmesh.denoiser.heartbeat"),
        ("router", "diffmesh.denoiser.heartbeat"),
        ("codec", "diffmesh.router.submit"),
    ] {
        let (client, mut errors) = connect_as(&nats, &users, who).await;
        client.publish(subject, "forged".into()).await.unwrap();
        client.flush().await.unwrap();
        let told = tokio::time::timeout(Duration::from_secs(5), errors.recv())
            .await
            .expect("no permission error")
            .unwrap();
        assert!(
            told.to_lowercase().contains("permissions violation"),
            "{who} -> {subject}: {told}"
        );
    }
    // Nothing forged arrived (real heartbeats and the mesh's own traffic do, without end).
    let until = tokio::time::Instant::now() + Duration::from_secs(1);
    while let Ok(Some(m)) = tokio::time::timeout_at(until, watched.next()).await {
        assert_ne!(&m.payload[..], b"forged", "{}", m.subject);
    }
    while let Ok(Some(m)) = tokio::time::timeout_at(until, submits.next()).await {
        assert_ne!(&m.payload[..], b"forged", "{}", m.subject);
    }
    drop((denoiser, gateway, router, cachestore, codec));
}
