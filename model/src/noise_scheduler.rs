//! `FlowMatchEulerDiscreteScheduler`, mirroring diffusers 0.42.1 value for value.
//!
//! diffusers computes a schedule partly in numpy (float64 or float32, depending on whether the caller
//! passes custom sigmas) and partly in torch float32. To get bit-identical sigmas and timesteps, the
//! code below performs the same operations in the same precision and order: the shifting runs in
//! the precision numpy would use ([`Real`]), then everything is rounded to f32 as
//! `torch.from_numpy(..).to(float32)` does.
//!
//! A [`Schedule`] is a plain value (sigmas + timesteps), not a stateful scheduler: each request in a
//! continuously batched engine carries its own schedule (its `mu` depends on its image size) and its
//! own step index.
use crate::error::{read_json, ModelError, Result};
use serde::Deserialize;
use std::ops::{Add, Div, Mul, Sub};
use std::path::Path;
use tch::{Kind, Tensor};

/// Mirrors `scheduler_config.json` (unknown keys such as `_class_name` are ignored).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default)]
pub struct FlowMatchEulerDiscreteSchedulerConfig {
    pub num_train_timesteps: i64,
    pub shift: f64,
    pub use_dynamic_shifting: bool,
    pub base_shift: Option<f64>,
    pub max_shift: Option<f64>,
    pub base_image_seq_len: i64,
    pub max_image_seq_len: i64,
    pub invert_sigmas: bool,
    pub shift_terminal: Option<f64>,
    pub use_karras_sigmas: bool,
    pub use_exponential_sigmas: bool,
    pub use_beta_sigmas: bool,
    pub time_shift_type: String,
    pub stochastic_sampling: bool,
}

impl Default for FlowMatchEulerDiscreteSchedulerConfig {
    fn default() -> Self {
        Self {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            base_shift: Some(0.5),
            max_shift: Some(1.15),
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
            invert_sigmas: false,
            shift_terminal: None,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
            time_shift_type: "exponential".into(),
            stochastic_sampling: false,
        }
    }
}

/// The float type numpy computes a stage in: f64 for numpy's own linspace, f32 for custom sigmas
/// that diffusers casts with `.astype(np.float32)`. Python scalars mixed in are rounded to it first
/// (numpy's NEP 50 "weak scalar" rule).
trait Real:
    Copy + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Div<Output = Self>
{
    fn of(x: f64) -> Self;
    fn to_f32(self) -> f32;
}
impl Real for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn to_f32(self) -> f32 {
        self
    }
}
impl Real for f64 {
    fn of(x: f64) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
}

/// `np.linspace(start, stop, num)` in float64, operation for operation.
pub fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    if num == 0 {
        return Vec::new();
    }
    if num == 1 {
        return vec![start];
    }
    let div = (num - 1) as f64;
    let delta = stop - start;
    let step = delta / div;
    let mut y: Vec<f64> = (0..num)
        .map(|i| {
            if step == 0.0 {
                i as f64 / div * delta + start
            } else {
                i as f64 * step + start
            }
        })
        .collect();
    y[num - 1] = stop;
    y
}

/// The sigmas `FluxPipeline.__call__` passes to `set_timesteps`: `np.linspace(1.0, 1/n, n)`.
pub fn flux_sigmas(num_steps: usize) -> Vec<f64> {
    linspace(1.0, 1.0 / num_steps as f64, num_steps)
}

#[derive(Debug, Clone)]
pub struct FlowMatchEulerDiscreteScheduler {
    pub config: FlowMatchEulerDiscreteSchedulerConfig,
    /// `sigmas[0]` and `sigmas[-1]` of the training schedule built in diffusers' `__init__`.
    sigma_max: f64,
    sigma_min: f64,
}

