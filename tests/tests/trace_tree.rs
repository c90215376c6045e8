//! One edit through the whole mesh (gateway, codec, router, a denoiser with the tiny model)
//! with spans exported over OTLP/gRPC to a receiver in this test: the spans of the job form one
//! tree (one trace id, one root, every parent present) that reaches every service, holds one
//! child span per denoising step, and comes back through the codec's post-processing.
//!
//! The services run in this process, so they share the tracer provider `init_telemetry`
//! installs here (as one service binary would); spans are told apart by their `target`, the
//! crate that opened them (`diffmesh_codec::...`).
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diffmesh_shared::process::telemetry::{init_telemetry, TelemetryGuard};
use diffmesh_tests::images::{png_bytes, rect_mask, template};
use diffmesh_tests::mesh::MeshBuilder;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
use reqwest::multipart::{Form, Part};
use tokio_util::sync::CancellationToken;

const STEPS: usize = 4;

/// One received span, reduced to what the assertions read.
#[derive(Debug, Clone)]
struct SpanRecord {
    trace_id: String,
    span_id: String,
    /// Empty for a root span.
    parent_id: String,
    name: String,
    attributes: HashMap<String, String>,
}

impl SpanRecord {
    /// The diffmesh service whose code opened the span (`diffmesh_codec::x` -> `codec`).
    fn service(&self) -> &str {
        let target = self.attributes.get("target").map(String::as_str);
        let krate = target.unwrap_or("").split("::").next().unwrap_or("");
        krate.strip_prefix("diffmesh_").unwrap_or(krate)
    }

    fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

fn value_text(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The OTLP TraceService: keeps every span it is sent.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<SpanRecord>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut received = Vec::new();
        for resource in request.into_inner().resource_spans {
            for scope in resource.scope_spans {
                for span in scope.spans {
                    received.push(SpanRecord {
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_id: hex(&span.parent_span_id),
                        name: span.name,
                        attributes: span
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), value_text(kv)))
                            .collect(),
                    });
                }
            }
        }
        self.spans
            .lock()
            .map_err(|_| tonic::Status::internal("receiver lock poisoned"))?
            .extend(received);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Serve the receiver on a free local port until `stop` is cancelled.
async fn start_receiver(receiver: Receiver, stop: CancellationToken) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the OTLP receiver");
    let addr = listener.local_addr().expect("receiver address");
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .serve_with_incoming_shutdown(
                TraceServiceServer::new(receiver),
                incoming,
                stop.cancelled_owned(),
            )
            .await;
        if let Err(err) = served {
            eprintln!("OTLP receiver stopped: {err}");
        }
    });
    addr
}

/// Export what has finished so far; the flush blocks, so it runs off the async workers (the
/// exporter's gRPC connection and the receiver both run on this test's runtime).
async fn flush(guard: &Arc<TelemetryGuard>) {
    let guard = guard.clone();
    tokio::task::spawn_blocking(move || guard.force_flush())
        .await
        .expect("flush task")
        .expect("flush spans");
}

/// The spans of the trace whose root is the gateway's `job` span, with that span's job id.
fn job_trace(spans: &[SpanRecord]) -> Option<(String, Vec<SpanRecord>)> {
    let root = spans
        .iter()
        .find(|s| s.name == "job" && s.service() == "gateway")?;
    let job_id = root.attr("job_id")?.to_string();
    let trace: Vec<SpanRecord> = spans
        .iter()
        .filter(|s| s.trace_id == root.trace_id)
        .cloned()
        .collect();
    Some((job_id, trace))
}

/// Everything the test waits for has arrived (the denoiser's span ends after the gateway has
/// answered, so the last spans may come a little after the response).
fn complete(trace: &[SpanRecord]) -> bool {
    let count = |service: &str, name: &str| {
        trace
            .iter()
            .filter(|s| s.service() == service && s.name == name)
            .count()
    };
    count("gateway", "job") == 1
        && count("codec", "codec") >= 2
        && count("router", "place") >= 1
        && count("denoiser", "denoise_job") >= 1
        && count("denoiser", "denoise_step") >= STEPS
}

