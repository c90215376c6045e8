//! The Stable Diffusion loop as per-request states an engine steps in batches (step-level
//! continuous batching, as `pipeline::stepper` does for Flux): [`SdPipeline::prepare`] encodes
//! the prompts and sets the schedule (an inpainting request's start, blend or extra channels),
//! [`SdPipeline::step_batch`] runs one UNet forward for the guided rows of many requests, each
//! at its own step and scheduler, and [`SdPipeline::decode`] runs the VAE. `generate` and
//! `inpaint` are this loop on one request, so a request stepped in a batch ends on what the
//! pipeline gives it alone.
use super::inputs::{InpaintInputs, TemplateSteps};
use super::{SdPipeline, SdRequest};
use crate::components::LatentCodec;
use crate::error::{ModelError, Result};
use crate::schedulers::DiscreteSchedule;
use crate::unet::masked::UNetTemplateCache;
use crate::unet::{UNetInputs, UNetResiduals};
use std::sync::Arc;
use tch::{Kind, Tensor};

/// What an inpainting request adds to the loop: a plain (4-channel) UNet's latent blending
/// outside the mask, or a 9-channel inpainting UNet's extra input channels.
pub(super) enum Extra {
    None,
    /// The image's latents, the latent mask (1: repaint) and the initial noise.
    Blend {
        image: Tensor,
        mask: Tensor,
        noise: Tensor,
    },
    /// The latent mask and the masked image's latents, after the scaled latents.
    Concat {
        mask: Tensor,
        masked: Tensor,
    },
}

/// `noise(i, step, shape)`: state `i` of a batch's noise for an ancestral step.
pub type BatchNoise<'a> = dyn FnMut(usize, usize, &[i64]) -> Result<Tensor> + 'a;

/// How a state's rows run the UNet's attention.
pub(super) enum Attention {
    /// In full.
    Full,
    /// In full, recording each step's cache ([`super::template`]).
    Capture(Vec<Option<UNetTemplateCache>>),
    /// Mask-aware: only the tokens under `mask` (`[h, w]` over the latents) computed, each row
    /// reading its row of the template's cache at the step.
    Edit {
        template: Arc<dyn TemplateSteps>,
        mask: Tensor,
    },
}

/// One request's place in the loop.
pub struct SdState {
    schedule: DiscreteSchedule,
    /// The step to run next.
    next: usize,
    /// The latents `[1, C, h, w]`, fp32.
    x: Tensor,
    /// The UNet's text inputs, one row per branch (negative then prompt when guided).
    embeds: Tensor,
    pooled: Option<Tensor>,
    time_ids: Option<Tensor>,
    /// The guidance scale where classifier-free guidance runs (above 1).
    guidance: Option<f64>,
    pub(super) extra: Extra,
    pub(super) attention: Attention,
    /// Per ControlNet steering it ([`super::control`]): its image repeated per row, and scale.
    pub(super) controls: Vec<(Tensor, f64)>,
}

impl SdState {
    /// Every step has run: [`SdPipeline::decode`] is next.
    pub fn done(&self) -> bool {
        self.next >= self.schedule.len()
    }

    /// The step to run next, of [`Self::steps`].
    pub fn next_step(&self) -> usize {
        self.next
    }

    pub fn steps(&self) -> usize {
        self.schedule.len()
    }

    /// The latents `[1, C, h, w]` as the last step left them.
    pub fn latents(&self) -> &Tensor {
        &self.x
    }

    /// UNet rows one step of it takes (2 when guided).
    pub fn rows(&self) -> i64 {
        self.embeds.size()[0]
    }

    /// The latents' side: states batch together only with the same side.
    pub fn latent_side(&self) -> [i64; 2] {
        let s = self.x.size();
        [s[2], s[3]]
    }