impl FlowMatchEulerDiscreteScheduler {
    pub fn new(config: FlowMatchEulerDiscreteSchedulerConfig) -> Result<Self> {
        if config.num_train_timesteps < 1 {
            return Err(ModelError::config(
                "num_train_timesteps",
                "must be at least 1",
            ));
        }
        for (flag, name) in [
            (config.use_karras_sigmas, "use_karras_sigmas"),
            (config.use_exponential_sigmas, "use_exponential_sigmas"),
            (config.use_beta_sigmas, "use_beta_sigmas"),
            (config.stochastic_sampling, "stochastic_sampling"),
        ] {
            if flag {
                return Err(ModelError::config(
                    name,
                    "not supported by diffmesh (only the Euler flow-matching schedule is)",
                ));
            }
        }
        if config.time_shift_type != "exponential" && config.time_shift_type != "linear" {
            return Err(ModelError::config(
                "time_shift_type",
                "must be \"exponential\" or \"linear\"",
            ));
        }
        if !config.use_dynamic_shifting && (config.shift.is_nan() || config.shift <= 0.0) {
            return Err(ModelError::config("shift", "must be > 0"));
        }
        // __init__: timesteps = linspace(1, N, N, float32)[::-1]; sigmas = timesteps / N (float32 torch),
        // then the static shift when dynamic shifting is off. Only the two ends are ever used again.
        let n = config.num_train_timesteps;
        let nf = n as f32;
        let shifted = |s: f32| -> f32 {
            if config.use_dynamic_shifting {
                s
            } else {
                (config.shift as f32 * s) / (1.0f32 + (config.shift - 1.0) as f32 * s)
            }
        };
        // timesteps[0] / N = N / N is exactly 1.0.
        let sigma_max = shifted(1.0) as f64;
        let sigma_min = shifted(1.0f32 / nf) as f64;
        Ok(Self {
            config,
            sigma_max,
            sigma_min,
        })
    }

    /// Load `scheduler_config.json` (or any file with the same keys).
    pub fn from_config_file(path: &Path) -> Result<Self> {
        Self::new(read_json(path)?)
    }

    /// `calculate_shift` of the Flux pipelines: `mu` grows linearly with the image token count.
    pub fn calculate_shift(&self, image_seq_len: i64) -> f64 {
        let c = &self.config;
        let (base_seq, max_seq) = (c.base_image_seq_len as f64, c.max_image_seq_len as f64);
        let (base_shift, max_shift) = (c.base_shift.unwrap_or(0.5), c.max_shift.unwrap_or(1.15));
        let m = (max_shift - base_shift) / (max_seq - base_seq);
        let b = base_shift - m * base_seq;
        image_seq_len as f64 * m + b
    }

    /// diffusers `set_timesteps(num_inference_steps=n, mu=mu)` without custom sigmas (numpy float64).
    pub fn set_timesteps(&self, num_inference_steps: usize, mu: Option<f64>) -> Result<Schedule> {
        if num_inference_steps == 0 {
            return Err(ModelError::input(
                "num_inference_steps",
                "must be at least 1",
            ));
        }
        let n = self.config.num_train_timesteps as f64;
        let timesteps = linspace(self.sigma_max * n, self.sigma_min * n, num_inference_steps);
        let sigmas: Vec<f64> = timesteps.iter().map(|t| t / n).collect();
        self.finish(self.shift_sigmas(sigmas, mu)?)
    }

    /// diffusers `set_timesteps(sigmas=sigmas, mu=mu)`: custom sigmas, cast to float32 first.
    pub fn set_sigmas(&self, sigmas: &[f64], mu: Option<f64>) -> Result<Schedule> {
        if sigmas.is_empty() {
            return Err(ModelError::input("sigmas", "must not be empty"));
        }
        let sigmas: Vec<f32> = sigmas.iter().map(|&s| s as f32).collect();
        self.finish(self.shift_sigmas(sigmas, mu)?)
    }

