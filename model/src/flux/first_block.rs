//! The full forward split for first-block caching (see [`super::step_cache`]): run the first
//! double block for a whole batch, read each row's probe, then run the remaining blocks only for
//! the rows whose step computes; the others add a cached residual to block 0's output.
use super::full_pass::Pass;
use super::{ControlResiduals, FluxInputs, FluxTransformer};
use crate::error::{ModelError, Result};
use tch::Tensor;

/// A batch's full forward stopped after its first double block.
pub struct FirstBlockRun {
    pass: Pass,
}

/// The rest of a forward for some rows of a [`FirstBlockRun`].
pub struct RestOutput {
    /// `[R, N, out]` predicted velocity.
    pub velocity: Tensor,
    /// `[R, N, inner]` what the blocks after the first added to the image stream (what a later
    /// first-block-cached step reuses).
    pub rest_residual: Tensor,
    /// `[R, N, inner]` what every block added (what a later TeaCache step reuses).
    pub residual: Tensor,
}

impl FirstBlockRun {
    /// The residual the first block added to each row's image stream, `[B, N, inner]`.
    pub fn probe(&self) -> Result<Tensor> {
        Ok(self.pass.img.f_sub(&self.pass.img_in)?)
    }

    /// Batch rows.
    pub fn rows(&self) -> i64 {
        self.pass.rows()
    }

    /// Rows `index` of the pass; every row (no copy) without one.
    fn pick(&self, index: Option<&Tensor>) -> Result<Pass> {
        match index {
            Some(index) => self.pass.select_rows(index),
            None => self.pass.select_all(),
        }
    }
}

impl FluxTransformer {
    /// Embed `inputs` and run the first double block (with `control`'s residual after it, as
    /// [`Self::forward_controlled`] does).
    pub fn forward_first_block(
        &self,
        inputs: &FluxInputs,
        control: Option<&ControlResiduals>,
    ) -> Result<FirstBlockRun> {
        if self.transformer_blocks.is_empty() {
            return Err(ModelError::input(
                "cache_method",
                "first-block caching needs at least one double block",
            ));
        }
        if let Some(c) = control {
            self.check_control(inputs, c)?;
        }
        let mut pass = self.begin_pass(inputs)?;
        self.run_doubles(&mut pass, 1, &mut None, control)?;
        Ok(FirstBlockRun { pass })
    }

    /// The remaining blocks and the final layer for rows `index` of `run` (every row without
    /// one); `control` holds the whole batch's residuals, as given to the first block.
    pub fn forward_rest(
        &self,
        run: &FirstBlockRun,
        index: Option<&Tensor>,
        control: Option<&ControlResiduals>,
    ) -> Result<RestOutput> {
        let pass = run.pick(index)?;
        let control = match (control, index) {
            (Some(c), Some(index)) => Some(c.select_rows(index)?),
            (Some(c), None) => Some(c.shallow_clone()),
            (None, _) => None,
        };
        let after_first = pass.img.shallow_clone();
        let blocks = self.finish_pass(pass, &mut None, control.as_ref())?;
        let rows = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };
        Ok(RestOutput {
            velocity: self.final_layer(&blocks.img_out, &blocks.cond.temb_silu, &rows)?,
            rest_residual: blocks.img_out.f_sub(&after_first)?,
            residual: blocks.img_out.f_sub(&blocks.img_in)?,
        })
    }

    /// Rows `index` of `run` (every row without one) skipping the remaining blocks: the final
    /// layer over the first block's output plus `rest_residual` (`[R, N, inner]`, from
    /// [`Self::forward_rest`] at an earlier step of the same requests).
    pub fn forward_rest_reused(
        &self,
        run: &FirstBlockRun,
        index: Option<&Tensor>,
        rest_residual: &Tensor,
    ) -> Result<Tensor> {
        let pass = run.pick(index)?;
        if pass.img.size() != rest_residual.size() {
            return Err(ModelError::input(
                "residual",
                format!(
                    "expected {:?}, got {:?}",
                    pass.img.size(),
                    rest_residual.size()
                ),
            ));
        }
        let rows = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };
        self.final_layer(&pass.img.f_add(rest_residual)?, &pass.cond.temb_silu, &rows)
    }
}

#[cfg(test)]
mod tests {
    use crate::bench_inputs::random_inputs_on;
    use crate::flux::{FluxConfig, FluxTransformer};
    use tch::{Device, Kind, Tensor};

    fn max_err(a: &Tensor, b: &Tensor) -> f64 {
        f64::try_from((a - b).abs().max()).unwrap()
    }

    /// The split forward is the full forward: every row through the rest gives `forward`'s
    /// output, a subset of rows gives those rows', and reusing a row's own rest residual gives
    /// its output again.
    #[test]
    fn the_split_forward_is_the_full_forward() {
        tch::manual_seed(9);
        let cfg = FluxConfig {
            in_channels: 16,
            out_channels: Some(8),
            num_layers: 2,
            num_single_layers: 2,
            attention_head_dim: 16,
            num_attention_heads: 2,
            joint_attention_dim: 24,
            pooled_projection_dim: 12,
            guidance_embeds: true,
            axes_dims_rope: vec![4, 6, 6],
            ..Default::default()
        };
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let model = FluxTransformer::new(&vs.root(), cfg.clone()).unwrap();
        // 3 rows of a 2x2 token grid and 5 text tokens.
        let inputs = random_inputs_on(&cfg, 2, 5, 3, Device::Cpu);
        tch::no_grad(|| {
            let full = model.forward(&inputs).unwrap();
            let run = model.forward_first_block(&inputs, None).unwrap();
            assert_eq!(run.rows(), 3);
            assert_eq!(run.probe().unwrap().size(), [3, 4, model.inner_dim()]);
            let all = model.forward_rest(&run, None, None).unwrap();
            assert!(max_err(&all.velocity, &full) <= 1e-5);
            let index = Tensor::from_slice(&[2i64, 0]);
            let some = model.forward_rest(&run, Some(&index), None).unwrap();
            let want = full.index_select(0, &index);
            assert!(max_err(&some.velocity, &want) <= 1e-5);
            let reused = model
                .forward_rest_reused(&run, Some(&index), &some.rest_residual)
                .unwrap();
            assert!(max_err(&reused, &want) <= 1e-5);
            // Every block's residual is the first block's plus the rest's.
            let first = run.probe().unwrap().index_select(0, &index);
            let whole = &first + &some.rest_residual;
            assert!(max_err(&whole, &some.residual) <= 1e-5);
            let wrong = Tensor::zeros([1, 4, model.inner_dim()], (Kind::Float, Device::Cpu));
            let err = model
                .forward_rest_reused(&run, Some(&index), &wrong)
                .unwrap_err();
            assert!(err.to_string().contains("residual"), "{err}");
        });
    }
}
