//! `cargo xtask fuzz --seconds S`: every cargo-fuzz target of `fuzz/` (uploads, forms, wire
//! messages, LoRA files, prompts) built once, then run for S seconds each. Prints each target's
//! executions and fails naming the target and its crash file when any input crashed one.
//!
//! cargo-fuzz needs the nightly toolchain (libFuzzer's coverage instrumentation); it is
//! installed with `cargo install cargo-fuzz --locked` when missing. The build has no sanitizer:
//! the code is safe Rust, panics are what is hunted, and the targets' own allocator turns an
//! oversized allocation into a crash (`fuzz/src/lib.rs`).
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::toolchain::{render, run, workspace_root};

#[derive(clap::Args)]
pub struct FuzzArgs {
    /// Seconds each target runs.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Only these targets (default: every target `cargo fuzz list` names).
    targets: Vec<String>,
}

/// The build and run flags (optimised, with debug assertions and overflow checks: cargo-fuzz's
/// default, less its address sanitizer); `run` repeats them or it builds again.
const BUILD_FLAGS: &[&str] = &["--sanitizer", "none"];
/// Where a target's seeds are written (`diffmesh_fuzz::SEEDS_ENV`).
const SEEDS_ENV: &str = "DIFFMESH_FUZZ_SEEDS";
/// libFuzzer's final count of inputs run (`-print_final_stats=1`).
const EXECUTED: &str = "stat::number_of_executed_units:";
/// libFuzzer's line naming the input it saved after a crash, timeout or out-of-memory.
const SAVED: &str = "Test unit written to ";

/// `cargo +nightly` from rustup's proxy (`$CARGO` is the stable toolchain's own cargo).
fn nightly_cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.arg("+nightly").current_dir(workspace_root());
    // Set by the `cargo xtask` that runs us; the nightly build must not inherit them.
    for var in [
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "RUSTUP_TOOLCHAIN",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

fn check_nightly() -> anyhow::Result<()> {
    let out = nightly_cargo().arg("--version").output();
    match out {
        Ok(out) if out.status.success() => Ok(()),
        _ => anyhow::bail!(
            "the nightly toolchain is missing: cargo-fuzz builds with nightly only \
             (`rustup toolchain install nightly`, then run this again)"
        ),
    }
}

fn ensure_cargo_fuzz() -> anyhow::Result<()> {
    let installed = nightly_cargo()
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if installed {
        return Ok(());
    }
    eprintln!("cargo-fuzz is missing: installing it");
    run(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))
}

fn list_targets() -> anyhow::Result<Vec<String>> {
    let out = nightly_cargo().args(["fuzz", "list"]).output()?;
    anyhow::ensure!(
        out.status.success(),
        "cargo fuzz list failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect())
}

/// The host triple cargo-fuzz builds for (its default `--target`).
fn host_triple() -> anyhow::Result<String> {
    let out = Command::new("rustc").args(["+nightly", "-vV"]).output()?;
    String::from_utf8(out.stdout)?
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .ok_or_else(|| anyhow::anyhow!("rustc -vV named no host"))
}

/// What one target's run came to.
struct Outcome {
    target: String,
    executions: Option<u64>,
    /// The saved input, when the run failed.
    failure: Option<String>,
}

/// Write the target's seeds into its corpus, then fuzz it for `seconds`.
fn fuzz_target(
    binary: &Path,
    fuzz_dir: &Path,
    target: &str,
    seconds: u64,
) -> anyhow::Result<Outcome> {
    let corpus = fuzz_dir.join("corpus").join(target);
    let seeded = Command::new(binary).env(SEEDS_ENV, &corpus).output()?;
    anyhow::ensure!(
        seeded.status.success(),
        "{target} could not write its seeds: {}",
        String::from_utf8_lossy(&seeded.stderr)
    );
    let logs = fuzz_dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    let log_path = logs.join(format!("{target}.log"));
    let log = std::fs::File::create(&log_path)?;
    let mut cmd = nightly_cargo();
    cmd.args(["fuzz", "run", target])
        .args(BUILD_FLAGS)
        .arg("--")
        .args([
            format!("-max_total_time={seconds}"),
            "-print_final_stats=1".into(),
            // A single input that takes this long is a hang.
            "-timeout=10".into(),
            "-rss_limit_mb=2048".into(),
        ])
        .stdout(log.try_clone()?)
        .stderr(log);
    eprintln!("+ {} (log: {})", render(&cmd), log_path.display());
    let status = cmd.status()?;
    let text = std::fs::read_to_string(&log_path)?;
    let executions = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(EXECUTED))
        .and_then(|n| n.trim().parse().ok());
    let failure = (!status.success()).then(|| {
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        eprintln!("--- {target} failed; the end of its log:");
        tail.iter().rev().for_each(|l| eprintln!("{l}"));
        text.lines()
            .find_map(|l| l.split_once(SAVED).map(|(_, path)| path.trim().to_string()))
            .unwrap_or_else(|| format!("no input saved; see {}", log_path.display()))
    });
    Ok(Outcome {
        target: target.to_string(),
        executions,
        failure,
    })
}

pub fn fuzz(args: FuzzArgs) -> anyhow::Result<()> {
    check_nightly()?;
    ensure_cargo_fuzz()?;
    let root = workspace_root();
    let fuzz_dir = root.join("fuzz");
    let targets = if args.targets.is_empty() {
        list_targets()?
    } else {
        args.targets
    };
    let started = std::time::Instant::now();
    run(nightly_cargo().args(["fuzz", "build"]).args(BUILD_FLAGS))?;
    eprintln!("fuzz targets built in {:.0?}", started.elapsed());
    let bin_dir: PathBuf = fuzz_dir.join("target").join(host_triple()?).join("release");
    let mut outcomes = Vec::new();
    for target in &targets {
        outcomes.push(fuzz_target(
            &bin_dir.join(target),
            &fuzz_dir,
            target,
            args.seconds,
        )?);
    }
    println!("{:<20} {:>14}  result", "target", "executions");
    for o in &outcomes {
        let executions = o.executions.map_or("?".to_string(), |n| n.to_string());
        let result = o
            .failure
            .as_deref()
            .map_or("ok".to_string(), |f| format!("CRASH {f}"));
        println!("{:<20} {executions:>14}  {result}", o.target);
    }
    let failed: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.failure.as_ref().map(|f| format!("{} ({f})", o.target)))
        .collect();
    anyhow::ensure!(
        failed.is_empty(),
        "fuzz targets crashed: {}; reproduce with `cargo +nightly fuzz run <target> <file>`",
        failed.join(", ")
    );
    Ok(())
}
