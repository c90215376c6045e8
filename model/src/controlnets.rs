//! Named ControlNets loaded from a folder (one sub-folder per name, in diffusers' layout:
//! `FluxControlNetModel` for Flux models, `ControlNetModel` for the UNet family), of which the
//! most recently used `capacity` stay loaded (Katz keeps the popular ControlNets resident on its
//! ControlNet workers). Used by the denoisers' engines and by the ControlNet worker; lives on one
//! thread: tch tensors are `Send`, not `Sync`, so no shared cache crate can hold them, and a
//! handful of entries needs no more than a recency list.
use crate::flux::{ControlResiduals, FluxConfig, FluxControlNet};
use crate::pipeline::control::ControlStep;
use crate::unet::config::UNetConfig;
use crate::unet::ControlNetModel;
use std::collections::VecDeque;
use std::path::{Component, Path, PathBuf};
use tch::{nn, Device, Kind};

/// A kind of ControlNet the registry loads: how from a folder, and what model it must fit.
pub trait LoadableControlNet: Sized {
    /// The configuration of the model it steers.
    type Base;
    /// The network and the variable store holding its weights, where it keeps none itself.
    fn load(
        folder: &Path,
        device: Device,
        kind: Kind,
    ) -> crate::Result<(Self, Option<nn::VarStore>)>;
    fn check_compatible(&self, base: &Self::Base) -> crate::Result<()>;
}

impl LoadableControlNet for FluxControlNet {
    type Base = FluxConfig;
    fn load(
        folder: &Path,
        device: Device,
        kind: Kind,
    ) -> crate::Result<(Self, Option<nn::VarStore>)> {
        FluxControlNet::load(folder, device, kind).map(|(net, store)| (net, Some(store)))
    }
    fn check_compatible(&self, base: &FluxConfig) -> crate::Result<()> {
        FluxControlNet::check_compatible(self, base)
    }
}

impl LoadableControlNet for ControlNetModel {
    type Base = UNetConfig;
    fn load(
        folder: &Path,
        device: Device,
        kind: Kind,
    ) -> crate::Result<(Self, Option<nn::VarStore>)> {
        ControlNetModel::load(folder, device, kind).map(|net| (net, None))
    }
    fn check_compatible(&self, base: &UNetConfig) -> crate::Result<()> {
        ControlNetModel::check_compatible(self, base)
    }
}

/// Where a ControlNet name points in `dir`, if a ControlNet is there. Only a plain folder name
/// resolves (no separators, no `..`): names come from requests. Which names a request may
/// give at all is the wire contract's rule (`diffmesh_shared::wire::controlnet::name_problem`).
pub fn controlnet_folder(dir: &Path, name: &str) -> Option<PathBuf> {
    let mut parts = Path::new(name).components();
    let plain = matches!(parts.next(), Some(Component::Normal(_))) && parts.next().is_none();
    if !plain || name.starts_with('.') {
        return None;
    }
    let folder = dir.join(name);
    folder.join("config.json").is_file().then_some(folder)
}

/// How a lookup went (the `outcome` label of `diffmesh_denoiser_controlnet_lookups_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Already loaded.
    Hit,
    /// Read from its folder (evicting the least recently used beyond the capacity).
    Loaded,
}

impl Lookup {
    pub fn as_str(self) -> &'static str {
        match self {
            Lookup::Hit => "hit",
            Lookup::Loaded => "loaded",
        }
    }
}

struct Resident<N> {
    name: String,
    net: N,
    _store: Option<nn::VarStore>,
}

/// The loaded ControlNets, most recently used last.
pub struct ControlNets<N = FluxControlNet> {
    dir: Option<PathBuf>,
    capacity: usize,
    device: Device,
    kind: Kind,
    resident: VecDeque<Resident<N>>,
}

impl<N: LoadableControlNet> ControlNets<N> {
    pub fn new(dir: Option<PathBuf>, capacity: usize, device: Device, kind: Kind) -> Self {
        Self {
            dir,
            capacity: capacity.max(1),
            device,
            kind,
            resident: VecDeque::new(),
        }
    }

    /// Names loaded now, least recently used first.
    pub fn resident(&self) -> Vec<&str> {
        self.resident.iter().map(|r| r.name.as_str()).collect()
    }

    /// Whether `name` is a ControlNet of this folder (loaded or not).
    pub fn holds(&self, name: &str) -> bool {
        self.dir
            .as_deref()
            .is_some_and(|d| controlnet_folder(d, name).is_some())
    }

    /// The ControlNet `name`, loaded if needed and checked against the model `base` when
    /// given (a ControlNet worker has no transformer: the denoiser checks what comes back).
    pub fn get(&mut self, name: &str, base: Option<&N::Base>) -> Result<(&N, Lookup), String> {
        let lookup = match self.resident.iter().position(|r| r.name == name) {
            Some(i) => {
                let r = self.resident.remove(i).expect("position is in range");
                self.resident.push_back(r);
                Lookup::Hit
            }
            None => {
                let dir = self
                    .dir
                    .as_deref()
                    .ok_or("controlnet.name: this denoiser serves no ControlNets")?;
                let folder = controlnet_folder(dir, name)
                    .ok_or_else(|| format!("controlnet.name: no ControlNet `{name}` here"))?;
                let (net, store) = N::load(&folder, self.device, self.kind)
                    .map_err(|e| format!("controlnet.name: loading `{name}`: {e}"))?;
                if let Some(base) = base {
                    net.check_compatible(base).map_err(|e| {
                        format!("controlnet.name: `{name}` does not fit this model: {e}")
                    })?;
                }
                while self.resident.len() >= self.capacity {
                    self.resident.pop_front();
                }
                self.resident.push_back(Resident {
                    name: name.to_string(),
                    net,
                    _store: store,
                });
                Lookup::Loaded
            }
        };
        let net = &self.resident.back().expect("just pushed").net;
        Ok((net, lookup))
    }
}

impl ControlNets<FluxControlNet> {
    /// One request's residuals for its next step, from the ControlNet `name`.
    pub fn residuals(
        &mut self,
        name: &str,
        step: &ControlStep,
        base: Option<&FluxConfig>,
    ) -> Result<(ControlResiduals, Lookup), String> {
        let (net, lookup) = self.get(name, base)?;
        let residuals = step
            .residuals(net)
            .map_err(|e| format!("controlnet: {e}"))?;
        Ok((residuals, lookup))
    }
}

#[cfg(test)]
mod tests {
    use super::controlnet_folder;

    #[test]
    fn only_plain_folder_names_with_a_config_resolve() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["silhouette", "empty", ".hidden"] {
            std::fs::create_dir_all(dir.path().join(name)).unwrap();
        }
        for name in ["silhouette", ".hidden"] {
            std::fs::write(dir.path().join(name).join("config.json"), "{}").unwrap();
        }
        assert!(controlnet_folder(dir.path(), "silhouette").is_some());
        for bad in [
            "empty",
            ".hidden",
            "missing",
            "../silhouette",
            "a/b",
            "/etc",
            "",
        ] {
            assert!(
                controlnet_folder(dir.path(), bad).is_none(),
                "{bad:?} resolved"
            );
        }
    }
}
