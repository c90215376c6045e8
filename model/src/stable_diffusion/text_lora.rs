//! LoRAs of the CLIP text encoders (diffusers' `text_encoder.` / `text_encoder_2.` keys, kohya's
//! `lora_te_` / `lora_te1_` / `lora_te2_`), as `load_lora_weights` applies them (issue 48).
//!
//! A request's text encoders matter once, when its prompts are encoded, while its UNet is
//! patched at every step. So the encoders are patched in place only around that encoding and
//! restored at once ([`TextLoraPatchers::with_patched`]): every other request encodes with the
//! base encoders whatever LoRA set the UNet holds, and no step pays for the text side.
use super::SdPipeline;
use crate::error::{ModelError, Result};
use crate::lora::{LoraAdapter, LoraPatcher, PatchStats, WeightedLora};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

/// One LoRA's text-encoder adapters (per encoder, in the pipeline's order; `None` where the file
/// adapts not that encoder) with the weight a request gives it.
#[derive(Debug, Clone, Copy)]
pub struct TextLora<'a> {
    pub adapters: &'a [Option<LoraAdapter>],
    pub weight: f64,
}

/// One patcher per CLIP text encoder of a pipeline (none for the tiny text encoder).
pub struct TextLoraPatchers {
    patchers: Vec<LoraPatcher>,
}

impl TextLoraPatchers {
    pub fn new(pipe: &SdPipeline) -> Self {
        Self {
            patchers: pipe.clip_stores().iter().map(LoraPatcher::new).collect(),
        }
    }

    /// The encoders it patches.
    pub fn encoders(&self) -> usize {
        self.patchers.len()
    }

    /// Whether `set` adapts any text encoder.
    pub fn adapts_any(set: &[TextLora<'_>]) -> bool {
        set.iter().any(|l| l.adapters.iter().any(Option::is_some))
    }

    /// Run `f` with the text encoders patched with `set`, then give them their base weights
    /// back, whether `f` succeeds, fails or panics. The stats count both switches.
    pub fn with_patched<T>(
        &mut self,
        set: &[TextLora<'_>],
        f: impl FnOnce() -> Result<T>,
    ) -> Result<(T, PatchStats)> {
        if let Some(l) = set.iter().find(|l| l.adapters.len() > self.patchers.len()) {
            return Err(ModelError::input(
                format!(
                    "lora {}",
                    l.adapters.iter().flatten().next().map_or("?", |a| &a.id)
                ),
                format!(
                    "adapts {} text encoders; this model has {}",
                    l.adapters.len(),
                    self.patchers.len()
                ),
            ));
        }
        let mut stats = PatchStats {
            layers: 0,
            seconds: 0.0,
        };
        let patched = self.patch(set, &mut stats);
        let outcome = match patched {
            Ok(()) => catch_unwind(AssertUnwindSafe(f)),
            Err(e) => Ok(Err(e)),
        };
        let restored = self.restore(&mut stats);
        match outcome {
            Ok(result) => {
                let value = result?;
                restored?;
                Ok((value, stats))
            }
            Err(panic) => resume_unwind(panic),
        }
    }

    fn patch(&mut self, set: &[TextLora<'_>], stats: &mut PatchStats) -> Result<()> {
        for (e, patcher) in self.patchers.iter_mut().enumerate() {
            let weighted: Vec<WeightedLora<'_>> = set
                .iter()
                .filter_map(|l| {
                    l.adapters
                        .get(e)
                        .and_then(Option::as_ref)
                        .map(|adapter| WeightedLora {
                            adapter,
                            weight: l.weight,
                        })
                })
                .collect();
            add(stats, patcher.apply(&weighted)?);
        }
        Ok(())
    }

    /// The base weights back; after a failure part-way, every layer ever patched is rewritten.
    fn restore(&mut self, stats: &mut PatchStats) -> Result<()> {
        for patcher in &mut self.patchers {
            match patcher.restore() {
                Ok(s) => add(stats, s),
                Err(_) => patcher.reset()?,
            }
        }
        Ok(())
    }
}

fn add(stats: &mut PatchStats, more: PatchStats) {
    stats.layers += more.layers;
    stats.seconds += more.seconds;
}
