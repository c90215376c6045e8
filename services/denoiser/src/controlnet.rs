//! The ControlNets a denoiser runs for its steered generations: named folders (diffusers'
//! `FluxControlNetModel` layout) under `--controlnet-dir`, of which the most recently used
//! `--controlnet-cache` stay loaded (Katz keeps the popular ControlNets resident on its ControlNet
//! workers). Lives on the engine thread: tch tensors are `Send`, not `Sync`, so no shared cache
//! crate can hold them, and a handful of entries needs no more than a recency list.
use diffmesh_model::flux::{ControlResiduals, FluxConfig, FluxControlNet};
use diffmesh_model::pipeline::control::ControlStep;
use diffmesh_model::tch::{nn, Device, Kind};
use prometheus::{GaugeVec, Histogram, HistogramOpts, IntCounterVec, Opts, Registry};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};

/// Where a ControlNet name points in `dir`, if it is there.
pub fn controlnet_folder(dir: &Path, name: &str) -> Option<PathBuf> {
    if diffmesh_shared::controlnet::name_problem(name).is_some() {
        return None;
    }
    let folder = dir.join(name);
    folder.join("config.json").is_file().then_some(folder)
}

/// The ControlNet names `dir` holds, sorted (what heartbeats advertise).
pub fn served(dir: Option<&Path>) -> Vec<String> {
    let Some(entries) = dir.and_then(|d| std::fs::read_dir(d).ok()) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| dir.and_then(|d| controlnet_folder(d, name)).is_some())
        .collect();
    names.sort();
    names
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

struct Resident {
    name: String,
    net: FluxControlNet,
    _store: nn::VarStore,
}

/// The loaded ControlNets, most recently used last.
pub struct ControlNets {
    dir: Option<PathBuf>,
    capacity: usize,
    device: Device,
    kind: Kind,
    resident: VecDeque<Resident>,
}

impl ControlNets {
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

    /// The ControlNet `name`, loaded if needed and checked against the transformer `base` when
    /// given (a ControlNet worker has no transformer: the denoiser checks what comes back).
    pub fn get(
        &mut self,
        name: &str,
        base: Option<&FluxConfig>,
    ) -> Result<(&FluxControlNet, Lookup), String> {
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
                let (net, store) = FluxControlNet::load(&folder, self.device, self.kind)
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

/// ControlNet metrics of the denoiser.
#[derive(Clone)]
pub struct ControlNetMetrics {
    /// ControlNets looked up for a steered step, by outcome (`hit`: loaded already, `loaded`).
    pub lookups: IntCounterVec,
    /// One ControlNet forward (one request's residuals for one step), loading included.
    pub seconds: Histogram,
    /// Steered rows' steps by where their residuals came from with `--controlnet-remote`:
    /// `remote` (a ControlNet worker), `fallback_local` (computed here after a worker failed
    /// or none came yet), `failed` (neither: the job fails).
    pub remote: IntCounterVec,
    /// The engine thread's wait for ControlNet workers' residuals, per step.
    pub remote_wait_seconds: Histogram,
    /// Per ControlNet, what one steered request costs the step loop a step (smoothed; the
    /// figure heartbeats give the router).
    pub step_seconds: GaugeVec,
}

impl ControlNetMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let lookups = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_controlnet_lookups_total",
                "ControlNets looked up for a steered step, by outcome (loaded: read from its folder)",
            ),
            &["outcome"],
        )?;
        for outcome in [Lookup::Hit, Lookup::Loaded] {
            lookups.with_label_values(&[outcome.as_str()]);
        }
        let seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_controlnet_duration_seconds",
                "One ControlNet forward for one request's step (loading included)",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
        )?;
        let remote = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_controlnet_remote_total",
                "Steered rows' steps by where their ControlNet residuals came from (remote, fallback_local, failed)",
            ),
            &["outcome"],
        )?;
        for outcome in ["remote", "fallback_local", "failed"] {
            remote.with_label_values(&[outcome]);
        }
        let remote_wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_controlnet_wait_duration_seconds",
                "The engine thread's wait for ControlNet workers' residuals, per step",
            )
            .buckets(vec![
                0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ]),
        )?;
        let step_seconds = GaugeVec::new(
            Opts::new(
                "diffmesh_denoiser_controlnet_step_seconds",
                "Per ControlNet, the step loop's seconds per steered request and step (smoothed; what the router costs)",
            ),
            &["controlnet"],
        )?;
        registry.register(Box::new(step_seconds.clone()))?;
        registry.register(Box::new(lookups.clone()))?;
        registry.register(Box::new(seconds.clone()))?;
        registry.register(Box::new(remote.clone()))?;
        registry.register(Box::new(remote_wait_seconds.clone()))?;
        Ok(Self {
            lookups,
            seconds,
            remote,
            remote_wait_seconds,
            step_seconds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::served;

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
}
