//! Step caching for the full-compute forward: TeaCache (Liu et al., 2024), the baseline the
//! serving stacks people use offer (xDiT, SGLang, ComfyUI nodes), and the one FlashPS is
//! compared against.
//!
//! Between neighbouring denoising steps a DiT's output changes little where its modulated input
//! changes little. TeaCache probes each step cheaply (the first block's AdaLN-modulated image
//! stream: `x_embedder`, then `norm1` under the step's conditioning) and accumulates the
//! relative L1 change of that probe since the last computed step. While the sum stays below a
//! threshold the step skips every block and reuses the residual the blocks added at the last
//! computed step (`img_out - img_in`); at or above it, the step computes in full, stores the new
//! residual, and resets the sum. The first and last steps always compute.
//!
//! TeaCache rescales the probe's change with a polynomial fitted per model (FLUX.1-dev has one
//! published); diffmesh's tiny model has none, so the change is used as it is (the identity),
//! and the threshold is in those units. Threshold 0 never skips.
//!
//! First-block caching (ParaAttention's FBCache, diffusers' `FirstBlockCache`) probes with the
//! model itself: every step runs the first double block, and the residual it added to the image
//! stream is the probe. When it differs from the last computed step's by less than the
//! threshold (relative L1, not summed), the step skips the remaining blocks and adds the
//! residual they added at the last computed step to block 0's output. Only the first step
//! always computes. The probe costs one block, but it is exact where TeaCache's is a proxy.
use super::blocks::DoubleMods;
use super::{Conditioning, ControlResiduals, FluxInputs, FluxTransformer};
use crate::error::{ModelError, Result};
use tch::{Kind, Tensor};

/// The threshold the bench reports the baseline at (`teacache_*` figures); a request names its
/// own. On the tiny model it skips about half the steps, about 2x: the operating point
/// TeaCache reports for FLUX.1 (1.5x to 2.25x), picked from a sweep (docs/BENCHMARKS.md).
pub const DEFAULT_CACHE_THRESHOLD: f64 = 0.2;

/// First-block caching's threshold for the bench's `fbcache_*` figures (its own units: the
/// first block's residual against the last computed step's, not summed). Picked by the same
/// rule as TeaCache's, the point of the sweep nearest 2x: on the tiny model, whose first
/// block is about a third of its blocks' work, that is 1.6x with 70% of steps skipped
/// (docs/BENCHMARKS.md).
pub const DEFAULT_FIRST_BLOCK_THRESHOLD: f64 = 0.4;

/// Which step cache a request runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMethod {
    /// Probe the first block's modulated input before any block; reuse every block's residual.
    #[default]
    TeaCache,
    /// Run the first block; reuse the residual of the blocks after it.
    FirstBlock,
}

/// One request's step-cache state across its steps (a guided request's two rows decide
/// together: their probes are concatenated).
#[derive(Debug)]
pub struct StepCache {
    method: CacheMethod,
    threshold: f64,
    accumulated: f64,
    previous_probe: Option<Tensor>,
    residual: Option<Tensor>,
    /// Steps skipped so far (for reports).
    pub skipped: usize,
}

/// What [`StepCache::choose`] chose for a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepChoice {
    /// Run every block (and store the residual).
    Compute,
    /// Reuse the last computed step's residual.
    Reuse,
}

/// A step's choice, with what [`StepCache::commit`] keeps once the step is taken (a batch
/// decides every state's step before it commits any, so a failed batch changes no state).
#[derive(Debug)]
pub struct StepDecision {
    pub choice: StepChoice,
    accumulated: f64,
    probe: Tensor,
}

impl StepCache {
    /// A state skipping while the change stays below `threshold` (finite, >= 0).
    pub fn new(method: CacheMethod, threshold: f64) -> Result<Self> {
        if !threshold.is_finite() || threshold < 0.0 {
            return Err(ModelError::input(
                "cache_threshold",
                format!("must be a finite number >= 0, got {threshold}"),
            ));
        }
        Ok(Self {
            method,
            threshold,
            accumulated: 0.0,
            previous_probe: None,
            residual: None,
            skipped: 0,
        })
    }

    /// Choose how step `taken` of `steps` (counted from this request's first step) runs, from
    /// its probe; nothing changes until [`Self::commit`].
    pub fn choose(&self, probe: Tensor, taken: usize, steps: usize) -> Result<StepDecision> {
        // TeaCache computes the last step too; FBCache only the first (no reference yet).
        let edge = match self.method {
            CacheMethod::TeaCache => taken == 0 || taken + 1 >= steps,
            CacheMethod::FirstBlock => taken == 0,
        };
        let (choice, accumulated) = match (&self.previous_probe, &self.residual, edge) {
            // A probe of another shape (a mask-aware step after a full one, or the reverse)
            // measures other tokens: compute, and start over from this step.
            (Some(prev), Some(_), false) if self.threshold > 0.0 && prev.size() == probe.size() => {
                let sum = match self.method {
                    CacheMethod::TeaCache => self.accumulated + relative_l1(&probe, prev)?,
                    // Against the last computed step's probe, not summed.
                    CacheMethod::FirstBlock => relative_l1(&probe, prev)?,
                };
                match sum < self.threshold {
                    true => (StepChoice::Reuse, sum),
                    false => (StepChoice::Compute, 0.0),
                }
            }
            _ => (StepChoice::Compute, 0.0),
        };
        Ok(StepDecision {
            choice,
            accumulated,
            probe,
        })
    }

