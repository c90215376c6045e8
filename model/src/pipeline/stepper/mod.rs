//! Per-request denoising state with a `step()`, for engines that batch requests at the step level
//! (continuous batching): each request keeps its own schedule, step index and (for edits) template
//! blend, and [`step_batch`] runs one transformer forward for many requests at different steps.
//!
//! The math is the pipeline's: [`Prepared`] builds conditioning, schedule and noise exactly as
//! [`super::text_to_image`] / [`super::inpaint`] do, the Euler step is `Schedule::step`, and the
//! edit blend is the inpainting pipeline's token-level blend, so a request stepped here alone
//! ends on the same latents as the pipeline functions with the same seed.
//!
//! On a FLUX.1-Fill transformer every state is an edit: the template with its repainted tokens
//! blanked and the token mask (as pixels) are its conditioning (`fill::fill_conditioning`), which
//! follows each token's latents into the transformer, in full and mask-aware steps alike. A
//! capture (nothing repainted) conditions on the whole template.
use super::conditioning_cache::ConditioningCache;
use super::control::{self, ControlInput, ControlState, ControlStep};
use super::{FluxPipeline, GenerateOptions, GenerationRequest, Prepared};
use crate::error::{ModelError, Result};
use crate::flux::step_cache::{CacheMethod, StepCache};
use crate::flux::{FluxInputs, KvCache, KvSink, MaskedRequest};
use crate::noise_scheduler::scale_noise_with_sigmas;
use crate::packing::{pack_latents, unpack_latents};
use tch::{Kind, Tensor};

/// The template of an edit: blend target outside the mask.
#[derive(Debug)]
pub struct EditSpec {
    /// `[1, 3, H, W]` in [-1, 1] at the request's resolution.
    pub template: Tensor,
    /// `[N]` bool (or 0/1 integers), one per packed image token, true = repaint.
    pub token_mask: Tensor,
    /// Fraction of the schedule to run, in (0, 1]; 1 starts from pure noise.
    pub strength: f64,
    /// Seed of the noise at the unmasked tokens; `None` = the request's seed. An edit that reads
    /// a template's activation cache must use the seed the cache was captured with, so that its
    /// unmasked tokens follow exactly the trajectory the cache recorded; its masked tokens still
    /// start from the request's own noise.
    pub template_seed: Option<u64>,
}

/// One request to step.
#[derive(Debug)]
pub struct StepRequest {
    pub prompt: String,
    pub seed: u64,
    pub height: i64,
    pub width: i64,
    pub steps: usize,
    /// Embedded guidance (guidance-distilled models only).
    pub guidance_scale: f64,
    pub edit: Option<EditSpec>,
    /// A ControlNet's control image (generations only; see [`super::control`]).
    pub control: Option<ControlInput>,
    /// True classifier-free guidance (None: the prompt alone steers).
    pub true_cfg: Option<TrueCfg>,
    /// TeaCache's threshold (see [`crate::flux::step_cache`]): a step whose probe changed less
    /// than this since the last computed step reuses that step's residual. None: every step
    /// computes; 0 caches but never skips.
    pub cache_threshold: Option<f64>,
    /// Which step cache runs at `cache_threshold`: TeaCache (the default) or first-block
    /// caching (full-compute steps only: not with a mask-aware step).
    pub cache_method: CacheMethod,
}

/// True classifier-free guidance: each step runs the request twice, with its prompt and with
/// `negative_prompt` (the empty string is the unconditional input), as two rows of the batch,
/// and steps with `uncond + scale * (cond - uncond)` (diffusers' `true_cfg_scale`).
#[derive(Debug, Clone, PartialEq)]
pub struct TrueCfg {
    pub negative_prompt: String,
    /// Above 1 (1 would equal the prompt alone at twice the cost).
    pub scale: f64,
}

/// Which of a guided request's two rows: its prompt or its negative prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Branch {
    Cond,
    Uncond,
}

struct EditState {
    image_latents: Tensor,
    noise: Tensor,
    /// `[1, N, 1]` 1.0 for repainted tokens.
    blend: Tensor,
    keep: Tensor,
    /// `[M]` int64 indices of the repainted tokens (what a mask-aware step computes).
    masked_index: Tensor,
}

