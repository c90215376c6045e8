//! The deployment files in `compose/` pass `compose/validate.sh`: compose structure (and
//! `docker compose config` where the CLI exists), Prometheus config and the alerting rules'
//! unit tests (promtool), the Alertmanager config and its routes (amtool) and inhibitions (the
//! server itself), the Grafana dashboard's JSON, views and metric names, provisioning, NATS
//! config, scripts, and one Dockerfile per service (referenced by it, multi-stage, non-root,
//! health-checked).
use std::path::Path;
use std::process::Command;

/// Checks that need only python3 (always there: the venv needs it), so they must have run.
const ALWAYS_RUN: &[&str] = &[
    "compose structure",
    "prometheus scrape jobs",
    "prometheus sends alerts to alertmanager:9093",
    "dashboard JSON",
    "dashboard and alert metric names",
    "grafana provisioning",
    "Dockerfile per service",
    "Dockerfile: COPY sources exist",
];

#[test]
fn compose_files_pass_validate_sh() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../compose/validate.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .expect("run compose/validate.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "compose/validate.sh failed:\n{stdout}{stderr}"
    );
    assert!(!stdout.contains("\nFAIL"), "a check failed:\n{stdout}");
    for check in ALWAYS_RUN {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("PASS") && l.contains(check)),
            "check `{check}` did not run:\n{stdout}"
        );
    }
    // Where promtool is found, the Prometheus checks run with it.
    if !stdout.contains("SKIP  promtool not found") {
        assert!(
            stdout.contains("PASS  promtool check config"),
            "promtool check config did not run:\n{stdout}"
        );
        assert!(
            stdout.contains("PASS  dashboard PromQL parses"),
            "the dashboard's PromQL was not checked:\n{stdout}"
        );
        assert!(
            stdout.contains("PASS  promtool test rules"),
            "the alerting rules' unit tests did not run:\n{stdout}"
        );
    }
    // Where haproxy is found, the balancer's config is checked with it.
    if !stdout.contains("SKIP  haproxy not found") {
        assert!(
            stdout.contains("PASS  haproxy -c haproxy/haproxy.cfg"),
            "haproxy -c did not run:\n{stdout}"
        );
    }
    // Where amtool is found, the Alertmanager config is checked and both severities routed.
    if !stdout.contains("SKIP  amtool not found") {
        for check in [
            "PASS  amtool check-config",
            "PASS  alertmanager routes severity=critical to page",
            "PASS  alertmanager routes severity=warning to ticket",
        ] {
            assert!(stdout.contains(check), "`{check}` missing:\n{stdout}");
        }
    }
    // Where the Alertmanager server is found, it evaluates the inhibitions: all three rounds.
    if !stdout.contains("SKIP  alertmanager inhibitions") {
        let line = stdout
            .lines()
            .find(|l| l.starts_with("PASS  alertmanager inhibitions"))
            .unwrap_or_else(|| panic!("the inhibition check did not pass:\n{stdout}"));
        assert!(
            line.contains("round 3"),
            "the inhibition check stopped early: {line}"
        );
    }
}
