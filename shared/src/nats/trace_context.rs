//! W3C trace context and the job id in NATS headers (async-nats has no propagation of its own).
//!
//! The sender injects the current span's context; the receiver extracts it and makes it the
//! parent of its handling span, so one trace spans gateway -> codec -> router -> denoiser.
use async_nats::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::wire::subjects::JOB_ID_HEADER;

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

/// Write `traceparent`/`tracestate` for `cx` into `headers`.
pub fn inject_context(cx: &Context, headers: &mut HeaderMap) {
    TraceContextPropagator::new().inject_context(cx, &mut HeaderInjector(headers));
}

/// Write the current tracing span's trace context, and the job id when given, into `headers`.
pub fn inject_current(headers: &mut HeaderMap, job_id: Option<&str>) {
    let cx = tracing::Span::current().context();
    inject_context(&cx, headers);
    if let Some(job_id) = job_id {
        headers.insert(JOB_ID_HEADER, job_id);
    }
}

/// Headers carrying the current trace context and the job id, for a new message.
pub fn headers_for(job_id: Option<&str>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    inject_current(&mut headers, job_id);
    headers
}

/// The remote trace context carried by `headers` (an empty context when there is none).
pub fn extract_context(headers: Option<&HeaderMap>) -> Context {
    match headers {
        Some(h) => TraceContextPropagator::new().extract(&HeaderExtractor(h)),
        None => Context::new(),
    }
}

/// Make the trace context in `headers` the parent of `span` (call before entering the span).
/// Without headers or without an OpenTelemetry layer this does nothing.
pub fn set_parent_from(span: &tracing::Span, headers: Option<&HeaderMap>) {
    // Errors only mean "no OpenTelemetry layer installed" or "span disabled": nothing to link.
    let _ = span.set_parent(extract_context(headers));
}

/// The job id header of a message, if present.
pub fn job_id_of(headers: Option<&HeaderMap>) -> Option<String> {
    headers
        .and_then(|h| h.get(JOB_ID_HEADER))
        .map(|v| v.as_str().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn inject_extract_round_trip() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("sender");
            let _entered = span.enter();
            let sent = span.context().span().span_context().clone();
            assert!(sent.is_valid());

            let headers = headers_for(Some("job-123"));
            let traceparent = headers.get("traceparent").expect("traceparent set");
            assert!(traceparent.as_str().contains(&sent.trace_id().to_string()));
            assert_eq!(job_id_of(Some(&headers)).as_deref(), Some("job-123"));

            let cx = extract_context(Some(&headers));
            let got = cx.span().span_context().clone();
            assert_eq!(got.trace_id(), sent.trace_id());
            assert_eq!(got.span_id(), sent.span_id());
            assert!(got.is_remote());

            // A receiving span parented on the headers joins the same trace.
            let receiver = tracing::info_span!("receiver");
            set_parent_from(&receiver, Some(&headers));
            assert_eq!(
                receiver.context().span().span_context().trace_id(),
                sent.trace_id()
            );
        });
    }

    #[test]
    fn missing_headers_give_an_empty_context() {
        let cx = extract_context(None);
        assert!(!cx.span().span_context().is_valid());
        let cx = extract_context(Some(&HeaderMap::new()));
        assert!(!cx.span().span_context().is_valid());
        assert_eq!(job_id_of(None), None);
    }
}
