//! Profiles measured with `cargo xtask profile` and checked in under `sched/profiles/`, built
//! into the binaries so the router has cost models without a file at run time: the tiny
//! (default) and medium models on a 2-vCPU CPU, and on an H100 (`--device cuda`, 2026-11-26).
use crate::cost_model::{CostModels, Profile};
use crate::error::SchedError;
use std::path::{Path, PathBuf};

/// `(name, JSON)` of every checked-in profile.
const BUILTIN: [(&str, &str); 4] = [
    ("tiny-cpu", include_str!("../profiles/tiny-cpu.json")),
    ("medium-cpu", include_str!("../profiles/medium-cpu.json")),
    ("tiny-h100", include_str!("../profiles/tiny-h100.json")),
    ("medium-h100", include_str!("../profiles/medium-h100.json")),
];

/// The profile the router uses by default: the tiny model (the mesh's default) on CPU.
pub const DEFAULT: &str = "tiny-cpu";

pub fn names() -> impl Iterator<Item = &'static str> {
    BUILTIN.iter().map(|(n, _)| *n)
}

/// A checked-in profile by name (`tiny-cpu`, `medium-cpu`, `tiny-h100`, `medium-h100`).
pub fn builtin(name: &str) -> Result<Profile, SchedError> {
    let (_, text) = BUILTIN.iter().find(|(n, _)| *n == name).ok_or_else(|| {
        SchedError::field(
            "profile",
            format!(
                "no built-in profile `{name}` (known: {})",
                names().collect::<Vec<_>>().join(", ")
            ),
        )
    })?;
    serde_json::from_str(text).map_err(|source| SchedError::Json {
        path: PathBuf::from(format!("sched/profiles/{name}.json")),
        source,
    })
}

/// A `--profile` value: a built-in profile's name, else a profile file's path. A value that
/// looks like neither (no `/`, no `.`, no such file) is taken for a mistyped name, and the
/// error lists the built-in ones.
pub fn load(spec: &Path) -> Result<Profile, SchedError> {
    match spec.to_str() {
        Some(name) if names().any(|n| n == name) => builtin(name),
        Some(name) if !name.contains(['/', '.']) && !spec.exists() => builtin(name),
        _ => Profile::read(spec),
    }
}

/// Cost models fitted on the default built-in profile.
pub fn builtin_models() -> Result<CostModels, SchedError> {
    CostModels::fit(&builtin(DEFAULT)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_is_measured_and_fits() {
        for name in names() {
            let p = builtin(name).unwrap();
            assert!(!p.synthetic, "{name} must be measured");
            assert!(p.compute.len() >= 8 && p.load.len() >= 8, "{name}");
            let m = CostModels::fit(&p).unwrap();
            // A GPU block at these sizes can be flat in FLOPs (launch-bound): slope 0 there.
            assert!(
                m.compute.slope >= 0.0 && m.load.slope > 0.0,
                "{name}: {m:?}"
            );
            assert!(m.step_latency(&one_request(&m)) > 0.0, "{name}: {m:?}");
        }
        assert!(builtin("nope")
            .unwrap_err()
            .to_string()
            .contains("tiny-cpu"));
    }

    fn one_request(m: &CostModels) -> crate::cost_model::BatchTotals {
        let mut t = crate::cost_model::BatchTotals::default();
        t.add(&m.shape, m.shape.masked_tokens(0.2));
        t
    }

    #[test]
    fn a_profile_is_named_or_read_from_a_file() {
        let named = load(Path::new("tiny-h100")).unwrap();
        assert_eq!(named, builtin("tiny-h100").unwrap());
        let path =
            std::env::temp_dir().join(format!("diffmesh-profile-{}.json", std::process::id()));
        named.write(&path).unwrap();
        let read = load(&path);
        let _ = std::fs::remove_file(&path);
        assert_eq!(read.unwrap(), named);
        let err = load(Path::new("no-such-profile.json")).unwrap_err();
        assert!(err.to_string().contains("no-such-profile.json"), "{err}");
        let err = load(Path::new("tiny-gpu")).unwrap_err().to_string();
        assert!(
            err.contains("tiny-gpu") && err.contains("tiny-h100"),
            "{err}"
        );
    }

    /// The router's default cost models must describe the model the mesh serves: a profile
    /// left behind by a retrained model (another width or depth) mispredicts every step.
    #[test]
    fn the_default_profile_has_the_shipped_tiny_models_shape() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny");
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("transformer/config.json")).unwrap(),
        )
        .unwrap();
        let int = |k: &str| {
            config[k]
                .as_u64()
                .unwrap_or_else(|| panic!("config.json: {k}"))
        };
        for name in [DEFAULT, "tiny-h100"] {
            let shape = builtin(name).unwrap().shape;
            assert_eq!(
                shape.hidden as u64,
                int("num_attention_heads") * int("attention_head_dim"),
                "{name}: hidden size"
            );
            assert_eq!(
                shape.blocks as u64,
                int("num_layers") + int("num_single_layers"),
                "{name}: blocks"
            );
        }
    }

    /// The H100 profiles: launch-bound blocks, which FLOPs alone fit to R^2 0.90 (medium) and
    /// 0.05 (tiny). With a cost per request, and more per mask-aware request (its gathers and
    /// merges), they fit as well as the CPU's.
    #[test]
    fn gpu_profiles_fit_with_the_per_request_terms() {
        for name in ["medium-h100", "tiny-h100"] {
            let m = CostModels::fit(&builtin(name).unwrap()).unwrap();
            println!("{name}: {}", m.describe());
            assert!(m.compute.r2 >= 0.95, "{name}: compute {:?}", m.compute);
            assert!(
                m.compute.per_cached_request > 0.0,
                "{name}: a mask-aware request costs more kernels: {:?}",
                m.compute
            );
        }
    }

    /// The bar for the linear cost models on this machine (FlashPS reports 0.99 on
    /// GPUs): compute (jointly; on the CPU also against FLOPs alone per pass kind, where a
    /// block's time is its arithmetic) and load against bytes.
    #[test]
    fn checked_in_profiles_fit_with_r2_at_least_0_95() {
        for name in names() {
            let p = builtin(name).unwrap();
            let m = CostModels::fit(&p).unwrap();
            assert!(m.compute.r2 >= 0.95, "{name}: compute {:?}", m.compute);
            assert!(m.load.r2 >= 0.95, "{name}: load {:?}", m.load);
            if !name.ends_with("-cpu") {
                continue;
            }
            let (full, masked) = CostModels::fit_by_kind(&p);
            for (kind, fit) in [("full", full), ("mask-aware", masked)] {
                let fit = fit.unwrap_or_else(|| panic!("{name}: no {kind} samples"));
                assert!(fit.r2 >= 0.95, "{name}: {kind} passes {fit:?}");
            }
        }
    }
}
