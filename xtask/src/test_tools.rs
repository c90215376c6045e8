//! Tools only the test suite drives, set up by `cargo xtask setup` and `cargo xtask test` (not
//! by `up`): Debian's `chromium`, `node` and `npm` where missing, and the npm packages of
//! `tests/e2e` (playwright-core, exactly as its package-lock.json pins) for the playground's
//! browser test (`tests/tests/playground.rs`). schemathesis comes with the venv
//! (`toolchain::PY_REQUIREMENTS`).
//!
//! Optional like promtool: a failure is a warning, and the tests that need a missing tool skip,
//! except in CI, where they fail and name it.
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use crate::setup::apt_install;
use crate::toolchain::{run, workspace_root};

/// Where Debian's package puts the browser (the tests look there too).
const CHROMIUM: &str = "/usr/bin/chromium";

pub fn ensure() {
    let started = Instant::now();
    let mut did = Vec::new();
    match ensure_debian_packages() {
        Ok(installed) if !installed.is_empty() => did.push(format!("apt: {}", installed.join(" "))),
        Ok(_) => {}
        Err(err) => eprintln!(
            "warning: could not install the browser test's tools ({err:#}); \
             tests/tests/playground.rs will skip (and fail in CI)"
        ),
    }
    match ensure_e2e_packages() {
        Ok(true) => did.push("npm ci in tests/e2e".into()),
        Ok(false) => {}
        Err(err) => eprintln!(
            "warning: could not install tests/e2e's npm packages ({err:#}); \
             tests/tests/playground.rs will skip (and fail in CI)"
        ),
    }
    if !did.is_empty() {
        eprintln!(
            "test tools installed in {:.1} s ({})",
            started.elapsed().as_secs_f64(),
            did.join("; ")
        );
    }
}

fn runs(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Install what is missing of chromium, node and npm; returns the packages installed.
fn ensure_debian_packages() -> anyhow::Result<Vec<&'static str>> {
    let mut missing = Vec::new();
    if !Path::new(CHROMIUM).exists() && !runs("chromium") {
        missing.push("chromium");
    }
    if !runs("node") {
        missing.push("nodejs");
    }
    if !runs("npm") {
        missing.push("npm");
    }
    if missing.is_empty() {
        return Ok(missing);
    }
    eprintln!(
        "installing Debian's {} for the playground's browser test",
        missing.join(", ")
    );
    apt_install(&missing)?;
    Ok(missing)
}

/// `npm ci` in tests/e2e unless node_modules already holds what package-lock.json pins (a
/// copy of the lock file in node_modules says so); returns whether it ran.
fn ensure_e2e_packages() -> anyhow::Result<bool> {
    let dir = workspace_root().join("tests/e2e");
    let lock = std::fs::read_to_string(dir.join("package-lock.json"))?;
    let stamp = dir.join("node_modules/.diffmesh-package-lock.json");
    let installed = dir.join("node_modules/playwright-core/package.json");
    if installed.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&lock) {
        return Ok(false);
    }
    eprintln!("installing tests/e2e's npm packages (playwright-core; the browser is Debian's)");
    run(Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
        // playwright-core downloads no browser of its own; say so in case a version would.
        .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
        .current_dir(&dir))?;
    std::fs::write(&stamp, lock)?;
    Ok(true)
}