/// The trace as an indented tree, for failure messages.
fn render(trace: &[SpanRecord]) -> String {
    let mut children: BTreeMap<&str, Vec<&SpanRecord>> = BTreeMap::new();
    for s in trace {
        children.entry(s.parent_id.as_str()).or_default().push(s);
    }
    fn walk(out: &mut String, children: &BTreeMap<&str, Vec<&SpanRecord>>, id: &str, depth: usize) {
        for s in children.get(id).map(Vec::as_slice).unwrap_or(&[]) {
            out.push_str(&format!(
                "{}{} [{}] {}\n",
                "  ".repeat(depth),
                s.name,
                s.service(),
                s.span_id
            ));
            walk(out, children, &s.span_id, depth + 1);
        }
    }
    let mut out = String::new();
    let ids: std::collections::HashSet<&str> = trace.iter().map(|s| s.span_id.as_str()).collect();
    for s in trace {
        if s.parent_id.is_empty() || !ids.contains(s.parent_id.as_str()) {
            out.push_str(&format!(
                "{} [{}] {} (parent {:?})\n",
                s.name,
                s.service(),
                s.span_id,
                s.parent_id
            ));
            walk(&mut out, &children, &s.span_id, 1);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_edit_is_one_trace_tree_across_the_mesh() {
    let receiver = Receiver::default();
    let stop = CancellationToken::new();
    let addr = start_receiver(receiver.clone(), stop.clone()).await;
    let guard = Arc::new(
        init_telemetry(
            "diffmesh-trace-test",
            Some(&format!("http://{addr}")),
            false,
        )
        .expect("telemetry"),
    );
    assert!(
        guard.is_active(),
        "another subscriber was installed first; this test must own the process's telemetry"
    );

    let mesh = MeshBuilder::new().without_cachestore().start().await;

    let (w, h) = (48, 40);
    let form = Form::new()
        .part(
            "image",
            Part::bytes(png_bytes(&template(w, h))).file_name("image.png"),
        )
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(w, h, 8, 8, 24, 24))).file_name("mask.png"),
        )
        .text("prompt", "a red square")
        .text("num_inference_steps", STEPS.to_string())
        .text("seed", "3")
        .text("response_format", "png");
    let response = reqwest::Client::new()
        .post(mesh.url("/v1/images/edits"))
        .multipart(form)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("edit request");
    assert_eq!(response.status().as_u16(), 200, "the edit must succeed");

    // Flush until the whole job has arrived (or give up and report what did).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let (job_id, trace) = loop {
        flush(&guard).await;
        let spans = receiver.spans.lock().expect("spans").clone();
        let found = job_trace(&spans);
        if let Some((job_id, trace)) = &found {
            if complete(trace) {
                break (job_id.clone(), trace.clone());
            }
        }
        if tokio::time::Instant::now() >= deadline {
            let shown = found.map(|(_, t)| render(&t)).unwrap_or_default();
            panic!(
                "the job's trace did not reach every service within 20s; {} spans received, \
                 the job's trace:\n{shown}",
                spans.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let tree = render(&trace);

    // One tree: exactly one root (the gateway's job span) and every other parent present.
    let ids: std::collections::HashSet<&str> = trace.iter().map(|s| s.span_id.as_str()).collect();
    let roots: Vec<&SpanRecord> = trace.iter().filter(|s| s.parent_id.is_empty()).collect();
    assert_eq!(roots.len(), 1, "one root span expected:\n{tree}");
    assert_eq!(
        (roots[0].name.as_str(), roots[0].service()),
        ("job", "gateway"),
        "the root is the gateway's job span:\n{tree}"
    );
    for s in &trace {
        assert!(
            s.parent_id.is_empty() || ids.contains(s.parent_id.as_str()),
            "span {} [{}] has a parent {} that is not in the trace:\n{tree}",
            s.name,
            s.service(),
            s.parent_id
        );
    }

    // Every span any service opened for this job belongs to this one trace.
    let spans = receiver.spans.lock().expect("spans").clone();
    let elsewhere: Vec<String> = spans
        .iter()
        .filter(|s| s.attr("job_id") == Some(job_id.as_str()) && s.trace_id != roots[0].trace_id)
        .map(|s| format!("{} [{}]", s.name, s.service()))
        .collect();
    assert!(
        elsewhere.is_empty(),
        "spans of job {job_id} outside its trace (propagation broken): {elsewhere:?}\n{tree}"
    );

    // The path: gateway -> codec pre -> router -> denoiser (steps) -> codec post.
    let parent_of = |s: &SpanRecord| trace.iter().find(|p| p.span_id == s.parent_id).cloned();
    let codec_ops: Vec<(&str, String)> = trace
        .iter()
        .filter(|s| s.service() == "codec" && s.name == "codec")
        .map(|s| {
            (
                s.attr("op").unwrap_or(""),
                parent_of(s)
                    .map(|p| p.service().to_string())
                    .unwrap_or_default(),
            )
        })
        .collect();
    assert!(
        codec_ops.contains(&("pre", "gateway".to_string())),
        "codec pre under the gateway: {codec_ops:?}\n{tree}"
    );
    assert!(
        codec_ops.contains(&("post", "denoiser".to_string())),
        "codec post under the denoiser: {codec_ops:?}\n{tree}"
    );
    let place = trace
        .iter()
        .find(|s| s.service() == "router" && s.name == "place")
        .expect("router place span");
    assert_eq!(
        parent_of(place).map(|p| p.service().to_string()).as_deref(),
        Some("gateway"),
        "the router's placement hangs under the gateway:\n{tree}"
    );
    let denoise = trace
        .iter()
        .find(|s| s.service() == "denoiser" && s.name == "denoise_job")
        .expect("denoiser job span");
    assert_eq!(
        parent_of(denoise).map(|p| p.name.clone()).as_deref(),
        Some("place"),
        "the denoiser's job span hangs under the router's placement:\n{tree}"
    );
    let steps: Vec<&SpanRecord> = trace.iter().filter(|s| s.name == "denoise_step").collect();
    assert_eq!(steps.len(), STEPS, "one span per denoising step:\n{tree}");
    assert!(
        steps.iter().all(|s| s.parent_id == denoise.span_id),
        "step spans are children of the denoiser's job span:\n{tree}"
    );
    let mut step_numbers: Vec<String> = steps
        .iter()
        .map(|s| s.attr("step").unwrap_or("?").to_string())
        .collect();
    step_numbers.sort();
    assert_eq!(
        step_numbers,
        (1..=STEPS).map(|k| k.to_string()).collect::<Vec<_>>(),
        "steps 1..N each once:\n{tree}"
    );

    drop(mesh);
    stop.cancel();
}
