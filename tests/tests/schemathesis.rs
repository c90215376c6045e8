//! The OpenAPI document checked against the running server by schemathesis (PyPI): the whole
//! mesh in-process (NATS, codec, cachestore, router, a denoiser with the tiny model, gateway),
//! then `schemathesis run http://127.0.0.1:PORT/openapi.json` generates valid and invalid
//! requests for every documented operation and checks every answer: no 5xx, a status the
//! document lists, the documented content type and headers, a body that matches its schema.
//!
//! The gateway's limits are small here (and the document carries them, so generated valid
//! requests stay cheap): few steps, one image, small sizes. Examples per operation and the
//! run's time are bounded. Without schemathesis the test says so and skips, except in CI, where
//! `cargo xtask setup` installs it into the project venv.
use std::time::{Duration, Instant};

use diffmesh_gateway::openapi::HEALTH_ROUTES;
use diffmesh_gateway::routes::routes;
use diffmesh_tests::mesh::MeshBuilder;
use diffmesh_tests::tools::{require, schemathesis};

/// The checks that matter for a served contract (schemathesis names).
const CHECKS: &str = "not_a_server_error,status_code_conformance,content_type_conformance,\
                      response_headers_conformance,response_schema_conformance";
/// Test cases per operation and phase, and the whole run's budget.
const MAX_EXAMPLES: u32 = 12;
const MAX_TIME_S: u32 = 40;
/// A fixed seed: a failure reproduces with the same command.
const SEED: u32 = 20_251_121;

/// More arguments from `DIFFMESH_SCHEMATHESIS_ARGS` (whitespace-separated), e.g. to run one
/// operation: `--include-path /v1/jobs/{id}`.
fn extra_args() -> Vec<String> {
    std::env::var("DIFFMESH_SCHEMATHESIS_ARGS")
        .map(|v| v.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_document_holds_against_the_running_server() {
    let Some(schemathesis) = require(
        schemathesis(),
        "schemathesis",
        "pip install schemathesis into the venv, or cargo xtask setup",
    ) else {
        return;
    };
    let mesh = MeshBuilder::new()
        .cachestore(|c| c.memory_bytes = 64 << 20)
        .denoiser(|_, d| d.max_queue = 32)
        .gateway(|g| {
            g.max_steps = 3;
            g.default_steps = 2;
            g.max_n = 2;
            g.max_pixels = 128 * 128;
            g.max_prompt_chars = 200;
            g.max_body_bytes = 1 << 20;
            // Keep resubmitting through a slow spell of a loaded machine: a 503 for a denoiser
            // that answered late is capacity, not the contract this test checks.
            g.submit_wait = Duration::from_secs_f64(10.0);
            g.job_timeout = Duration::from_secs_f64(20.0);
        })
        .start()
        .await;
    let url = mesh.url("/openapi.json");
    // Its own working directory: schemathesis and hypothesis write nothing into the repository.
    let work = tempfile::tempdir().expect("tempdir");

    let started = Instant::now();
    let mut cmd = tokio::process::Command::new(&schemathesis);
    cmd.arg("run")
        .arg(&url)
        .args(["--checks", CHECKS])
        .args(["--phases", "examples,coverage,fuzzing"])
        .args(["--max-examples", &MAX_EXAMPLES.to_string()])
        .args(["--max-time", &MAX_TIME_S.to_string()])
        .args(["--seed", &SEED.to_string()])
        .args(["--request-timeout", "30"])
        // One worker: with two, hypothesis (in schemathesis's threads) parses source with
        // `ast.parse` in both at once, which Python 3.11 does not survive ("AST constructor
        // recursion depth mismatch", cpython gh-106905; it failed CI once).
        .args(["--workers", "1"])
        .args(["--generation-database", "none"])
        .args(["--suppress-health-check", "all"])
        .arg("--no-color")
        .args(extra_args())
        .current_dir(work.path())
        .kill_on_drop(true);
    let limit = Duration::from_secs(u64::from(MAX_TIME_S) + 60);
    let output = tokio::time::timeout(limit, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("schemathesis ran over {limit:?}"))
        .expect("run schemathesis");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}{stderr}");
    println!("schemathesis run: {:.1} s", started.elapsed().as_secs_f64());
    assert!(
        output.status.success(),
        "schemathesis found problems ({}); reproduce with: {} run {url} --checks {CHECKS} \
         --seed {SEED}\n{stdout}{stderr}",
        output.status,
        schemathesis.display()
    );
    // It really ran, and tested every operation it loaded (unless told to pick some).
    let count = |label: &str| -> Option<(usize, Option<usize>)> {
        let line = stdout.lines().find_map(|l| l.trim().strip_prefix(label))?;
        let mut parts = line.trim().split('/');
        let first = parts.next()?.trim().parse().ok()?;
        Some((first, parts.next().and_then(|t| t.trim().parse().ok())))
    };
    let (selected, total) = count("Selected:").expect("no `Selected:` line in the summary");
    let (tested, _) = count("Tested:").expect("no `Tested:` line in the summary");
    if extra_args().is_empty() {
        // Every documented operation but GET /openapi.json, which schemathesis leaves out as
        // the schema it loaded.
        let expected = routes().len() + HEALTH_ROUTES.len() - 1;
        assert_eq!(
            (selected, total),
            (expected, Some(expected)),
            "schemathesis did not load every documented operation"
        );
    }
    assert!(
        tested > 0 && tested == selected,
        "tested {tested} of {selected} operations"
    );
}