    /// Each row as many times as the state has branches.
    fn branches(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.f_repeat([self.rows(), 1, 1, 1])?)
    }

    pub(super) fn attention_is_full(&self) -> bool {
        matches!(self.attention, Attention::Full)
    }

    /// The UNet inputs of its rows for its next step, the sample being the scaled latents
    /// alone (an inpainting UNet's extra channels are added by the step).
    pub(super) fn unet_inputs(&self) -> Result<UNetInputs> {
        let t = self.schedule.timesteps[self.next] as f32;
        Ok(UNetInputs {
            sample: self
                .schedule
                .scale_model_input(&self.branches(&self.x)?, self.next)?,
            timestep: Tensor::from_slice(&vec![t; self.rows() as usize]),
            encoder_hidden_states: self.embeds.shallow_clone(),
            text_embeds: self.pooled.as_ref().map(Tensor::shallow_clone),
            time_ids: self.time_ids.as_ref().map(Tensor::shallow_clone),
        })
    }
    /// The latents after this step from the UNet's output `mine` for its rows (guidance
    /// applied, then the scheduler's step, then an inpainting blend); advances its scheduler's
    /// state but not the latents or the step index. `i`: its place in the batch, for `noise`.
    fn next_latents(
        &mut self,
        i: usize,
        mine: &Tensor,
        noise: &mut BatchNoise,
        device: tch::Device,
    ) -> Result<Tensor> {
        let prediction = match self.guidance {
            Some(scale) => {
                let (uncond, text) = (mine.f_narrow(0, 0, 1)?, mine.f_narrow(0, 1, 1)?);
                uncond.f_add(&text.f_sub(&uncond)?.f_mul_scalar(scale)?)?
            }
            None => mine.shallow_clone(),
        };
        let n = if self.schedule.needs_noise() {
            Some(noise(i, self.next, &self.x.size())?.f_to_device(device)?)
        } else {
            None
        };
        let step = self.next;
        let mut x = self.schedule.step(step, &prediction, &self.x, n.as_ref())?;
        if let Extra::Blend { image, mask, noise } = &self.extra {
            // Outside the mask, the image's latents noised to the next step's level.
            let proper = if step + 1 < self.schedule.len() {
                self.schedule.add_noise(image, noise, step + 1)?
            } else {
                image.shallow_clone()
            };
            let keep = mask.f_neg()?.f_add_scalar(1.0)?;
            x = keep.f_mul(&proper)?.f_add(&mask.f_mul(&x)?)?;
        }
        Ok(x)
    }
}

impl SdPipeline {
    /// A request's state before its first step: `latents` `[1, C, H / f, W / f]` are the
    /// initial noise (diffusers' `latents=`); `inpaint` repaints an image under a mask.
    pub fn prepare(
        &self,
        req: &SdRequest,
        latents: &Tensor,
        inpaint: Option<&InpaintInputs>,
    ) -> Result<SdState> {
        self.check_request(req, latents)?;
        let schedule = self.schedule(req)?;
        let (start, extra) = match inpaint {
            Some(inputs) => self.inpaint_extra(req, inputs, latents, schedule.len())?,
            None => (0, Extra::None),
        };
        let (device, _) = self.unet.device_kind();
        let x = latents
            .f_to_device(device)?
            .f_to_kind(Kind::Float)?
            .f_mul_scalar(schedule.init_noise_sigma)?;
        let guided = req.guidance_scale > 1.0;
        let (embeds, pooled) =
            self.conditioning(&req.prompt, req.negative_prompt.as_deref(), guided)?;
        let (h, w) = (req.height as f32, req.width as f32);
        // SDXL's added conditioning: original size, crop origin, target size.
        let ids = Tensor::from_slice(&[h, w, 0.0, 0.0, h, w]).f_view([1, 6])?;
        let time_ids = match &pooled {
            Some(_) if guided => Some(Tensor::f_cat(&[&ids, &ids], 0)?),
            Some(_) => Some(ids),
            None => None,
        };
        Ok(SdState {
            embeds,
            pooled,
            time_ids,
            guidance: guided.then_some(req.guidance_scale),
            schedule,
            next: start,
            x,
            extra,
            attention: Attention::Full,
            controls: Vec::new(),
        })
    }

    /// The UNet's text inputs of `prompt` (and `negative` where `guided`), one row per branch,
    /// negative first: the hidden states, and SDXL's pooled embeddings.
    fn conditioning(
        &self,
        prompt: &str,
        negative: Option<&str>,
        guided: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        tch::no_grad(|| {
            let prompt = self.encode_prompt(prompt)?;
            let negative = if guided {
                Some(self.negative(negative, &prompt)?)
            } else {
                None
            };
            let pair = |negative: Option<&Tensor>, positive: &Tensor| -> Result<Tensor> {
                Ok(match negative {
                    Some(n) => Tensor::f_cat(&[n, positive], 0)?,
                    None => positive.shallow_clone(),
                })
            };
            let pooled = match &prompt.pooled {
                Some(pooled) => {
                    let negative_pooled = negative.as_ref().and_then(|n| n.pooled.as_ref());
                    Some(pair(negative_pooled, pooled)?)
                }
                None => None,
            };
            Ok((
                pair(negative.as_ref().map(|n| &n.embeds), &prompt.embeds)?,
                pooled,
            ))
        })
    }

