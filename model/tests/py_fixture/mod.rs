//! Runs a parity-fixture script with the Python interpreter from `DIFFMESH_PYTHON` (default: the
//! project venv) and loads what it wrote. Fixtures go under cargo's per-test temp dir in target/.
#![allow(dead_code)]
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::Tensor;

pub fn python() -> String {
    std::env::var("DIFFMESH_PYTHON")
        .unwrap_or_else(|_| "/root/.cache/diffmesh/venv/bin/python".into())
}

/// Repository root (the parent of the `model` crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("model crate has a parent")
        .to_path_buf()
}

/// Run `python/parity/<script> <args..> <out>` into a fresh `target/tmp/<name>` and return it.
pub fn generate(script: &str, args: &[&str], name: &str) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).expect("create fixture dir");
    let script = repo_root().join("python/parity").join(script);
    let status = Command::new(python())
        .arg(&script)
        .args(args)
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {} (set DIFFMESH_PYTHON): {e}", python()));
    assert!(
        status.success(),
        "{} {args:?} failed: {status}",
        script.display()
    );
    out
}

pub fn read_tensors(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .into_iter()
        .collect()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shape mismatch");
    (a - b).abs().max().double_value(&[])
}