/// How one state takes its next step in [`step_batch_modes`].
#[derive(Clone, Copy)]
pub enum StepMode<'a> {
    /// Every token through every block.
    Full,
    /// Only the repainted tokens (mask-aware); the unmasked tokens' K/V of this state's current
    /// step come from `cache` (a template's activation cache for that step). Edits only.
    Cached(&'a dyn KvCache),
}

/// Denoising state of one request (batch of one image).
pub struct DenoiseState {
    prep: Prepared,
    latents: Tensor,
    /// Next step index into `prep.schedule`.
    index: usize,
    start: usize,
    edit: Option<EditState>,
    control: Option<ControlState>,
    /// `[1, N, extra]` FLUX.1-Fill conditioning (masked template latents, then the mask).
    fill: Option<Tensor>,
    step_cache: Option<StepCache>,
    /// This step's step-cache decision taken ahead (see [`DenoiseState::plan_step`]).
    planned: Option<PlannedStep>,
}

/// Conditioning channels per token the transformer takes after the latents: 0, or a
/// FLUX.1-Fill transformer's (`fill::fill_conditioning_channels`).
fn conditioning_channels(p: &FluxPipeline<'_>) -> i64 {
    let (channels, f) = (p.codec.latent_channels(), p.codec.downscale_factor());
    let fill = super::fill::fill_conditioning_channels(channels, f);
    if p.transformer.cfg.in_channels == 4 * channels + fill {
        fill
    } else {
        0
    }
}

/// The pixel mask `[1, 1, H, W]` (1.0 = repaint) of a token mask `[N]` over a `rows x cols`
/// grid of `unit`-pixel tokens.
fn token_mask_pixels(token_mask: &Tensor, rows: i64, cols: i64, unit: i64) -> Result<Tensor> {
    Ok(token_mask
        .f_ne(0)?
        .f_to_kind(Kind::Float)?
        .f_view([1, 1, rows, 1, cols, 1])?
        .f_expand([1, 1, rows, unit, cols, unit], false)?
        .f_reshape([1, 1, rows * unit, cols * unit])?)
}

impl DenoiseState {
    /// Encode the prompt, draw the seeded noise and, for edits, encode the template.
    pub fn new(p: &FluxPipeline<'_>, req: &StepRequest) -> Result<Self> {
        Self::prepare(p, req, None)
    }

    /// As [`DenoiseState::new`], taking the prompt's embeddings and the template's latents from
    /// `cache` where it holds them (and keeping them there). `template_key` names the content
    /// of the edit's template image (None: the template is not shared and is encoded). The
    /// state is the same as `new`'s: the cache only skips recomputing identical tensors.
    pub fn new_cached(
        p: &FluxPipeline<'_>,
        req: &StepRequest,
        cache: &mut ConditioningCache,
        template_key: Option<&str>,
    ) -> Result<Self> {
        Self::prepare(p, req, Some((cache, template_key)))
    }

