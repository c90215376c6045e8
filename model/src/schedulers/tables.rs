//! The training schedule and the numeric helpers the discrete schedulers share, computed in
//! the precision diffusers computes them in (see the module docs of [`super`]).
use super::{DiscreteSchedulerConfig, Method};
use crate::error::{ModelError, Result};
pub use crate::noise_scheduler::linspace;
use tch::{Kind, Tensor};

/// Refuse a configuration these schedulers do not implement, naming the field.
pub fn refuse_unsupported(method: Method, c: &DiscreteSchedulerConfig) -> Result<()> {
    let refuse = |field: &str, why: &str| Err(ModelError::config(field, why.to_string()));
    for (field, on) in [
        (
            "trained_betas",
            c.trained_betas.as_ref().is_some_and(|v| !v.is_null()),
        ),
        (
            "rescale_betas_zero_snr",
            c.rescale_betas_zero_snr == Some(true),
        ),
        (
            "use_exponential_sigmas",
            c.use_exponential_sigmas == Some(true),
        ),
        ("use_beta_sigmas", c.use_beta_sigmas == Some(true)),
        ("use_lu_lambdas", c.use_lu_lambdas == Some(true)),
        ("use_flow_sigmas", c.use_flow_sigmas == Some(true)),
        ("thresholding", c.thresholding == Some(true)),
        ("variance_type", c.variance_type.is_some()),
        ("euler_at_final", c.euler_at_final == Some(true)),
        (
            "lambda_min_clipped",
            c.lambda_min_clipped.is_some_and(f64::is_finite),
        ),
    ] {
        if on {
            return refuse(field, "is not supported by diffmesh's discrete schedulers");
        }
    }
    if c.use_karras_sigmas == Some(true)
        && !matches!(method, Method::Euler | Method::DpmSolverMultistep)
    {
        return refuse(
            "use_karras_sigmas",
            "only Euler and DPM++ take Karras sigmas",
        );
    }
    if let Some(t) = c.timestep_type.as_deref().filter(|t| *t != "discrete") {
        return refuse("timestep_type", &format!("{t} is not supported (discrete)"));
    }
    if let Some(t) = c.interpolation_type.as_deref().filter(|t| *t != "linear") {
        return refuse(
            "interpolation_type",
            &format!("{t} is not supported (linear)"),
        );
    }
    if let Some(t) = c
        .final_sigmas_type
        .as_deref()
        .filter(|t| !matches!(*t, "zero" | "sigma_min"))
    {
        return refuse("final_sigmas_type", &format!("{t} is not supported"));
    }
    if method == Method::DpmSolverMultistep {
        if let Some(a) = c.algorithm_type.as_deref().filter(|a| *a != "dpmsolver++") {
            return refuse(
                "algorithm_type",
                &format!("{a} is not supported (dpmsolver++)"),
            );
        }
        if let Some(o) = c.solver_order.filter(|o| !matches!(o, 1 | 2)) {
            return refuse("solver_order", &format!("{o} is not supported (1 or 2)"));
        }
        if let Some(s) = c
            .solver_type
            .as_deref()
            .filter(|s| !matches!(*s, "midpoint" | "heun"))
        {
            return refuse("solver_type", &format!("{s} is not supported"));
        }
    }
    Ok(())
}

/// How the inference timesteps are spread over the training ones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Spacing {
    Linspace,
    /// `steps_offset` added.
    Leading(i64),
    Trailing,
}

impl Spacing {
    pub fn of(method: Method, c: &DiscreteSchedulerConfig) -> Result<Self> {
        let default = if method == Method::Ddim {
            "leading"
        } else {
            "linspace"
        };
        Ok(match c.timestep_spacing.as_deref().unwrap_or(default) {
            "linspace" => Self::Linspace,
            "leading" => Self::Leading(c.steps_offset.unwrap_or(0)),
            "trailing" => Self::Trailing,
            other => {
                return Err(ModelError::config(
                    "timestep_spacing",
                    format!("{other} is not supported (linspace, leading, trailing)"),
                ))
            }
        })
    }
}

impl Spacing {
    /// `steps` of the `train` training timesteps, the largest first, as Euler's and DDIM's
    /// `set_timesteps` spread them (before Euler keeps them as float32 and DDIM rounds them).
    pub fn spread(self, train: usize, steps: usize) -> Vec<f64> {
        match self {
            Self::Linspace => linspace(0.0, (train - 1) as f64, steps)
                .into_iter()
                .rev()
                .collect(),
            Self::Leading(offset) => {
                let ratio = (train / steps) as f64;
                (0..steps)
                    .rev()
                    .map(|i| (i as f64 * ratio).round_ties_even() + offset as f64)
                    .collect()
            }
            Self::Trailing => arange_down(train as f64, train as f64 / steps as f64)
                .into_iter()
                .map(|t| t.round_ties_even() - 1.0)
                .collect(),
        }
    }
}

