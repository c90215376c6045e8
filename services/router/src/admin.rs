//! The router's HTTP server on its health address: the common `/healthz`, `/readyz`,
//! `/metrics`, plus the admin routes
//!
//! - `GET /admin/policy`: `{"policy", "known": [...], "cost_models": {...}}`
//! - `POST /admin/policy` with `{"policy": "<name>"}`: switch the placement policy at run time;
//!   answers `{"policy", "previous"}`, or 400 naming the field for a bad body or an unknown name.
//!
//! The admin routes are unauthenticated: bind the health address to a private network.
use crate::service::Router;
use actix_web::dev::ServerHandle;
use actix_web::{web, App, HttpResponse, HttpServer};
use diffmesh_sched::policy::POLICY_NAMES;
use diffmesh_shared::process::health::{
    configure_health_routes, health_data, spawn_server, Readiness,
};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;

pub struct AdminServer {
    pub addr: SocketAddr,
    handle: ServerHandle,
}

impl AdminServer {
    /// Bind `addr` and serve in the background (inside a Tokio runtime).
    pub fn start(
        addr: SocketAddr,
        registry: prometheus::Registry,
        ready: Readiness,
        router: Arc<Router>,
    ) -> std::io::Result<AdminServer> {
        let health = health_data(registry, ready);
        let router = web::Data::from(router);
        let server = HttpServer::new(move || {
            App::new()
                .app_data(health.clone())
                .app_data(router.clone())
                .app_data(web::JsonConfig::default().limit(4096))
                .configure(configure_health_routes)
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
