//! Every service's `/metrics` in a running mesh (gateway, codec, router, a denoiser with the
//! tiny model, cachestore) after one edit and one bad request per service: the families the
//! dashboards and alerts need exist, every name follows the convention
//! (`diffmesh_` prefix; `_seconds`, `_bytes`, `_ratio`, counters `_total`, or a documented
//! unitless metric: `shared::process::metrics::naming_problem`), and every metric the Grafana dashboard
//! queries or an alerting rule watches is really exported, with the labels those queries match
//! on and group by.
//!
//! The services share this process, so the process-wide NATS metrics
//! (`diffmesh_nats_request_*`) show on every service's page here; in a deployment each
//! process shows its own requests.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use diffmesh_shared::process::metrics::naming_problem;
use diffmesh_shared::wire::subjects;
use diffmesh_tests::harness::scrape_metrics;
use diffmesh_tests::images::{png_bytes, rect_mask, template};
use diffmesh_tests::mesh::MeshBuilder;
use diffmesh_tests::promql;
use reqwest::multipart::{Form, Part};

/// Families each service must export: name and what it stands for in issue #6's list.
const REQUIRED: &[(&str, &[&str])] = &[
    (
        "gateway",
        &[
            "diffmesh_gateway_requests_total",
            // End-to-end latency.
            "diffmesh_gateway_request_duration_seconds",
            // Per-stage latency; the `submit` stage includes waiting for admission.
            "diffmesh_gateway_stage_duration_seconds",
            "diffmesh_gateway_failures_total",
            // NATS round trip time.
            "diffmesh_nats_request_duration_seconds",
        ],
    ),
    (
        "codec",
        &[
            "diffmesh_codec_duration_seconds",
            "diffmesh_codec_requests_total",
            "diffmesh_codec_mask_ratio",
            // Template images decoded once for all their edits.
            "diffmesh_codec_decoded_cache_total",
            "diffmesh_codec_failures_total",
        ],
    ),
    (
        "router",
        &[
            // Queue depth (submits waiting for a slot) and time to place (queueing included).
            "diffmesh_router_admission_waiting",
            "diffmesh_router_decision_duration_seconds",
            "diffmesh_router_live_workers",
            "diffmesh_router_placements_total",
            "diffmesh_router_failures_total",
            // The cost model checked against the steps denoisers report.
            "diffmesh_router_step_prediction_ratio",
            // Per denoiser, the factor placement scales its forecasts by.
            "diffmesh_router_worker_step_time_ratio",
        ],
    ),
    (
        "denoiser",
        &[
            // Queue depth, running batch size, step duration, per-job latency.
            "diffmesh_denoiser_queued_jobs",
            "diffmesh_denoiser_running_jobs",
            "diffmesh_denoiser_batch_rows",
            "diffmesh_denoiser_step_duration_seconds",
            "diffmesh_denoiser_job_duration_seconds",
            // Queueing latency on the worker.
            "diffmesh_denoiser_queue_wait_seconds",
            "diffmesh_denoiser_failures_total",
            // Memory the served model's weights take, per component.
            "diffmesh_denoiser_model_resident_bytes",
            // Memory of the device it computes on (the host's on the CPU).
            "diffmesh_denoiser_device_memory_bytes",
        ],
    ),
    (
        "controlnet",
        &[
            "diffmesh_controlnet_requests_total",
            "diffmesh_controlnet_forward_duration_seconds",
            "diffmesh_controlnet_lookups_total",
            "diffmesh_controlnet_sessions",
        ],
    ),
    (
        "cachestore",
        &[
            // Hits, misses and bytes per tier.
            "diffmesh_cachestore_hits_total",
            "diffmesh_cachestore_misses_total",
            "diffmesh_cachestore_bytes",
            "diffmesh_cachestore_read_bytes_total",
            "diffmesh_cachestore_failures_total",
        ],
    ),
];

/// `# TYPE name kind` lines of a Prometheus text page: family name -> kind.
fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| {
            let mut parts = rest.split_whitespace();
            Some((parts.next()?.to_string(), parts.next()?.to_string()))
        })
        .collect()
}

/// Sample lines (`name{labels} value`) of one family, labels included.
fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    text.lines()
        .filter(move |l| l.starts_with(name) && !l.starts_with('#'))
}

/// Every query of a dashboard's panels.
fn dashboard_exprs(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).expect("read the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.extend(target["expr"].as_str().map(str::to_string));
        }
    }
    exprs
}