    fn prepare(
        p: &FluxPipeline<'_>,
        req: &StepRequest,
        mut reuse: Option<(&mut ConditioningCache, Option<&str>)>,
    ) -> Result<Self> {
        tch::no_grad(|| {
            let opts = GenerateOptions {
                height: req.height,
                width: req.width,
                steps: req.steps,
                guidance_scale: req.guidance_scale,
                true_cfg_scale: 1.0,
                negative_prompt: None,
            };
            let text = match reuse.as_mut() {
                Some((cache, _)) => {
                    let (device, kind) = p.transformer.device_kind();
                    Some(cache.text(p, &req.prompt, device, kind)?)
                }
                None => None,
            };
            let extra = conditioning_channels(p);
            if extra > 0 && req.edit.is_none() {
                return Err(ModelError::input(
                    "edit",
                    "a FLUX.1-Fill model repaints a masked image: it takes edits only",
                ));
            }
            let mut prep = Prepared::with_conditioning(
                p,
                &[GenerationRequest {
                    prompt: req.prompt.clone(),
                    seed: req.seed,
                }],
                &opts,
                text,
                extra,
            )?;
            if let Some(cfg) = &req.true_cfg {
                if !(cfg.scale.is_finite() && cfg.scale > 1.0) {
                    return Err(ModelError::input(
                        "true_cfg.scale",
                        format!("must be above 1, got {}", cfg.scale),
                    ));
                }
                let (device, kind) = p.transformer.device_kind();
                let negative = match reuse.as_mut() {
                    Some((cache, _)) => cache.text(p, &cfg.negative_prompt, device, kind)?,
                    None => {
                        super::embed(p, std::slice::from_ref(&cfg.negative_prompt), device, kind)?
                    }
                };
                prep.negative = Some(negative);
                prep.true_cfg_scale = cfg.scale;
            }
            let step_cache = req
                .cache_threshold
                .map(|t| StepCache::new(req.cache_method, t))
                .transpose()?;
            let mut noise = prep.noise(&[req.seed], p.codec.latent_channels())?;
            let Some(edit) = &req.edit else {
                let control = match &req.control {
                    Some(c) => Some(ControlState::new(p, &prep, req, c)?),
                    None => None,
                };
                return Ok(Self {
                    prep,
                    latents: noise,
                    index: 0,
                    start: 0,
                    edit: None,
                    control,
                    fill: None,
                    step_cache,
                    planned: None,
                });
            };
            if req.control.is_some() {
                return Err(ModelError::input(
                    "control",
                    "edits do not take a ControlNet (their unmasked tokens follow the template)",
                ));
            }
            let expect = [1, 3, req.height, req.width];
            if edit.template.size() != expect {
                return Err(ModelError::input(
                    "template",
                    format!("expected {expect:?}, got {:?}", edit.template.size()),
                ));
            }
            let tokens = noise.size()[1];
            if edit.token_mask.size() != [tokens] {
                return Err(ModelError::input(
                    "token_mask",
                    format!(
                        "expected [{tokens}] (one per image token), got {:?}",
                        edit.token_mask.size()
                    ),
                ));
            }
            let start = prep.schedule.start_index(edit.strength)?;
            let template = edit
                .template
                .f_to_device(prep.device)?
                .f_to_kind(prep.kind)?;
            let image_latents = match reuse.as_mut() {
                Some((cache, key)) => cache.template_latents(p, *key, &template, prep.kind)?,
                None => pack_latents(&p.codec.encode(&template)?.f_to_kind(prep.kind)?)?,
            };
            let blend = edit
                .token_mask
                .f_to_device(prep.device)?
                .f_ne(0)?
                .f_to_kind(prep.kind)?
                .f_view([1, tokens, 1])?;
            let keep = blend.f_neg()?.f_add_scalar(1.0)?;
            if let Some(seed) = edit.template_seed.filter(|&s| s != req.seed) {
                let channels = p.codec.latent_channels();
                let template_noise = match reuse.as_mut() {
                    Some((cache, _)) => cache.template_noise(&prep, seed, channels)?,
                    None => prep.noise(&[seed], channels)?,
                };
                noise = blend.f_mul(&noise)?.f_add(&keep.f_mul(&template_noise)?)?;
            }
            let masked_index = edit
                .token_mask
                .f_to_device(prep.device)?
                .f_ne(0)?
                .f_nonzero()?
                .f_view([-1])?;
            let latents =
                scale_noise_with_sigmas(&image_latents, &[prep.schedule.sigmas[start]], &noise)?;
            let fill = if extra > 0 {
                let unit = 2 * p.codec.downscale_factor();
                let pixels = token_mask_pixels(
                    &edit.token_mask.f_to_device(prep.device)?,
                    req.height / unit,
                    req.width / unit,
                    unit,
                )?;
                let image = template.f_to_kind(Kind::Float)?;
                Some(super::fill::fill_conditioning(
                    p, &image, &pixels, prep.kind,
                )?)
            } else {
                None
            };
            Ok(Self {
                prep,
                latents,
                index: start,
                start,
                edit: Some(EditState {
                    image_latents,
                    noise,
                    blend,
                    keep,
                    masked_index,
                }),
                control: None,
                fill,
                step_cache,
                planned: None,
            })
        })
    }