    /// Encode the text conditioning of `states` (one request's images) again from `prompt` and
    /// `negative`: after the text encoders were patched with a request's LoRAs
    /// ([`super::text_lora`]), its states condition on what the patched encoders give.
    pub fn recondition(
        &self,
        states: &mut [SdState],
        prompt: &str,
        negative: Option<&str>,
    ) -> Result<()> {
        let Some(first) = states.first() else {
            return Ok(());
        };
        let (embeds, pooled) = self.conditioning(prompt, negative, first.guidance.is_some())?;
        for s in states {
            if s.embeds.size() != embeds.size() {
                return Err(ModelError::input(
                    "states",
                    format!(
                        "conditioning {:?} does not replace {:?}",
                        embeds.size(),
                        s.embeds.size()
                    ),
                ));
            }
            s.embeds = embeds.shallow_clone();
            s.pooled = pooled.as_ref().map(Tensor::shallow_clone);
        }
        Ok(())
    }

    /// One step of every state in `states` (same latent side, none done, none steered: see
    /// [`Self::step_batch_steered`]) in one UNet forward. `noise(i, step, shape)` gives state
    /// `i`'s noise for an ancestral step.
    pub fn step_batch(&self, states: &mut [&mut SdState], noise: &mut BatchNoise) -> Result<()> {
        self.step_batch_steered(states, noise, &[])
    }

