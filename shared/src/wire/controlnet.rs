//! ControlNets as requests name them: a ControlNet the serving side holds (a named folder in
//! diffusers' `FluxControlNetModel` layout) and the strength it steers with. The control image
//! travels beside the job (the codec prepares it at the model resolution).
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Largest `controlnet.scale` accepted (diffusers' `controlnet_conditioning_scale`; real
/// ControlNets are used between 0.3 and 1.5).
pub const MAX_CONTROLNET_SCALE: f32 = 2.0;
/// Longest ControlNet name.
pub const MAX_NAME_LEN: usize = 64;
/// Most ControlNets steering one generation (Katz: most multi-ControlNet requests use 2 or 3).
pub const MAX_CONTROLNETS: usize = 4;

/// The ControlNet a generation is steered by.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlNetRef {
    pub name: String,
    pub scale: f32,
}

/// Why `name` cannot name a ControlNet folder (`None`: it can): 1-64 characters of ASCII
/// letters, digits, `-`, `_` and `.`, not starting with `.` (it becomes a path component and a
/// NATS subject token).
pub fn name_problem(name: &str) -> Option<String> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Some(format!("must be 1 to {MAX_NAME_LEN} characters"));
    }
    if name.starts_with('.') {
        return Some("must not start with `.`".into());
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Some(format!(
            "`{c}` is not allowed (letters, digits, `-`, `_`, `.`)"
        ));
    }
    None
}

/// The ControlNet names a folder serves, sorted (what heartbeats advertise): its sub-folders
/// with a `config.json` whose names a request may give.
pub fn served(dir: Option<&Path>) -> Vec<String> {
    let Some(dir) = dir else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name_problem(name).is_none())
        .filter(|name| dir.join(name).join("config.json").is_file())
        .collect();
    names.sort();
    names
}

/// The `_class_name` of UNet ControlNets (diffusers' `ControlNetModel`, SD 2.x and SDXL).
pub const UNET_CONTROLNET_CLASS: &str = "ControlNetModel";
/// The `_class_name` of Flux ControlNets.
pub const FLUX_CONTROLNET_CLASS: &str = "FluxControlNetModel";

/// [`served`] split by the network the ControlNets steer: (Flux's, the UNet family's), as a
/// ControlNet worker announces them, by the class its `config.json` names; a folder of any other
/// class (SD3's, a union ControlNet, none) is in neither list, since no engine here runs it.
pub fn served_by_network(dir: Option<&Path>) -> (Vec<String>, Vec<String>) {
    #[derive(Deserialize)]
    struct Class {
        #[serde(rename = "_class_name")]
        class: Option<String>,
    }
    let (mut flux, mut unet) = (Vec::new(), Vec::new());
    for name in served(dir) {
        let config = dir.map(|d| d.join(&name).join("config.json"));
        let class = config
            .and_then(|c| std::fs::read(c).ok())
            .and_then(|bytes| serde_json::from_slice::<Class>(&bytes).ok())
            .and_then(|c| c.class);
        match class.as_deref() {
            Some(UNET_CONTROLNET_CLASS) => unet.push(name),
            Some(FLUX_CONTROLNET_CLASS) => flux.push(name),
            _ => {}
        }
    }
    (flux, unet)
}

#[cfg(test)]
mod tests {
    use super::{name_problem, served, served_by_network};

    #[test]
    fn workers_announce_flux_and_unet_controlnets_apart() {
        let dir = tempfile::tempdir().unwrap();
        for (name, config) in [
            ("canny", r#"{"_class_name": "FluxControlNetModel"}"#),
            ("depth-xl", r#"{"_class_name": "ControlNetModel"}"#),
            ("old", "{}"),
        ] {
            std::fs::create_dir_all(dir.path().join(name)).unwrap();
            std::fs::write(dir.path().join(name).join("config.json"), config).unwrap();
        }
        let (flux, unet) = served_by_network(Some(dir.path()));
        assert_eq!(flux, ["canny"]);
        assert_eq!(unet, ["depth-xl"]);
    }

    #[test]
    fn heartbeats_advertise_the_folders_that_hold_a_controlnet() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["silhouette", "canny", "empty", "bad name"] {
            std::fs::create_dir_all(dir.path().join(name)).unwrap();
        }
        for name in ["silhouette", "canny", "bad name"] {
            std::fs::write(dir.path().join(name).join("config.json"), "{}").unwrap();
        }
        std::fs::write(dir.path().join("README.md"), "not a ControlNet").unwrap();
        assert_eq!(served(Some(dir.path())), ["canny", "silhouette"]);
        assert!(served(None).is_empty());
        assert!(served(Some(&dir.path().join("missing"))).is_empty());
    }

    #[test]
    fn names_are_path_and_subject_safe() {
        assert_eq!(name_problem("silhouette"), None);
        assert_eq!(name_problem("canny-v2.1_b"), None);
        for bad in ["", ".hidden", "a/b", "a b", "a*", "a>", &"x".repeat(65)] {
            assert!(name_problem(bad).is_some(), "{bad:?} accepted");
        }
    }
}