/// `alphas_cumprod` of the training schedule, float32 as torch computes it.
pub fn alphas_cumprod(c: &DiscreteSchedulerConfig) -> Result<Vec<f32>> {
    let n = c.num_train_timesteps.unwrap_or(1000);
    if !(2..=100_000).contains(&n) {
        return Err(ModelError::config(
            "num_train_timesteps",
            format!("must be between 2 and 100000, got {n}"),
        ));
    }
    let (start, end) = (c.beta_start.unwrap_or(1e-4), c.beta_end.unwrap_or(0.02));
    if !(start > 0.0 && end < 1.0 && start <= end) {
        return Err(ModelError::config(
            "beta_start",
            format!("betas must satisfy 0 < beta_start <= beta_end < 1, got {start}, {end}"),
        ));
    }
    let betas = match c.beta_schedule.as_deref().unwrap_or("linear") {
        "linear" => Tensor::f_linspace(start, end, n, (Kind::Float, tch::Device::Cpu))?,
        "scaled_linear" => {
            Tensor::f_linspace(start.sqrt(), end.sqrt(), n, (Kind::Float, tch::Device::Cpu))?
                .f_square()?
        }
        other => {
            return Err(ModelError::config(
                "beta_schedule",
                format!("{other} is not supported (linear, scaled_linear)"),
            ))
        }
    };
    let alphas_cumprod = betas
        .f_neg()?
        .f_add_scalar(1.0)?
        .f_cumprod(0, Kind::Float)?;
    Ok(Vec::<f32>::try_from(&alphas_cumprod)?)
}

/// `((1 - acp) / acp) ** 0.5` per training timestep, float32.
pub fn train_sigmas(alphas_cumprod: &[f32]) -> Vec<f32> {
    alphas_cumprod
        .iter()
        .map(|&a| ((1.0 - a) / a).sqrt())
        .collect()
}

/// numpy's `arange(start, 0, -step)` for a positive `step` (float64).
pub fn arange_down(start: f64, step: f64) -> Vec<f64> {
    let count = (start / step).ceil().max(0.0) as usize;
    (0..count).map(|i| start + i as f64 * -step).collect()
}

/// numpy's `interp(x, arange(len(fp)), fp)` (float64).
pub fn interp(x: f64, fp: &[f32]) -> f64 {
    let last = fp.len() - 1;
    if x <= 0.0 {
        return f64::from(fp[0]);
    }
    if x >= last as f64 {
        return f64::from(fp[last]);
    }
    let i = x.floor() as usize;
    let (lo, hi) = (f64::from(fp[i]), f64::from(fp[i + 1]));
    let w = x - i as f64;
    lo + (hi - lo) * w
}

/// Karras et al.'s sigmas between `max` and `min` (rho 7), float64 as numpy computes them.
pub fn karras(min: f64, max: f64, steps: usize) -> Vec<f64> {
    let rho = 7.0;
    let (min_inv, max_inv) = (min.powf(1.0 / rho), max.powf(1.0 / rho));
    linspace(0.0, 1.0, steps)
        .into_iter()
        .map(|r| (max_inv + r * (min_inv - max_inv)).powf(rho))
        .collect()
}

/// diffusers' `_sigma_to_t`: the fractional training timestep of `sigma`, interpolating in
/// log sigma between the two training timesteps around it (`log_sigmas` ascending).
pub fn sigma_to_t(sigma: f64, log_sigmas: &[f32]) -> f64 {
    let log_sigma = sigma.max(1e-10).ln();
    let n = log_sigmas.len();
    // The last index whose log sigma is at most `log_sigma` (0 if none), at most n - 2.
    let low = log_sigmas
        .iter()
        .rposition(|&l| log_sigma - f64::from(l) >= 0.0)
        .unwrap_or(0)
        .min(n - 2);
    let (lo, hi) = (f64::from(log_sigmas[low]), f64::from(log_sigmas[low + 1]));
    let w = ((lo - log_sigma) / (lo - hi)).clamp(0.0, 1.0);
    (1.0 - w) * low as f64 + w * (low + 1) as f64
}

/// The float32 natural log of each sigma (numpy's `np.log` of a float32 array).
pub fn log_f32(sigmas: &[f32]) -> Vec<f32> {
    sigmas.iter().map(|&s| f64::from(s).ln() as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numpy_helpers() {
        assert_eq!(linspace(0.0, 999.0, 4), vec![0.0, 333.0, 666.0, 999.0]);
        assert_eq!(
            arange_down(1000.0, 250.0),
            vec![1000.0, 750.0, 500.0, 250.0]
        );
        assert_eq!(arange_down(1000.0, 1000.0 / 3.0).len(), 3);
        assert_eq!(interp(1.5, &[0.0, 2.0, 4.0]), 3.0);
        assert_eq!(interp(7.0, &[0.0, 2.0, 4.0]), 4.0);
        let logs = log_f32(&[1.0, 2.0, 4.0]);
        assert!((sigma_to_t(2.0f64.sqrt(), &logs) - 0.5).abs() < 1e-6);
        assert_eq!(sigma_to_t(100.0, &logs), 2.0);
        assert_eq!(sigma_to_t(0.1, &logs), 0.0);
    }
}