    /// Keep a taken step's decision; a computed step brings its blocks' residual (`computed`).
    pub fn commit(&mut self, decision: StepDecision, computed: Option<Tensor>) {
        if let Some(residual) = computed {
            self.residual = Some(residual);
        }
        let keep_probe = match decision.choice {
            StepChoice::Reuse => {
                self.skipped += 1;
                self.method == CacheMethod::TeaCache
            }
            StepChoice::Compute => true,
        };
        self.accumulated = decision.accumulated;
        if keep_probe {
            self.previous_probe = Some(decision.probe);
        }
    }

    pub fn method(&self) -> CacheMethod {
        self.method
    }

    /// The residual of the last computed step (`None` before the first).
    pub fn residual(&self) -> Option<&Tensor> {
        self.residual.as_ref()
    }
}

/// `mean|a - b| / mean|b|` (0 where `b` is all zeros and so is `a`).
fn relative_l1(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.f_to_kind(Kind::Float)?;
    let b = b.f_to_kind(Kind::Float)?;
    let num = a
        .f_sub(&b)?
        .f_abs()?
        .f_mean(Kind::Float)?
        .f_double_value(&[])?;
    let den = b.f_abs()?.f_mean(Kind::Float)?.f_double_value(&[])?;
    Ok(match den > 0.0 {
        true => num / den,
        false if num == 0.0 => 0.0,
        false => f64::INFINITY,
    })
}

