//! One-time, idempotent set-up of a fresh machine: the Python venv with torch (libtorch) and
//! diffusers in the cache directory, `nats-server` from Debian where it is missing,
//! `promtool` and `amtool` (for `compose/validate.sh`) from Debian's prometheus packages, the
//! Alertmanager server (for its inhibition check), and `haproxy` (the balancer of `compose/`
//! and of the chaos scripts' replicated gateways).
use crate::toolchain::{run, Toolchain, PY_DATA_PACKAGES, PY_REQUIREMENTS};
use std::process::Command;

pub fn setup(tc: &Toolchain) -> anyhow::Result<()> {
    ensure_venv(tc)?;
    ensure_nats_server()?;
    // Before the checkers: its package brings amtool too.
    ensure_alertmanager();
    ensure_validate_tools(tc);
    ensure_haproxy();
    Ok(())
}

fn ensure_venv(tc: &Toolchain) -> anyhow::Result<()> {
    let wanted = [PY_REQUIREMENTS, PY_DATA_PACKAGES].concat().join("\n");
    if std::fs::read_to_string(tc.stamp()).ok().as_deref() == Some(wanted.as_str())
        && tc.python().exists()
    {
        return Ok(());
    }
    std::fs::create_dir_all(&tc.root)?;
    if !tc.python().exists() {
        eprintln!(
            "setting up the Python environment in {} (torch {} is large: a few GB)",
            tc.venv().display(),
            crate::toolchain::TORCH_VERSION
        );
        let python = find_system_python()?;
        if run(Command::new(&python).args(["-m", "venv"]).arg(tc.venv())).is_err() {
            // Debian's python3 ships venv separately.
            apt_install(&["python3-venv"])?;
            run(Command::new(&python).args(["-m", "venv"]).arg(tc.venv()))?;
        }
    }
    run(Command::new(tc.python()).args(["-m", "pip", "install", "--quiet", "--upgrade", "pip"]))?;
    run(Command::new(tc.python())
        .args(["-m", "pip", "install", "--quiet"])
        .args(PY_REQUIREMENTS))?;
    run(Command::new(tc.python())
        .args(["-m", "pip", "install", "--quiet", "--no-deps"])
        .args(PY_DATA_PACKAGES))?;
    std::fs::write(tc.stamp(), wanted)?;
    Ok(())
}

fn find_system_python() -> anyhow::Result<String> {
    for candidate in ["python3", "python"] {
        if Command::new(candidate)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Ok(candidate.to_string());
        }
    }
    apt_install(&["python3", "python3-venv", "python3-pip"])?;
    Ok("python3".into())
}

fn ensure_nats_server() -> anyhow::Result<()> {
    if nats_server_binary().is_some() {
        return Ok(());
    }
    eprintln!("nats-server not found: installing Debian's package");
    apt_install(&["nats-server"])?;
    anyhow::ensure!(
        nats_server_binary().is_some(),
        "nats-server still missing after apt-get install"
    );
    Ok(())
}

/// Installed, not unpacked: it needs libraries a bare machine lacks (Lua, OpenTracing), and
/// Debian's package starts no balancer (its config has no frontend). Optional: without it
/// `compose/validate.sh` skips its check and the chaos scripts run one gateway.
fn ensure_haproxy() {
    if haproxy_binary().is_some() {
        return;
    }
    eprintln!("haproxy not found: installing Debian's package");
    if let Err(err) = apt_install(&["haproxy"]) {
        eprintln!(
            "warning: could not install haproxy ({err:#}); compose/validate.sh will skip its check"
        );
    }
}

/// The Alertmanager server, which `compose/validate.sh` starts to check the inhibitions.
/// Installed, not unpacked: Debian's build reads its templates from /usr/share. Optional:
/// without it the script skips that check.
fn ensure_alertmanager() {
    const BINARY: &str = "/usr/bin/prometheus-alertmanager";
    if std::path::Path::new(BINARY).exists() {
        return;
    }
    eprintln!("the Alertmanager server not found: installing Debian's prometheus-alertmanager");
    if let Err(err) = apt_install(&["prometheus-alertmanager"]) {
        eprintln!(
            "warning: could not install prometheus-alertmanager ({err:#}); compose/validate.sh \
             will skip the inhibition check"
        );
        return;
    }
    // Where systemd runs, the package starts a server on :9093 (the compose stack's port);
    // only its binary is wanted here.
    let _ = Command::new("systemctl")
        .args(["disable", "--now", "--quiet", "prometheus-alertmanager"])
        .output();
}