    pub fn is_done(&self) -> bool {
        self.index >= self.prep.schedule.len()
    }

    /// Steps taken so far and steps this request runs in total (edits with strength < 1 skip
    /// the first part of the schedule).
    pub fn progress(&self) -> (usize, usize) {
        (
            self.index - self.start,
            self.prep.schedule.len() - self.start,
        )
    }

    /// Requests with equal keys can share one transformer forward (same token counts).
    pub fn batch_key(&self) -> (i64, i64, i64) {
        self.row_key(Branch::Cond)
    }

    /// The batch key of one of this state's rows (a negative prompt may encode to another
    /// length than the prompt).
    fn row_key(&self, branch: Branch) -> (i64, i64, i64) {
        let text = self.text(branch);
        (
            self.prep.latent_h,
            self.prep.latent_w,
            text.hidden.size().get(1).copied().unwrap_or(0),
        )
    }

    /// The rows this state adds to a step: its prompt's, and its negative prompt's if guided.
    fn branches(&self) -> &'static [Branch] {
        if self.prep.negative.is_some() {
            &[Branch::Cond, Branch::Uncond]
        } else {
            &[Branch::Cond]
        }
    }

    /// Batch rows this request takes per step: 2 with true CFG, else 1.
    pub fn rows(&self) -> usize {
        self.branches().len()
    }

    fn text(&self, branch: Branch) -> &crate::components::TextEmbeddings {
        match (branch, &self.prep.negative) {
            (Branch::Uncond, Some(negative)) => negative,
            _ => &self.prep.text,
        }
    }

    /// Text position ids of one row (zeros, one per text token of its branch).
    fn txt_ids(&self, branch: Branch) -> Result<Tensor> {
        let tokens = self.row_key(branch).2;
        if self.prep.txt_ids.size()[0] == tokens {
            return Ok(self.prep.txt_ids.shallow_clone());
        }
        let (kind, device) = (self.prep.txt_ids.kind(), self.prep.txt_ids.device());
        Ok(Tensor::f_zeros([tokens, 3], (kind, device))?)
    }

    /// The velocity to step with from this state's rows (`[cond]` or `[cond, uncond]`).
    fn guided(&self, rows: [Option<Tensor>; 2]) -> Result<Tensor> {
        match rows {
            [Some(cond), None] => Ok(cond),
            [Some(cond), Some(uncond)] => super::guide(&cond, &uncond, self.prep.true_cfg_scale),
            _ => Err(ModelError::input(
                "state",
                "a step lost the row of its prompt",
            )),
        }
    }

    /// Schedule index of the next step (the step of a template cache this state reads next).
    pub fn step_index(&self) -> usize {
        self.index
    }

    /// Text tokens of this request's prompt (T).
    pub fn text_tokens(&self) -> i64 {
        self.prep.text.hidden.size().get(1).copied().unwrap_or(0)
    }

    /// Image tokens of this request (N).
    pub fn image_tokens(&self) -> i64 {
        self.latents.size()[1]
    }

    /// Repainted tokens of an edit (M); `None` for a generation.
    pub fn masked_tokens(&self) -> Option<i64> {
        self.edit.as_ref().map(|e| e.masked_index.size()[0])
    }

    /// Whether this request is steered by a ControlNet.
    pub fn has_control(&self) -> bool {
        self.control.is_some()
    }

    /// The ControlNet inputs of this request's next step (`None`: not steered, or done).
    pub fn control_step(&self) -> Result<Option<ControlStep>> {
        let Some(c) = &self.control else {
            return Ok(None);
        };
        if self.is_done() {
            return Ok(None);
        }
        Ok(Some(ControlStep {
            inputs: group_inputs(&[(self, Branch::Cond)])?,
            control: c.latents.shallow_clone(),
            scale: c.scale,
            guidance_scale: c.guidance_scale,
        }))
    }

    /// Run this state's next step with full compute while recording the K/V of every image
    /// token in every block into `sink`: the capture pass of a template (an edit whose mask
    /// repaints nothing, so every token follows the template's noised trajectory).
    pub fn capture_step(&mut self, p: &FluxPipeline<'_>, sink: &mut dyn KvSink) -> Result<()> {
        if self.is_done() {
            return Err(ModelError::input(
                "state",
                "capture_step after the last step",
            ));
        }
        if self.caches_steps() {
            return Err(ModelError::input(
                "cache_threshold",
                "a capture records every step: it takes no step caching",
            ));
        }
        tch::no_grad(|| {
            let inputs = group_inputs(&[(&*self, Branch::Cond)])?;
            let velocity = p.transformer.forward_capture(&inputs, sink)?;
            self.apply(&velocity)
        })
    }

    /// Current packed latents `[1, N, 4C]`.
    pub fn latents(&self) -> &Tensor {
        &self.latents
    }

    /// Current latents unpacked, `[1, C, H / f, W / f]` as the codec takes them (previews).
    pub fn unpacked_latents(&self) -> Result<Tensor> {
        unpack_latents(&self.latents, self.prep.latent_h, self.prep.latent_w)
    }

    /// What the transformer takes for this state's image tokens: the latents, followed on a
    /// FLUX.1-Fill model by the conditioning.
    fn transformer_input(&self) -> Result<Tensor> {
        Ok(match &self.fill {
            Some(c) => Tensor::f_cat(&[&self.latents, c], 2)?,
            None => self.latents.shallow_clone(),
        })
    }

    /// Run this request's next step alone.
    pub fn step(&mut self, p: &FluxPipeline<'_>) -> Result<()> {
        step_batch(p, &mut [self])
    }

    /// Euler step with this request's velocity row, then the edit blend.
    fn apply(&mut self, velocity: &Tensor) -> Result<()> {
        let latents = self.next_latents(velocity)?;
        self.commit(latents);
        Ok(())
    }

    /// Take the step's latents (from [`Self::next_latents`]).
    fn commit(&mut self, latents: Tensor) {
        self.latents = latents;
        self.index += 1;
    }

    /// The latents after this step with `velocity`, the state unchanged (the schedule's step
    /// is stateless, so a batch can compute every state's before committing any).
    fn next_latents(&self, velocity: &Tensor) -> Result<Tensor> {
        let schedule = &self.prep.schedule;
        let index = self.index;
        let mut latents = schedule.step(index, velocity, &self.latents)?;
        if let Some(e) = &self.edit {
            let proper = if index + 1 < schedule.len() {
                schedule.scale_noise(&e.image_latents, index + 1, &e.noise)?
            } else {
                e.image_latents.shallow_clone()
            };
            latents = e.keep.f_mul(&proper)?.f_add(&e.blend.f_mul(&latents)?)?;
        }
        Ok(latents)
    }

    /// Decode the final latents: `[1, 3, H, W]`, unclamped (nominally [-1, 1]).
    pub fn decode(&self, p: &FluxPipeline<'_>) -> Result<Tensor> {
        if !self.is_done() {
            return Err(ModelError::input(
                "state",
                "decode called before the last step",
            ));
        }
        tch::no_grad(|| self.prep.decode(p.codec, &self.latents))
    }
}