    /// The schedule `FluxPipeline` / `FluxInpaintPipeline` build for an image of `image_seq_len`
    /// packed tokens: `flux_sigmas(n)` with `mu = calculate_shift(image_seq_len)`.
    pub fn flux_schedule(&self, num_steps: usize, image_seq_len: i64) -> Result<Schedule> {
        if num_steps == 0 {
            return Err(ModelError::input(
                "num_inference_steps",
                "must be at least 1",
            ));
        }
        self.set_sigmas(
            &flux_sigmas(num_steps),
            Some(self.calculate_shift(image_seq_len)),
        )
    }

    /// Steps 2 and 3 of diffusers' `set_timesteps`: time shift and `shift_terminal` stretch.
    fn shift_sigmas<R: Real>(&self, sigmas: Vec<R>, mu: Option<f64>) -> Result<Vec<f32>> {
        let c = &self.config;
        let one = R::of(1.0);
        let mut sigmas: Vec<R> = if c.use_dynamic_shifting {
            let mu = mu.ok_or_else(|| {
                ModelError::input("mu", "required when use_dynamic_shifting is true")
            })?;
            // time_shift(mu, 1.0, t); `(1/t - 1) ** 1.0` is exact, so the power is omitted.
            let a = if c.time_shift_type == "linear" {
                R::of(mu)
            } else {
                R::of(mu.exp())
            };
            sigmas
                .into_iter()
                .map(|t| a / (a + (one / t - one)))
                .collect()
        } else {
            let (shift, shift_m1) = (R::of(c.shift), R::of(c.shift - 1.0));
            sigmas
                .into_iter()
                .map(|s| shift * s / (one + shift_m1 * s))
                .collect()
        };
        if let Some(terminal) = c.shift_terminal.filter(|&t| t != 0.0) {
            let last = *sigmas.last().expect("non-empty: checked by callers");
            let scale = (one - last) / R::of(1.0 - terminal);
            sigmas = sigmas
                .into_iter()
                .map(|s| one - (one - s) / scale)
                .collect();
        }
        Ok(sigmas.into_iter().map(Real::to_f32).collect())
    }

    /// Steps 5 and 6: timesteps from the float32 sigmas, then the terminal sigma.
    fn finish(&self, sigmas: Vec<f32>) -> Result<Schedule> {
        let n = self.config.num_train_timesteps as f32;
        let (mut sigmas, terminal) = if self.config.invert_sigmas {
            (
                sigmas.into_iter().map(|s| 1.0f32 - s).collect::<Vec<f32>>(),
                1.0f32,
            )
        } else {
            (sigmas, 0.0f32)
        };
        let timesteps = sigmas.iter().map(|s| s * n).collect();
        sigmas.push(terminal);
        Ok(Schedule { sigmas, timesteps })
    }
}

/// One request's denoising schedule: `timesteps.len() + 1 == sigmas.len()`, the last sigma being
/// the terminal 0 (1 with `invert_sigmas`). Timesteps are in diffusers units (0..1000).
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub sigmas: Vec<f32>,
    pub timesteps: Vec<f32>,
}

impl Schedule {
    /// Number of denoising steps.
    pub fn len(&self) -> usize {
        self.timesteps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.timesteps.is_empty()
    }

    /// First step index for img2img/inpainting `strength` (diffusers `get_timesteps`): denoising
    /// starts at `sigmas[start]`; strength 1 starts from pure noise.
    pub fn start_index(&self, strength: f64) -> Result<usize> {
        if !(strength > 0.0 && strength <= 1.0) {
            return Err(ModelError::input("strength", "must be in (0, 1]"));
        }
        let n = self.len() as f64;
        let init = (n * strength).min(n);
        let start = (n - init).max(0.0) as usize;
        if start >= self.len() {
            return Err(ModelError::input(
                "strength",
                "too small: no denoising step would run",
            ));
        }
        Ok(start)
    }

    fn sigma(&self, index: usize, field: &str) -> Result<f32> {
        self.sigmas.get(index).copied().ok_or_else(|| {
            ModelError::input(
                field,
                format!(
                    "step index {index} out of range for {} sigmas",
                    self.sigmas.len()
                ),
            )
        })
    }

