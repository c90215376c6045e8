//! `DDIMScheduler` with `eta = 0` (deterministic, as pipelines call it): the clean-sample and
//! noise predictions at `t`, recombined at the previous timestep's `alphas_cumprod`.
use super::{DiscreteSchedule, DiscreteScheduler, Prediction, State};
use crate::error::Result;
use tch::Tensor;

#[derive(Debug)]
pub(super) struct Ddim {
    alphas_cumprod: Vec<f32>,
    /// Where the last step lands: 1 with `set_alpha_to_one`, else `alphas_cumprod[0]`.
    final_alpha_cumprod: f32,
    /// The distance between consecutive timesteps (`num_train_timesteps // steps`).
    stride: i64,
    /// `clip_sample_range` where the clean-sample prediction is clipped.
    clip: Option<f64>,
}

pub(super) fn schedule(s: &DiscreteScheduler, steps: usize) -> Result<DiscreteSchedule> {
    let c = &s.config;
    let train = s.alphas_cumprod.len();
    // Integers, as diffusers keeps them.
    let timesteps: Vec<f64> = s
        .spacing
        .spread(train, steps)
        .into_iter()
        .map(f64::round_ties_even)
        .collect();
    Ok(DiscreteSchedule {
        timesteps,
        sigmas: Vec::new(),
        init_noise_sigma: 1.0,
        prediction: s.prediction,
        state: State::Ddim(Ddim {
            final_alpha_cumprod: if c.set_alpha_to_one.unwrap_or(true) {
                1.0
            } else {
                s.alphas_cumprod[0]
            },
            alphas_cumprod: s.alphas_cumprod.clone(),
            stride: (train / steps) as i64,
            clip: c
                .clip_sample
                .unwrap_or(true)
                .then(|| c.clip_sample_range.unwrap_or(1.0)),
        }),
    })
}

impl Ddim {
    /// `alphas_cumprod[t]`, float32.
    pub(super) fn alphas_cumprod_at(&self, t: i64) -> Result<f32> {
        usize::try_from(t)
            .ok()
            .and_then(|t| self.alphas_cumprod.get(t).copied())
            .ok_or_else(|| {
                crate::error::ModelError::input(
                    "timestep",
                    format!("{t} is outside the training schedule"),
                )
            })
    }

    pub(super) fn step(
        &mut self,
        timesteps: &[f64],
        index: usize,
        prediction: Prediction,
        model_output: &Tensor,
        sample: &Tensor,
    ) -> Result<Tensor> {
        let t = timesteps[index] as i64;
        let prev = t - self.stride;
        let acp = |t: i64| {
            usize::try_from(t)
                .ok()
                .and_then(|t| self.alphas_cumprod.get(t).copied())
        };
        let alpha_t = acp(t).ok_or_else(|| {
            crate::error::ModelError::input(
                "timestep",
                format!("{t} is outside the training schedule"),
            )
        })?;
        let alpha_prev = acp(prev).unwrap_or(self.final_alpha_cumprod);
        let beta_t = 1.0 - alpha_t;
        let (sa, sb) = (f64::from(alpha_t.sqrt()), f64::from(beta_t.sqrt()));
        let (x0, eps) = match prediction {
            Prediction::Epsilon => (
                sample
                    .f_sub(&model_output.f_mul_scalar(sb)?)?
                    .f_div_scalar(sa)?,
                model_output.shallow_clone(),
            ),
            Prediction::VPrediction => (
                sample
                    .f_mul_scalar(sa)?
                    .f_sub(&model_output.f_mul_scalar(sb)?)?,
                model_output
                    .f_mul_scalar(sa)?
                    .f_add(&sample.f_mul_scalar(sb)?)?,
            ),
        };
        let x0 = match self.clip {
            Some(range) => x0.f_clamp(-range, range)?,
            None => x0,
        };
        let direction = eps.f_mul_scalar(f64::from((1.0 - alpha_prev).sqrt()))?;
        Ok(x0
            .f_mul_scalar(f64::from(alpha_prev.sqrt()))?
            .f_add(&direction)?)
    }
}
