//! The playground at `/` driven in headless Chromium (Debian's chromium through playwright-core:
//! `tests/e2e/playground.mjs`) against the whole mesh in-process (NATS, codec, cachestore,
//! router, a denoiser with the tiny model, gateway), as a person would use it:
//!
//! 1. upload `docs/examples/template.png`, paint a stroke, type a prompt, submit, and see the
//!    progress (step k of N) and the result;
//! 2. tick "register it as a template" and submit again (capture, then an edit by id);
//! 3. on a fresh page pick that template from the list, paint, submit, see the result.
//!
//! API keys are on, so the page asks for one and sends it with every call. Every result is then
//! checked through the API: its job is done, and the image has the template's size and equals
//! it exactly outside the mask the page sent.
//!
//! The screenshot after the first edit goes to `target/tmp/playground/playground.png`; with
//! `DIFFMESH_UPDATE_SCREENSHOT=1` it is also copied to `docs/playground.png` (the README's).
//! Without chromium, node or `tests/e2e/node_modules` the test says so and skips, except in CI,
//! where `cargo xtask setup` installs them.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use diffmesh_tests::mesh::{MeshBuilder, TestMesh};
use diffmesh_tests::tools::{chromium, e2e_package, node, repo_root, require};
use image::{GenericImageView, GrayImage, RgbaImage};
use serde_json::Value;

/// Steps of every edit: enough that the page sees step events (a tiny-model step takes
/// milliseconds), few enough to keep the test short.
const STEPS: u32 = 60;
/// The whole browser run: three edits and a template capture, on a busy 2-core machine.
const BROWSER_TIMEOUT: Duration = Duration::from_secs(420);
/// API keys are on, so the page's key field and the Bearer header on every call (the event
/// stream included) are part of what runs.
const API_KEY: &str = "playground-test-key";

struct Mesh {
    api: std::net::SocketAddr,
    http: reqwest::Client,
    _mesh: TestMesh,
}

async fn start_mesh() -> Mesh {
    let mesh = MeshBuilder::new()
        .cachestore(|c| c.memory_bytes = 64 << 20)
        .gateway(|g| {
            g.max_steps = STEPS.max(g.max_steps);
            g.submit_wait = Duration::from_secs_f64(30.0);
            g.job_timeout = Duration::from_secs_f64(180.0);
            g.api_keys = Some(format!("browser:{API_KEY}"));
        })
        // Chromium shares the two cores with the whole mesh: a heartbeat can come late by more
        // than the test default's 300 ms without the denoiser being gone (a false loss puts a
        // `retrying` line into the page's log). Losing a denoiser is not what this tests.
        .router(|r| r.missed_heartbeats = 20)
        .start()
        .await;
    Mesh {
        api: mesh.api(),
        http: reqwest::Client::new(),
        _mesh: mesh,
    }
}

impl Mesh {
    async fn get(&self, path: &str) -> reqwest::Response {
        let url = format!("http://{}{path}", self.api);
        self.http
            .get(&url)
            .bearer_auth(API_KEY)
            .send()
            .await
            .expect("GET")
    }
}

/// Run the browser script; its last stdout line is its JSON report.
async fn run_browser(node: &Path, e2e: &Path, url: &str, out: &Path) -> Value {
    let template = repo_root().join("docs/examples/template.png");
    let chromium = chromium().expect("checked above");
    let mut cmd = tokio::process::Command::new(node);
    cmd.arg(e2e.join("playground.mjs"))
        .arg("--url")
        .arg(url)
        .arg("--image")
        .arg(&template)
        .arg("--chromium")
        .arg(&chromium)
        .arg("--out")
        .arg(out)
        .arg("--screenshot")
        .arg(out.join("playground.png"))
        .arg("--steps")
        .arg(STEPS.to_string())
        .arg("--api-key")
        .arg(API_KEY)
        .current_dir(e2e)
        .kill_on_drop(true);
    let output = tokio::time::timeout(BROWSER_TIMEOUT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("the browser run took over {BROWSER_TIMEOUT:?}"))
        .expect("run node");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let report: Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON report from the browser run\n{stdout}\n{stderr}"));
    assert!(
        output.status.success() && report["ok"] == true,
        "the browser run failed ({}): {:#}\nstderr: {stderr}",
        output.status,
        report["problems"]
    );
    report
}

