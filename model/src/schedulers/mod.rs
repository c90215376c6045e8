//! The discrete-time (DDPM-family) schedulers SD1.x/SD2.x and SDXL checkpoints ship with or
//! people pick for them (issue 48), as diffusers 0.42.1 computes them: `EulerDiscreteScheduler`,
//! `EulerAncestralDiscreteScheduler`, `DPMSolverMultistepScheduler` (DPM++ 2M, optionally with
//! Karras sigmas) and `DDIMScheduler`, each from a `scheduler_config.json`, with epsilon and
//! v-prediction.
//!
//! [`DiscreteScheduler::set_timesteps`] gives a [`DiscreteSchedule`]: the timesteps the UNet is
//! called with, the sigmas where the method has them, the initial noise scale, and the
//! stepping state (DPM++'s previous model output). The tables are computed as diffusers does,
//! in the same precision at each stage (torch float32 for the betas and their cumulative
//! product, numpy float64 for interpolation and Karras sigmas), so timesteps and sigmas match
//! diffusers' to the last bit or nearly.
mod ddim;
mod dpm;
mod euler;
mod tables;

/// The training schedule's cumulative alphas (its betas as the config gives them).
pub use tables::alphas_cumprod;

use crate::error::{ModelError, Result};
use serde::Deserialize;
use std::path::Path;
use tch::Tensor;

/// The union of the four schedulers' `scheduler_config.json` fields this code reads (unset
/// fields take the scheduler's own default).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct DiscreteSchedulerConfig {
    #[serde(rename = "_class_name")]
    pub class_name: Option<String>,
    pub num_train_timesteps: Option<i64>,
    pub beta_start: Option<f64>,
    pub beta_end: Option<f64>,
    pub beta_schedule: Option<String>,
    pub trained_betas: Option<serde_json::Value>,
    pub prediction_type: Option<String>,
    pub timestep_spacing: Option<String>,
    pub steps_offset: Option<i64>,
    pub rescale_betas_zero_snr: Option<bool>,
    pub interpolation_type: Option<String>,
    pub use_karras_sigmas: Option<bool>,
    pub use_exponential_sigmas: Option<bool>,
    pub use_beta_sigmas: Option<bool>,
    pub use_lu_lambdas: Option<bool>,
    pub use_flow_sigmas: Option<bool>,
    pub sigma_min: Option<f64>,
    pub sigma_max: Option<f64>,
    pub timestep_type: Option<String>,
    pub final_sigmas_type: Option<String>,
    pub solver_order: Option<i64>,
    pub algorithm_type: Option<String>,
    pub solver_type: Option<String>,
    pub lower_order_final: Option<bool>,
    pub euler_at_final: Option<bool>,
    pub thresholding: Option<bool>,
    pub clip_sample: Option<bool>,
    pub clip_sample_range: Option<f64>,
    pub set_alpha_to_one: Option<bool>,
    pub lambda_min_clipped: Option<f64>,
    pub variance_type: Option<String>,
}

impl DiscreteSchedulerConfig {
    /// Read a `scheduler_config.json`. Python's `json` writes infinities as bare
    /// `-Infinity` (DPM-Solver's `lambda_min_clipped`), which JSON has no word for: they are
    /// read as unset.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&without_non_finite(&text)).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// `text` with the bare `-Infinity`, `Infinity` and `NaN` outside strings replaced by `null`.
fn without_non_finite(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if !in_string {
            if let Some(word) = ["-Infinity", "Infinity", "NaN"]
                .into_iter()
                .find(|w| rest.starts_with(w))
            {
                out.push_str("null");
                rest = &rest[word.len()..];
                continue;
            }
        }
        match (in_string, escaped, c) {
            (true, false, '\\') => escaped = true,
            (true, false, '"') | (false, _, '"') => in_string = !in_string,
            _ => escaped = false,
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// Which method a scheduler steps with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Euler,
    EulerAncestral,
    DpmSolverMultistep,
    Ddim,
}

impl Method {
    /// diffusers' class name.
    pub fn class_name(self) -> &'static str {
        match self {
            Self::Euler => "EulerDiscreteScheduler",
            Self::EulerAncestral => "EulerAncestralDiscreteScheduler",
            Self::DpmSolverMultistep => "DPMSolverMultistepScheduler",
            Self::Ddim => "DDIMScheduler",
        }
    }

    fn of_class(name: &str) -> Option<Self> {
        [
            Self::Euler,
            Self::EulerAncestral,
            Self::DpmSolverMultistep,
            Self::Ddim,
        ]
        .into_iter()
        .find(|m| m.class_name() == name)
    }
}

/// What the model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prediction {
    Epsilon,
    VPrediction,
}

/// A scheduler: its method, its settings with the method's defaults filled in, and the
/// training-time tables.
#[derive(Debug, Clone)]
pub struct DiscreteScheduler {
    pub method: Method,
    pub config: DiscreteSchedulerConfig,
    prediction: Prediction,
    spacing: tables::Spacing,
    /// `alphas_cumprod` of the training schedule (float32, as torch computes it).
    alphas_cumprod: Vec<f32>,
}