    /// [`Self::step_batch`] with ControlNet residuals over all the batch's rows.
    pub(super) fn step_batch_with(
        &self,
        states: &mut [&mut SdState],
        noise: &mut BatchNoise,
        residuals: Option<&UNetResiduals>,
    ) -> Result<()> {
        let Some(first) = states.first() else {
            return Ok(());
        };
        let side = first.latent_side();
        if let Some(s) = states.iter().find(|s| s.done() || s.latent_side() != side) {
            let why = if s.done() {
                "a finished request".to_string()
            } else {
                format!("latents of side {:?} beside {side:?}", s.latent_side())
            };
            return Err(ModelError::input("states", format!("cannot step {why}")));
        }
        let (device, kind) = self.unet.device_kind();
        tch::no_grad(|| {
            let mut parts = Vec::with_capacity(states.len());
            for s in states.iter() {
                let mut x = s.unet_inputs()?;
                if let Extra::Concat { mask, masked } = &s.extra {
                    x.sample =
                        Tensor::f_cat(&[&x.sample, &s.branches(mask)?, &s.branches(masked)?], 1)?;
                }
                parts.push(x);
            }
            let cat = |part: &dyn Fn(&UNetInputs) -> Option<&Tensor>| -> Result<Option<Tensor>> {
                let picked: Option<Vec<&Tensor>> = parts.iter().map(part).collect();
                Ok(match picked {
                    Some(p) => Some(Tensor::f_cat(&p, 0)?),
                    None => None,
                })
            };
            let all = |part: &dyn Fn(&UNetInputs) -> &Tensor| -> Result<Tensor> {
                Ok(Tensor::f_cat(
                    &parts.iter().map(part).collect::<Vec<_>>(),
                    0,
                )?)
            };
            let inputs = UNetInputs {
                sample: all(&|x| &x.sample)?.f_to_kind(kind)?,
                timestep: all(&|x| &x.timestep)?,
                encoder_hidden_states: all(&|x| &x.encoder_hidden_states)?,
                text_embeds: cat(&|x| x.text_embeds.as_ref())?,
                time_ids: cat(&|x| x.time_ids.as_ref())?,
            };
            let out = self
                .run_unet(states, &inputs, residuals)?
                .f_to_kind(Kind::Float)?;
            // All or nothing: each state's next latents are computed first (its scheduler's
            // state checkpointed), and only kept once every state has stepped, so a batch that
            // fails part-way can be retried job by job without stepping anyone twice.
            let saved: Vec<_> = states.iter().map(|s| s.schedule.checkpoint()).collect();
            // A panic part-way (caught by the engine, which then retries) is put back too.
            let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut next = Vec::with_capacity(states.len());
                let mut row = 0;
                for (i, s) in states.iter_mut().enumerate() {
                    let rows = s.rows();
                    let x = out
                        .f_narrow(0, row, rows)
                        .map_err(ModelError::from)
                        .and_then(|mine| s.next_latents(i, &mine, noise, device));
                    row += rows;
                    next.push(x?);
                }
                Ok::<_, ModelError>(next)
            }));
            let restore = |states: &mut [&mut SdState]| {
                for (s, checkpoint) in states.iter_mut().zip(saved) {
                    s.schedule.restore(checkpoint);
                }
            };
            let next = match stepped {
                Ok(Ok(next)) => next,
                Ok(Err(e)) => {
                    restore(states);
                    return Err(e);
                }
                Err(panic) => {
                    restore(states);
                    std::panic::resume_unwind(panic)
                }
            };
            for (s, x) in states.iter_mut().zip(next) {
                s.x = x;
                s.next += 1;
            }
            Ok(())
        })
    }

    /// The batch's UNet forward as its states' attention modes ask: in full; capturing (the
    /// captures' rows recorded); or mask-aware when any state is an edit (the other rows then
    /// compute every token, which pads every row to all of them: batch edits with edits).
    fn run_unet(
        &self,
        states: &mut [&mut SdState],
        inputs: &UNetInputs,
        residuals: Option<&UNetResiduals>,
    ) -> Result<Tensor> {
        let captures = states
            .iter()
            .any(|s| matches!(s.attention, Attention::Capture(_)));
        let edits = states
            .iter()
            .any(|s| matches!(s.attention, Attention::Edit { .. }));
        if captures && edits {
            return Err(ModelError::input(
                "states",
                "a capture and an edit cannot share a step",
            ));
        }
        if residuals.is_some() && (captures || edits) {
            return Err(ModelError::input(
                "controlnet",
                "a steered request cannot share a step with captures or edits",
            ));
        }
        if captures {
            let (out, cache) = self.unet.forward_capture(inputs)?;
            let mut row = 0;
            for s in states.iter_mut() {
                let rows = s.rows();
                let step = s.next;
                if let Attention::Capture(steps) = &mut s.attention {
                    steps[step] = Some(cache.narrow_rows(row, rows)?);
                }
                row += rows;
            }
            return Ok(out);
        }
        if !edits {
            return self.unet.forward_controlled(inputs, residuals);
        }
        // Each edit's cache of this step (a served template decodes it now, for this step only).
        let held: Vec<Option<Arc<UNetTemplateCache>>> = states
            .iter()
            .map(|s| match &s.attention {
                Attention::Edit { template, .. } => template.step(s.next).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;
        // Rows that compute in full read no cache; any edit's names one for them.
        let any = held
            .iter()
            .flatten()
            .next()
            .cloned()
            .ok_or_else(|| ModelError::input("template", "holds no cache for this step"))?;
        let mut masks = Vec::new();
        let mut rows: Vec<(&UNetTemplateCache, i64)> = Vec::new();
        for (s, cache) in states.iter().zip(&held) {
            let [h, w] = s.latent_side();
            for r in 0..s.rows() {
                match (&s.attention, cache) {
                    (Attention::Edit { mask, .. }, Some(cache)) => {
                        masks.push(mask.shallow_clone());
                        rows.push((cache, r));
                    }
                    _ => {
                        masks.push(Tensor::f_ones([h, w], (Kind::Float, s.x.device()))?);
                        rows.push((&any, 0));
                    }
                }
            }
        }
        self.unet
            .forward_masked_rows(inputs, &Tensor::f_stack(&masks, 0)?, &rows)
    }

    /// The image `[1, 3, H, W]` in [0, 1] of a finished state.
    pub fn decode(&self, state: &SdState) -> Result<Tensor> {
        if !state.done() {
            return Err(ModelError::input(
                "states",
                format!(
                    "decoding a request at step {} of {}",
                    state.next,
                    state.steps()
                ),
            ));
        }
        tch::no_grad(|| {
            let vae_kind = self.vae.kind();
            let image = self.vae.decode(&state.x.f_to_kind(vae_kind)?)?;
            Ok(image
                .f_to_kind(Kind::Float)?
                .f_div_scalar(2.0)?
                .f_add_scalar(0.5)?
                .f_clamp(0.0, 1.0)?)
        })
    }

    /// `prepare` and `step_batch` on one request until it is done, then `decode`.
    pub(super) fn run_alone(
        &self,
        req: &SdRequest,
        latents: &Tensor,
        inpaint: Option<&InpaintInputs>,
        noise: &mut dyn FnMut(usize, &[i64]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let mut state = self.prepare(req, latents, inpaint)?;
        while !state.done() {
            self.step_batch(&mut [&mut state], &mut |_, step, shape| noise(step, shape))?;
        }
        self.decode(&state)
    }
}
