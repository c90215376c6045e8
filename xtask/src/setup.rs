//! One-time, idempotent set-up of a fresh machine: the Python venv with torch (libtorch) and
//! diffusers in the cache directory, and `nats-server` from Debian where it is missing.
use crate::toolchain::{run, Toolchain, PY_REQUIREMENTS};
use std::process::Command;

pub fn setup(tc: &Toolchain) -> anyhow::Result<()> {
    ensure_venv(tc)?;
    ensure_nats_server()?;
    Ok(())
}

fn ensure_venv(tc: &Toolchain) -> anyhow::Result<()> {
    let wanted = PY_REQUIREMENTS.join("\n");
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

/// `nats-server` on PATH or where Debian puts it (/usr/sbin is not on every user's PATH).
pub fn nats_server_binary() -> Option<String> {
    if Command::new("nats-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Some("nats-server".into());
    }
    let debian = "/usr/sbin/nats-server";
    std::path::Path::new(debian)
        .exists()
        .then(|| debian.to_string())
}

fn apt_install(packages: &[&str]) -> anyhow::Result<()> {
    let sudo = !is_root();
    let mut update = if sudo {
        Command::new("sudo")
    } else {
        Command::new("apt-get")
    };
    if sudo {
        update.arg("apt-get");
    }
    run(update.arg("update").arg("-qq"))?;
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
