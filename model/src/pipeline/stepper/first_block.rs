//! First-block caching on the step-batching engine (see [`crate::flux::step_cache`]): a group
//! of full-compute rows that holds a first-block-caching request runs its first block for every
//! row, each such request decides its step from its rows' first-block residuals, and only the
//! rows that compute run the remaining blocks; the others add their request's cached residual.
//! A guided request's two rows may sit in two groups: every group's first block runs before
//! any request decides.
use super::step_caching::CachedStep;
use super::{Branch, DenoiseState};
use crate::error::{ModelError, Result};
use crate::flux::first_block::FirstBlockRun;
use crate::flux::step_cache::CacheMethod;
use crate::flux::{ControlResiduals, FluxInputs};
use crate::pipeline::FluxPipeline;
use tch::Tensor;

/// A row of a shared forward: a state and its branch.
pub(super) type Row = (usize, Branch);

/// A row with its place in its group's batch.
type PlacedRow = (i64, Row);

/// A full-compute group with a first-block-caching member: its rows, inputs and the ControlNet
/// residuals merged over its rows (if any row is steered).
pub(super) struct FirstBlockGroup<'g> {
    pub members: &'g [Row],
    pub inputs: FluxInputs,
    pub control: Option<ControlResiduals>,
}

impl DenoiseState {
    /// Whether this request caches steps by their first block (its steps must be full-compute
    /// ones: an engine runs its edits without a template cache).
    pub fn caches_first_block(&self) -> bool {
        self.step_cache
            .as_ref()
            .is_some_and(|c| c.method() == CacheMethod::FirstBlock)
    }
}

/// Step `groups`: set `velocities` of every row and `step_caches` of every first-block-caching
/// state (a computed step's rows keep their residual for the state's cache, as computed
/// TeaCache rows do).
pub(super) fn step_groups(
    p: &FluxPipeline<'_>,
    states: &[&mut DenoiseState],
    groups: &[FirstBlockGroup<'_>],
    step_caches: &mut [Option<CachedStep>],
    velocities: &mut [[Option<Tensor>; 2]],
) -> Result<()> {
    let runs: Vec<FirstBlockRun> = groups
        .iter()
        .map(|g| {
            p.transformer
                .forward_first_block(&g.inputs, g.control.as_ref())
        })
        .collect::<Result<_>>()?;
    let probes: Vec<Tensor> = runs.iter().map(|r| r.probe()).collect::<Result<_>>()?;
    // Where each row sits: (group, row in it).
    let place = |row: Row| -> Option<(usize, i64)> {
        groups.iter().enumerate().find_map(|(g, group)| {
            let k = group.members.iter().position(|&m| m == row)?;
            Some((g, k as i64))
        })
    };
    let deciding: Vec<usize> = {
        let mut ids: Vec<usize> = groups
            .iter()
            .flat_map(|g| g.members.iter().map(|&(i, _)| i))
            .filter(|&i| states[i].caches_first_block())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    };
    for &i in &deciding {
        let s = &*states[i];
        let rows: Vec<Tensor> = s
            .branches()
            .iter()
            .map(|&b| {
                let (g, k) = place((i, b)).ok_or_else(|| lost_row(i))?;
                Ok(probes[g].f_narrow(0, k, 1)?)
            })
            .collect::<Result<_>>()?;
        let cache = s.step_cache.as_ref().ok_or_else(|| lost_row(i))?;
        let (taken, steps) = s.progress();
        step_caches[i] = Some(CachedStep {
            decision: cache.choose(Tensor::f_cat(&rows, 0)?, taken, steps)?,
            residual_rows: [None, None],
        });
    }
    let reuses: Vec<bool> = (0..states.len())
        .map(|i| {
            states[i].caches_first_block()
                && step_caches[i].as_ref().is_some_and(CachedStep::reuses)
        })
        .collect();
    for (group, run) in groups.iter().zip(&runs) {
        let (computed, reused): (Vec<PlacedRow>, Vec<PlacedRow>) = group
            .members
            .iter()
            .enumerate()
            .map(|(k, &row)| (k as i64, row))
            .partition(|&(_, (i, _))| !reuses[i]);
        let index = |rows: &[PlacedRow]| -> Option<Tensor> {
            let ks: Vec<i64> = rows.iter().map(|&(k, _)| k).collect();
            (ks.len() as i64 != run.rows()).then(|| Tensor::from_slice(&ks))
        };
        if !computed.is_empty() {
            let ix = index(&computed).map(|t| t.to_device(run_device(p)));
            let out = p
                .transformer
                .forward_rest(run, ix.as_ref(), group.control.as_ref())?;
            for (r, &(_, (i, b))) in computed.iter().enumerate() {
                let r = r as i64;
                velocities[i][b as usize] = Some(out.velocity.f_narrow(0, r, 1)?);
                if let Some(step) = step_caches[i].as_mut() {
                    let residual = match states[i].caches_first_block() {
                        true => &out.rest_residual,
                        false => &out.residual,
                    };
                    step.residual_rows[b as usize] = Some(residual.f_narrow(0, r, 1)?);
                }
            }
        }
        if !reused.is_empty() {
            let residuals: Vec<Tensor> = reused
                .iter()
                .map(|&(_, (i, b))| cached_row(states[i], b))
                .collect::<Result<_>>()?;
            let ix = index(&reused).map(|t| t.to_device(run_device(p)));
            let v = p.transformer.forward_rest_reused(
                run,
                ix.as_ref(),
                &Tensor::f_cat(&residuals, 0)?,
            )?;
            for (r, &(_, (i, b))) in reused.iter().enumerate() {
                velocities[i][b as usize] = Some(v.f_narrow(0, r as i64, 1)?);
            }
        }
    }
    Ok(())
}

fn run_device(p: &FluxPipeline<'_>) -> tch::Device {
    p.transformer.device_kind().0
}

/// Row `branch` of a state's cached residual (`[1, N, inner]`).
fn cached_row(s: &DenoiseState, branch: Branch) -> Result<Tensor> {
    let residual = s
        .step_cache
        .as_ref()
        .and_then(|c| c.residual())
        .ok_or_else(|| ModelError::input("cache_threshold", "no computed step to reuse"))?;
    let k = s.branches().iter().position(|&b| b == branch).unwrap_or(0);
    Ok(residual.f_narrow(0, k as i64, 1)?)
}

fn lost_row(i: usize) -> ModelError {
    ModelError::input(
        "cache_method",
        format!("state {i}: a first-block-caching row is missing from its step's groups"),
    )
}
