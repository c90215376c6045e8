//! The text side of a job's LoRAs (kohya's `lora_te*`, diffusers' `text_encoder.` keys) on a
//! model with CLIP text encoders.
//!
//! A job's prompts are encoded when it starts, with the base encoders: its LoRAs may still be
//! loading, and it may step on the base model within its bound meanwhile. The first time it
//! steps with its LoRA set patched into the UNet, and that set adapts the text encoders, its
//! prompts are encoded again with the encoders patched around that encoding
//! (`diffmesh_model::stable_diffusion::text_lora`), so from then on it conditions as
//! `load_lora_weights` would have it. One patch serves every job of the group that needs it. A
//! reconditioned job's ControlNet sessions on workers are dropped (they hold the old text
//! states) and opened again under new ids with the new ones.
use super::Active;
use crate::engine::EngineJobError;
use crate::lora::LoadedLora;
use diffmesh_model::lora::{LoraAdapter, LoraSetKey, OriginalsOn};
use diffmesh_model::stable_diffusion::text_lora::{TextLora, TextLoraPatchers};
use diffmesh_model::stable_diffusion::SdPipeline;
use diffmesh_model::unet::lora::{read_unet_lora_bytes, LoraTargets};
use diffmesh_model::ModelError;
use diffmesh_shared::panic_message;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Per LoRA of a set: its text-encoder adapters (per encoder) and weight.
type SetAdapters = Vec<(Vec<Option<LoraAdapter>>, f64)>;

/// The text encoders' patchers, and the text adapters of the last set reconditioned for.
pub(super) struct TextLoras {
    patchers: TextLoraPatchers,
    /// Per CLIP encoder, its linear layers as LoRA files name them (none for the tiny encoder:
    /// text-encoder keys are then left out).
    modules: Vec<Vec<String>>,
    /// The set last read, and its adapters: the jobs of one set are mostly reconditioned one
    /// after another, as they arrive.
    read: Option<(LoraSetKey, SetAdapters)>,
}

/// The LoRA set the UNet holds now, as the engine has it.
pub(super) struct Reading<'a> {
    pub set: &'a [LoadedLora],
    pub key: &'a LoraSetKey,
    /// The UNet's linear layers (the files are read whole).
    pub unet_modules: &'a [String],
}

impl TextLoras {
    pub(super) fn new(pipe: &SdPipeline, originals_on: OriginalsOn) -> Self {
        Self {
            patchers: TextLoraPatchers::new(pipe, originals_on),
            modules: pipe.text_linear_modules(),
            read: None,
        }
    }

    /// Read the text adapters of `r.set` from its files into `read`, unless they are there.
    fn read_set(&mut self, r: &Reading<'_>, pipe: &SdPipeline) -> Result<(), ModelError> {
        if self.read.as_ref().is_none_or(|(k, _)| k != r.key) {
            let targets = LoraTargets {
                config: &pipe.unet.config,
                unet_modules: r.unet_modules,
                text_modules: &self.modules,
            };
            let adapters = r
                .set
                .iter()
                .map(|l| {
                    read_unet_lora_bytes(&l.blob.id, l.blob.bytes.clone(), targets)
                        .map(|u| (u.text_encoders, l.weight))
                        .map_err(|e| {
                            ModelError::input(format!("loras: {}", l.blob.id), e.to_string())
                        })
                })
                .collect::<Result<SetAdapters, ModelError>>()?;
            self.read = Some((r.key.clone(), adapters));
        }
        Ok(())
    }

    /// The jobs of `jobs` not yet conditioned for set `r.key`, which the UNet holds now: where
    /// the set adapts the text encoders, encode their prompts again with the encoders patched;
    /// a job whose encoding fails is failed.
    pub(super) fn recondition<'a>(
        &mut self,
        r: Reading<'_>,
        pipe: &SdPipeline,
        jobs: impl Iterator<Item = &'a mut Active>,
    ) {
        let key = r.key;
        let mut stale: Vec<&mut Active> = jobs.filter(|a| a.conditioned_for != *key).collect();
        if stale.is_empty() {
            return;
        }
        if key.is_base() || self.modules.is_empty() {
            for a in stale {
                a.conditioned_for = key.clone();
            }
            return;
        }
        if let Err(e) = self.read_set(&r, pipe) {
            let error = EngineJobError::from_model(e);
            for a in stale {
                a.failed.get_or_insert_with(|| error.clone());
            }
            return;
        }
        let adapters: &[(Vec<Option<LoraAdapter>>, f64)] = match &self.read {
            Some((_, adapters)) => adapters,
            None => &[],
        };
        let set: Vec<TextLora<'_>> = adapters
            .iter()
            .map(|(adapters, weight)| TextLora {
                adapters,
                weight: *weight,
            })
            .collect();
        if !TextLoraPatchers::adapts_any(&set) {
            for a in stale {
                a.conditioned_for = key.clone();
            }
            return;
        }
        let outcome = self.patchers.with_patched(&set, || {
            Ok(stale
                .iter_mut()
                .map(|a| {
                    let (prompt, negative) =
                        super::jobs::conditioning_prompts(&a.job, a.capture.is_some());
                    // One job's panic is its own failure, not the engine's.
                    catch_unwind(AssertUnwindSafe(|| {
                        pipe.recondition(&mut a.states, &prompt, negative.as_deref())
                            .map_err(EngineJobError::from_model)
                    }))
                    .unwrap_or_else(|p| Err(EngineJobError::Panic(panic_message(p))))
                })
                .collect::<Vec<_>>())
        });
        if self.patchers.poisoned() {
            // Every later job would encode with adapted encoders; the UNet's patcher does the
            // same when its base weights cannot be had back.
            tracing::error!("restoring the text encoders' base weights failed: exiting");
            std::process::abort();
        }
        match outcome {
            Ok((results, stats)) => {
                tracing::debug!(set = %key, jobs = results.len(), layers = stats.layers,
                    seconds = stats.seconds, "prompts encoded again with the text encoders patched");
                for (a, result) in stale.into_iter().zip(results) {
                    match result {
                        Ok(()) => {
                            a.conditioned_for = key.clone();
                            // Its workers' sessions hold the old text states.
                            a.control_links.clear();
                            a.control_generation += 1;
                        }
                        Err(e) => {
                            a.failed.get_or_insert(e);
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
