//! CFG parallelism (Katz's latent parallelism, xDiT's CFG parallel; issue 47 point 3): with
//! true classifier-free guidance every step needs two forwards, the prompt's and the
//! negative prompt's. A group of `2k` ranks runs them at once: its first half computes the
//! prompt's velocity and its second half the negative prompt's, each half split by sequence
//! when `k > 1`; then member `i` of each half swaps its velocity with member `i` of the
//! other, and every rank combines the two (`uncond + scale * (cond - uncond)`) the same
//! way, so all `2k` hold the guided velocity.
use super::sequence_parallel::{comm_err as comm, floats, SequenceParallel};
use super::{FluxInputs, FluxTransformer};
use crate::error::{ModelError, Result};
use diffmesh_parallel::{Collectives, Group};
use tch::Tensor;

impl FluxTransformer {
    /// The guided velocity of one step, computed by the `2k` members of `group` (every
    /// member calls it with the same `cond` and `uncond` inputs); `how` splits each half's
    /// forward when `k > 1`. Sub-groups take ids `4 * group.id + 1..=3`.
    pub fn velocity_cfg_parallel<C: Collectives>(
        &self,
        cond: &FluxInputs,
        uncond: &FluxInputs,
        scale: f64,
        comm_of: &mut C,
        group: &Group,
        how: SequenceParallel,
    ) -> Result<Tensor> {
        let size = group.size();
        if size < 2 || !size.is_multiple_of(2) {
            return Err(ModelError::input(
                "ranks",
                format!("CFG parallelism needs an even group of at least 2 ranks, got {size}"),
            ));
        }
        let k = size / 2;
        let me = group.me();
        let world = group.ranks.iter().max().map_or(0, |m| m + 1);
        let (half, mine, first) = if group.position < k {
            (&group.ranks[..k], cond, true)
        } else {
            (&group.ranks[k..], uncond, false)
        };
        let own = if k == 1 {
            self.forward(mine)?
        } else {
            let id = 4 * group.id + if first { 1 } else { 2 };
            let sub = Group::new(id, half, me, world).map_err(comm)?;
            self.forward_sequence_parallel(mine, comm_of, &sub, how)?
        };
        // Swap with the member at the same place in the other half (the pairs are disjoint,
        // so they share one id).
        let i = group.position % k;
        let pair = [group.ranks[i], group.ranks[k + i]];
        let pair = Group::new(4 * group.id + 3, &pair, me, world).map_err(comm)?;
        let other = 1 - pair.position;
        let values = floats(&own)?;
        let mut theirs = vec![0.0; values.len()];
        comm_of
            .shift(&pair, other, other, &values, &mut theirs)
            .map_err(comm)?;
        let theirs = Tensor::f_from_slice(&theirs)?
            .f_view(own.size().as_slice())?
            .f_to_kind(own.kind())?;
        let (c, u) = if first {
            (&own, &theirs)
        } else {
            (&theirs, &own)
        };
        crate::pipeline::guide(c, u, scale)
    }
}