/// Send bytes that are not MessagePack to `subject` and wait for the service's answer: the
/// bad input is rejected (and counted as a failure), never a crash or silence.
async fn send_garbage(client: &async_nats::Client, subject: String) {
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        client.request(subject.clone(), "not msgpack".into()),
    )
    .await
    .unwrap_or_else(|_| panic!("{subject}: no answer to a bad request within 10s"));
    assert!(reply.is_ok(), "{subject}: {reply:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_exports_the_required_metrics_with_conventional_names() {
    // The denoiser serves the shipped ControlNets (their per-step cost is exported from start).
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny-controlnets");
    let mesh = MeshBuilder::new()
        .denoiser(move |_, d| d.controlnet_dir = Some(shipped.clone()))
        .start()
        .await;
    let (gateway, codec, router) = (&mesh.gateway, &mesh.codec, &mesh.router);
    let (denoiser, cachestore) = (mesh.denoiser("d1"), mesh.cachestore());
    let services = [
        ("gateway", gateway),
        ("codec", codec),
        ("router", router),
        ("denoiser", denoiser),
        ("cachestore", cachestore),
    ];

    // One edit through the whole mesh fills the latency histograms.
    let (w, h) = (40, 40);
    let edit = Form::new()
        .part(
            "image",
            Part::bytes(png_bytes(&template(w, h))).file_name("image.png"),
        )
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(w, h, 4, 4, 20, 20))).file_name("mask.png"),
        )
        .text("prompt", "a red square")
        .text("num_inference_steps", "2")
        .text("response_format", "png")
        // Ten minutes: met, and counted as met.
        .text("deadline_ms", "600000");
    let api = gateway.addrs.api.expect("gateway API address");
    let http = reqwest::Client::new();
    let r = http
        .post(format!("http://{api}/v1/images/edits"))
        .multipart(edit)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("edit");
    assert_eq!(r.status().as_u16(), 200);
    // One bad request per service: each failure counter gets a series with its reason.
    let bad = Form::new().text("prompt", "no image");
    let r = http
        .post(format!("http://{api}/v1/images/edits"))
        .multipart(bad)
        .send()
        .await
        .expect("bad edit");
    assert_eq!(r.status().as_u16(), 400);
    let client = async_nats::connect(mesh.nats.url())
        .await
        .expect("NATS client");
    send_garbage(&client, subjects::CODEC_PRE.to_string()).await;
    send_garbage(&client, subjects::ROUTER_SUBMIT.to_string()).await;
    send_garbage(&client, subjects::denoiser_submit("d1")).await;
    send_garbage(&client, diffmesh_shared::wire::cachestore::get_subject()).await;
    // A request nobody answers is counted by the shared request helper, by subject and reason.
    let unanswered = diffmesh_shared::nats::request_msgpack::<_, ()>(
        &client,
        "diffmesh.audit.nobody",
        &(),
        Duration::from_secs(2),
    )
    .await;
    assert!(unanswered.is_err(), "nobody serves diffmesh.audit.nobody");

    // A ControlNet worker (`diffmesh-controlnet`) with the shipped ControlNets.
    let controlnets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny-controlnets");
    let worker = diffmesh_controlnet::start(diffmesh_controlnet::WorkerConfig::for_tests(
        mesh.nats.url(),
        controlnets,
        "cn1",
    ))
    .await
    .expect("ControlNet worker");
    send_garbage(
        &client,
        diffmesh_shared::wire::controlnet_service::step_subject("cn1"),
    )
    .await;

    let mut pages: BTreeMap<&str, String> = BTreeMap::new();
    for (name, s) in &services {
        pages.insert(name, scrape_metrics(s.addrs.health).await.expect("scrape"));
    }
    pages.insert(
        "controlnet",
        scrape_metrics(worker.health_addr).await.expect("scrape"),
    );
    // The gateway also serves /metrics on its API port, the same page.
    let on_api = scrape_metrics(api).await.expect("scrape the API port");
    assert!(families(&on_api).contains_key("diffmesh_gateway_requests_total"));

    let mut problems = Vec::new();
    let mut exported = BTreeMap::new();
    for (service, text) in &pages {
        let found = families(text);
        assert!(!found.is_empty(), "{service}: /metrics has no families");
        for (name, kind) in &found {
            if let Some(problem) = naming_problem(name, kind) {
                problems.push(format!("{service}: {problem}"));
            }
        }
        let required = REQUIRED
            .iter()
            .find(|(s, _)| s == service)
            .map(|(_, r)| *r)
            .unwrap_or(&[]);
        for name in required {
            if !found.contains_key(*name) {
                problems.push(format!("{service}: required family {name} missing"));
            }
        }
        exported.extend(found);
    }
    assert!(
        problems.is_empty(),
        "metric problems:\n{}",
        problems.join("\n")
    );

    // The edit gave a deadline and its result was ready in time.
    assert!(
        pages["gateway"].contains(r#"diffmesh_gateway_deadlines_total{outcome="met"} 1"#),
        "{}",
        pages["gateway"]
    );

    // Failures carry their reason; the bad requests above each left one.
    for (service, reason) in [
        ("gateway", "invalid_request"),
        ("codec", "codec"),
        ("router", "bad_request"),
        ("denoiser", "bad_request"),
        ("cachestore", "bad_request"),
    ] {
        let name = format!("diffmesh_{service}_failures_total");
        let label = format!("reason=\"{reason}\"");
        let counted =
            samples(&pages[service], &name).any(|l| l.contains(&label) && !l.ends_with(" 0"));
        assert!(
            counted,
            "{service}: no {name}{{{label}}} after a bad request"
        );
    }

    // Every NATS request hop of the edit has its round trip recorded, by subject.
    let nats_rtt = "diffmesh_nats_request_duration_seconds_count";
    for subject in [
        subjects::CODEC_PRE.to_string(),
        subjects::ROUTER_SUBMIT.to_string(),
        subjects::denoiser_submit("d1"),
        subjects::CODEC_POST.to_string(),
    ] {
        let label = format!("subject=\"{subject}\"");
        assert!(
            samples(&pages["gateway"], nats_rtt).any(|l| l.contains(&label) && !l.ends_with(" 0")),
            "no NATS round trip recorded for {subject}"
        );
    }

    assert!(
        samples(&pages["gateway"], "diffmesh_nats_request_failures_total").any(|l| {
            l.contains("subject=\"diffmesh.audit.nobody\"")
                && l.contains("reason=\"no_responders\"")
        }),
        "the unanswered request is not counted in diffmesh_nats_request_failures_total"
    );

    // The Grafana dashboard queries only metrics that exist.
    let dashboard = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../compose/grafana/dashboards/diffmesh-overview.json");
    let histogram_part = |name: &str| {
        ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            name.strip_suffix(suffix)
                .filter(|base| exported.get(*base).map(String::as_str) == Some("histogram"))
                .map(str::to_string)
        })
    };
    let not_exported = |names: BTreeSet<String>| -> Vec<String> {
        names
            .into_iter()
            .filter(|n| !exported.contains_key(n) && histogram_part(n).is_none())
            .collect()
    };
    let dashboard_queries = dashboard_exprs(&dashboard);
    let queried: BTreeSet<String> = dashboard_queries
        .iter()
        .flat_map(|q| promql::metric_names(q))
        .collect();
    let missing = not_exported(queried);
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics no service exports: {missing:?}"
    );
    // And the alerting rules watch only metrics that exist.
    let alerts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../compose/prometheus/alerts.yml");
    let rules = std::fs::read_to_string(&alerts).expect("read the alerting rules");
    // Every metric the rules mention (comments aside).
    let alerting: BTreeSet<String> = rules
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(promql::metric_names)
        .collect();
    assert!(
        alerting.len() >= 5,
        "alerts.yml names too few metrics: {alerting:?}"
    );
    let missing = not_exported(alerting);
    assert!(
        missing.is_empty(),
        "the alerting rules watch metrics no service exports: {missing:?}"
    );

    // And their label matchers and groupings name labels those metrics carry (a wrong name
    // matches nothing, or sums everything into one series, without any error).
    let mut labels = BTreeMap::new();
    for page in pages.values() {
        for (family, names) in promql::exported_labels(page) {
            labels
                .entry(family)
                .or_insert_with(BTreeSet::new)
                .extend(names);
        }
    }
    let queries: Vec<String> = dashboard_queries
        .into_iter()
        .chain(promql::rule_exprs(&rules))
        .collect();
    assert!(
        queries.len() >= 20,
        "too few queries read: {}",
        queries.len()
    );
    let wrong: Vec<String> = queries
        .iter()
        .flat_map(|q| promql::unknown_labels(q, &labels))
        .collect();
    assert!(
        wrong.is_empty(),
        "queries name labels their metrics lack:\n{}",
        wrong.join("\n")
    );
}
