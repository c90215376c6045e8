//! The text side of a job's LoRAs (kohya's `lora_te*`, diffusers' `text_encoder.` keys) on a
//! model with CLIP text encoders.
//!
//! A job's prompts are encoded when it starts, with the base encoders: its LoRAs may still be
//! loading, and it may step on the base model within its bound meanwhile. The first time it
//! steps with its LoRA set patched into the UNet, and that set adapts the text encoders, its
//! prompts are encoded again with the encoders patched around that encoding
//! (`diffmesh_model::stable_diffusion::text_lora`), so from then on it conditions as
//! `load_lora_weights` would have it. One patch serves every job of the group that needs it.
use super::Active;
use crate::engine::EngineJobError;
use diffmesh_model::lora::{LoraAdapter, LoraSetKey};
use diffmesh_model::stable_diffusion::text_lora::{TextLora, TextLoraPatchers};
use diffmesh_model::stable_diffusion::SdPipeline;
use diffmesh_model::ModelError;

/// The text encoders' patchers, and the text adapters of the set the UNet holds now.
pub(super) struct TextLoras {
    patchers: TextLoraPatchers,
    /// Per CLIP encoder, its linear layers as LoRA files name them (none for the tiny encoder:
    /// text-encoder keys are then left out).
    pub(super) modules: Vec<Vec<String>>,
    /// The set `adapters` belong to.
    key: LoraSetKey,
    /// Per LoRA of that set: its text-encoder adapters and weight.
    adapters: Vec<(Vec<Option<LoraAdapter>>, f64)>,
}

impl TextLoras {
    pub(super) fn new(pipe: &SdPipeline) -> Self {
        Self {
            patchers: TextLoraPatchers::new(pipe),
            modules: pipe.text_linear_modules(),
            key: LoraSetKey::default(),
            adapters: Vec::new(),
        }
    }

    /// The UNet now holds set `key`, whose LoRAs' text adapters are `adapters`.
    pub(super) fn record(
        &mut self,
        key: LoraSetKey,
        adapters: Vec<(Vec<Option<LoraAdapter>>, f64)>,
    ) {
        self.key = key;
        self.adapters = adapters;
    }

    /// The jobs of `jobs` not yet conditioned for set `key`, which the UNet holds now: where
    /// the set adapts the text encoders, encode their prompts again with the encoders patched;
    /// a job whose encoding fails is failed.
    pub(super) fn recondition<'a>(
        &mut self,
        key: &LoraSetKey,
        pipe: &SdPipeline,
        jobs: impl Iterator<Item = &'a mut Active>,
    ) {
        let mut stale: Vec<&mut Active> = jobs.filter(|a| a.conditioned_for != *key).collect();
        if stale.is_empty() {
            return;
        }
        let set: Vec<TextLora<'_>> = self
            .adapters
            .iter()
            .map(|(adapters, weight)| TextLora {
                adapters,
                weight: *weight,
            })
            .collect();
        if key.is_base() || !TextLoraPatchers::adapts_any(&set) {
            for a in stale {
                a.conditioned_for = key.clone();
            }
            return;
        }
        if self.key != *key {
            let error = EngineJobError::from_model(ModelError::input(
                "params.loras",
                format!(
                    "the text encoders' adapters of {key} were not read (the UNet holds {})",
                    self.key
                ),
            ));
            for a in stale {
                a.failed.get_or_insert_with(|| error.clone());
            }
            return;
        }
        let outcome = self.patchers.with_patched(&set, || {
            Ok(stale
                .iter_mut()
                .map(|a| {
                    let (prompt, negative) =
                        super::jobs::conditioning_prompts(&a.job, a.capture.is_some());
                    pipe.recondition(&mut a.states, &prompt, negative.as_deref())
                })
                .collect::<Vec<_>>())
        });
        match outcome {
            Ok((results, stats)) => {
                tracing::debug!(set = %key, jobs = results.len(), layers = stats.layers,
                    seconds = stats.seconds, "prompts encoded again with the text encoders patched");
                for (a, result) in stale.into_iter().zip(results) {
                    match result {
                        Ok(()) => a.conditioned_for = key.clone(),
                        Err(e) => {
                            a.failed.get_or_insert(EngineJobError::from_model(e));
                        }
                    }
                }
            }
            Err(e) => {
                let error = EngineJobError::from_model(e);
                for a in stale {
                    a.failed.get_or_insert_with(|| error.clone());
                }
            }
        }
    }
}
