//! A full-compute step taken in two halves, for runtimes whose forward runs elsewhere (a
//! node's ranks, `diffmesh-denoiser --ranks`): [`DenoiseState::step_inputs`] gives the
//! transformer inputs of the state's next step, one per row (its prompt's and, when guided,
//! its negative prompt's), and [`DenoiseState::apply_velocities`] takes the velocities the
//! forward returned for them and steps. The inputs and the math after the forward are
//! [`super::step_batch`]'s, so a state stepped this way ends on the same latents.
//!
//! An edit's mask-aware step splits the same way: [`DenoiseState::masked_step_rows`] gives
//! its rows without the template cache (each rank reads its own) and
//! [`DenoiseState::apply_masked_velocities`] takes the masked tokens' velocities.
use super::{group_inputs, DenoiseState};
use crate::error::{ModelError, Result};
use crate::flux::{FluxInputs, KvCache, MaskedRequest};
use tch::Tensor;

/// One row of an edit's mask-aware step: a [`MaskedRequest`] but for the cache.
pub struct MaskedRow {
    pub hidden_states: Tensor,
    pub token_index: Tensor,
    pub encoder_hidden_states: Tensor,
    pub pooled_projections: Tensor,
    pub timestep: f64,
    pub guidance: Option<f64>,
    pub img_ids: Tensor,
    pub txt_ids: Tensor,
}

impl MaskedRow {
    /// Another handle on the same tensors (for another rank's thread).
    pub fn shallow_clone(&self) -> Self {
        Self {
            hidden_states: self.hidden_states.shallow_clone(),
            token_index: self.token_index.shallow_clone(),
            encoder_hidden_states: self.encoder_hidden_states.shallow_clone(),
            pooled_projections: self.pooled_projections.shallow_clone(),
            timestep: self.timestep,
            guidance: self.guidance,
            img_ids: self.img_ids.shallow_clone(),
            txt_ids: self.txt_ids.shallow_clone(),
        }
    }

    /// The request reading `cache` (the tensors shared, not copied).
    pub fn request<'c>(&self, cache: &'c dyn KvCache) -> MaskedRequest<'c> {
        MaskedRequest {
            hidden_states: self.hidden_states.shallow_clone(),
            token_index: self.token_index.shallow_clone(),
            encoder_hidden_states: self.encoder_hidden_states.shallow_clone(),
            pooled_projections: self.pooled_projections.shallow_clone(),
            timestep: self.timestep,
            guidance: self.guidance,
            img_ids: self.img_ids.shallow_clone(),
            txt_ids: self.txt_ids.shallow_clone(),
            cache,
            full_hidden_states: None,
        }
    }
}

impl DenoiseState {
    /// The transformer inputs of this state's next step, one per row. Steered states need
    /// their ControlNet residuals in the forward and are refused (field `control`).
    pub fn step_inputs(&self) -> Result<Vec<FluxInputs>> {
        self.remote_rows(|b| group_inputs(&[(self, b)]))
    }

    /// Step with the velocities of [`DenoiseState::step_inputs`]' rows, in their order.
    pub fn apply_velocities(&mut self, velocities: Vec<Tensor>) -> Result<()> {
        let rows = self.velocity_rows(velocities)?;
        tch::no_grad(|| {
            let v = self.guided(rows)?;
            self.apply(&v)
        })
    }

    /// The rows of this edit's next step in mask-aware mode (its step reads the template
    /// cache at [`DenoiseState::step_index`]), one per branch.
    pub fn masked_step_rows(&self) -> Result<Vec<MaskedRow>> {
        self.remote_rows(|b| self.masked_row(b))
    }

    /// Step with the masked tokens' velocities `[M, out]` of
    /// [`DenoiseState::masked_step_rows`]' rows, in their order.
    pub fn apply_masked_velocities(&mut self, velocities: Vec<Tensor>) -> Result<()> {
        let rows = self.velocity_rows(velocities)?;
        tch::no_grad(|| self.apply_masked(rows))
    }

    /// `row(branch)` for each branch of the next step, which must exist and be unsteered.
    fn remote_rows<T>(&self, row: impl Fn(super::Branch) -> Result<T>) -> Result<Vec<T>> {
        if self.is_done() {
            return Err(ModelError::input("state", "every step has been taken"));
        }
        if self.has_control() {
            return Err(ModelError::input(
                "control",
                "a steered request steps with its ControlNet residuals, not on a remote forward",
            ));
        }
        if self.caches_steps() {
            return Err(ModelError::input(
                "cache_threshold",
                "a step-caching request decides its steps here, not on a remote forward",
            ));
        }
        tch::no_grad(|| self.branches().iter().map(|&b| row(b)).collect())
    }

    /// One velocity per row, as `guided` takes them.
    fn velocity_rows(&self, velocities: Vec<Tensor>) -> Result<[Option<Tensor>; 2]> {
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
        Ok(rows)
    }
}
