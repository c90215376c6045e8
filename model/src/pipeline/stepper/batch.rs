//! One step for a batch of states ([`step_batch_controlled`]): full-compute rows grouped by
//! shape into shared forwards, every mask-aware row packed into one mask-aware forward, steps
//! that reuse a cached residual running no block (TeaCache) or only the first
//! (first-block caching, which decides inside its group's forward: `first_block`); every
//! state's latents and step-cache decision are kept only once all of them are computed.
use super::control;
use super::first_block::{self, FirstBlockGroup};
use super::step_caching::CachedStep;
use super::{group_inputs, Branch, DenoiseState, StepMode};
use crate::error::{ModelError, Result};
use crate::flux::{ControlResiduals, FluxInputs, KvCache, MaskedRequest, SharedBlockReads};
use crate::pipeline::FluxPipeline;
use tch::Tensor;

/// One denoising step for every unfinished state, each at its own step index: states with the
/// same [`DenoiseState::batch_key`] share one transformer forward (per-row timesteps).
pub fn step_batch(p: &FluxPipeline<'_>, states: &mut [&mut DenoiseState]) -> Result<()> {
    let modes = vec![StepMode::Full; states.len()];
    step_batch_modes(p, states, &modes, 0)
}

/// [`step_batch`] where each state has its own [`StepMode`]: full-compute states are grouped by
/// shape as there, and every mask-aware state (any shapes, masks, steps) is packed into one
/// mask-aware forward whose first `full_prefix` blocks run over all tokens (see
/// [`crate::flux::FluxTransformer::forward_masked_prefix`]).
pub fn step_batch_modes(
    p: &FluxPipeline<'_>,
    states: &mut [&mut DenoiseState],
    modes: &[StepMode<'_>],
    full_prefix: usize,
) -> Result<()> {
    let none: Vec<Option<ControlResiduals>> = states.iter().map(|_| None).collect();
    step_batch_controlled(p, states, modes, full_prefix, &none)
}

/// [`step_batch_modes`] where `residuals[i]` are state `i`'s ControlNet residuals for this step
/// (from [`DenoiseState::control_step`], computed here or on a ControlNet worker). A steered
/// state must bring them, unless its step reuses a cached residual (step caching: see
/// [`DenoiseState::plan_step`]); full-compute groups mix steered and plain rows.
pub fn step_batch_controlled(
    p: &FluxPipeline<'_>,
    states: &mut [&mut DenoiseState],
    modes: &[StepMode<'_>],
    full_prefix: usize,
    residuals: &[Option<ControlResiduals>],
) -> Result<()> {
    if modes.len() != states.len() || residuals.len() != states.len() {
        return Err(ModelError::input(
            "modes",
            format!(
                "{} modes and {} residual sets for {} states",
                modes.len(),
                residuals.len(),
                states.len()
            ),
        ));
    }
    tch::no_grad(|| {
        // Rows of the same shape share a forward; a guided state has two rows, possibly in
        // two groups, so every state steps once all its rows are computed.
        type Row = (usize, Branch);
        let mut groups: Vec<((i64, i64, i64), Vec<Row>)> = Vec::new();
        let mut cached: Vec<(usize, &dyn KvCache)> = Vec::new();
        // TeaCache: every such state's step is chosen before any forward; a reused step runs
        // no block, mask-aware or full. First-block caching chooses after the first block.
        let mut step_caches: Vec<Option<CachedStep>> = states.iter().map(|_| None).collect();
        let mut reused: Vec<(usize, bool)> = Vec::new();
        for (i, s) in states.iter_mut().enumerate().filter(|(_, s)| !s.is_done()) {
            let masked = matches!(modes[i], StepMode::Cached(_));
            if masked && s.edit.is_none() {
                return Err(ModelError::input(
                    "modes",
                    format!("state {i}: a mask-aware step needs an edit (template + mask)"),
                ));
            }
            if masked && s.caches_first_block() {
                return Err(ModelError::input(
                    "cache_method",
                    format!(
                        "state {i}: first-block caching runs every token through the first \
                         block; a mask-aware step combines with TeaCache only"
                    ),
                ));
            }
            step_caches[i] = match s.take_planned(masked) {
                Some(step) => Some(step),
                None => s.choose_step(p, masked)?,
            };
            let s = &**s;
            // A step that reuses its residual runs no block: it needs no ControlNet either.
            if step_caches[i].as_ref().is_some_and(CachedStep::reuses) {
                reused.push((i, masked));
                continue;
            }
            if s.has_control() != residuals[i].is_some() {
                return Err(ModelError::input(
                    "control",
                    format!("state {i}: ControlNet residuals given iff the request is steered"),
                ));
            }
            if let StepMode::Cached(cache) = modes[i] {
                cached.push((i, cache));
                continue;
            }
            for &branch in s.branches() {
                let key = s.row_key(branch);
                match groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, members)) => members.push((i, branch)),
                    None => groups.push((key, vec![(i, branch)])),
                }
            }
        }
        let mut velocities: Vec<[Option<Tensor>; 2]> =
            states.iter().map(|_| [None, None]).collect();
        let (doubles, singles) = (
            p.transformer.transformer_blocks.len(),
            p.transformer.single_transformer_blocks.len(),
        );
        let mut first_block_groups = Vec::new();
        for (_, members) in &groups {
            let rows: Vec<(&DenoiseState, Branch)> =
                members.iter().map(|&(i, b)| (&*states[i], b)).collect();
            let inputs = group_inputs(&rows)?;
            // A guided steered state's negative row takes the prompt row's residuals, as in
            // diffusers' `FluxControlNetPipeline` (the ControlNet runs once per step, on the
            // prompt): guidance then pushes away from the negative prompt, not from the control.
            let steered: Vec<Option<&ControlResiduals>> = members
                .iter()
                .map(|&(i, _)| residuals[i].as_ref())
                .collect();
            let merged = if steered.iter().all(Option::is_none) {
                None
            } else {
                control::merge_rows(&steered, doubles, singles, &like_residual(&inputs, p)?)?
            };
            // First-block caching decides after the group's first block: see `first_block`.
            if members.iter().any(|&(i, _)| states[i].caches_first_block()) {
                first_block_groups.push(FirstBlockGroup {
                    members,
                    inputs,
                    control: merged,
                });
                continue;
            }
            let caching = members.iter().any(|&(i, _)| step_caches[i].is_some());
            let (velocity, residual) = match (merged, caching) {
                (r, true) => {
                    let (v, res) = p.transformer.forward_with_residual(&inputs, r.as_ref())?;
                    (v, Some(res))
                }
                (Some(r), false) => (p.transformer.forward_controlled(&inputs, &r)?, None),
                (None, false) => (p.transformer.forward(&inputs)?, None),
            };
            for (row, &(i, b)) in members.iter().enumerate() {
                velocities[i][b as usize] = Some(velocity.f_narrow(0, row as i64, 1)?);
                if let (Some(step), Some(res)) = (step_caches[i].as_mut(), &residual) {
                    step.residual_rows[b as usize] = Some(res.f_narrow(0, row as i64, 1)?);
                }
            }
        }
        first_block::step_groups(
            p,
            states,
            &first_block_groups,
            &mut step_caches,
            &mut velocities,
        )?;
        for &(i, masked) in &reused {
            velocities[i] = states[i].reused_velocities(p, masked)?;
        }
        // All or nothing: every state's next latents are computed before any is kept, so a
        // batch that fails part-way (the mask-aware forward after the full ones, say) can be
        // retried job by job without stepping anyone twice. Full-compute states step here,
        // mask-aware ones (computed or reusing a step) below.
        let mut stepped: Vec<(usize, Tensor)> = Vec::with_capacity(states.len());
        for (i, rows) in velocities.iter_mut().enumerate() {
            if rows[0].is_some() && !matches!(modes[i], StepMode::Cached(_)) {
                let v = states[i].guided(std::mem::take(rows))?;
                stepped.push((i, states[i].next_latents(&v)?));
            }
        }
        if !cached.is_empty() {
            let rows: Vec<Row> = cached
                .iter()
                .flat_map(|&(i, _)| states[i].branches().iter().map(move |&b| (i, b)))
                .collect();
            // A guided state's two rows read one cache, which hands out each block once.
            let shared: Vec<SharedBlockReads> = cached
                .iter()
                .map(|&(_, cache)| SharedBlockReads::new(cache))
                .collect();
            let requests: Vec<MaskedRequest> = cached
                .iter()
                .zip(&shared)
                .flat_map(|(&(i, cache), shared)| {
                    let s = &*states[i];
                    let cache: &dyn KvCache = if s.rows() > 1 { shared } else { cache };
                    s.branches()
                        .iter()
                        .map(move |&b| s.masked_request(cache, full_prefix > 0, b))
                })
                .collect::<Result<_>>()?;
            let caching = cached.iter().any(|&(i, _)| step_caches[i].is_some());
            let (outputs, residuals) = match caching {
                true => p
                    .transformer
                    .forward_masked_with_residuals(&requests, full_prefix)?,
                false => (
                    p.transformer
                        .forward_masked_prefix(&requests, full_prefix)?,
                    Vec::new(),
                ),
            };
            drop(requests);
            drop(shared);
            for (&(i, b), v) in rows.iter().zip(outputs) {
                velocities[i][b as usize] = Some(v);
            }
            for (&(i, b), r) in rows.iter().zip(residuals) {
                if let Some(step) = step_caches[i].as_mut() {
                    step.residual_rows[b as usize] = Some(r);
                }
            }
        }
        // Mask-aware states, computed or reusing a step, step from their masked tokens' rows.
        let masked_states = cached.iter().map(|&(i, _)| i).chain(
            reused
                .iter()
                .filter(|&&(_, masked)| masked)
                .map(|&(i, _)| i),
        );
        for i in masked_states {
            let rows = std::mem::take(&mut velocities[i]);
            stepped.push((i, states[i].masked_next_latents(rows)?));
        }
        let mut kept = Vec::with_capacity(stepped.len());
        for (i, latents) in stepped {
            let step = match step_caches[i].take() {
                Some(step) => Some(states[i].finish_step(step)?),
                None => None,
            };
            kept.push((i, latents, step));
        }
        for (i, latents, step) in kept {
            states[i].commit(latents);
            if let Some((decision, residual)) = step {
                states[i].keep_step(decision, residual);
            }
        }
        Ok(())
    })
}

/// A `[1, N, inner]` tensor of the transformer's kind (what an unsteered row's residual is).
fn like_residual(inputs: &FluxInputs, p: &FluxPipeline<'_>) -> Result<Tensor> {
    let n = inputs.hidden_states.size()[1];
    let (device, kind) = p.transformer.device_kind();
    Ok(Tensor::f_empty(
        [1, n, p.transformer.inner_dim()],
        (kind, device),
    )?)
}
