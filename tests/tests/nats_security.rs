//! The mesh on a NATS server that refuses anonymous connections, each service connected as its
//! own user with only the subjects its role needs (`shared::nats::auth`): an anonymous client
//! is refused; sync and async generations, a template edit and a LoRA run end to end with no
//! permission violation anywhere; and a client holding one service's credentials cannot
//! publish outside them (the gateway's cannot hand a denoiser work or fake a heartbeat, the
//! codec's cannot submit to the router, the router's cannot fake a heartbeat). Over TLS, as
//! `compose/` runs it, only a client that checks the mesh's CA and logs in gets through. An
//! async job's webhook is relayed and posted under the gateway's grants. The
//! JetStream API is open to each role only for its own streams.
use std::time::Duration;

use diffmesh_shared::nats::auth::{mesh_users, server_config, Role, User};
use diffmesh_shared::testing::NatsServer;
use diffmesh_tests::harness::{
    init_test_logging, scrape_metrics, start_cachestore, start_codec, start_denoiser,
    start_gateway, start_router, template_form, tiny_model_dir,
};
use diffmesh_tests::images::{png_bytes, rect_mask};
use diffmesh_tests::webhook_receiver::WebhookReceiver;
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
    // Webhooks on: the relay and the senders consume under the gateway's grants too.
    let receiver = WebhookReceiver::start();
    let gateway = start_gateway(&nats, |c| {
        (c.common.nats_user, c.common.nats_password) = (u, p);
        c.webhooks.webhook_signing_key = Some("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into());
        c.webhooks.webhook_allow_http = true;
        c.webhooks.webhook_allow_private_addresses = true;
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
        .json(&json!({"prompt": "a red circle", "num_inference_steps": 4,
            "callback_url": receiver.url("/ok")}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let job: Value = r.json().await.unwrap();
    let posts = receiver
        .wait_for(job["id"].as_str().unwrap(), 1, Duration::from_secs(60))
        .await;
    assert_eq!(
        posts.len(),
        1,
        "the job's webhook, relayed and sent under the gateway's grants"
    );
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
    let form = template_form(4);
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
    // A LoRA: the gateway stores it, the denoiser reads its weights for a generation.
    let modules = [("transformer_blocks.0.attn.to_q".to_string(), 192, 192)];
    let weights = diffmesh_shared::testing::lora_file(&modules, 4, 0.6, 1);
    let form = Form::new().part("weights", Part::bytes(weights).file_name("s.safetensors"));
    let r = http
        .post(url("/v1/loras"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    let lora: Value = r.json().await.unwrap();
    let r = http
        .post(url("/v1/images/generations"))
        .json(&json!({"prompt": "a red circle", "num_inference_steps": 4,
                      "loras": [{"id": lora["id"], "scale": 1.0}]}))
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
        // No service may delete a bucket's stream or snapshot it, though each uses JetStream.
        ("gateway", "$JS.API.STREAM.DELETE.KV_diffmesh-jobs"),
        ("denoiser", "$JS.API.STREAM.SNAPSHOT.OBJ_diffmesh-blobs"),
        // The JetStream API only for a role's own streams: the codec reads no job record, the
        // gateway neither purges nor rescales the cache bucket, the denoiser does not purge
        // the LoRA weights it reads, and the controlnet worker has no JetStream at all.
        ("codec", "$JS.API.STREAM.MSG.GET.KV_diffmesh-jobs"),
        ("gateway", "$JS.API.STREAM.PURGE.OBJ_diffmesh-cache"),
        ("gateway", "$JS.API.STREAM.UPDATE.OBJ_diffmesh-cache"),
        ("denoiser", "$JS.API.STREAM.PURGE.OBJ_diffmesh-loras"),
        ("controlnet", "$JS.API.STREAM.INFO.KV_diffmesh-jobs"),
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

/// The mesh's NATS over TLS, as `compose/` runs it: the server's certificate is signed by the
/// mesh's own CA (`shared::nats::tls`), services check it (`--nats-ca-file`) and log in as
/// their user. A client without TLS, or trusting another CA, gets nowhere; a service with the
/// CA and its credentials connects and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_reach_nats_only_over_tls_checked_against_the_mesh_ca() {
    use diffmesh_shared::nats::tls::{mesh_certificates, server_tls_block};
    use diffmesh_shared::nats::{connect_as as connect_securely, NatsSecurity};
    init_test_logging();
    let dir = tempfile::tempdir().unwrap();
    let certs = mesh_certificates(&["localhost", "127.0.0.1"]).unwrap();
    let path = |name: &str| dir.path().join(name);
    std::fs::write(path("ca.pem"), &certs.ca_cert_pem).unwrap();
    std::fs::write(path("cert.pem"), &certs.server_cert_pem).unwrap();
    std::fs::write(path("key.pem"), &certs.server_key_pem).unwrap();
    // A CA of someone else, whose certificate the mesh's server does not have.
    let other = mesh_certificates(&["127.0.0.1"]).unwrap();
    std::fs::write(path("other-ca.pem"), &other.ca_cert_pem).unwrap();

    let users = mesh_users().unwrap();
    let text = |name: &str| path(name).display().to_string();
    let config = format!(
        "{}{}",
        server_config(&users),
        server_tls_block(&text("cert.pem"), &text("key.pem"), &text("ca.pem"))
    );
    let nats = NatsServer::start_with_config(&config);
    let (user, password) = creds(&users, Role::Router);
    let (user, password) = (user.unwrap(), password.unwrap());
    let quick = Duration::from_millis(300);

    // The server takes no plain text: its greeting asks for TLS before anything else.
    let port: u16 = nats.url().rsplit(':').next().unwrap().parse().unwrap();
    let mut raw = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut greeting = [0u8; 2048];
    let n = std::io::Read::read(&mut raw, &mut greeting).unwrap();
    let greeting = String::from_utf8_lossy(&greeting[..n]);
    assert!(greeting.contains("\"tls_required\":true"), "{greeting}");
    let kind = |err: diffmesh_shared::MeshError| match err {
        diffmesh_shared::MeshError::Connect { source, .. } => source.kind(),
        other => panic!("not a connect error: {other}"),
    };
    use async_nats::ConnectErrorKind;
    // The right password, without TLS: the server hangs up (no time-out: refused at once).
    let plain = NatsSecurity {
        credentials: Some((&user, &password)),
        ca_file: None,
    };
    let err = connect_securely(&nats.url(), "plain", quick, plain).await;
    let refused = kind(err.unwrap_err());
    assert!(
        matches!(refused, ConnectErrorKind::Io | ConnectErrorKind::Tls),
        "{refused:?}"
    );
    // TLS trusting another CA: the server's certificate does not check out.
    let other_ca = path("other-ca.pem");
    let impostor = NatsSecurity {
        credentials: Some((&user, &password)),
        ca_file: Some(&other_ca),
    };
    let err = connect_securely(&nats.url(), "other-ca", quick, impostor).await;
    let err = err.unwrap_err().to_string();
    assert!(err.contains("invalid peer certificate"), "{err}");
    // The mesh's CA but no user: refused by the server.
    let ca = path("ca.pem");
    let anonymous = NatsSecurity {
        credentials: None,
        ca_file: Some(&ca),
    };
    let err = connect_securely(&nats.url(), "anonymous", quick, anonymous).await;
    assert_eq!(
        kind(err.unwrap_err()),
        ConnectErrorKind::AuthorizationViolation
    );
    // A CA file that is not there: a configuration error at once, not retries.
    let missing = dir.path().join("missing.pem");
    let err = connect_securely(
        &nats.url(),
        "missing",
        Duration::from_secs(30),
        NatsSecurity {
            credentials: None,
            ca_file: Some(&missing),
        },
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("--nats-ca-file"), "{err}");

    // The router, as compose starts it: TLS with the CA, its user; it comes up ready.
    let router = start_router(&nats, |c| {
        c.common.nats_user = Some(user.clone());
        c.common.nats_password = Some(password.clone());
        c.common.nats_ca_file = Some(ca.clone());
    })
    .expect("router over TLS");
    router
        .wait_ready(Duration::from_secs(20))
        .await
        .expect("the router is ready over TLS");
    drop(router);
}
