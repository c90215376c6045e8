//! `DPMSolverMultistepScheduler` with `algorithm_type = "dpmsolver++"` (DPM++ 1S/2M, midpoint
//! or Heun), optionally on Karras sigmas: each step converts the model output to a clean-sample
//! prediction and takes a first-order step, or a second-order one from the last two.
use super::tables::{self, Spacing};
use super::{DiscreteSchedule, DiscreteScheduler, Prediction, State};
use crate::error::Result;
use tch::Tensor;

#[derive(Debug)]
pub(super) struct Dpm {
    order: i64,
    heun: bool,
    lower_order_final: bool,
    final_zero: bool,
    /// The previous step's clean-sample prediction (second order).
    previous: Option<Tensor>,
    /// Steps taken at the order below (diffusers' `lower_order_nums`).
    lower_order_nums: i64,
}

pub(super) fn schedule(s: &DiscreteScheduler, steps: usize) -> Result<DiscreteSchedule> {
    let c = &s.config;
    let train_sigmas = tables::train_sigmas(&s.alphas_cumprod);
    let train = train_sigmas.len();
    let last_timestep = train as f64; // lambda_min_clipped is -inf
    let mut timesteps: Vec<f64> = match s.spacing {
        Spacing::Linspace => {
            let mut t: Vec<f64> = tables::linspace(0.0, last_timestep - 1.0, steps + 1)
                .into_iter()
                .map(f64::round_ties_even)
                .rev()
                .collect();
            t.pop();
            t
        }
        Spacing::Leading(offset) => {
            let ratio = (train / (steps + 1)) as f64;
            (1..=steps)
                .rev()
                .map(|i| (i as f64 * ratio).round_ties_even() + offset as f64)
                .collect()
        }
        Spacing::Trailing => tables::arange_down(last_timestep, train as f64 / steps as f64)
            .into_iter()
            .map(|t| t.round_ties_even() - 1.0)
            .collect(),
    };
    let mut sigmas: Vec<f64> = if c.use_karras_sigmas == Some(true) {
        // Karras between the training schedule's own ends (DPM++ has no sigma_min/max).
        let (min, max) = (train_sigmas[0], train_sigmas[train - 1]);
        let sigmas = tables::karras(f64::from(min), f64::from(max), steps);
        let logs = tables::log_f32(&train_sigmas);
        timesteps = sigmas
            .iter()
            .map(|&sigma| tables::sigma_to_t(sigma, &logs).round_ties_even())
            .collect();
        sigmas
    } else {
        timesteps
            .iter()
            .map(|&t| tables::interp(t, &train_sigmas))
            .collect()
    };
    let final_zero = c.final_sigmas_type.as_deref() != Some("sigma_min");
    sigmas.push(if final_zero {
        0.0
    } else {
        f64::from(train_sigmas[0])
    });
    Ok(DiscreteSchedule {
        timesteps,
        sigmas: sigmas.into_iter().map(|v| v as f32).collect(),
        init_noise_sigma: 1.0,
        prediction: s.prediction,
        state: State::Dpm(Dpm {
            order: c.solver_order.unwrap_or(2),
            heun: c.solver_type.as_deref() == Some("heun"),
            lower_order_final: c.lower_order_final.unwrap_or(true),
            final_zero,
            previous: None,
            lower_order_nums: 0,
        }),
    })
}

/// `(alpha_t, sigma_t, lambda_t)` of a sigma, float32 as diffusers computes them.
fn alpha_sigma_lambda(sigma: f32) -> (f32, f32, f32) {
    let alpha = 1.0 / (sigma * sigma + 1.0).sqrt();
    let sigma_t = sigma * alpha;
    (alpha, sigma_t, alpha.ln() - sigma_t.ln())
}

impl Dpm {
    /// What a step changes: the previous prediction and the lower-order count.
    pub(super) fn checkpoint(&self) -> (Option<Tensor>, i64) {
        (
            self.previous.as_ref().map(Tensor::shallow_clone),
            self.lower_order_nums,
        )
    }

    pub(super) fn restore(&mut self, (previous, lower_order_nums): (Option<Tensor>, i64)) {
        self.previous = previous;
        self.lower_order_nums = lower_order_nums;
    }

    pub(super) fn step(
        &mut self,
        sigmas: &[f32],
        index: usize,
        prediction: Prediction,
        model_output: &Tensor,
        sample: &Tensor,
    ) -> Result<Tensor> {
        let steps = sigmas.len() - 1;
        let short = steps < 15;
        let lower_order_final =
            index == steps - 1 && ((self.lower_order_final && short) || self.final_zero);
        let kind = model_output.kind();
        let sample = sample.f_to_kind(tch::Kind::Float)?;
        let (alpha_s0, sigma_s0, lambda_s0) = alpha_sigma_lambda(sigmas[index]);
        // The sample is `alpha x0 + sigma eps` here (variance preserving), not Euler's `x0 +
        // sigma eps`.
        let x0 = match prediction {
            Prediction::Epsilon => sample
                .f_sub(&model_output.f_mul_scalar(f64::from(sigma_s0))?)?
                .f_div_scalar(f64::from(alpha_s0))?,
            Prediction::VPrediction => sample
                .f_mul_scalar(f64::from(alpha_s0))?
                .f_sub(&model_output.f_mul_scalar(f64::from(sigma_s0))?)?,
        };
        let previous = self.previous.replace(x0.shallow_clone());
        let (alpha_t, sigma_t, lambda_t) = alpha_sigma_lambda(sigmas[index + 1]);
        let h = lambda_t - lambda_s0;
        let e = (-h).exp() - 1.0;
        let stepped = match previous {
            Some(m1) if self.order == 2 && self.lower_order_nums >= 1 && !lower_order_final => {
                let (_, _, lambda_s1) = alpha_sigma_lambda(sigmas[index - 1]);
                let r0 = (lambda_s0 - lambda_s1) / h;
                let d1 = x0.f_sub(&m1)?.f_mul_scalar(f64::from(1.0 / r0))?;
                let d1_coefficient = if self.heun {
                    -(alpha_t * (e / h + 1.0))
                } else {
                    0.5 * (alpha_t * e)
                };
                sample
                    .f_mul_scalar(f64::from(sigma_t / sigma_s0))?
                    .f_sub(&x0.f_mul_scalar(f64::from(alpha_t * e))?)?
                    .f_sub(&d1.f_mul_scalar(f64::from(d1_coefficient))?)?
            }
            _ => sample
                .f_mul_scalar(f64::from(sigma_t / sigma_s0))?
                .f_sub(&x0.f_mul_scalar(f64::from(alpha_t * e))?)?,
        };
        if self.lower_order_nums < self.order {
            self.lower_order_nums += 1;
        }
        Ok(stepped.f_to_kind(kind)?)
    }
}
