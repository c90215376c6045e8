//! Flux pipelines as plain functions over borrowed components, following diffusers'
//! `FluxPipeline` / `FluxInpaintPipeline` (0.42.1): 2x2-packed latents, `latent_image_ids`,
//! resolution-dependent `mu`, the embedded `guidance` input of guidance-distilled models, optional
//! true CFG with a negative prompt, Euler steps.
//!
//! Differences from diffusers, on purpose: initial noise comes from [`noise`] (per-request seeds,
//! so batching never changes a request's result); image sizes must be multiples of
//! `2 * downscale_factor` instead of being silently floored; inpainting masks at token level (see
//! [`inpaint`]) and uses the posterior mean for template latents.
pub mod cli;
pub mod conditioning_cache;
pub mod control;
pub mod fill;
pub mod inpaint;
pub mod noise;
pub mod stepper;
pub mod template;

pub use inpaint::{inpaint, InpaintInputs, InpaintOutput};

use crate::components::{LatentCodec, TextEmbeddings, TextEncoder};
use crate::error::{ModelError, Result};
use crate::flux::{FluxInputs, FluxTransformer};
use crate::noise_scheduler::{FlowMatchEulerDiscreteScheduler, Schedule};
use crate::packing::{latent_image_ids, pack_latents, unpack_latents};
use tch::{Device, Kind, Tensor};

/// The components one pipeline run borrows.
#[derive(Clone, Copy)]
pub struct FluxPipeline<'a> {
    pub transformer: &'a FluxTransformer,
    pub text_encoder: &'a dyn TextEncoder,
    pub codec: &'a dyn LatentCodec,
    pub scheduler: &'a FlowMatchEulerDiscreteScheduler,
}

/// One request of a batch: its prompt and the seed of its initial noise.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub prompt: String,
    pub seed: u64,
}

/// Settings shared by every request of a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    pub height: i64,
    pub width: i64,
    pub steps: usize,
    /// Embedded guidance of guidance-distilled models (`guidance_embeds`); ignored otherwise.
    pub guidance_scale: f64,
    /// True classifier-free guidance, used when `negative_prompt` is set and this is > 1.
    pub true_cfg_scale: f64,
    pub negative_prompt: Option<String>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            height: 512,
            width: 512,
            steps: 28,
            guidance_scale: 3.5,
            true_cfg_scale: 1.0,
            negative_prompt: None,
        }
    }
}

/// What an observer sees after every denoising step (after the inpainting blend).
#[derive(Debug)]
pub struct StepEvent<'a> {
    /// Index into the schedule of the step just taken (`sigmas[index] -> sigmas[index + 1]`).
    pub index: usize,
    pub schedule: &'a Schedule,
    /// Packed latents `[B, N, 4C]`.
    pub latents: &'a Tensor,
}

