//! The small HTTP server every service runs next to its NATS work: `/healthz` (the process is
//! up), `/readyz` (the service can do work now, from a readiness callback) and `/metrics`
//! (Prometheus text format from the service's registry and `metrics::process_registry`).
use std::net::SocketAddr;
use std::sync::Arc;

use actix_web::dev::ServerHandle;
use actix_web::{web, App, HttpResponse, HttpServer};
use prometheus::{Encoder, Registry, TextEncoder};

/// Answers "can this service take work now?" (NATS connected, model loaded, ...).
pub type Readiness = Arc<dyn Fn() -> bool + Send + Sync>;

/// A readiness callback that is always ready.
pub fn always_ready() -> Readiness {
    Arc::new(|| true)
}

/// What the health routes read: the metrics registry and the readiness callback.
#[derive(Clone)]
pub struct HealthState {
    pub registry: Registry,
    pub ready: Readiness,
}

/// A running health server; stop it with [`HealthServer::stop`].
pub struct HealthServer {
    /// The bound address (useful when the configured port was 0).
    pub addr: SocketAddr,
    handle: ServerHandle,
}

impl HealthServer {
    /// Bind `addr` and serve in the background. Must be called inside a Tokio runtime.
    pub fn start(
        addr: SocketAddr,
        registry: Registry,
        ready: Readiness,
    ) -> std::io::Result<HealthServer> {
        let state = HealthState { registry, ready };
        let server = HttpServer::new(move || {
            App::new()
                .app_data(web::Data::new(state.clone()))
                .configure(configure_health_routes)
        })
        .workers(1)
        .disable_signals()
        .bind(addr)?;
        let addr = server.addrs().first().copied().unwrap_or(addr);
        let handle = spawn_server(server.run(), "health");
        Ok(HealthServer { addr, handle })
    }

    /// Stop accepting connections and wait for in-flight requests.
    pub async fn stop(self) {
        self.handle.stop(true).await;
    }
}

/// Health routes, also mountable inside a service's own actix `App` (the gateway serves them
/// on its API port). Needs a `web::Data<HealthState>`, see [`health_data`].
pub fn configure_health_routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/healthz", web::get().to(healthz))
        .route("/readyz", web::get().to(readyz))
        .route("/metrics", web::get().to(metrics));
}

/// App data for [`configure_health_routes`] when mounting them in another app.
pub fn health_data(registry: Registry, ready: Readiness) -> web::Data<HealthState> {
    web::Data::new(HealthState { registry, ready })
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain").body("ok")
}

async fn readyz(state: web::Data<HealthState>) -> HttpResponse {
    if (state.ready)() {
        HttpResponse::Ok().content_type("text/plain").body("ready")
    } else {
        HttpResponse::ServiceUnavailable()
            .content_type("text/plain")
            .body("not ready")
    }
}

async fn metrics(state: web::Data<HealthState>) -> HttpResponse {
    // The service's own metrics plus those shared code records (NATS round trips, JetStream
    // retries; the retry counter registers on first use, and is exported before any retry).
    crate::stores::transient::retries();
    let mut families = state.registry.gather();
    families.extend(crate::process::metrics::process_registry().gather());
    let mut buf = Vec::new();
    match TextEncoder::new().encode(&families, &mut buf) {
        Ok(()) => HttpResponse::Ok()
            .content_type(prometheus::TEXT_FORMAT)
            .body(buf),
        Err(err) => HttpResponse::InternalServerError().body(err.to_string()),
    }
}

/// Run an actix server on the current tokio runtime, logging how it ended; returns the handle
/// that stops it.
pub fn spawn_server(
    server: actix_web::dev::Server,
    what: &'static str,
) -> actix_web::dev::ServerHandle {
    let handle = server.handle();
    tokio::spawn(async move {
        if let Err(err) = server.await {
            tracing::error!(error = %err, server = what, "HTTP server stopped with an error");
        }
    });
    handle
}
