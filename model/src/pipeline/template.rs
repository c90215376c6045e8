//! Template capture (FlashPS §3): run a template image through the whole schedule the way an edit
//! sees its unmasked tokens (the template noised to each step's sigma with the template's seed),
//! recording every image token's K/V of every block at every step. Edits of that template then
//! compute only their masked tokens and read these K/V for the rest ([`super::stepper::StepMode`]).
//!
//! The cache is exact for the unmasked tokens' *inputs* (same latents, same noise, same
//! timesteps); it approximates their K/V because in the full forward they would also attend to the
//! edit's masked tokens and prompt. That approximation is FlashPS's; the engine bench measures its
//! quality (SSIM/PSNR against full compute).
use super::stepper::{DenoiseState, EditSpec, StepRequest};
use super::FluxPipeline;
use crate::error::{ModelError, Result};
use crate::flux::{CapturedKv, KvCache, KvFormat, KvSink};
use tch::{Kind, Tensor};

/// What a template's cache depends on, besides the template pixels and the model.
#[derive(Debug)]
pub struct TemplateSpec {
    /// `[1, 3, H, W]` in [-1, 1].
    pub template: Tensor,
    /// Text the template's tokens attend to during capture (its caption; may be empty).
    pub prompt: String,
    /// Seed of the noise of the template's trajectory; edits reading the cache use it for their
    /// unmasked tokens ([`EditSpec::template_seed`]).
    pub seed: u64,
    pub steps: usize,
    pub guidance_scale: f64,
}

/// Receives the captured K/V of every (step, block), in order: step-major, blocks in order.
pub trait TemplateSink {
    fn put(&mut self, step: usize, block: usize, k: &Tensor, v: &Tensor) -> Result<()>;

    /// Key layout to capture.
    fn format(&self) -> KvFormat {
        KvFormat::Raw
    }
}

/// The denoising state of a template's capture pass: an edit of the template that repaints
/// nothing, so every token follows the template's noised trajectory. Step it with
/// [`DenoiseState::capture_step`] (engines interleave this with other work step by step).
pub fn capture_state(p: &FluxPipeline<'_>, spec: &TemplateSpec) -> Result<DenoiseState> {
    let size = spec.template.size();
    if size.len() != 4 || size[0] != 1 || size[1] != 3 {
        return Err(ModelError::input(
            "template",
            format!("expected [1, 3, H, W], got {size:?}"),
        ));
    }
    let factor = 2 * p.codec.downscale_factor();
    let (h, w) = (size[2], size[3]);
    if h % factor != 0 || w % factor != 0 {
        return Err(ModelError::input(
            "template",
            format!("height and width must be multiples of {factor}, got {h}x{w}"),
        ));
    }
    let tokens = (h / factor) * (w / factor);
    let request = StepRequest {
        true_cfg: None,
        cache_threshold: None,
        cache_method: Default::default(),
        control: None,
        prompt: spec.prompt.clone(),
        seed: spec.seed,
        height: h,
        width: w,
        steps: spec.steps,
        guidance_scale: spec.guidance_scale,
        edit: Some(EditSpec {
            template: spec.template.shallow_clone(),
            token_mask: Tensor::f_zeros([tokens], (Kind::Bool, spec.template.device()))?,
            strength: 1.0,
            template_seed: None,
        }),
    };
    DenoiseState::new(p, &request)
}

/// Capture a template's K/V at every step of its schedule; returns the number of steps.
pub fn capture_template(
    p: &FluxPipeline<'_>,
    spec: &TemplateSpec,
    sink: &mut dyn TemplateSink,
) -> Result<usize> {
    let mut state = capture_state(p, spec)?;
    let mut step = 0;
    while !state.is_done() {
        let mut at_step = StepSink { step, inner: sink };
        state.capture_step(p, &mut at_step)?;
        step += 1;
    }
    Ok(step)
}

/// Forwards one step's blocks to a [`TemplateSink`].
struct StepSink<'a> {
    step: usize,
    inner: &'a mut dyn TemplateSink,
}

impl KvSink for StepSink<'_> {
    fn put(&mut self, block: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.inner.put(self.step, block, k, v)
    }

    fn format(&self) -> KvFormat {
        self.inner.format()
    }
}

/// A whole template cache in memory, one [`CapturedKv`] per step (tests, benches, small models).
#[derive(Debug, Default)]
pub struct TemplateKv {
    pub steps: Vec<CapturedKv>,
    pub format: KvFormat,
}

impl TemplateKv {
    pub fn new(format: KvFormat) -> Self {
        Self {
            steps: Vec::new(),
            format,
        }
    }

    /// The cache of one step, for [`super::stepper::StepMode::Cached`].
    pub fn step(&self, step: usize) -> Result<&dyn KvCache> {
        self.steps
            .get(step)
            .map(|c| c as &dyn KvCache)
            .ok_or_else(|| {
                ModelError::input(
                    "cache",
                    format!(
                        "step {step} missing (cache holds {} steps)",
                        self.steps.len()
                    ),
                )
            })
    }
}

impl TemplateSink for TemplateKv {
    fn put(&mut self, step: usize, block: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        if step == self.steps.len() {
            self.steps.push(CapturedKv::new(self.format));
        }
        let Some(cache) = self.steps.get_mut(step) else {
            return Err(ModelError::input(
                "cache",
                format!(
                    "steps must arrive in order: got {step} after {}",
                    self.steps.len()
                ),
            ));
        };
        cache.put(block, k, v)
    }

    fn format(&self) -> KvFormat {
        self.format
    }
}