/// Called after every step; an error aborts the run (e.g. a cancelled job).
pub type Observer<'o> = Option<&'o mut dyn FnMut(&StepEvent<'_>) -> Result<()>>;

/// Output of [`text_to_image`].
#[derive(Debug)]
pub struct GenerateOutput {
    /// Decoded images `[B, 3, H, W]`, unclamped (nominally [-1, 1]).
    pub images: Tensor,
    /// Final packed latents `[B, N, 4C]`.
    pub latents: Tensor,
}

/// Per-run state shared by the step loop: conditioning, ids and the schedule.
pub(crate) struct Prepared {
    pub device: Device,
    pub kind: Kind,
    pub batch: i64,
    pub latent_h: i64,
    pub latent_w: i64,
    pub schedule: Schedule,
    text: TextEmbeddings,
    negative: Option<TextEmbeddings>,
    true_cfg_scale: f64,
    img_ids: Tensor,
    txt_ids: Tensor,
    guidance: Option<Tensor>,
}

fn embed(
    p: &FluxPipeline<'_>,
    prompts: &[String],
    device: Device,
    kind: Kind,
) -> Result<TextEmbeddings> {
    let e = p.text_encoder.encode(prompts)?;
    Ok(TextEmbeddings {
        hidden: e.hidden.f_to_device(device)?.f_to_kind(kind)?,
        pooled: e.pooled.f_to_device(device)?.f_to_kind(kind)?,
    })
}

impl Prepared {
    pub(crate) fn new(
        p: &FluxPipeline<'_>,
        requests: &[GenerationRequest],
        opts: &GenerateOptions,
    ) -> Result<Self> {
        Self::with_text(p, requests, opts, None)
    }

    /// As [`Prepared::new`], with the requests' prompt embeddings given (`None`: encode them).
    pub(crate) fn with_text(
        p: &FluxPipeline<'_>,
        requests: &[GenerationRequest],
        opts: &GenerateOptions,
        text: Option<TextEmbeddings>,
    ) -> Result<Self> {
        Self::with_conditioning(p, requests, opts, text, 0)
    }

    /// As [`Prepared::with_text`] for a transformer that takes `extra_channels` of conditioning
    /// per token after the latents (FLUX.1-Fill's masked image and mask).
    pub(crate) fn with_conditioning(
        p: &FluxPipeline<'_>,
        requests: &[GenerationRequest],
        opts: &GenerateOptions,
        text: Option<TextEmbeddings>,
        extra_channels: i64,
    ) -> Result<Self> {
        if requests.is_empty() {
            return Err(ModelError::input(
                "requests",
                "at least one request is required",
            ));
        }
        let unit = 2 * p.codec.downscale_factor();
        for (field, v) in [("height", opts.height), ("width", opts.width)] {
            if v <= 0 || v % unit != 0 {
                return Err(ModelError::input(
                    field,
                    format!("{v} must be a positive multiple of {unit}"),
                ));
            }
        }
        if opts.steps == 0 {
            return Err(ModelError::input("steps", "must be at least 1"));
        }
        if p.transformer.cfg.in_channels != 4 * p.codec.latent_channels() + extra_channels {
            return Err(ModelError::config(
                "transformer.in_channels",
                format!(
                    "must be 4 x the codec's latent channels + {extra_channels} of conditioning"
                ),
            ));
        }
        let (device, kind) = p.transformer.device_kind();
        let f = p.codec.downscale_factor();
        let (latent_h, latent_w) = (opts.height / f, opts.width / f);
        let (rows, cols) = (latent_h / 2, latent_w / 2);
        let schedule = p.scheduler.flux_schedule(opts.steps, rows * cols)?;
        let text = match text {
            Some(text) => text,
            None => {
                let prompts: Vec<String> = requests.iter().map(|r| r.prompt.clone()).collect();
                embed(p, &prompts, device, kind)?
            }
        };
        let negative = match &opts.negative_prompt {
            Some(neg) if opts.true_cfg_scale > 1.0 => {
                Some(embed(p, &vec![neg.clone(); requests.len()], device, kind)?)
            }
            _ => None,
        };
        let batch = requests.len() as i64;
        let guidance = if p.transformer.cfg.guidance_embeds {
            Some(Tensor::f_full(
                [batch],
                opts.guidance_scale,
                (Kind::Float, device),
            )?)
        } else {
            None
        };
        let tokens = text.hidden.size().get(1).copied().unwrap_or(0);
        Ok(Self {
            device,
            kind,
            batch,
            latent_h,
            latent_w,
            schedule,
            text,
            negative,
            true_cfg_scale: opts.true_cfg_scale,
            img_ids: latent_image_ids(rows, cols, kind)?.f_to_device(device)?,
            txt_ids: Tensor::f_zeros([tokens, 3], (kind, device))?,
            guidance,
        })
    }

    /// The velocity at step `index` (with true CFG: one forward over `[cond; uncond]`).
    pub(crate) fn velocity(
        &self,
        transformer: &FluxTransformer,
        latents: &Tensor,
        index: usize,
    ) -> Result<Tensor> {
        let t = self.schedule.timesteps[index] as f64;
        let cfg_rows = if self.negative.is_some() { 2 } else { 1 };
        // diffusers: `t.expand(B).to(latents.dtype) / 1000`.
        let timestep = Tensor::f_full([self.batch * cfg_rows], t, (Kind::Float, self.device))?
            .f_to_kind(self.kind)?
            .f_div_scalar(1000.0)?;
        let (hidden_states, text, pooled, guidance) = match &self.negative {
            None => (
                latents.shallow_clone(),
                self.text.hidden.shallow_clone(),
                self.text.pooled.shallow_clone(),
                self.guidance.as_ref().map(Tensor::shallow_clone),
            ),
            Some(neg) => (
                Tensor::f_cat(&[latents, latents], 0)?,
                Tensor::f_cat(&[&self.text.hidden, &neg.hidden], 0)?,
                Tensor::f_cat(&[&self.text.pooled, &neg.pooled], 0)?,
                self.guidance
                    .as_ref()
                    .map(|g| Tensor::f_cat(&[g, g], 0))
                    .transpose()?,
            ),
        };
        let v = transformer.forward(&FluxInputs {
            hidden_states,
            encoder_hidden_states: text,
            pooled_projections: pooled,
            timestep,
            img_ids: self.img_ids.shallow_clone(),
            txt_ids: self.txt_ids.shallow_clone(),
            guidance,
        })?;
        if self.negative.is_none() {
            return Ok(v);
        }
        let parts = v.f_chunk(2, 0)?;
        guide(&parts[0], &parts[1], self.true_cfg_scale)
    }

    /// The requests' seeded noise, or `given` packed latents checked against the run's shape.
    pub(crate) fn initial_latents(
        &self,
        requests: &[GenerationRequest],
        channels: i64,
        given: Option<&Tensor>,
    ) -> Result<Tensor> {
        let Some(given) = given else {
            let seeds: Vec<u64> = requests.iter().map(|r| r.seed).collect();
            return self.noise(&seeds, channels);
        };
        let want = [
            self.batch,
            (self.latent_h / 2) * (self.latent_w / 2),
            4 * channels,
        ];
        if given.size() != want {
            return Err(ModelError::input(
                "latents",
                format!("expected packed latents {want:?}, got {:?}", given.size()),
            ));
        }
        Ok(given.f_to_device(self.device)?.f_to_kind(self.kind)?)
    }

    /// Packed per-request noise `[B, N, 4C]` for `seeds`.
    pub(crate) fn noise(&self, seeds: &[u64], channels: i64) -> Result<Tensor> {
        let n = noise::batch_noise(
            seeds,
            &[channels, self.latent_h, self.latent_w],
            self.device,
            self.kind,
        )?;
        pack_latents(&n)
    }

    /// Every Euler step of the schedule from `latents`, then the decoded images. `conditioning`
    /// (FLUX.1-Fill's) follows each token's latents into the transformer.
    pub(crate) fn denoise_and_decode(
        &self,
        p: &FluxPipeline<'_>,
        mut latents: Tensor,
        conditioning: Option<&Tensor>,
        mut observer: Observer<'_>,
    ) -> Result<GenerateOutput> {
        for index in 0..self.schedule.len() {
            let v = match conditioning {
                Some(c) => {
                    let x = Tensor::f_cat(&[&latents, c], 2)?;
                    self.velocity(p.transformer, &x, index)?
                }
                None => self.velocity(p.transformer, &latents, index)?,
            };
            latents = self.schedule.step(index, &v, &latents)?;
            if let Some(obs) = observer.as_mut() {
                obs(&StepEvent {
                    index,
                    schedule: &self.schedule,
                    latents: &latents,
                })?;
            }
        }
        let images = self.decode(p.codec, &latents)?;
        Ok(GenerateOutput { images, latents })
    }

    pub(crate) fn decode(&self, codec: &dyn LatentCodec, latents: &Tensor) -> Result<Tensor> {
        codec.decode(&unpack_latents(latents, self.latent_h, self.latent_w)?)
    }
}

/// True classifier-free guidance: the velocity to step with from the prompt's (`cond`) and the
/// negative prompt's (`uncond`), diffusers' `uncond + scale * (cond - uncond)`.
pub(crate) fn guide(cond: &Tensor, uncond: &Tensor, scale: f64) -> Result<Tensor> {
    Ok(uncond.f_add(&cond.f_sub(uncond)?.f_mul_scalar(scale)?)?)
}

/// Text-to-image (`FluxPipeline.__call__`): every request starts from its own seeded noise and
/// takes `opts.steps` Euler steps on the resolution-shifted schedule.
pub fn text_to_image(
    p: &FluxPipeline<'_>,
    requests: &[GenerationRequest],
    opts: &GenerateOptions,
    observer: Observer<'_>,
) -> Result<GenerateOutput> {
    text_to_image_from(p, requests, opts, None, observer)
}

/// [`text_to_image`] from given packed initial latents `[B, N, 4C]` instead of the requests'
/// seeded noise (`FluxPipeline(..., latents=...)`); `None` draws them from the seeds.
pub fn text_to_image_from(
    p: &FluxPipeline<'_>,
    requests: &[GenerationRequest],
    opts: &GenerateOptions,
    initial: Option<&Tensor>,
    observer: Observer<'_>,
) -> Result<GenerateOutput> {
    tch::no_grad(|| {
        let prep = Prepared::new(p, requests, opts)?;
        let latents = prep.initial_latents(requests, p.codec.latent_channels(), initial)?;
        prep.denoise_and_decode(p, latents, None, observer)
    })
}
