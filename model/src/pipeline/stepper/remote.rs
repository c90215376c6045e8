//! A full-compute step taken in two halves, for runtimes whose forward runs elsewhere (a
//! node's ranks, `diffmesh-denoiser --ranks`): [`DenoiseState::step_inputs`] gives the
//! transformer inputs of the state's next step, one per row (its prompt's and, when guided,
//! its negative prompt's), and [`DenoiseState::apply_velocities`] takes the velocities the
//! forward returned for them and steps. The inputs and the math after the forward are
//! [`super::step_batch`]'s, so a state stepped this way ends on the same latents.
use super::{group_inputs, DenoiseState};
use crate::error::{ModelError, Result};
use crate::flux::FluxInputs;
use tch::Tensor;

impl DenoiseState {
    /// The transformer inputs of this state's next step, one per row. Steered states need
    /// their ControlNet residuals in the forward and are refused (field `control`).
    pub fn step_inputs(&self) -> Result<Vec<FluxInputs>> {
        if self.is_done() {
            return Err(ModelError::input("state", "every step has been taken"));
        }
        if self.has_control() {
            return Err(ModelError::input(
                "control",
                "a steered request steps with its ControlNet residuals, not on a remote forward",
            ));
        }
        tch::no_grad(|| {
            self.branches()
                .iter()
                .map(|&b| group_inputs(&[(self, b)]))
                .collect()
        })
    }

    /// Step with the velocities of [`DenoiseState::step_inputs`]' rows, in their order.
    pub fn apply_velocities(&mut self, velocities: Vec<Tensor>) -> Result<()> {
        if velocities.len() != self.rows() {
            return Err(ModelError::input(
                "velocities",
                format!("{} velocities for {} rows", velocities.len(), self.rows()),
            ));
        }
        let mut rows = [None, None];
        for (slot, v) in rows.iter_mut().zip(velocities) {
            *slot = Some(v);
        }
        tch::no_grad(|| {
            let v = self.guided(rows)?;
            self.apply(&v)
        })
    }
}
