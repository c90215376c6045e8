//! External tools some tests drive (Chromium and node for the playground, schemathesis for the
//! OpenAPI check). Outside CI a missing tool skips the test with a message saying how to get it;
//! in CI (`CI` set, as CI runs `.ci/run`) `cargo xtask setup` installs them, so a missing one
//! fails the test instead of letting it pass without running.
use std::path::{Path, PathBuf};
use std::process::Command;

/// Whether this run is CI's (`CI` set to anything but empty, `0` or `false`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// Decide what to do when `tool` is missing: in CI fail (panic) with `why`; elsewhere print a
/// SKIP line and return `None` so the test returns early.
pub fn require<T>(found: Option<T>, tool: &str, how_to_get_it: &str) -> Option<T> {
    if found.is_some() {
        return found;
    }
    assert!(
        !in_ci(),
        "{tool} is missing in CI; `cargo xtask setup` should have installed it ({how_to_get_it})"
    );
    // Straight to stderr: the test harness captures print!/eprint!, and a skip must be seen.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "SKIP: {tool} not found ({how_to_get_it}); this test did not run"
    );
    None
}

/// `program` if running it with `--version` succeeds.
pub fn runs(program: impl AsRef<Path>) -> bool {
    Command::new(program.as_ref())
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the repository")
        .to_path_buf()
}

/// Chromium: `$DIFFMESH_CHROMIUM`, else Debian's `/usr/bin/chromium`, else `chromium` on PATH.
pub fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("DIFFMESH_CHROMIUM") {
        return Some(PathBuf::from(p)).filter(|p| p.exists());
    }
    let debian = PathBuf::from("/usr/bin/chromium");
    if debian.exists() {
        return Some(debian);
    }
    runs("chromium").then(|| PathBuf::from("chromium"))
}

/// `node` on PATH.
pub fn node() -> Option<PathBuf> {
    runs("node").then(|| PathBuf::from("node"))
}

/// The e2e package (`tests/e2e`) when its dependencies are installed (`npm ci` there).
pub fn e2e_package() -> Option<PathBuf> {
    let dir = repo_root().join("tests/e2e");
    dir.join("node_modules/playwright-core/package.json")
        .exists()
        .then_some(dir)
}

/// `schemathesis`: on PATH, or in the project venv (`$VIRTUAL_ENV`, or next to
/// `$DIFFMESH_PYTHON`).
pub fn schemathesis() -> Option<PathBuf> {
    let mut candidates = vec![PathBuf::from("schemathesis")];
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        candidates.push(Path::new(&venv).join("bin/schemathesis"));
    }
    if let Some(python) = std::env::var_os("DIFFMESH_PYTHON") {
        if let Some(bin) = Path::new(&python).parent() {
            candidates.push(bin.join("schemathesis"));
        }
    }
    candidates.into_iter().find(|c| runs(c))
}