impl FluxTransformer {
    /// TeaCache's probe of a step: the first double block's attention-modulated image stream
    /// `[B, N, inner]` (`norm1` under the step's conditioning), without running any block.
    pub fn step_probe(&self, inputs: &FluxInputs) -> Result<Tensor> {
        let first = self.transformer_blocks.first().ok_or_else(|| {
            ModelError::input("model", "step caching needs at least one double block")
        })?;
        let (img, cond) = self.embedded(inputs)?;
        let rows = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };
        let m = DoubleMods::new(&first.norm1, &cond.temb_silu, &rows)?;
        m.msa.apply(&img, first.dim)
    }

    /// The image stream after `x_embedder`, and the step's conditioning.
    pub(super) fn embedded(&self, inputs: &FluxInputs) -> Result<(Tensor, Conditioning)> {
        let img = self.x_embedder.forward(&inputs.hidden_states)?;
        let cond = self.conditioning(
            &inputs.timestep,
            inputs.guidance.as_ref(),
            &inputs.pooled_projections,
        )?;
        Ok((img, cond))
    }

    /// The full forward's output (steered by `control` where given, as
    /// [`Self::forward_controlled`]) and the residual its blocks added to the image stream
    /// (`[B, N, inner]`), which a later step may reuse.
    pub fn forward_with_residual(
        &self,
        inputs: &FluxInputs,
        control: Option<&ControlResiduals>,
    ) -> Result<(Tensor, Tensor)> {
        if let Some(c) = control {
            self.check_control(inputs, c)?;
        }
        let run = self.forward_blocks(inputs, None, control)?;
        let rows = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };
        let out = self.final_layer(&run.img_out, &run.cond.temb_silu, &rows)?;
        Ok((out, run.img_out.f_sub(&run.img_in)?))
    }

    /// A step that skips every block: the final layer over the image stream plus `residual`
    /// (from [`Self::forward_with_residual`] at an earlier step of the same request).
    pub fn forward_from_residual(&self, inputs: &FluxInputs, residual: &Tensor) -> Result<Tensor> {
        let (img, cond) = self.embedded(inputs)?;
        if img.size() != residual.size() {
            return Err(ModelError::input(
                "residual",
                format!("expected {:?}, got {:?}", img.size(), residual.size()),
            ));
        }
        let rows = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };
        self.final_layer(&img.f_add(residual)?, &cond.temb_silu, &rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v)
    }

    /// The choices a cache of `method` at `threshold` takes over a request whose steps probe
    /// `probes` (a computed step stores a dummy residual).
    fn decide(method: CacheMethod, threshold: f64, probes: &[Tensor]) -> Vec<StepChoice> {
        let mut c = StepCache::new(method, threshold).unwrap();
        probes
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let d = c.choose(p.shallow_clone(), i, probes.len()).unwrap();
                let choice = d.choice;
                let residual = (choice == StepChoice::Compute)
                    .then(|| Tensor::zeros([2], (Kind::Float, Device::Cpu)));
                c.commit(d, residual);
                choice
            })
            .collect()
    }

    /// Threshold 0 computes every step; a large one reuses every middle step once a residual
    /// is stored, and never the first or the last.
    #[test]
    fn the_threshold_decides_and_the_edges_always_compute() {
        let probes = [
            t(&[1.0, 2.0]),
            t(&[1.1, 2.0]),
            t(&[1.2, 2.1]),
            t(&[1.3, 2.2]),
        ];
        let run = |threshold: f64| decide(CacheMethod::TeaCache, threshold, &probes);
        use StepChoice::{Compute, Reuse};
        assert_eq!(run(0.0), [Compute; 4]);
        assert_eq!(run(10.0), [Compute, Reuse, Reuse, Compute]);
        // ~0.033 per step: the sum passes 0.05 at step 2, which computes and resets.
        assert_eq!(run(0.05), [Compute, Reuse, Compute, Compute]);
    }

    /// The residual path is the full forward: computing with the residual gives `forward`'s
    /// output, and reusing that residual for the same inputs gives it again.
    #[test]
    fn reusing_a_steps_own_residual_gives_its_output() {
        use crate::bench_inputs::random_inputs_on;
        use crate::flux::FluxConfig;
        tch::manual_seed(5);
        let cfg = FluxConfig {
            in_channels: 16,
            out_channels: Some(8),
            num_layers: 1,
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
        let inputs = random_inputs_on(&cfg, 4, 5, 2, Device::Cpu);
        tch::no_grad(|| {
            let full = model.forward(&inputs).unwrap();
            let (out, residual) = model.forward_with_residual(&inputs, None).unwrap();
            assert!(out.equal(&full));
            let reused = model.forward_from_residual(&inputs, &residual).unwrap();
            let err = f64::try_from((&reused - &full).abs().max()).unwrap();
            assert!(err <= 1e-5, "{err}");
            assert!(f64::try_from(residual.abs().max()).unwrap() > 1e-3);
            let probe = model.step_probe(&inputs).unwrap();
            assert_eq!(probe.size(), [2, 16, model.inner_dim()]);
            let wrong = residual.narrow(1, 0, 3);
            let err = model.forward_from_residual(&inputs, &wrong).unwrap_err();
            assert!(err.to_string().contains("residual"), "{err}");
        });
    }

    /// First-block caching compares each probe with the last computed step's, not with the
    /// previous step's and not summed, and does not force the last step: a slow drift reuses
    /// until it has moved the threshold away from the last computed probe.
    #[test]
    fn first_block_caching_compares_with_the_last_computed_step() {
        // The probe grows by 0.04 a step.
        let probes = [1.0f32, 1.04, 1.08, 1.12, 1.16, 1.2].map(|v| t(&[v, v]));
        let run = |method: CacheMethod, threshold: f64| decide(method, threshold, &probes);
        use StepChoice::{Compute, Reuse};
        // |1.08 - 1.0| / 1.0 = 0.08 >= 0.07: step 2 computes; steps 3 and 4 are within 0.07
        // of 1.08 (0.037, 0.074 -> step 4 computes), step 5 within 0.07 of 1.16, and reuses:
        // the last step is not forced.
        assert_eq!(
            run(CacheMethod::FirstBlock, 0.07),
            [Compute, Reuse, Compute, Reuse, Compute, Reuse]
        );
        // TeaCache sums the step-to-step changes (about 0.04, 0.038, ...) and computes the last.
        assert_eq!(
            run(CacheMethod::TeaCache, 0.07),
            [Compute, Reuse, Compute, Reuse, Compute, Compute]
        );
        assert_eq!(
            run(CacheMethod::FirstBlock, 10.0),
            [Compute, Reuse, Reuse, Reuse, Reuse, Reuse]
        );
    }

    /// A probe over other tokens (the step switched between full and mask-aware) computes.
    #[test]
    fn a_probe_of_another_shape_computes() {
        let mut c = StepCache::new(CacheMethod::TeaCache, 10.0).unwrap();
        let d = c.choose(t(&[1.0, 2.0]), 0, 4).unwrap();
        c.commit(d, Some(Tensor::zeros([2], (Kind::Float, Device::Cpu))));
        let d = c.choose(t(&[1.0, 2.0, 3.0]), 1, 4).unwrap();
        assert_eq!(d.choice, StepChoice::Compute);
        let d = c.choose(t(&[1.0, 2.0]), 1, 4).unwrap();
        assert_eq!(d.choice, StepChoice::Reuse);
    }

    #[test]
    fn bad_thresholds_name_the_field() {
        for bad in [-0.1, f64::NAN, f64::INFINITY] {
            let err = StepCache::new(CacheMethod::FirstBlock, bad)
                .unwrap_err()
                .to_string();
            assert!(err.contains("cache_threshold"), "{err}");
        }
        assert_eq!(relative_l1(&t(&[0.0]), &t(&[0.0])).unwrap(), 0.0);
    }
}
