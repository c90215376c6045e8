//! LoRAs of the CLIP text encoders (diffusers' `text_encoder.` / `text_encoder_2.` keys, kohya's
//! `lora_te_` / `lora_te1_` / `lora_te2_`), as `load_lora_weights` applies them (issue 48).
//!
//! A request's text encoders matter once, when its prompts are encoded, while its UNet is
//! patched at every step. So the encoders are patched in place only around that encoding and
//! restored at once ([`TextLoraPatchers::with_patched`]): every other request encodes with the
//! base encoders whatever LoRA set the UNet holds, and no step pays for the text side.
use super::SdPipeline;
use crate::error::{ModelError, Result};
use crate::lora::{LoraAdapter, LoraPatcher, OriginalsOn, PatchStats, WeightedLora};
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
    /// The base weights could not be written back: every encoding from now on would be wrong.
    poisoned: bool,
}

impl TextLoraPatchers {
    /// Patchers keeping their base copies `originals_on` (the host suits the encoders, patched
    /// once a job rather than once a step).
    pub fn new(pipe: &SdPipeline, originals_on: OriginalsOn) -> Self {
        Self {
            patchers: pipe
                .clip_stores()
                .iter()
                .map(|vs| LoraPatcher::with_originals_on(vs, originals_on))
                .collect(),
            poisoned: false,
        }
    }

    /// Whether the encoders' base weights could not be written back after a patch: the
    /// caller must stop using the pipeline (the UNet engine exits, as for the UNet's own).
    pub fn poisoned(&self) -> bool {
        self.poisoned
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
    /// back, whether the patch, `f` or neither fails, or `f` panics (re-raised after). The stats
    /// count both switches.
    pub fn with_patched<T>(
        &mut self,
        set: &[TextLora<'_>],
        f: impl FnOnce() -> Result<T>,
    ) -> Result<(T, PatchStats)> {
        if self.poisoned {
            return Err(ModelError::config(
                "text_encoder",
                "its base weights could not be restored after a LoRA patch",
            ));
        }
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
        let patched = catch_unwind(AssertUnwindSafe(|| self.patch(set, &mut stats)));
        // After a failed patch a patcher's bookkeeping may not know every layer it wrote.
        let whole = !matches!(patched, Ok(Ok(())));
        let outcome = match patched {
            Ok(Ok(())) => catch_unwind(AssertUnwindSafe(f)),
            Ok(Err(e)) => Ok(Err(e)),
            Err(panic) => Err(panic),
        };
        // A failed restore outranks what `f` answered: the encoders are not the base's.
        self.restore(whole, &mut stats)?;
        match outcome {
            Ok(result) => Ok((result?, stats)),
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

    /// The base weights back in every encoder: every layer ever patched rewritten where
    /// `whole` (after a failed patch) or where a patcher fails to restore; where even that
    /// fails, the patchers are poisoned.
    fn restore(&mut self, whole: bool, stats: &mut PatchStats) -> Result<()> {
        let mut failed = None;
        for patcher in &mut self.patchers {
            let restored = if whole {
                Err(ModelError::config("text_encoder", "a patch failed"))
            } else {
                patcher.restore()
            };
            match restored {
                Ok(s) => add(stats, s),
                Err(_) => {
                    if let Err(e) = patcher.reset() {
                        failed.get_or_insert(e);
                    }
                }
            }
        }
        match failed {
            None => Ok(()),
            Some(e) => {
                self.poisoned = true;
                Err(ModelError::config(
                    "text_encoder",
                    format!("its base weights could not be restored after a LoRA patch: {e}"),
                ))
            }
        }
    }
}

fn add(stats: &mut PatchStats, more: PatchStats) {
    stats.layers += more.layers;
    stats.seconds += more.seconds;
}