impl DenoiseState {
    /// This state's next step as one request of a mask-aware forward.
    fn masked_request<'c>(
        &self,
        cache: &'c dyn KvCache,
        with_full: bool,
        branch: Branch,
    ) -> Result<MaskedRequest<'c>> {
        let mut request = self.masked_row(branch)?.request(cache);
        if with_full {
            request.full_hidden_states = Some(self.transformer_input()?.f_squeeze_dim(0)?);
        }
        Ok(request)
    }

    /// Row `branch` of this state's next mask-aware step, without its cache.
    fn masked_row(&self, branch: Branch) -> Result<MaskedRow> {
        let e = self
            .edit
            .as_ref()
            .ok_or_else(|| ModelError::input("modes", "not an edit"))?;
        let latents = self.transformer_input()?.f_squeeze_dim(0)?;
        let t = self.prep.schedule.timesteps[self.index];
        let guidance = match &self.prep.guidance {
            Some(g) => Some(g.f_to_kind(Kind::Double)?.f_view([-1])?.double_value(&[0])),
            None => None,
        };
        Ok(MaskedRow {
            hidden_states: latents.f_index_select(0, &e.masked_index)?,
            token_index: e.masked_index.shallow_clone(),
            encoder_hidden_states: self.text(branch).hidden.f_squeeze_dim(0)?,
            pooled_projections: self.text(branch).pooled.f_squeeze_dim(0)?,
            // The full forward's `t / 1000` in f32, so both paths see the same timestep.
            timestep: (t / 1000.0) as f64,
            guidance,
            img_ids: self.prep.img_ids.shallow_clone(),
            txt_ids: self.txt_ids(branch)?,
        })
    }

    /// Step with the guided rows' velocities of the masked tokens.
    fn apply_masked(&mut self, rows: [Option<Tensor>; 2]) -> Result<()> {
        let latents = self.masked_next_latents(rows)?;
        self.commit(latents);
        Ok(())
    }

    /// [`Self::next_latents`] from the guided rows' velocities of the masked tokens.
    fn masked_next_latents(&self, rows: [Option<Tensor>; 2]) -> Result<Tensor> {
        let v = self.guided(rows)?;
        let e = self
            .edit
            .as_ref()
            .ok_or_else(|| ModelError::input("modes", "not an edit"))?;
        // Unmasked rows stay zero: the edit blend replaces them with the template anyway.
        let full =
            self.latents
                .f_zeros_like()?
                .f_index_copy(1, &e.masked_index, &v.f_unsqueeze(0)?)?;
        self.next_latents(&full)
    }
}

