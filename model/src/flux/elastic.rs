//! A denoising trajectory whose steps run on changing execution layouts (GF-DiT §3, §5: each
//! step is a task a policy binds to a layout; consecutive tasks may use different groups and
//! degrees). Every rank of the world runs [`Trajectory::run`] with the same plan, so each pair
//! of ranks meets its shared collectives in the same order.
//!
//! The artifacts a step hands the next are the latents (and the schedule's position, which
//! the plan's step index carries). Every member of a layout ends its step holding the whole
//! latents (the sequence-parallel forward all-gathers the velocity), so moving to a smaller
//! group or a subset needs no transfer at all; a rank joining a layout without the latents of
//! the last step (it was not in that layout) gets them from the first rank that has them,
//! sent over a two-rank group: layout-aware migration between replicated layouts. Ranks
//! outside a step's layout skip it (on a node they would run other requests' tasks).
use super::sequence_parallel::{comm_err as comm, floats, SequenceParallel};
use super::{FluxInputs, FluxTransformer};
use crate::error::{ModelError, Result};
use crate::noise_scheduler::Schedule;
use diffmesh_parallel::{Collectives, Group};
use tch::Tensor;

/// Where one step runs: world ranks in group order, and how attention is split over them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub ranks: Vec<usize>,
    pub how: SequenceParallel,
}

/// Group ids of the plan's own groups: step `i` runs on group `STEP_GROUPS + i`; moving the
/// latents to a newcomer before step `i` uses `MIGRATION_GROUPS + i * world + newcomer`.
const STEP_GROUPS: u64 = 1 << 40;
const MIGRATION_GROUPS: u64 = 1 << 41;

/// One request's denoising trajectory and where each of its steps runs.
pub struct Trajectory<'a> {
    pub model: &'a FluxTransformer,
    /// The conditioning (its `hidden_states` and `timestep` are replaced each step).
    pub inputs: &'a FluxInputs,
    /// The initial latents, the same on every rank.
    pub latents: &'a Tensor,
    pub schedule: &'a Schedule,
    /// One layout per step of `schedule`.
    pub plan: &'a [Layout],
}

impl Trajectory<'_> {
    /// Run every step on its layout. Every rank `me` of the world `[0, world)` calls it;
    /// returns the final latents on the ranks of the last layout, `None` elsewhere.
    pub fn run<C: Collectives>(
        &self,
        comm_of: &mut C,
        me: usize,
        world: usize,
    ) -> Result<Option<Tensor>> {
        let Trajectory {
            model,
            inputs,
            latents,
            schedule,
            plan,
        } = *self;
        if plan.len() != schedule.len() {
            return Err(ModelError::input(
                "plan",
                format!("{} layouts for {} steps", plan.len(), schedule.len()),
            ));
        }
        // Who holds the latents of the last step (all ranks start with the initial ones).
        let mut holders: Vec<usize> = (0..world).collect();
        let mut mine = Some(latents.shallow_clone());
        let size = latents.size();
        for (i, layout) in plan.iter().enumerate() {
            // Migration: ranks of this layout without the last step's latents get them.
            let source = holders[0];
            for &newcomer in layout.ranks.iter().filter(|r| !holders.contains(r)) {
                let id = MIGRATION_GROUPS + (i * world + newcomer) as u64;
                if me == source {
                    let pair = Group::new(id, &[source, newcomer], me, world).map_err(comm)?;
                    let values = floats(mine.as_ref().expect("a holder holds the latents"))?;
                    comm_of.send(&pair, 1, &values).map_err(comm)?;
                } else if me == newcomer {
                    let pair = Group::new(id, &[source, newcomer], me, world).map_err(comm)?;
                    let mut values = vec![0.0; size.iter().product::<i64>() as usize];
                    comm_of.recv(&pair, 0, &mut values).map_err(comm)?;
                    mine = Some(
                        Tensor::f_from_slice(&values)?
                            .f_view(size.as_slice())?
                            .f_to_kind(latents.kind())?,
                    );
                }
            }
            if !layout.ranks.contains(&me) {
                // Not in this step: whatever this rank held is now stale.
                mine = None;
                holders = layout.ranks.clone();
                continue;
            }
            let x = mine.take().expect("every member holds the latents now");
            let step_inputs = FluxInputs {
                hidden_states: x.shallow_clone(),
                encoder_hidden_states: inputs.encoder_hidden_states.shallow_clone(),
                pooled_projections: inputs.pooled_projections.shallow_clone(),
                timestep: Tensor::f_from_slice(&[schedule.timesteps[i] / 1000.0])?,
                img_ids: inputs.img_ids.shallow_clone(),
                txt_ids: inputs.txt_ids.shallow_clone(),
                guidance: inputs.guidance.as_ref().map(Tensor::shallow_clone),
            };
            let velocity = if layout.ranks.len() == 1 {
                model.forward(&step_inputs)?
            } else {
                let group =
                    Group::new(STEP_GROUPS + i as u64, &layout.ranks, me, world).map_err(comm)?;
                model.forward_sequence_parallel(&step_inputs, comm_of, &group, layout.how)?
            };
            mine = Some(schedule.step(i, &velocity, &x)?);
            holders = layout.ranks.clone();
        }
        Ok(mine)
    }
}