/// The job behind a result the page showed: done, and its image equals the template outside
/// the mask the page sent (and has its size).
async fn check_result(mesh: &Mesh, edit: &Value, mask_path: &Path, template: &RgbaImage) {
    let name = edit["name"].as_str().unwrap();
    let job_id = edit["jobId"]
        .as_str()
        .unwrap_or_else(|| panic!("{name}: the page shows no job id: {edit}"));
    assert_eq!(edit["state"], "done", "{name}: {edit}");
    assert_eq!(edit["resultShown"], true, "{name}: no result image shown");
    assert_eq!(
        (edit["resultWidth"].as_u64(), edit["resultHeight"].as_u64()),
        (
            Some(u64::from(template.width())),
            Some(u64::from(template.height()))
        ),
        "{name}: the shown result is not at the template's size"
    );

    let job: Value = mesh
        .get(&format!("/v1/jobs/{job_id}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(job["status"], "done", "{name}: {job}");
    assert_eq!(job["kind"], "edit", "{name}: {job}");
    let png = mesh
        .get(&format!("/v1/jobs/{job_id}/result/0"))
        .await
        .bytes()
        .await
        .unwrap();
    let result = image::load_from_memory(&png)
        .expect("result PNG")
        .to_rgba8();
    let mask: GrayImage = image::open(mask_path)
        .unwrap_or_else(|e| panic!("{}: {e}", mask_path.display()))
        .to_luma8();
    assert_eq!(result.dimensions(), template.dimensions(), "{name}");
    assert_eq!(
        mask.dimensions(),
        template.dimensions(),
        "{name}: mask size"
    );

    let painted = mask.pixels().filter(|p| p.0[0] >= 128).count();
    let total = mask.pixels().len();
    assert!(
        painted > 0 && painted < total / 2,
        "{name}: the stroke should cover part of the image, covers {painted} of {total} pixels"
    );
    let mut changed = 0;
    for (x, y, m) in mask.enumerate_pixels() {
        let (r, t) = (result.get_pixel(x, y), template.get_pixel(x, y));
        if m.0[0] < 128 {
            assert_eq!(
                r.0[..3],
                t.0[..3],
                "{name}: unmasked pixel ({x}, {y}) changed"
            );
        } else if r != t {
            changed += 1;
        }
    }
    assert!(changed > 0, "{name}: nothing under the mask was repainted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn playground_edits_an_upload_and_a_registered_template_in_chromium() {
    let Some(_) = require(chromium(), "chromium", "apt-get install chromium") else {
        return;
    };
    let Some(node) = require(node(), "node", "apt-get install nodejs npm") else {
        return;
    };
    let Some(e2e) = require(
        e2e_package(),
        "playwright-core in tests/e2e/node_modules",
        "npm ci --prefix tests/e2e, or cargo xtask setup",
    ) else {
        return;
    };
    let mesh = start_mesh().await;
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("playground");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();

    let started = Instant::now();
    let report = run_browser(&node, &e2e, &format!("http://{}/", mesh.api), &out).await;
    println!("browser run: {:.1} s", started.elapsed().as_secs_f64());

    let template = image::open(repo_root().join("docs/examples/template.png"))
        .unwrap()
        .to_rgba8();
    let edits = report["edits"].as_array().expect("edits");
    let names: Vec<&str> = edits.iter().filter_map(|e| e["name"].as_str()).collect();
    assert_eq!(names, ["upload", "registered", "picked"], "{report}");
    for edit in edits {
        let mask = out.join(edit["mask"].as_str().unwrap());
        check_result(&mesh, edit, &mask, &template).await;
    }

    // The first edit's progress came from the event stream: step events (the page folds them
    // into one `step k/N` line and counts them) up to the last step, then done.
    let log: Vec<&str> = edits[0]["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let last_step = format!("step {STEPS}/{STEPS}");
    assert_eq!(
        log.iter().rev().take(2).rev().copied().collect::<Vec<_>>(),
        [last_step.as_str(), "done"],
        "the page's log: {log:?}"
    );
    let step_events = edits[0]["stepEvents"].as_array().unwrap();
    assert_eq!(step_events.len(), 1, "{log:?}");
    let seen = step_events[0].as_u64().unwrap();
    assert!(
        (1..=u64::from(STEPS)).contains(&seen),
        "{seen} step events for {STEPS} steps"
    );
    println!("the page saw {seen} of {STEPS} step events; log: {log:?}");
    // Previews every 2 steps (the page's default), never after the last: at most 29 shown.
    // Then the result downloads as JPEG, re-encoded by the browser.
    let previews = edits[0]["previews"].as_u64().unwrap_or(0);
    assert!(
        (1..u64::from(STEPS / 2)).contains(&previews),
        "{previews} previews for {STEPS} steps"
    );
    println!("the page showed {previews} previews");
    assert_eq!(
        edits[0]["download"],
        serde_json::json!({"name": "edited.jpg", "type": "image/jpeg", "blob": true}),
        "{}",
        edits[0]
    );

    // The template edits ran on the registered template, which the list shows as ready.
    let template_id = edits[1]["templateId"].as_str().expect("template id");
    assert_eq!(edits[1]["source"], "template");
    assert_eq!(edits[2]["templateId"], template_id, "{}", edits[2]);
    let view: Value = mesh
        .get(&format!("/v1/templates/{template_id}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(view["status"], "ready", "{view}");
    let image = mesh
        .get(&format!("/v1/templates/{template_id}/image"))
        .await;
    assert_eq!(image.status(), 200);
    assert_eq!(image.headers()["content-type"], "image/png");
    // Without the key the page's calls would have been refused.
    let anonymous = mesh
        .http
        .get(format!("http://{}/v1/templates", mesh.api))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);

    let screenshot = out.join("playground.png");
    let shot = image::open(&screenshot).expect("screenshot PNG");
    assert!(
        shot.width() >= 1000 && shot.height() >= 600,
        "{:?}",
        shot.dimensions()
    );
    println!("screenshot: {}", screenshot.display());
    if std::env::var_os("DIFFMESH_UPDATE_SCREENSHOT").is_some_and(|v| v == "1") {
        let docs = repo_root().join("docs/playground.png");
        std::fs::copy(&screenshot, &docs).unwrap();
        println!("copied to {}", docs.display());
    }
}