/// The transformer inputs of a group of same-shaped states, one row each.
fn group_inputs(rows: &[(&DenoiseState, Branch)]) -> Result<FluxInputs> {
    let (first, first_branch) = rows[0];
    let cat = |f: &dyn Fn(&DenoiseState, Branch) -> Tensor| -> Result<Tensor> {
        let parts: Vec<Tensor> = rows.iter().map(|&(s, b)| f(s, b)).collect();
        Ok(Tensor::f_cat(&parts, 0)?)
    };
    // diffusers: `t.expand(B).to(latents.dtype) / 1000`, here one t per row.
    let t: Vec<f32> = rows
        .iter()
        .map(|(s, _)| s.prep.schedule.timesteps[s.index])
        .collect();
    let timestep = Tensor::from_slice(&t)
        .f_to_device(first.prep.device)?
        .f_to_kind(first.prep.kind)?
        .f_div_scalar(1000.0)?;
    // Every state of one pipeline has guidance iff the transformer embeds it.
    let guidance: Option<Vec<Tensor>> = rows
        .iter()
        .map(|(s, _)| s.prep.guidance.as_ref().map(Tensor::shallow_clone))
        .collect();
    let guidance = guidance.map(|g| Tensor::f_cat(&g, 0)).transpose()?;
    let inputs: Vec<Tensor> = rows
        .iter()
        .map(|(s, _)| s.transformer_input())
        .collect::<Result<_>>()?;
    Ok(FluxInputs {
        hidden_states: Tensor::f_cat(&inputs, 0)?,
        encoder_hidden_states: cat(&|s, b| s.text(b).hidden.shallow_clone())?,
        pooled_projections: cat(&|s, b| s.text(b).pooled.shallow_clone())?,
        timestep,
        img_ids: first.prep.img_ids.shallow_clone(),
        txt_ids: first.txt_ids(first_branch)?,
        guidance,
    })
}

/// Kind of the latents a state computes in (for callers converting outputs).
pub fn state_kind(state: &DenoiseState) -> Kind {
    state.prep.kind
}

mod batch;
mod first_block;
mod remote;
mod step_caching;
pub use batch::{step_batch, step_batch_controlled, step_batch_modes};
pub use remote::MaskedRow;
use step_caching::PlannedStep;

#[cfg(test)]
mod tests;
