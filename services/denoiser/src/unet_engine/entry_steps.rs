//! A template cache of the tiers as a UNet edit reads it: each step's blocks decoded (to the
//! model's device and dtype) when an edit's step needs them, not the whole trajectory at
//! admission. An SDXL template at 1024 px holds about 1.7 GB of f32 K/V per step (estimated
//! from the shapes), tens of GB over 30 steps; this way an edit holds one step's, and the
//! encoded entry (the tiers' bytes, held anyway) is the only copy of the rest. The last decoded step is kept, so edits of one
//! template at the same step (a batch) decode it once.
use super::jobs::template_rows;
use crate::templates::TemplateEntry;
use diffmesh_model::stable_diffusion::template::TemplateSteps;
use diffmesh_model::stable_diffusion::SdPipeline;
use diffmesh_model::tch::{Device, Kind};
use diffmesh_model::unet::cache_codec::decode_step;
use diffmesh_model::unet::masked::UNetTemplateCache;
use diffmesh_model::{ModelError, Result};
use diffmesh_shared::wire::messages::TemplateRef;
use std::sync::{Arc, Mutex};

pub struct EntrySteps {
    entry: Arc<TemplateEntry>,
    /// Layers of each `Transformer2DModel`, as the cache holds them.
    layers: Vec<usize>,
    rows: i64,
    device: Device,
    kind: Kind,
    /// The step decoded last.
    last: Mutex<Option<(usize, Arc<UNetTemplateCache>)>>,
    /// Steps decoded so far (each decode counts; a kept step does not).
    decodes: std::sync::atomic::AtomicUsize,
}

impl EntrySteps {
    /// `entry` as the template of edits of `template` on `pipe`'s UNet; its block count is
    /// checked now, each step's contents when decoded.
    pub fn new(
        entry: Arc<TemplateEntry>,
        template: &TemplateRef,
        pipe: &SdPipeline,
    ) -> Result<Self> {
        let (device, kind) = pipe.unet.device_kind();
        let layers = pipe.unet.transformer_layers();
        Self::with_layers(entry, layers, template_rows(template), device, kind)
    }

    /// `entry` for transformers of `layers` layers each, captured with `rows` rows.
    fn with_layers(
        entry: Arc<TemplateEntry>,
        layers: Vec<usize>,
        rows: i64,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        let expected: usize = layers.iter().map(|l| l + 1).sum();
        if entry.blocks() != expected {
            return Err(ModelError::input(
                "template",
                format!(
                    "its cache holds {} blocks a step; this UNet's transformers need {expected}",
                    entry.blocks()
                ),
            ));
        }
        Ok(Self {
            entry,
            layers,
            rows,
            device,
            kind,
            last: Mutex::new(None),
            decodes: Default::default(),
        })
    }

    /// Steps decoded so far.
    pub fn decodes(&self) -> usize {
        self.decodes.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn decode(&self, k: usize) -> Result<UNetTemplateCache> {
        let blocks = (0..self.entry.blocks())
            .map(|b| {
                self.entry.block(k, b).ok_or_else(|| {
                    ModelError::input("template", format!("no block {b} at step {k}"))
                })
            })
            .collect::<Result<Vec<&[u8]>>>()?;
        let cache = decode_step(&blocks, &self.layers, self.rows, self.kind)?;
        self.decodes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.device {
            Device::Cpu => Ok(cache),
            device => cache.to_device(device),
        }
    }
}

impl TemplateSteps for EntrySteps {
    fn steps(&self) -> usize {
        self.entry.steps()
    }

    /// A capture records every step (templates are captured at strength 1).
    fn start(&self) -> usize {
        0
    }

    fn rows(&self) -> i64 {
        self.rows
    }

    fn step(&self, k: usize) -> Result<Arc<UNetTemplateCache>> {
        if k >= self.steps() {
            return Err(ModelError::input(
                "template",
                format!("holds {} steps, not step {k}", self.steps()),
            ));
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, cache)) = last.as_ref() {
            if *at == k {
                return Ok(cache.clone());
            }
        }
        // The previous step's cache goes before this one's is made, so at most one is held.
        *last = None;
        let cache = Arc::new(self.decode(k)?);
        *last = Some((k, cache.clone()));
        Ok(cache)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffmesh_model::flux::kv_codec::CacheDtype;
    use diffmesh_model::stable_diffusion::template::SdTemplate;
    use diffmesh_model::tch::Tensor;
    use diffmesh_model::unet::attention::CapturedTransformer;

    /// A synthetic step: two transformers of one layer, 2 rows of 6 tokens, 4 channels.
    fn step(seed: i64) -> UNetTemplateCache {
        diffmesh_model::tch::manual_seed(seed);
        let t = || Tensor::randn([2, 6, 4], (Kind::Float, Device::Cpu));
        UNetTemplateCache {
            transformers: (0..2)
                .map(|_| CapturedTransformer {
                    kv: vec![(t(), t())],
                    out: t(),
                })
                .collect(),
        }
    }

    #[test]
    fn steps_are_decoded_when_asked_and_the_last_is_kept() {
        let steps: Vec<_> = (0..3).map(|s| Some(Arc::new(step(s)))).collect();
        let template = SdTemplate { steps, rows: 2 };
        let entry =
            super::super::jobs::capture_entry(&template, "k".into(), CacheDtype::F32).unwrap();
        let lazy =
            EntrySteps::with_layers(Arc::new(entry), vec![1, 1], 2, Device::Cpu, Kind::Float)
                .unwrap();
        assert_eq!(
            (lazy.steps(), lazy.start(), lazy.rows(), lazy.decodes()),
            (3, 0, 2, 0)
        );
        let one = lazy.step(1).unwrap();
        let again = lazy.step(1).unwrap();
        assert!(
            Arc::ptr_eq(&one, &again),
            "a kept step is not decoded again"
        );
        assert_eq!(lazy.decodes(), 1);
        let want = template.step(1).unwrap();
        for (a, b) in one.transformers.iter().zip(&want.transformers) {
            assert!(a.out.equal(&b.out) && a.kv[0].0.equal(&b.kv[0].0));
        }
        lazy.step(2).unwrap();
        assert_eq!(lazy.decodes(), 2);
        assert!(lazy.step(3).is_err());
        // A cache of another UNet's block count is refused up front.
        let entry =
            super::super::jobs::capture_entry(&template, "k".into(), CacheDtype::F32).unwrap();
        let other = EntrySteps::with_layers(Arc::new(entry), vec![2], 2, Device::Cpu, Kind::Float);
        assert!(other.is_err());
    }
}
