//! TeaCache on the step-batching engine (see [`crate::flux::step_cache`]; first-block caching
//! is in `first_block`): a request caching its steps with TeaCache probes each step before the
//! batch's forwards, and a step whose modulated input changed little since the last computed
//! one skips every block, reusing that step's residual. A full-compute request probes its whole image stream; a mask-aware edit probes
//! and reuses at its masked tokens only, the ones it computes (its unmasked tokens follow the
//! template anyway), so the two kinds of caching combine.
//!
//! Decisions are taken before any forward and kept only when the batch commits its latents,
//! with the residuals the computed steps produced: a batch that fails part-way leaves every
//! request's cache as it was.
use super::{group_inputs, Branch, DenoiseState};
use crate::error::{ModelError, Result};
use crate::flux::step_cache::{StepChoice, StepDecision};
use crate::flux::FluxInputs;
use crate::pipeline::FluxPipeline;
use tch::Tensor;

/// One state's step-cache decision for this step and the residual rows its computed forward
/// gave (one per row: prompt, then negative prompt).
#[derive(Debug)]
pub(super) struct CachedStep {
    pub decision: StepDecision,
    pub residual_rows: [Option<Tensor>; 2],
}

impl CachedStep {
    pub fn reuses(&self) -> bool {
        self.decision.choice == StepChoice::Reuse
    }
}

/// A decision taken ahead of its batch, for the step at `index`, mask-aware or not.
#[derive(Debug)]
pub(super) struct PlannedStep {
    index: usize,
    masked: bool,
    step: CachedStep,
}

impl DenoiseState {
    /// Decide this request's next step ahead of its batch (a mask-aware one where `masked`):
    /// whether it reuses the last computed step's residual, so an engine neither loads a cache
    /// nor counts compute for it. The batch takes the decision as it is; a batch that steps
    /// this state otherwise (the other mode) decides again. False without a step cache, and
    /// with first-block caching (which decides inside the forward, after the first block).
    pub fn plan_step(&mut self, p: &FluxPipeline<'_>, masked: bool) -> Result<bool> {
        if self.is_done() {
            return Ok(false);
        }
        let step = match self.take_planned(masked) {
            Some(step) => Some(step),
            None => tch::no_grad(|| self.choose_step(p, masked))?,
        };
        let reuses = step.as_ref().is_some_and(CachedStep::reuses);
        self.planned = step.map(|step| PlannedStep {
            index: self.index,
            masked,
            step,
        });
        Ok(reuses)
    }

    /// The decision [`Self::plan_step`] took for this step in this mode, if any.
    pub(super) fn take_planned(&mut self, masked: bool) -> Option<CachedStep> {
        let planned = self.planned.take()?;
        (planned.index == self.index && planned.masked == masked).then_some(planned.step)
    }

    /// Steps this request's step cache has skipped (0 without one).
    pub fn skipped_steps(&self) -> usize {
        self.step_cache.as_ref().map_or(0, |c| c.skipped)
    }

    /// Whether this request caches steps (it has a `cache_threshold`).
    pub fn caches_steps(&self) -> bool {
        self.step_cache.is_some()
    }

    /// The transformer inputs of one row; with `masked`, the image tokens are the repainted
    /// ones only (what a mask-aware step computes; positions are not needed by the probe or
    /// the final layer).
    fn row_inputs(&self, branch: Branch, masked: bool) -> Result<FluxInputs> {
        let mut inputs = group_inputs(&[(self, branch)])?;
        if masked {
            let e = self
                .edit
                .as_ref()
                .ok_or_else(|| ModelError::input("modes", "not an edit"))?;
            inputs.hidden_states = inputs.hidden_states.f_index_select(1, &e.masked_index)?;
        }
        Ok(inputs)
    }

    /// This step's decision (`None`: the request caches no steps).
    pub(super) fn choose_step(
        &self,
        p: &FluxPipeline<'_>,
        masked: bool,
    ) -> Result<Option<CachedStep>> {
        // First-block caching decides inside the forward, after the first block.
        let Some(cache) = self
            .step_cache
            .as_ref()
            .filter(|_| !self.caches_first_block())
        else {
            return Ok(None);
        };
        let probes: Vec<Tensor> = self
            .branches()
            .iter()
            .map(|&b| p.transformer.step_probe(&self.row_inputs(b, masked)?))
            .collect::<Result<_>>()?;
        let (taken, steps) = self.progress();
        let decision = cache.choose(Tensor::f_cat(&probes, 0)?, taken, steps)?;
        Ok(Some(CachedStep {
            decision,
            residual_rows: [None, None],
        }))
    }

    /// The velocity rows of a step that reuses the last computed step's residual: over the
    /// whole image, or over the repainted tokens (`[M, out]`, as a mask-aware forward gives).
    pub(super) fn reused_velocities(
        &self,
        p: &FluxPipeline<'_>,
        masked: bool,
    ) -> Result<[Option<Tensor>; 2]> {
        let residual = self
            .step_cache
            .as_ref()
            .and_then(|c| c.residual())
            .ok_or_else(|| ModelError::input("cache_threshold", "no computed step to reuse"))?;
        let mut rows = [None, None];
        for (k, &b) in self.branches().iter().enumerate() {
            let inputs = self.row_inputs(b, masked)?;
            let v = p
                .transformer
                .forward_from_residual(&inputs, &residual.f_narrow(0, k as i64, 1)?)?;
            rows[b as usize] = Some(match masked {
                true => v.f_squeeze_dim(0)?,
                false => v,
            });
        }
        Ok(rows)
    }

    /// This step's decision with the residual a computed one keeps (its rows in branch
    /// order), checked before any state commits.
    pub(super) fn finish_step(&self, step: CachedStep) -> Result<(StepDecision, Option<Tensor>)> {
        let CachedStep {
            decision,
            residual_rows,
        } = step;
        if decision.choice == StepChoice::Reuse {
            return Ok((decision, None));
        }
        let rows: Vec<Tensor> = self
            .branches()
            .iter()
            .map(|&b| {
                residual_rows[b as usize].as_ref().map(|r| match r.dim() {
                    2 => r.unsqueeze(0),
                    _ => r.shallow_clone(),
                })
            })
            .collect::<Option<_>>()
            .ok_or_else(|| {
                ModelError::input("cache_threshold", "a computed step lost a residual row")
            })?;
        Ok((decision, Some(Tensor::f_cat(&rows, 0)?)))
    }

    /// Keep a finished step's decision (see [`Self::finish_step`]).
    pub(super) fn keep_step(&mut self, decision: StepDecision, residual: Option<Tensor>) {
        if let Some(cache) = self.step_cache.as_mut() {
            cache.commit(decision, residual);
        }
    }
}
