//! LoRA adapters patched into a model's linear weights in place (Katz §6, "efficient LoRA
//! patching"), with an exact way back.
//!
//! Patching writes `W0 + sum_i w_i * s_i * B_i @ A_i` over the live weight (computed in f32, then
//! stored in the weight's dtype), so a patched forward costs what the base forward costs and needs
//! no LoRA layers. Katz patches off by subtracting; we restore from a copy of each adapted weight
//! taken the first time it is patched, because `(W + D) - D` is not `W` in
//! floating point: over thousands of switches, and in bf16 after one, the base model would drift.
//! The copies cost memory for the adapted layers only, on the CPU or on the weights' device
//! ([`OriginalsOn`]): on a GPU, copies in host memory save device memory but make every switch
//! copy the adapted layers over PCIe.
use crate::error::{ModelError, Result};
use std::collections::{BTreeSet, HashMap};
use std::time::Instant;
use tch::{nn::VarStore, Device, Kind, Tensor};

/// Where [`LoraPatcher`] keeps the base copies of the layers it patches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OriginalsOn {
    /// Host memory: no extra device memory; a switch on a GPU copies host to device.
    Host,
    /// The weights' own device: switches stay on the device, at the cost of a second copy of
    /// the adapted layers there (the same as `Host` on a CPU).
    #[default]
    Device,
}

/// The low-rank update of one linear layer: `scale * up @ down`.
#[derive(Debug)]
pub struct LoraDelta {
    /// The layer's path, e.g. `transformer_blocks.0.attn.to_q` (its weight is `<module>.weight`).
    pub module: String,
    /// `[rank, in]` (PEFT's `lora_A`).
    pub down: Tensor,
    /// `[out, rank]` (PEFT's `lora_B`).
    pub up: Tensor,
    /// `alpha / rank` from the adapter's config.
    pub scale: f64,
}

/// One adapter: its updates, on the CPU.
#[derive(Debug)]
pub struct LoraAdapter {
    pub id: String,
    pub deltas: Vec<LoraDelta>,
}

impl LoraAdapter {
    /// Bytes of its A and B matrices.
    pub fn bytes(&self) -> u64 {
        self.deltas
            .iter()
            .map(|d| ((d.down.numel() + d.up.numel()) * d.down.kind().elt_size_in_bytes()) as u64)
            .sum()
    }
}

/// An adapter with the weight a request applies it with.
#[derive(Debug, Clone, Copy)]
pub struct WeightedLora<'a> {
    pub adapter: &'a LoraAdapter,
    pub weight: f64,
}

/// What the weights hold: no adapter, or a set of adapters with their weights, in a canonical
/// order (by id), so equal sets compare equal.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct LoraSetKey(Vec<(String, u64)>);

impl LoraSetKey {
    pub fn new<'a>(set: impl IntoIterator<Item = (&'a str, f64)>) -> Self {
        let mut v: Vec<(String, u64)> = set
            .into_iter()
            .map(|(id, w)| (id.to_string(), w.to_bits()))
            .collect();
        v.sort();
        Self(v)
    }

    pub fn of(set: &[WeightedLora<'_>]) -> Self {
        Self::new(set.iter().map(|l| (l.adapter.id.as_str(), l.weight)))
    }

    /// The base model (no adapter).
    pub fn is_base(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Display for LoraSetKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return write!(f, "base");
        }
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|(id, w)| format!("{id}*{}", f64::from_bits(*w)))
            .collect();
        write!(f, "{}", parts.join("+"))
    }
}

/// The paths of the 2-D `<module>.weight` variables of `vs` (the layers a LoRA file can
/// adapt, as it names them), sorted.
pub fn linear_modules(vs: &VarStore) -> Vec<String> {
    let mut modules: Vec<String> = vs
        .variables()
        .into_iter()
        .filter(|(name, t)| name.ends_with(".weight") && t.dim() == 2)
        .map(|(name, _)| name.trim_end_matches(".weight").to_string())
        .collect();
    modules.sort();
    modules
}

/// What one switch of the weights did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PatchStats {
    /// Layers written (restored or patched).
    pub layers: usize,
    pub seconds: f64,
}

/// Owns the in-place patch state of one model's weights.
pub struct LoraPatcher {
    /// Every 2-D `<module>.weight` of the model, by module path (shallow: the model's storage).
    weights: HashMap<String, Tensor>,
    /// Base copies of the layers ever patched (see [`OriginalsOn`]).
    originals: HashMap<String, Tensor>,
    originals_on: OriginalsOn,
    /// Layers that now hold a patch.
    patched: BTreeSet<String>,
    current: LoraSetKey,
}

impl LoraPatcher {
    /// A patcher over `vs`'s variables, base copies on the weights' device; the weights start
    /// unpatched.
    pub fn new(vs: &VarStore) -> Self {
        Self::with_originals_on(vs, OriginalsOn::Device)
    }