/// `haproxy` on PATH or where Debian puts it.
fn haproxy_binary() -> Option<String> {
    sbin_binary("haproxy", "-v")
}

/// A checker `compose/validate.sh` runs, taken from a Debian package.
struct DebianTool {
    binary: &'static str,
    package: &'static str,
    /// What the script checks with it (said when it cannot be had).
    checks: &'static str,
}

/// `promtool` checks the Prometheus config, the alerting rules and the dashboard's queries;
/// `amtool` the Alertmanager config and its routes.
const VALIDATE_TOOLS: [DebianTool; 2] = [
    DebianTool {
        binary: "promtool",
        package: "prometheus",
        checks: "the Prometheus checks",
    },
    DebianTool {
        binary: "amtool",
        package: "prometheus-alertmanager",
        checks: "the Alertmanager checks",
    },
];

/// Where `compose/validate.sh` looks for `binary` when it is not on PATH.
fn tool_path(tc: &Toolchain, binary: &str) -> std::path::PathBuf {
    tc.root.join("bin").join(binary)
}

/// The checkers come from Debian's packages, unpacked rather than installed: installing would
/// also start the servers, and only the checkers are needed (a ~20 MB download each).
/// Optional: without one the script skips its checks and says so.
fn ensure_validate_tools(tc: &Toolchain) {
    for tool in &VALIDATE_TOOLS {
        let on_path = Command::new(tool.binary)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if on_path || tool_path(tc, tool.binary).exists() {
            continue;
        }
        eprintln!(
            "{} not found: unpacking it from Debian's {} package",
            tool.binary, tool.package
        );
        if let Err(err) = unpack_tool(tc, tool) {
            eprintln!(
                "warning: could not get {} ({err:#}); compose/validate.sh will skip {}",
                tool.binary, tool.checks
            );
        }
    }
}

fn unpack_tool(tc: &Toolchain, tool: &DebianTool) -> anyhow::Result<()> {
    let work = tc.root.join(format!("{}-deb", tool.package));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let download = |work: &std::path::Path| {
        run(Command::new("apt-get")
            .args(["download", "-qq", tool.package])
            .current_dir(work))
    };
    if download(&work).is_err() {
        // A fresh machine has no package lists yet.
        apt_update()?;
        download(&work)?;
    }
    let deb = std::fs::read_dir(&work)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| anyhow::anyhow!("apt-get download left no .deb in {}", work.display()))?;
    let unpacked = work.join("root");
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))?;
    let target = tool_path(tc, tool.binary);
    std::fs::create_dir_all(tc.root.join("bin"))?;
    std::fs::copy(unpacked.join("usr/bin").join(tool.binary), &target)?;
    std::fs::remove_dir_all(&work)?;
    anyhow::ensure!(
        Command::new(&target)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "{} does not run",
        target.display()
    );
    Ok(())
}

/// `nats-server` on PATH or where Debian puts it (/usr/sbin is not on every user's PATH).
pub fn nats_server_binary() -> Option<String> {
    sbin_binary("nats-server", "--version")
}

/// `name` when it runs from PATH (asked for its version with `version_arg`), else Debian's
/// /usr/sbin copy when there is one.
fn sbin_binary(name: &str, version_arg: &str) -> Option<String> {
    if Command::new(name)
        .arg(version_arg)
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Some(name.into());
    }
    let debian = format!("/usr/sbin/{name}");
    std::path::Path::new(&debian).exists().then_some(debian)
}

fn apt_update() -> anyhow::Result<()> {
    let sudo = !is_root();
    let mut update = if sudo {
        Command::new("sudo")
    } else {
        Command::new("apt-get")
    };
    if sudo {
        update.arg("apt-get");
    }
    run(update.arg("update").arg("-qq"))
}

pub(crate) fn apt_install(packages: &[&str]) -> anyhow::Result<()> {
    let sudo = !is_root();
    apt_update()?;
    let mut install = if sudo {
        Command::new("sudo")
    } else {
        Command::new("apt-get")
    };
    if sudo {
        install.arg("apt-get");
    }
    install
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-qq"])
        .args(packages);
    run(&mut install)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}
