//! `cargo xtask <command>`: the project's developer commands.
//!
//! `up` and `test` are the two commands a newcomer needs: each does the whole set-up of a fresh
//! machine first (see setup.rs), then runs the mesh or every test.
mod mesh;
mod setup;
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
    /// Install what the project needs (torch/libtorch + diffusers venv in the cache dir, nats-server).
    Setup,
    /// Set up, then run every test of the workspace.
    Test {
        /// Extra arguments for `cargo test` (e.g. `-p diffmesh-model`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Set up, build, and start NATS (if none answers) and every service; Ctrl-C stops them.
    Up(mesh::UpArgs),
    /// Stop a mesh started with `up --detach`.
    Down,
    /// One forward pass of a model component (see `diffmesh-forward --help`).
    Forward(PassThrough),
    /// Benchmarks: `bench model` (see `diffmesh-bench --help`).
    Bench(PassThrough),
    /// Train the tiny default model (see `diffmesh-train-tiny --help`).
    TrainTiny(PassThrough),
    /// Discrete-event simulation of the scheduler (see `diffmesh-sim --help`).
    Sim(PassThrough),
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
        Cmd::Setup => setup::setup(&tc),
        Cmd::Test { args } => {
            setup::setup(&tc)?;
            let mut cmd = Command::new(cargo());
            cmd.current_dir(workspace_root())
                .args(["test", "--workspace", "--no-fail-fast"])
                .args(args);
            tc.apply(&mut cmd)?;
            run(&mut cmd)
        }
        Cmd::Up(args) => {
            setup::setup(&tc)?;
            mesh::up(&tc, args)
        }
        Cmd::Down => mesh::down(),
        Cmd::Forward(p) => release_bin(&tc, "diffmesh-model", "diffmesh-forward", &p.args),
        Cmd::Bench(p) => release_bin(&tc, "diffmesh-model", "diffmesh-bench", &p.args),
        Cmd::TrainTiny(p) => release_bin(&tc, "diffmesh-model", "diffmesh-train-tiny", &p.args),
        Cmd::Sim(p) => release_bin(&tc, "diffmesh-sched", "diffmesh-sim", &p.args),
    }
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Build one binary in release mode, then run it directly (not through `cargo run`, which would
/// hold the build lock for the whole run).
fn release_bin(tc: &Toolchain, package: &str, bin: &str, args: &[String]) -> anyhow::Result<()> {
    setup::setup(tc)?;
    let root = workspace_root();
    let mut build = Command::new(cargo());
    build
        .current_dir(&root)
        .args(["build", "--release", "--quiet", "-p", package, "--bin", bin]);
    tc.apply(&mut build)?;
    run(&mut build)?;
    let mut cmd = Command::new(target_dir(&root).join("release").join(bin));
    cmd.current_dir(&root).args(args);
    tc.apply(&mut cmd)?;
    run(&mut cmd)
}

fn target_dir(root: &std::path::Path) -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(Into::into)
        .unwrap_or_else(|| root.join("target"))
}