/// The names `--scheduler` takes (and the sampler names people know them by).
pub const NAMES: &[&str] = &["euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "ddim"];

impl DiscreteScheduler {
    /// From a `scheduler_config.json` (its `_class_name` picks the method).
    pub fn from_config_file(path: &Path) -> Result<Self> {
        Self::from_config(DiscreteSchedulerConfig::from_file(path)?)
    }

    /// From a scheduler config (its `_class_name` picks the method).
    pub fn from_config(config: DiscreteSchedulerConfig) -> Result<Self> {
        let class = config.class_name.clone().unwrap_or_default();
        let method = Method::of_class(&class).ok_or_else(|| {
            ModelError::config(
                "_class_name",
                format!(
                    "{class:?} is not a discrete scheduler diffmesh runs (EulerDiscreteScheduler, \
                     EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler, DDIMScheduler)"
                ),
            )
        })?;
        Self::new(method, config)
    }

    /// The scheduler `name` ([`NAMES`]) on the training schedule of `base` (a checkpoint's own
    /// scheduler config: betas, prediction type, offset), as pipelines swap schedulers with
    /// `Scheduler.from_config(pipe.scheduler.config)`.
    pub fn named(name: &str, base: &DiscreteSchedulerConfig) -> Result<Self> {
        let mut config = base.clone();
        let method = match name {
            "euler" => Method::Euler,
            "euler_a" => Method::EulerAncestral,
            "dpmpp_2m" | "dpmpp_2m_karras" => {
                config.use_karras_sigmas = Some(name == "dpmpp_2m_karras");
                config.algorithm_type = Some("dpmsolver++".into());
                config.solver_order = Some(2);
                Method::DpmSolverMultistep
            }
            "ddim" => Method::Ddim,
            other => {
                return Err(ModelError::input(
                    "scheduler",
                    format!("unknown scheduler {other:?} (one of {})", NAMES.join(", ")),
                ))
            }
        };
        if method != Method::Euler && method != Method::DpmSolverMultistep {
            config.use_karras_sigmas = None;
        }
        config.class_name = Some(method.class_name().into());
        Self::new(method, config)
    }

    pub fn new(method: Method, config: DiscreteSchedulerConfig) -> Result<Self> {
        tables::refuse_unsupported(method, &config)?;
        let prediction = match config.prediction_type.as_deref().unwrap_or("epsilon") {
            "epsilon" => Prediction::Epsilon,
            "v_prediction" => Prediction::VPrediction,
            other => {
                return Err(ModelError::config(
                    "prediction_type",
                    format!("{other} is not supported (epsilon, v_prediction)"),
                ))
            }
        };
        let spacing = tables::Spacing::of(method, &config)?;
        let alphas_cumprod = tables::alphas_cumprod(&config)?;
        Ok(Self {
            method,
            config,
            prediction,
            spacing,
            alphas_cumprod,
        })
    }

    /// The schedule of `steps` denoising steps.
    pub fn set_timesteps(&self, steps: usize) -> Result<DiscreteSchedule> {
        let train = self.alphas_cumprod.len();
        if steps == 0 || steps > train {
            return Err(ModelError::input(
                "num_inference_steps",
                format!("must be between 1 and {train}, got {steps}"),
            ));
        }
        match self.method {
            Method::Euler | Method::EulerAncestral => euler::schedule(self, steps),
            Method::DpmSolverMultistep => dpm::schedule(self, steps),
            Method::Ddim => ddim::schedule(self, steps),
        }
    }
}

/// A scheduler set to a number of steps, with its stepping state.
#[derive(Debug)]
pub struct DiscreteSchedule {
    /// What the UNet is called with at each step.
    pub timesteps: Vec<f64>,
    /// One more than the steps (the last is where the final step lands); empty for DDIM.
    pub sigmas: Vec<f32>,
    /// The standard deviation of the initial noise.
    pub init_noise_sigma: f64,
    prediction: Prediction,
    state: State,
}

/// A schedule's stepping state as it was ([`DiscreteSchedule::checkpoint`]), so a batch whose
/// step failed part-way can be put back and retried without stepping anything twice.
#[derive(Debug)]
pub struct ScheduleCheckpoint(Option<(Option<Tensor>, i64)>);

#[derive(Debug)]
enum State {
    Euler { ancestral: bool },
    Dpm(dpm::Dpm),
    Ddim(ddim::Ddim),
}

impl DiscreteSchedule {
    /// Its stepping state now (tensors shared, not copied).
    pub fn checkpoint(&self) -> ScheduleCheckpoint {
        ScheduleCheckpoint(match &self.state {
            State::Dpm(dpm) => Some(dpm.checkpoint()),
            _ => None,
        })
    }

    /// Back to `checkpoint` (taken from this schedule).
    pub fn restore(&mut self, checkpoint: ScheduleCheckpoint) {
        if let (State::Dpm(dpm), Some(saved)) = (&mut self.state, checkpoint.0) {
            dpm.restore(saved);
        }
    }

    pub fn len(&self) -> usize {
        self.timesteps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.timesteps.is_empty()
    }

    /// Whether [`DiscreteSchedule::step`] draws noise (needs it given).
    pub fn needs_noise(&self) -> bool {
        matches!(self.state, State::Euler { ancestral: true })
    }

    /// The UNet's input at step `index`: `sample / sqrt(sigma^2 + 1)` for the Euler methods,
    /// unchanged for the others.
    pub fn scale_model_input(&self, sample: &Tensor, index: usize) -> Result<Tensor> {
        match self.state {
            State::Euler { .. } => {
                let sigma = *self.sigmas.get(index).ok_or_else(|| out_of_range(index))?;
                Ok(sample.f_div_scalar(f64::from((sigma * sigma + 1.0).sqrt()))?)
            }
            _ => Ok(sample.shallow_clone()),
        }
    }

    /// `original` noised to the level of step `index` (diffusers' `add_noise` at
    /// `timesteps[index]`): `x0 + sigma * noise` for the Euler methods, `alpha x0 + sigma
    /// noise` in the variance-preserving form for DPM++ and DDIM.
    pub fn add_noise(&self, original: &Tensor, noise: &Tensor, index: usize) -> Result<Tensor> {
        let (a, s) = match &self.state {
            State::Euler { .. } => {
                let sigma = *self.sigmas.get(index).ok_or_else(|| out_of_range(index))?;
                (1.0, sigma)
            }
            State::Dpm(_) => {
                let sigma = *self.sigmas.get(index).ok_or_else(|| out_of_range(index))?;
                let alpha = 1.0 / (sigma * sigma + 1.0).sqrt();
                (alpha, sigma * alpha)
            }
            State::Ddim(ddim) => {
                let t = *self
                    .timesteps
                    .get(index)
                    .ok_or_else(|| out_of_range(index))?;
                let acp = ddim.alphas_cumprod_at(t as i64)?;
                (acp.sqrt(), (1.0 - acp).sqrt())
            }
        };
        Ok(original
            .f_mul_scalar(f64::from(a))?
            .f_add(&noise.f_mul_scalar(f64::from(s))?)?)
    }

    /// Step `index` (steps are taken in order) from `sample` with the model's output at it;
    /// `noise` (standard normal, the sample's shape) where [`DiscreteSchedule::needs_noise`].
    pub fn step(
        &mut self,
        index: usize,
        model_output: &Tensor,
        sample: &Tensor,
        noise: Option<&Tensor>,
    ) -> Result<Tensor> {
        if index >= self.len() {
            return Err(out_of_range(index));
        }
        if model_output.size() != sample.size() {
            return Err(ModelError::input(
                "model_output",
                format!(
                    "shape {:?} != sample {:?}",
                    model_output.size(),
                    sample.size()
                ),
            ));
        }
        let prediction = self.prediction;
        match &mut self.state {
            State::Euler { ancestral } => {
                let noise = match (*ancestral, noise) {
                    (true, None) => {
                        return Err(ModelError::input(
                            "noise",
                            "the ancestral Euler step needs noise",
                        ))
                    }
                    (true, Some(n)) => Some(n),
                    (false, _) => None,
                };
                euler::step(&self.sigmas, index, prediction, model_output, sample, noise)
            }
            State::Dpm(dpm) => dpm.step(&self.sigmas, index, prediction, model_output, sample),
            State::Ddim(ddim) => {
                ddim.step(&self.timesteps, index, prediction, model_output, sample)
            }
        }
    }
}

fn out_of_range(index: usize) -> ModelError {
    ModelError::input("step", format!("step {index} is past the schedule"))
}

/// The model's prediction of the clean sample, from `sigma` (the Euler/DPM parametrisation,
/// `x = x0 + sigma * eps` scaled by `1 / sqrt(sigma^2 + 1)` for v-prediction): diffusers'
/// `pred_original_sample`.
fn x0_from_sigma(
    prediction: Prediction,
    sigma: f32,
    model_output: &Tensor,
    sample: &Tensor,
) -> Result<Tensor> {
    Ok(match prediction {
        Prediction::Epsilon => sample.f_sub(&model_output.f_mul_scalar(f64::from(sigma))?)?,
        Prediction::VPrediction => {
            let s2 = sigma * sigma + 1.0;
            model_output
                .f_mul_scalar(f64::from(-sigma / s2.sqrt()))?
                .f_add(&sample.f_div_scalar(f64::from(s2))?)?
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn non_finite_numbers_read_as_null() {
        let text = r#"{"a": -Infinity, "b": "NaN -Infinity", "c": [Infinity, NaN], "d": "q\"NaN"}"#;
        let cleaned = super::without_non_finite(text);
        assert_eq!(
            cleaned,
            r#"{"a": null, "b": "NaN -Infinity", "c": [null, null], "d": "q\"NaN"}"#
        );
    }
}
