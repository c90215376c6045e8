//! Strict safetensors loading into a tch `VarStore`.
//!
//! Models create their parameters under diffusers' key names (tch joins path segments with '.',
//! the same separator checkpoints use), then `load_strict` copies a checkpoint in: a single
//! `*.safetensors` file or shards listed by a `*.safetensors.index.json`. Loading fails with one
//! message that names every missing and every mis-shaped key.
use crate::error::{ModelError, Result};
use crate::safetensors_file::SafetensorsFile;
use std::collections::hash_map::Entry;
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

/// Bytes the variables of `vs` hold (on whatever device they are).
pub fn store_bytes(vs: &VarStore) -> u64 {
    vs.variables()
        .values()
        .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum()
}

/// An empty store whose variables are created in `kind` on `device`: a model built on it never
/// holds its weights in f32 first (12B parameters of FLUX.1 would take 48 GB).
pub fn new_store(device: tch::Device, kind: tch::Kind) -> VarStore {
    let mut vs = VarStore::new(device);
    vs.set_kind(kind);
    vs
}

/// Copy a checkpoint into `vs`, converting dtype and device to each variable's own.
/// Keys in the checkpoint that the model does not use are returned (callers may log them).
pub fn load_strict(vs: &mut VarStore, dir: &Path) -> Result<Vec<String>> {
    load_strict_renamed(vs, dir, &|_| None)
}

/// [`load_strict`] for checkpoints written under other key names: `rename` maps a checkpoint key
/// to the model's (`None` keeps it). A renamed key never replaces a key the checkpoint holds under
/// the model's own name (tied copies, e.g. T5's `encoder.embed_tokens` beside `shared`).
pub fn load_strict_renamed(
    vs: &mut VarStore,
    dir: &Path,
    rename: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<String>> {
    // Headers first: which file holds each model key, so missing and mis-shaped keys are all
    // reported before any weight is read.
    let mut files = Vec::new();
    for path in checkpoint_files(dir)? {
        files.push(SafetensorsFile::open(&path)?);
    }
    // Model key -> (file, checkpoint key); a key under the model's own name wins over a rename.
    let mut sources: HashMap<String, (usize, String)> = HashMap::new();
    let mut renamed = Vec::new();
    for (i, file) in files.iter().enumerate() {
        for key in file.entries().keys() {
            match rename(key).filter(|new| new != key) {
                Some(new) => renamed.push((new, (i, key.clone()))),
                None => {
                    sources.insert(key.clone(), (i, key.clone()));
                }
            }
        }
    }
    let mut unused: Vec<String> = Vec::new();
    for (new, source) in renamed {
        match sources.entry(new) {
            Entry::Occupied(_) => unused.push(source.1),
            Entry::Vacant(slot) => {
                slot.insert(source);
            }
        }
    }
    let variables = vs.variables();
    let mut missing = Vec::new();
    let mut misshaped = Vec::new();
    for (name, var) in &variables {
        match sources.get(name) {
            None => missing.push(name.clone()),
            Some((i, key)) => {
                let shape = &files[*i].entries()[key].shape;
                if *shape != var.size() {
                    misshaped.push(format!(
                        "{name}: checkpoint {shape:?}, model {:?}",
                        var.size()
                    ));
                }
            }
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
            let (i, key) = sources.remove(&name).expect("checked above");
            let src = files[i].read(&key)?;
            var.f_copy_(&src.f_to_kind(var.kind())?.f_to_device(var.device())?)?;
        }
        Ok(())
    })?;
    unused.extend(sources.into_values().map(|(_, key)| key));
    unused.sort();
    Ok(unused)
}

/// A diffusers component folder's `config.json`, whose `_class_name` (where it names one) must
/// be `class`.
pub fn component_config<C: serde::de::DeserializeOwned>(dir: &Path, class: &str) -> Result<C> {
    let path = dir.join("config.json");
    let raw: serde_json::Value = crate::error::read_json(&path)?;
    if let Some(found) = raw.get("_class_name").and_then(|c| c.as_str()) {
        if found != class {
            return Err(ModelError::config(
                "_class_name",
                format!("expected {class}, found {found}"),
            ));
        }
    }
    serde_json::from_value(raw).map_err(|source| ModelError::Json { path, source })
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

/// How a component's checkpoint lands in its variables: beyond [`load_frozen`], checkpoint keys
/// under other names and variables that stay in f32 whatever the component's dtype.
pub struct LoadPlan<'a> {
    pub kind: tch::Kind,
    /// Checkpoint key to model key (see [`load_strict_renamed`]).
    pub rename: &'a dyn Fn(&str) -> Option<String>,
    /// Variables kept in f32 (transformers' `_keep_in_fp32_modules`).
    pub keep_f32: &'a dyn Fn(&str) -> bool,
}

/// [`load_frozen`] following `plan`.
pub fn load_frozen_planned(
    vs: &mut VarStore,
    dir: &Path,
    plan: &LoadPlan<'_>,
    what: &str,
) -> Result<()> {
    vs.set_kind(plan.kind);
    if plan.kind != tch::Kind::Float {
        tch::no_grad(|| -> Result<()> {
            for (name, mut var) in vs.variables() {
                if (plan.keep_f32)(&name) {
                    // set_data changes the variable the model holds, not a copy.
                    var.f_set_data(&var.f_to_kind(tch::Kind::Float)?)?;
                }
            }
            Ok(())
        })?;
    }
    let unused = load_strict_renamed(vs, dir, plan.rename)?;
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
