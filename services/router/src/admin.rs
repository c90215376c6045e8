//! The router's admin API, on an address of its own (`--admin-addr`), apart from the health
//! address that Prometheus and orchestrators reach, and only with `Authorization: Bearer
//! <--admin-key>` (ROUTER_ADMIN_KEY); without an admin address there is no admin API.
//!
//! - `GET /admin/policy`: `{"policy", "known": [...], "cost_models": {...}}`
//! - `POST /admin/policy` with `{"policy": "<name>"}`: switch the placement policy at run time;
//!   answers `{"policy", "previous"}`, or 400 naming the field for a bad body or an unknown name.
//!
//! A request without the key, or with another, is answered 401 before anything is read.
use crate::service::Router;
use actix_web::dev::{ServerHandle, Service};
use actix_web::{web, App, HttpResponse, HttpServer};
use diffmesh_sched::policy::POLICY_NAMES;
use diffmesh_shared::process::health::spawn_server;
use futures::future::{ready, Either};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::sync::Arc;

/// Shortest admin key accepted: a short key can be guessed through the API.
pub const MIN_ADMIN_KEY_CHARS: usize = 16;

/// Check an admin key from the configuration: long enough to resist guessing.
pub fn check_admin_key(key: Option<&str>) -> Result<AdminKey, String> {
    let key = key.map(str::trim).unwrap_or_default();
    if key.chars().count() < MIN_ADMIN_KEY_CHARS {
        return Err(format!(
            "--admin-addr needs ROUTER_ADMIN_KEY of at least {MIN_ADMIN_KEY_CHARS} characters \
             (the admin API switches the placement policy of the whole mesh)"
        ));
    }
    Ok(AdminKey(Sha256::digest(key.as_bytes()).into()))
}

/// The admin key, kept only as its SHA-256: comparing hashes tells an attacker nothing about
/// how much of a guess was right.
#[derive(Clone, Copy)]
pub struct AdminKey([u8; 32]);

impl AdminKey {
    fn admits(&self, header: Option<&actix_web::http::header::HeaderValue>) -> bool {
        let presented = header
            .and_then(|h| h.to_str().ok())
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim);
        presented.is_some_and(|key| <[u8; 32]>::from(Sha256::digest(key.as_bytes())) == self.0)
    }
}

pub struct AdminServer {
    pub addr: SocketAddr,
    handle: ServerHandle,
}

impl AdminServer {
    /// Bind `addr` and serve the admin routes in the background (inside a Tokio runtime).
    pub fn start(addr: SocketAddr, key: AdminKey, router: Arc<Router>) -> std::io::Result<Self> {
        let router = web::Data::from(router);
        let server = HttpServer::new(move || {
            App::new()
                .app_data(router.clone())
                .app_data(web::JsonConfig::default().limit(4096))
                .wrap_fn(move |req, srv| {
                    if key.admits(req.headers().get("authorization")) {
                        Either::Left(srv.call(req))
                    } else {
                        let answer = HttpResponse::Unauthorized()
                            .insert_header(("WWW-Authenticate", "Bearer"))
                            .json(json!({ "error": {
                                "message": "the admin API needs Authorization: Bearer <ROUTER_ADMIN_KEY>",
                                "error_type": "authentication_error",
                                "field": "authorization",
                            }}));
                        Either::Right(ready(Ok(req.into_response(answer))))
                    }
                })
                .route("/admin/policy", web::get().to(get_policy))
                .route("/admin/policy", web::post().to(set_policy))
        })
        .workers(1)
        .disable_signals()
        .bind(addr)?;
        let addr = server.addrs().first().copied().unwrap_or(addr);
        let handle = spawn_server(server.run(), "router admin");
        Ok(AdminServer { addr, handle })
    }

    pub async fn stop(self) {
        self.handle.stop(true).await;
    }
}

fn bad_request(message: String) -> HttpResponse {
    HttpResponse::BadRequest().json(json!({
        "error": { "message": message, "error_type": "invalid_request_error", "field": "policy" }
    }))
}

async fn get_policy(router: web::Data<Router>) -> HttpResponse {
    let mut view = router.ask(crate::placement::Describe).await;
    view["known"] = json!(POLICY_NAMES);
    HttpResponse::Ok().json(view)
}

async fn set_policy(router: web::Data<Router>, body: web::Bytes) -> HttpResponse {
    let value: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad_request(format!("body must be JSON {{\"policy\": NAME}}: {e}")),
    };
    let Some(name) = value.get("policy").and_then(|p| p.as_str()) else {
        return bad_request("`policy` must be a string naming a policy".into());
    };
    match router.switch_policy(name).await {
        Ok(previous) => HttpResponse::Ok().json(json!({ "policy": name, "previous": previous })),
        Err(e) => bad_request(e.to_string()),
    }
}