    /// Euler step from `sigmas[index]` to `sigmas[index + 1]`: `sample + dt * model_output`,
    /// computed in f32 and cast back to the model output's dtype, as diffusers does.
    pub fn step(&self, index: usize, model_output: &Tensor, sample: &Tensor) -> Result<Tensor> {
        euler_step(model_output, sample, &Tensor::from(self.dt(index)?))
    }

    /// `sigmas[index + 1] - sigmas[index]` in f32, the Euler step size of step `index`. Engines
    /// batching requests at different steps stack these into a `[B, 1, 1]` tensor for [`euler_step`].
    pub fn dt(&self, index: usize) -> Result<f32> {
        if index >= self.len() {
            return Err(ModelError::input(
                "step_index",
                format!("{index} out of range for {} steps", self.len()),
            ));
        }
        Ok(self.sigmas[index + 1] - self.sigmas[index])
    }

    /// Flow-matching forward process at `sigmas[index]`: `sigma * noise + (1 - sigma) * sample`.
    pub fn scale_noise(&self, sample: &Tensor, index: usize, noise: &Tensor) -> Result<Tensor> {
        let sigma = self.sigma(index, "step_index")?;
        scale_noise_with_sigmas(sample, &[sigma], noise)
    }
}

/// `sample.float() + dt * model_output`, cast to `model_output`'s dtype. `dt` is a 0-dim tensor or
/// one value per batch row (`[B, 1, ...]`), so requests at different steps share one call.
pub fn euler_step(model_output: &Tensor, sample: &Tensor, dt: &Tensor) -> Result<Tensor> {
    let sample = sample.f_to_kind(Kind::Float)?;
    let dt = dt
        .f_to_kind(Kind::Float)?
        .f_to_device(model_output.device())?;
    let prev = sample.f_add(&dt.f_mul(model_output)?)?;
    Ok(prev.f_to_kind(model_output.kind())?)
}

