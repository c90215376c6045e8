//! Strict safetensors loading into a tch `VarStore`.
//!
//! Models create their parameters under diffusers' key names (tch joins path segments with '.',
//! the same separator checkpoints use), then `load_strict` copies a checkpoint in: a single
//! `*.safetensors` file or shards listed by a `*.safetensors.index.json`. Loading fails with one
//! message that names every missing and every mis-shaped key.
use crate::error::{ModelError, Result};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Tensor};

/// The safetensors files of a component folder: the shards named by an index file if there is
/// one, otherwise every `*.safetensors` file (sorted, so loading is deterministic).
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut names: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    names.sort();
    if let Some(index) = names
        .iter()
        .find(|p| p.to_string_lossy().ends_with(".safetensors.index.json"))
    {
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: HashMap<String, String>,
        }
        let index: Index = crate::error::read_json(index)?;
        let shards: BTreeSet<String> = index.weight_map.into_values().collect();
        return Ok(shards.into_iter().map(|s| dir.join(s)).collect());
    }
    let files: Vec<PathBuf> = names
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    if files.is_empty() {
        return Err(ModelError::Weights {
            dir: dir.to_path_buf(),
            report: "no *.safetensors file found".into(),
        });
    }
    Ok(files)
}

/// Read every tensor of a component folder into memory (CPU), keyed by checkpoint name.
pub fn read_checkpoint(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let mut all = HashMap::new();
    for file in checkpoint_files(dir)? {
        for (name, tensor) in Tensor::read_safetensors(&file)? {
            all.insert(name, tensor);
        }
    }
    Ok(all)
}

/// Copy a checkpoint into `vs`, converting dtype and device to each variable's own.
/// Keys in the checkpoint that the model does not use are returned (callers may log them).
pub fn load_strict(vs: &mut VarStore, dir: &Path) -> Result<Vec<String>> {
    let mut checkpoint = read_checkpoint(dir)?;
    let variables = vs.variables();
    let mut missing = Vec::new();
    let mut misshaped = Vec::new();
    for (name, var) in &variables {
        match checkpoint.get(name) {
            None => missing.push(name.clone()),
            Some(t) if t.size() != var.size() => misshaped.push(format!(
                "{name}: checkpoint {:?}, model {:?}",
                t.size(),
                var.size()
            )),
            Some(_) => {}
        }
    }
    if !missing.is_empty() || !misshaped.is_empty() {
        missing.sort();
        misshaped.sort();
        let mut report = String::new();
        for m in &missing {
            report.push_str(&format!("  missing key: {m}\n"));
        }
        for m in &misshaped {
            report.push_str(&format!("  mis-shaped key: {m}\n"));
        }
        return Err(ModelError::Weights {
            dir: dir.to_path_buf(),
            report,
        });
    }
    tch::no_grad(|| -> Result<()> {
        for (name, mut var) in variables {
            let src = checkpoint.remove(&name).expect("checked above");
            var.f_copy_(&src.f_to_kind(var.kind())?.f_to_device(var.device())?)?;
        }
        Ok(())
    })?;
    let mut unused: Vec<String> = checkpoint.into_keys().collect();
    unused.sort();
    Ok(unused)
}

/// [`load_strict`] into `vs` as `kind`, then freeze it (inference): the loading every
/// component folder shares. Unused checkpoint keys are logged, naming `what` reads them.
pub fn load_frozen(vs: &mut VarStore, dir: &Path, kind: tch::Kind, what: &str) -> Result<()> {
    vs.set_kind(kind);
    let unused = load_strict(vs, dir)?;
    if !unused.is_empty() {
        tracing::warn!(dir = %dir.display(), count = unused.len(), first = %unused[0], "checkpoint keys not used by the {what}");
    }
    vs.freeze();
    Ok(())
}

/// Write every variable of `vs` to one safetensors file (used by training and test fixtures).
pub fn save(vs: &VarStore, path: &Path) -> Result<()> {
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&vars, path)?;
    Ok(())
}
