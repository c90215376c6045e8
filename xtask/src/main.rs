//! `cargo xtask <command>`: the project's developer commands.
//!
//! `up` and `test` are the two commands a newcomer needs: each does the whole set-up of a fresh
//! machine first (see setup.rs), then runs the mesh or every test.
mod compose_secrets;
mod elastic_sweep;
mod fuzz;
mod gates;
mod load;
mod load_inputs;
mod load_tap;
mod mesh;
mod overload;
mod plot;
mod setup;
mod sweep;
mod test_tools;
mod toolchain;

use clap::{Parser, Subcommand};
use std::process::Command;
use toolchain::{run, workspace_root, Toolchain};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "diffmesh developer commands")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what the project needs (torch/libtorch + diffusers venv in the cache dir, nats-server)
    /// and what the tests drive (chromium, node, tests/e2e's npm packages).
    Setup,
    /// Set up, run the gates (`lint`), then every test of the workspace; with arguments for
    /// `cargo test` (a package, a filter) only those tests, without the gates.
    Test {
        /// Extra arguments for `cargo test` (e.g. `-p diffmesh-model`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The gates every change passes: `cargo fmt --check`, clippy with `-D warnings`, and
    /// cargo-deny (licenses, bans, sources, advisories).
    Lint,
    /// Set up, build, and start NATS (if none answers) and every service; Ctrl-C stops them.
    Up(mesh::UpArgs),
    /// Stop a mesh started with `up --detach`.
    Down,
    /// Write what `compose/` needs to start: NATS users and TLS certificates, an API key, the
    /// router's admin key, Grafana's password (into compose/secrets, ignored by git).
    ComposeSecrets(compose_secrets::ComposeSecretsArgs),
    /// One forward pass of a model component (see `diffmesh-forward --help`).
    Forward(PassThrough),
    /// FLUX.1 prompt embeddings of a prompts file, as `FluxPipeline.encode_prompt` returns them
    /// (see `diffmesh-pipeline encode-prompt --help`).
    EncodePrompt(PassThrough),
    /// A whole FLUX.1 (or Fill) pipeline from given latents to an image tensor, as diffusers'
    /// pipeline returns it (see `diffmesh-pipeline generate --help`).
    Generate(PassThrough),
    /// Benchmarks: `bench model` (see `diffmesh-bench --help`), `bench engine` (see
    /// `diffmesh-engine-bench --help`), `bench lora` (see `diffmesh-lora-bench --help`),
    /// `bench controlnet` (see `diffmesh-controlnet-bench --help`), `bench collectives`
    /// (see `diffmesh-collectives-bench --help`), `bench sp` (see `diffmesh-sp-bench --help`)
    /// and `bench unet` (see `diffmesh-unet-bench --help`).
    Bench(PassThrough),
    /// Train the tiny default model (see `diffmesh-train-tiny --help`).
    TrainTiny(PassThrough),
    /// Discrete-event simulation of the scheduler (see `diffmesh-sim --help`).
    Sim(PassThrough),
    /// Measure per-block compute and cache-load latency on this machine and write scheduler
    /// profiles to sched/profiles (see `diffmesh-profile --help`).
    Profile(PassThrough),
    /// Load generator for the live mesh: Poisson edit requests against the gateway.
    Load(load::LoadArgs),
    /// Offer the live mesh 1.5x, 2x and 3x its measured capacity, sync and async, and check
    /// that every refusal is a quick 429 with Retry-After and no accepted job fails.
    Overload(overload::OverloadArgs),
    /// Simulator sweep over loads, policies and seeds: CSV and a p95-vs-load plot.
    Sweep(sweep::SweepArgs),
    /// GF-DiT's elastic parallelism in the simulator: every policy at every load on 8 and 72
    /// ranks, JSON lines and an SLO-attainment-vs-load plot per rank count.
    ElasticSweep(elastic_sweep::ElasticSweepArgs),
    /// Run every cargo-fuzz target of fuzz/ for `--seconds` each (nightly; installs cargo-fuzz
    /// if missing); fails naming the target and the crash file on any crash.
    Fuzz(fuzz::FuzzArgs),
}