/// `scale_noise` with explicit sigmas: one for the whole batch, or one per batch row.
pub fn scale_noise_with_sigmas(sample: &Tensor, sigmas: &[f32], noise: &Tensor) -> Result<Tensor> {
    if sample.size() != noise.size() {
        return Err(ModelError::input(
            "noise",
            format!(
                "shape {:?} != sample shape {:?}",
                noise.size(),
                sample.size()
            ),
        ));
    }
    let dims = sample.dim();
    if dims == 0 {
        return Err(ModelError::input("sample", "must have a batch dimension"));
    }
    let batch = sample.size()[0];
    if sigmas.len() != 1 && sigmas.len() as i64 != batch {
        return Err(ModelError::input(
            "sigmas",
            format!("{} values for batch {batch}", sigmas.len()),
        ));
    }
    let mut shape = vec![sigmas.len() as i64];
    shape.extend(std::iter::repeat_n(1, dims - 1));
    let one_minus: Vec<f32> = sigmas.iter().map(|s| 1.0f32 - s).collect();
    let to = |v: &[f32]| -> Result<Tensor> {
        Ok(Tensor::from_slice(v)
            .f_view(shape.as_slice())?
            .f_to_kind(sample.kind())?
            .f_to_device(sample.device())?)
    };
    let (sigma, one_minus) = (to(sigmas)?, to(&one_minus)?);
    Ok(sigma.f_mul(noise)?.f_add(&one_minus.f_mul(sample)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linspace_matches_numpy_shape_rules() {
        assert_eq!(linspace(1.0, 0.25, 4), vec![1.0, 0.75, 0.5, 0.25]);
        assert_eq!(linspace(2.0, 5.0, 1), vec![2.0]);
        assert_eq!(linspace(3.0, 3.0, 3), vec![3.0, 3.0, 3.0]);
    }

    #[test]
    fn schedule_ends_with_terminal_sigma() {
        let s = FlowMatchEulerDiscreteScheduler::new(Default::default()).unwrap();
        let sch = s.set_timesteps(4, None).unwrap();
        assert_eq!(sch.sigmas.len(), 5);
        assert_eq!(*sch.sigmas.last().unwrap(), 0.0);
        assert_eq!(sch.sigmas[0], 1.0);
        assert_eq!(sch.timesteps[0], 1000.0);
    }

    #[test]
    fn dynamic_shifting_needs_mu() {
        let cfg = FlowMatchEulerDiscreteSchedulerConfig {
            use_dynamic_shifting: true,
            ..Default::default()
        };
        let s = FlowMatchEulerDiscreteScheduler::new(cfg).unwrap();
        assert!(matches!(
            s.set_timesteps(4, None),
            Err(ModelError::Input { .. })
        ));
        assert!(s.set_timesteps(4, Some(0.8)).is_ok());
    }

    #[test]
    fn unsupported_options_are_rejected() {
        let cfg = FlowMatchEulerDiscreteSchedulerConfig {
            use_karras_sigmas: true,
            ..Default::default()
        };
        let err = FlowMatchEulerDiscreteScheduler::new(cfg).unwrap_err();
        assert!(err.to_string().contains("use_karras_sigmas"));
    }

    #[test]
    fn strength_start_index() {
        let s = FlowMatchEulerDiscreteScheduler::new(Default::default()).unwrap();
        let sch = s.set_timesteps(10, None).unwrap();
        assert_eq!(sch.start_index(1.0).unwrap(), 0);
        assert_eq!(sch.start_index(0.6).unwrap(), 4);
        assert_eq!(sch.start_index(0.01).unwrap(), 9);
        assert!(sch.start_index(1e-300).is_err());
        assert!(sch.start_index(0.0).is_err());
    }

    #[test]
    fn step_and_scale_noise_reach_the_ends() {
        let s = FlowMatchEulerDiscreteScheduler::new(Default::default()).unwrap();
        let sch = s.set_timesteps(1, None).unwrap();
        let x0 = Tensor::from_slice(&[0.5f32, -1.0]).view([1, 2]);
        let noise = Tensor::from_slice(&[2.0f32, 3.0]).view([1, 2]);
        let xt = sch.scale_noise(&x0, 0, &noise).unwrap();
        assert_eq!(Vec::<f32>::try_from(xt.view([-1])).unwrap(), vec![2.0, 3.0]);
        // With the exact velocity (noise - x0), one Euler step from sigma 1 to 0 lands on x0.
        let v = &noise - &x0;
        let out = sch.step(0, &v, &xt).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(out.view([-1])).unwrap(),
            vec![0.5, -1.0]
        );
        assert!(sch.step(1, &v, &xt).is_err());
    }

    #[test]
    fn per_row_step_equals_separate_steps() {
        let cfg = FlowMatchEulerDiscreteSchedulerConfig {
            shift: 3.0,
            ..Default::default()
        };
        let sch = FlowMatchEulerDiscreteScheduler::new(cfg)
            .unwrap()
            .set_timesteps(5, None)
            .unwrap();
        let x = Tensor::randn([2, 3, 4], (Kind::Float, tch::Device::Cpu));
        let v = Tensor::randn([2, 3, 4], (Kind::Float, tch::Device::Cpu));
        let dts = Tensor::from_slice(&[sch.dt(1).unwrap(), sch.dt(3).unwrap()]).view([2, 1, 1]);
        let both = euler_step(&v, &x, &dts).unwrap();
        assert_eq!(both.get(0), sch.step(1, &v.get(0), &x.get(0)).unwrap());
        assert_eq!(both.get(1), sch.step(3, &v.get(1), &x.get(1)).unwrap());
        let sigmas = [sch.sigmas[2], sch.sigmas[4]];
        let noised = scale_noise_with_sigmas(&x, &sigmas, &v).unwrap();
        assert_eq!(
            noised.get(1),
            sch.scale_noise(&x.get(1).unsqueeze(0), 4, &v.get(1).unsqueeze(0))
                .unwrap()
                .get(0)
        );
    }
}
