//! One `init_telemetry` for every service: env-filtered logs (text or JSON) plus OpenTelemetry
//! spans, exported over OTLP/gRPC when an endpoint is configured.
//!
//! The OpenTelemetry layer is installed even without an exporter so every span has a trace id
//! and W3C trace context still propagates across NATS hops (see `trace_context`).
//!
//! Logs and spans are filtered separately: `RUST_LOG` sets what is logged, while the trace
//! always gets the diffmesh crates' spans and events at INFO and above (other crates' at WARN),
//! so turning logs down never breaks a job's trace tree.
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, EnvFilter, Layer};

use crate::error::MeshError;

/// Flushes and shuts down the trace exporter when dropped; keep it alive for the process.
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Export every finished span now (the batch exporter otherwise sends every few seconds).
    /// A guard from a repeated `init_telemetry` call has nothing to flush.
    pub fn force_flush(&self) -> Result<(), MeshError> {
        match &self.provider {
            Some(provider) => provider
                .force_flush()
                .map_err(|e| MeshError::Telemetry(format!("flushing spans: {e}"))),
            None => Ok(()),
        }
    }

    /// Whether this guard owns the process's tracer provider (the first `init_telemetry`).
    pub fn is_active(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // Export errors at shutdown (collector gone) are not worth failing the exit over.
            if let Err(err) = provider.shutdown() {
                eprintln!("telemetry shutdown: {err}");
            }
        }
    }
}

/// What goes into traces: every diffmesh crate (targets `diffmesh_*`) at INFO and above,
/// everything else (NATS client, HTTP, the exporter's own gRPC stack) only at WARN.
fn trace_filter() -> Targets {
    Targets::new()
        .with_target("diffmesh", Level::INFO)
        .with_default(Level::WARN)
}

/// Install the global tracing subscriber.
///
/// `otlp_endpoint` enables span export (OTLP/gRPC); the exporter connects lazily, so a missing
/// collector only costs dropped spans, never a failed start. With an endpoint this must be
/// called inside a Tokio runtime (tonic needs one). Calling it again (several services in one
/// test process) keeps the first subscriber and returns an inert guard.
pub fn init_telemetry(
    service_name: &str,
    otlp_endpoint: Option<&str>,
    json: bool,
) -> Result<TelemetryGuard, MeshError> {
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let resource = Resource::builder()
        .with_service_name(service_name.to_string())
        .build();
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if let Some(endpoint) = otlp_endpoint.filter(|e| !e.is_empty()) {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build()
            .map_err(|e| MeshError::Telemetry(format!("OTLP exporter for {endpoint}: {e}")))?;
        builder = builder.with_batch_exporter(exporter);
    }
    let provider = builder.build();
    let tracer = provider.tracer(service_name.to_string());

    let log_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = if json {
        fmt::layer().json().with_current_span(true).boxed()
    } else {
        fmt::layer().boxed()
    };
    let installed = tracing_subscriber::registry()
        .with(logs.with_filter(log_filter))
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(trace_filter()),
        )
        .try_init()
        .is_ok();
    if installed {
        opentelemetry::global::set_tracer_provider(provider.clone());
        Ok(TelemetryGuard {
            provider: Some(provider),
        })
    } else {
        let _ = provider.shutdown();
        Ok(TelemetryGuard { provider: None })
    }
}

#[cfg(test)]
mod tests {
    use tracing::Level;

    /// An OTLP endpoint with no collector behind it must not fail the start, and a second
    /// call (several services in one process) must not fail either.
    #[tokio::test]
    async fn starts_without_a_collector() {
        let first = super::init_telemetry("test", Some("http://127.0.0.1:9"), false);
        assert!(first.is_ok());
        tracing::info_span!("work").in_scope(|| tracing::info!("logged"));
        let second = super::init_telemetry("test", None, true).expect("second init");
        assert!(!second.is_active());
        assert!(second.force_flush().is_ok());
        drop(second);
        drop(first);
    }

    /// Traces keep the diffmesh crates' INFO spans whatever RUST_LOG says, and keep other
    /// crates' chatter (the exporter's own gRPC stack) out.
    #[test]
    fn trace_filter_keeps_diffmesh_info_spans_only() {
        let filter = super::trace_filter();
        assert!(filter.would_enable("diffmesh_codec", &Level::INFO));
        assert!(filter.would_enable("diffmesh_denoiser::engine", &Level::INFO));
        assert!(!filter.would_enable("diffmesh_codec", &Level::DEBUG));
        assert!(!filter.would_enable("h2::codec", &Level::INFO));
        assert!(filter.would_enable("async_nats", &Level::WARN));
    }
}