/// Arguments handed unchanged to the underlying binary.
#[derive(clap::Args)]
struct PassThrough {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let tc = Toolchain::locate()?;
    match cli.command {
        Cmd::Setup => {
            setup::setup(&tc)?;
            test_tools::ensure();
            Ok(())
        }
        Cmd::Test { args } => {
            setup::setup(&tc)?;
            test_tools::ensure();
            if args.is_empty() {
                gates::check(&tc)?;
            }
            let mut cmd = Command::new(cargo());
            cmd.current_dir(workspace_root())
                .args(["test", "--workspace", "--no-fail-fast"])
                .args(args);
            tc.apply(&mut cmd)?;
            run(&mut cmd)
        }
        Cmd::Lint => {
            setup::setup(&tc)?;
            gates::check(&tc)
        }
        Cmd::Up(args) => {
            setup::setup(&tc)?;
            mesh::up(&tc, args)
        }
        Cmd::Down => mesh::down(),
        Cmd::ComposeSecrets(args) => compose_secrets::compose_secrets(args),
        Cmd::Forward(p) => release_bin(&tc, "diffmesh-model", "diffmesh-forward", &p.args),
        Cmd::EncodePrompt(p) => release_bin(
            &tc,
            "diffmesh-model",
            "diffmesh-pipeline",
            &[&["encode-prompt".to_string()], p.args.as_slice()].concat(),
        ),
        Cmd::Generate(p) => release_bin(
            &tc,
            "diffmesh-model",
            "diffmesh-pipeline",
            &[&["generate".to_string()], p.args.as_slice()].concat(),
        ),
        Cmd::Bench(p) => match p.args.split_first() {
            // The serving programs' benches live in their own crate (bench/).
            Some((part, rest)) if part == "engine" => {
                release_bin(&tc, "diffmesh-benches", "diffmesh-engine-bench", rest)
            }
            Some((part, rest)) if part == "lora" => {
                release_bin(&tc, "diffmesh-benches", "diffmesh-lora-bench", rest)
            }
            Some((part, rest)) if part == "controlnet-service" => release_bin(
                &tc,
                "diffmesh-benches",
                "diffmesh-controlnet-service-bench",
                rest,
            ),
            // The sequence-parallel step on CPU ranks: the elastic simulator's measured costs.
            Some((part, rest)) if part == "sp" => {
                release_bin(&tc, "diffmesh-model", "diffmesh-sp-bench", rest)
            }
            // GF-DiT's group-free collectives on CPU ranks (parallel/).
            Some((part, rest)) if part == "collectives" => {
                release_bin(&tc, "diffmesh-parallel", "diffmesh-collectives-bench", rest)
            }
            Some((part, rest)) if part == "controlnet" => {
                release_bin(&tc, "diffmesh-model", "diffmesh-controlnet-bench", rest)
            }
            // The UNet family's full forward against diffusers.
            Some((part, rest)) if part == "unet" => {
                release_bin(&tc, "diffmesh-model", "diffmesh-unet-bench", rest)
            }
            _ => release_bin(&tc, "diffmesh-model", "diffmesh-bench", &p.args),
        },
        Cmd::TrainTiny(p) => release_bin(&tc, "diffmesh-model", "diffmesh-train-tiny", &p.args),
        Cmd::Sim(p) => release_bin(&tc, "diffmesh-sched", "diffmesh-sim", &p.args),
        Cmd::Profile(p) => release_bin_with(
            &tc,
            "diffmesh-model",
            "diffmesh-profile",
            &["--features", "profile"],
            &p.args,
        ),
        Cmd::Load(args) => load::load(args),
        Cmd::Overload(args) => overload::overload(args),
        Cmd::Fuzz(args) => fuzz::fuzz(args),
        Cmd::Sweep(args) => {
            let sim = build_release_bin(&tc, "diffmesh-sched", "diffmesh-sim", &[])?;
            sweep::sweep(&sim, args)
        }
        Cmd::ElasticSweep(args) => {
            let sim = build_release_bin(&tc, "diffmesh-sched", "diffmesh-sim", &[])?;
            elastic_sweep::sweep(&sim, args)
        }
    }
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Build one binary in release mode, then run it directly (not through `cargo run`, which would
/// hold the build lock for the whole run).
fn release_bin(tc: &Toolchain, package: &str, bin: &str, args: &[String]) -> anyhow::Result<()> {
    release_bin_with(tc, package, bin, &[], args)
}

/// [`release_bin`] with extra `cargo build` arguments (e.g. the features a binary needs).
fn release_bin_with(
    tc: &Toolchain,
    package: &str,
    bin: &str,
    build_args: &[&str],
    args: &[String],
) -> anyhow::Result<()> {
    let path = build_release_bin(tc, package, bin, build_args)?;
    let mut cmd = Command::new(path);
    let root = workspace_root();
    cmd.current_dir(&root).args(args);
    tc.apply(&mut cmd)?;
    run(&mut cmd)
}

/// Build one binary in release mode; its path.
fn build_release_bin(
    tc: &Toolchain,
    package: &str,
    bin: &str,
    build_args: &[&str],
) -> anyhow::Result<std::path::PathBuf> {
    setup::setup(tc)?;
    let root = workspace_root();
    let mut build = Command::new(cargo());
    build
        .current_dir(&root)
        .args(["build", "--release", "--quiet", "-p", package, "--bin", bin])
        .args(build_args);
    tc.apply(&mut build)?;
    run(&mut build)?;
    Ok(target_dir(&root).join("release").join(bin))
}

fn target_dir(root: &std::path::Path) -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(Into::into)
        .unwrap_or_else(|| root.join("target"))
}