    pub fn with_originals_on(vs: &VarStore, originals_on: OriginalsOn) -> Self {
        let weights = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.dim() == 2)
            .filter_map(|(name, t)| name.strip_suffix(".weight").map(|m| (m.to_string(), t)))
            .collect();
        Self {
            weights,
            originals: HashMap::new(),
            originals_on,
            patched: BTreeSet::new(),
            current: LoraSetKey::default(),
        }
    }

    /// What the weights hold now.
    pub fn current(&self) -> &LoraSetKey {
        &self.current
    }

    /// Check that every update of `adapter` fits a linear layer of this model.
    pub fn check(&self, adapter: &LoraAdapter) -> Result<()> {
        for d in &adapter.deltas {
            let field = || format!("lora {}: {}", adapter.id, d.module);
            let Some(w) = self.weights.get(&d.module) else {
                return Err(ModelError::input(
                    field(),
                    "is not a linear layer of this model",
                ));
            };
            let (out, inp) = (w.size()[0], w.size()[1]);
            let (ds, us) = (d.down.size(), d.up.size());
            if ds.len() != 2 || us.len() != 2 || ds[1] != inp || us[0] != out || us[1] != ds[0] {
                return Err(ModelError::input(
                    field(),
                    format!("lora_A {ds:?} and lora_B {us:?} do not fit the layer's weight [{out}, {inp}]"),
                ));
            }
            if !d.scale.is_finite() {
                return Err(ModelError::input(field(), "scale is not finite"));
            }
        }
        Ok(())
    }

    /// Make the weights hold `set` (empty: the base model). A no-op when they already do.
    pub fn apply(&mut self, set: &[WeightedLora<'_>]) -> Result<PatchStats> {
        let key = LoraSetKey::of(set);
        if key == self.current {
            return Ok(PatchStats {
                layers: 0,
                seconds: 0.0,
            });
        }
        for l in set {
            self.check(l.adapter)?;
        }
        let started = Instant::now();
        // Sum the updates per layer (f32, on the weight's device) before touching any weight, so
        // a failure leaves the weights as they were.
        let mut updates: HashMap<&str, Tensor> = HashMap::new();
        for l in set {
            for d in &l.adapter.deltas {
                let device = self.weights[&d.module].device();
                let f32_on = |t: &Tensor| t.f_to_device(device)?.f_to_kind(Kind::Float);
                let delta = f32_on(&d.up)?
                    .f_matmul(&f32_on(&d.down)?)?
                    .f_mul_scalar(d.scale * l.weight)?;
                let sum = match updates.remove(d.module.as_str()) {
                    Some(s) => s.f_add(&delta)?,
                    None => delta,
                };
                updates.insert(d.module.as_str(), sum);
            }
        }
        let mut layers = 0;
        let written = tch::no_grad(|| -> Result<()> {
            for module in updates.keys() {
                if !self.originals.contains_key(*module) {
                    let w = &self.weights[*module];
                    let device = match self.originals_on {
                        OriginalsOn::Host => Device::Cpu,
                        OriginalsOn::Device => w.device(),
                    };
                    let mut copy = Tensor::f_empty(w.size(), (w.kind(), device))?;
                    copy.f_copy_(w)?;
                    self.originals.insert(module.to_string(), copy);
                }
            }
            // Layers patched now but not in the new set go back to the base.
            let stale: Vec<String> = self
                .patched
                .iter()
                .filter(|m| !updates.contains_key(m.as_str()))
                .cloned()
                .collect();
            for module in stale {
                self.weights[&module]
                    .shallow_clone()
                    .f_copy_(&self.originals[&module])?;
                self.patched.remove(&module);
                layers += 1;
            }
            for (module, update) in &updates {
                let base = self.originals[*module].f_to_device(update.device())?;
                let patched = base.f_to_kind(Kind::Float)?.f_add(update)?;
                self.weights[*module].shallow_clone().f_copy_(&patched)?;
                self.patched.insert(module.to_string());
                layers += 1;
            }
            Ok(())
        });
        if let Err(e) = written {
            // Some layers may hold the new set and others the old: back to the base model,
            // exactly, so the bookkeeping (`current`) tells the truth again.
            self.reset()?;
            return Err(e);
        }
        self.current = key;
        Ok(PatchStats {
            layers,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Make the weights the base model's again (exactly).
    pub fn restore(&mut self) -> Result<PatchStats> {
        self.apply(&[])
    }

    /// Write the base copy back into every layer ever patched, whatever the patch state says:
    /// after a failure in the middle of [`apply`](Self::apply) (a panic), a layer may hold a
    /// patch its bookkeeping does not know of. Every base copy is taken before its layer is
    /// first written, so this is exact.
    pub fn reset(&mut self) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for (module, original) in &self.originals {
                self.weights[module].shallow_clone().f_copy_(original)?;
            }
            Ok(())
        })?;
        self.patched.clear();
        self.current = LoraSetKey::default();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (VarStore, crate::flux::layers::Linear) {
        let vs = VarStore::new(Device::Cpu);
        let l = crate::flux::layers::Linear::new(vs.root() / "blocks" / "0" / "to_q", 6, 5, true);
        (vs, l)
    }

    fn adapter(id: &str, seed: i64, scale: f64) -> LoraAdapter {
        tch::manual_seed(seed);
        LoraAdapter {
            id: id.into(),
            deltas: vec![LoraDelta {
                module: "blocks.0.to_q".into(),
                down: Tensor::randn([2, 6], (Kind::Float, Device::Cpu)),
                up: Tensor::randn([5, 2], (Kind::Float, Device::Cpu)),
                scale,
            }],
        }
    }

    #[test]
    fn patching_adds_the_scaled_update_and_restore_is_exact() {
        for on in [OriginalsOn::Host, OriginalsOn::Device] {
            patch_and_restore(on);
        }
    }

    fn patch_and_restore(on: OriginalsOn) {
        let (vs, lin) = store();
        let base = lin.weight.copy();
        let mut p = LoraPatcher::with_originals_on(&vs, on);
        let a = adapter("a", 1, 0.5);
        let b = adapter("b", 2, 2.0);
        let set = [
            WeightedLora {
                adapter: &a,
                weight: 0.8,
            },
            WeightedLora {
                adapter: &b,
                weight: -1.0,
            },
        ];
        let stats = p.apply(&set).unwrap();
        assert_eq!(stats.layers, 1);
        let da = a.deltas[0].up.matmul(&a.deltas[0].down) * (0.5 * 0.8);
        let db = b.deltas[0].up.matmul(&b.deltas[0].down) * -2.0;
        let want = &base + da + db;
        let err = f64::try_from((&lin.weight - &want).abs().max()).unwrap();
        assert!(err < 1e-6, "{err}");
        // The same set again (other order) writes nothing.
        let again = [set[1], set[0]];
        assert_eq!(p.apply(&again).unwrap().layers, 0);
        // Many switches later the base is bit-exact.
        for _ in 0..50 {
            p.apply(&set[..1]).unwrap();
            p.apply(&set[1..]).unwrap();
        }
        p.restore().unwrap();
        assert!(lin.weight.equal(&base));
        assert!(p.current().is_base());
    }

    #[test]
    fn reset_restores_the_base_weights_whatever_the_bookkeeping_says() {
        let (vs, lin) = store();
        let base = lin.weight.copy();
        let mut p = LoraPatcher::new(&vs);
        let a = adapter("a", 1, 0.5);
        p.apply(&[WeightedLora {
            adapter: &a,
            weight: 1.0,
        }])
        .unwrap();
        // As if a later patch had been cut off half-way: the layer changed, unrecorded.
        p.patched.clear();
        let _ = tch::no_grad(|| lin.weight.shallow_clone().f_add_scalar_(3.0).unwrap());
        assert!(!lin.weight.equal(&base));
        p.reset().unwrap();
        assert!(lin.weight.equal(&base));
        assert!(p.current().is_base());
    }

    #[test]
    fn an_adapter_that_does_not_fit_is_refused_and_changes_nothing() {
        let (vs, lin) = store();
        let base = lin.weight.copy();
        let mut p = LoraPatcher::new(&vs);
        let mut bad = LoraAdapter {
            id: "bad".into(),
            deltas: vec![LoraDelta {
                module: "blocks.0.to_k".into(),
                down: Tensor::zeros([2, 6], (Kind::Float, Device::Cpu)),
                up: Tensor::zeros([5, 2], (Kind::Float, Device::Cpu)),
                scale: 1.0,
            }],
        };
        let err = p.check(&bad).unwrap_err().to_string();
        assert!(err.contains("blocks.0.to_k"), "{err}");
        bad.deltas[0].module = "blocks.0.to_q".into();
        bad.deltas[0].down = Tensor::zeros([2, 7], (Kind::Float, Device::Cpu));
        let set = [WeightedLora {
            adapter: &bad,
            weight: 1.0,
        }];
        let err = p.apply(&set).unwrap_err().to_string();
        assert!(err.contains("do not fit"), "{err}");
        assert!(lin.weight.equal(&base));
        assert!(p.current().is_base());
    }

    #[test]
    fn set_keys_ignore_order_and_name_the_base() {
        let k1 = LoraSetKey::new([("b", 1.0), ("a", 0.5)]);
        let k2 = LoraSetKey::new([("a", 0.5), ("b", 1.0)]);
        assert_eq!(k1, k2);
        assert_ne!(k1, LoraSetKey::new([("a", 0.5), ("b", 0.9)]));
        assert_eq!(k1.to_string(), "a*0.5+b*1");
        assert_eq!(LoraSetKey::default().to_string(), "base");
    }
}
