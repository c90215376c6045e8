//! `EulerDiscreteScheduler` (optionally on Karras sigmas) and
//! `EulerAncestralDiscreteScheduler`: Euler steps in sigma, the ancestral one adding fresh
//! noise at each step.
use super::tables::{self, Spacing};
use super::{x0_from_sigma, DiscreteSchedule, DiscreteScheduler, Method, Prediction, State};
use crate::error::Result;
use tch::Tensor;

pub(super) fn schedule(s: &DiscreteScheduler, steps: usize) -> Result<DiscreteSchedule> {
    let c = &s.config;
    let train_sigmas = tables::train_sigmas(&s.alphas_cumprod);
    // Float32 values, as diffusers keeps them.
    let mut timesteps: Vec<f64> = s
        .spacing
        .spread(train_sigmas.len(), steps)
        .into_iter()
        .map(|t| f64::from(t as f32))
        .collect();
    let mut sigmas: Vec<f64> = timesteps
        .iter()
        .map(|&t| tables::interp(t, &train_sigmas))
        .collect();
    if s.method == Method::Euler && c.use_karras_sigmas == Some(true) {
        let min = c.sigma_min.unwrap_or(sigmas[sigmas.len() - 1]);
        let max = c.sigma_max.unwrap_or(sigmas[0]);
        sigmas = tables::karras(min, max, steps);
        let logs = tables::log_f32(&train_sigmas);
        timesteps = sigmas
            .iter()
            .map(|&sigma| f64::from(tables::sigma_to_t(sigma, &logs) as f32))
            .collect();
    }
    let last = match (s.method, c.final_sigmas_type.as_deref()) {
        (Method::Euler, Some("sigma_min")) => f64::from(train_sigmas[0]),
        _ => 0.0,
    };
    sigmas.push(last);
    let sigmas: Vec<f32> = sigmas.into_iter().map(|v| v as f32).collect();
    let max = sigmas.iter().copied().fold(0.0f32, f32::max);
    let init_noise_sigma = match s.spacing {
        Spacing::Linspace | Spacing::Trailing => f64::from(max),
        Spacing::Leading(_) => f64::from((max * max + 1.0).sqrt()),
    };
    Ok(DiscreteSchedule {
        timesteps,
        sigmas,
        init_noise_sigma,
        prediction: s.prediction,
        state: State::Euler {
            ancestral: s.method == Method::EulerAncestral,
        },
    })
}

/// One Euler step from `sigmas[index]` to `sigmas[index + 1]` (the ancestral one to the
/// smaller `sigma_down`, then `noise * sigma_up` added).
pub(super) fn step(
    sigmas: &[f32],
    index: usize,
    prediction: Prediction,
    model_output: &Tensor,
    sample: &Tensor,
    noise: Option<&Tensor>,
) -> Result<Tensor> {
    let (sigma, next) = (sigmas[index], sigmas[index + 1]);
    let kind = model_output.kind();
    let sample = sample.f_to_kind(tch::Kind::Float)?;
    let x0 = x0_from_sigma(prediction, sigma, model_output, &sample)?;
    let derivative = sample.f_sub(&x0)?.f_div_scalar(f64::from(sigma))?;
    let stepped = match noise {
        None => sample.f_add(&derivative.f_mul_scalar(f64::from(next - sigma))?)?,
        Some(noise) => {
            let up = (next * next * (sigma * sigma - next * next) / (sigma * sigma)).sqrt();
            let down = (next * next - up * up).sqrt();
            sample
                .f_add(&derivative.f_mul_scalar(f64::from(down - sigma))?)?
                .f_add(&noise.f_mul_scalar(f64::from(up))?)?
        }
    };
    Ok(stepped.f_to_kind(kind)?)
}
