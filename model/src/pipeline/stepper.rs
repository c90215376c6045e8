//! Per-request denoising state with a `step()`, for engines that batch requests at the step level
//! (continuous batching): each request keeps its own schedule, step index and (for edits) template
//! blend, and [`step_batch`] runs one transformer forward for many requests at different steps.
//!
//! The math is the pipeline's: [`Prepared`] builds conditioning, schedule and noise exactly as
//! [`super::text_to_image`] / [`super::inpaint`] do, the Euler step is `Schedule::step`, and the
//! edit blend is the inpainting pipeline's token-level blend, so a request stepped here alone
//! ends on the same latents as the pipeline functions with the same seed.
use super::conditioning_cache::ConditioningCache;
use super::control::{self, ControlInput, ControlState, ControlStep};
use super::{FluxPipeline, GenerateOptions, GenerationRequest, Prepared};
use crate::error::{ModelError, Result};
use crate::flux::{ControlResiduals, FluxInputs, KvCache, KvSink, MaskedRequest};
use crate::packing::pack_latents;
use crate::scheduler::scale_noise_with_sigmas;
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
            let prep = Prepared::with_text(
                p,
                &[GenerationRequest {
                    prompt: req.prompt.clone(),
                    seed: req.seed,
                }],
                &opts,
                text,
            )?;
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
        (
            self.prep.latent_h,
            self.prep.latent_w,
            self.prep.text.hidden.size().get(1).copied().unwrap_or(0),
        )
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
            inputs: group_inputs(&[self])?,
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
        tch::no_grad(|| {
            let inputs = group_inputs(&[&*self])?;
            let velocity = p.transformer.forward_capture(&inputs, sink)?;
            self.apply(&velocity)
        })
    }

    /// Current packed latents `[1, N, 4C]`.
    pub fn latents(&self) -> &Tensor {
        &self.latents
    }

    /// Run this request's next step alone.
    pub fn step(&mut self, p: &FluxPipeline<'_>) -> Result<()> {
        step_batch(p, &mut [self])
    }

    /// Euler step with this request's velocity row, then the edit blend.
    fn apply(&mut self, velocity: &Tensor) -> Result<()> {
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
        self.latents = latents;
        self.index += 1;
        Ok(())
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

/// One denoising step for every unfinished state, each at its own step index: states with the
/// same [`DenoiseState::batch_key`] share one transformer forward (per-row timesteps).
pub fn step_batch(p: &FluxPipeline<'_>, states: &mut [&mut DenoiseState]) -> Result<()> {
    let modes = vec![StepMode::Full; states.len()];
    step_batch_modes(p, states, &modes, 0)
}

/// [`step_batch`] where each state has its own [`StepMode`]: full-compute states are grouped by
/// shape as there, and every mask-aware state (any shapes, masks, steps) is packed into one
/// mask-aware forward whose first `full_prefix` blocks run over all tokens (see
/// [`crate::flux::FluxTransformer::forward_masked_prefix`]).
pub fn step_batch_modes(
    p: &FluxPipeline<'_>,
    states: &mut [&mut DenoiseState],
    modes: &[StepMode<'_>],
    full_prefix: usize,
) -> Result<()> {
    let none: Vec<Option<ControlResiduals>> = states.iter().map(|_| None).collect();
    step_batch_controlled(p, states, modes, full_prefix, &none)
}

/// [`step_batch_modes`] where `residuals[i]` are state `i`'s ControlNet residuals for this step
/// (from [`DenoiseState::control_step`], computed here or on a ControlNet worker). A steered
/// state must bring them; full-compute groups mix steered and plain rows.
pub fn step_batch_controlled(
    p: &FluxPipeline<'_>,
    states: &mut [&mut DenoiseState],
    modes: &[StepMode<'_>],
    full_prefix: usize,
    residuals: &[Option<ControlResiduals>],
) -> Result<()> {
    if modes.len() != states.len() || residuals.len() != states.len() {
        return Err(ModelError::input(
            "modes",
            format!(
                "{} modes and {} residual sets for {} states",
                modes.len(),
                residuals.len(),
                states.len()
            ),
        ));
    }
    for (i, s) in states.iter().enumerate().filter(|(_, s)| !s.is_done()) {
        if s.has_control() != residuals[i].is_some() {
            return Err(ModelError::input(
                "control",
                format!("state {i}: ControlNet residuals given iff the request is steered"),
            ));
        }
    }
    tch::no_grad(|| {
        let mut groups: Vec<((i64, i64, i64), Vec<usize>)> = Vec::new();
        let mut cached: Vec<(usize, &dyn KvCache)> = Vec::new();
        for (i, s) in states.iter().enumerate().filter(|(_, s)| !s.is_done()) {
            if let StepMode::Cached(cache) = modes[i] {
                if s.edit.is_none() {
                    return Err(ModelError::input(
                        "modes",
                        format!("state {i}: a mask-aware step needs an edit (template + mask)"),
                    ));
                }
                cached.push((i, cache));
                continue;
            }
            let key = s.batch_key();
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(i),
                None => groups.push((key, vec![i])),
            }
        }
        let (doubles, singles) = (
            p.transformer.transformer_blocks.len(),
            p.transformer.single_transformer_blocks.len(),
        );
        for (_, members) in groups {
            let rows: Vec<&DenoiseState> = members.iter().map(|&i| &*states[i]).collect();
            let inputs = group_inputs(&rows)?;
            let steered: Vec<Option<&ControlResiduals>> =
                members.iter().map(|&i| residuals[i].as_ref()).collect();
            let merged = if steered.iter().all(Option::is_none) {
                None
            } else {
                control::merge_rows(&steered, doubles, singles, &like_residual(&inputs, p)?)?
            };
            let velocity = match merged {
                Some(r) => p.transformer.forward_controlled(&inputs, &r)?,
                None => p.transformer.forward(&inputs)?,
            };
            for (row, &i) in members.iter().enumerate() {
                states[i].apply(&velocity.f_narrow(0, row as i64, 1)?)?;
            }
        }
        if !cached.is_empty() {
            let requests: Vec<MaskedRequest> = cached
                .iter()
                .map(|&(i, cache)| states[i].masked_request(cache, full_prefix > 0))
                .collect::<Result<_>>()?;
            let velocities = p
                .transformer
                .forward_masked_prefix(&requests, full_prefix)?;
            drop(requests);
            for (&(i, _), v) in cached.iter().zip(velocities) {
                let s = &mut states[i];
                let index = &s.edit.as_ref().expect("checked above").masked_index;
                // Unmasked rows stay zero: the edit blend replaces them with the template anyway.
                let full = s
                    .latents
                    .f_zeros_like()?
                    .f_index_copy(1, index, &v.f_unsqueeze(0)?)?;
                s.apply(&full)?;
            }
        }
        Ok(())
    })
}

impl DenoiseState {
    /// This state's next step as one request of a mask-aware forward.
    fn masked_request<'c>(
        &self,
        cache: &'c dyn KvCache,
        with_full: bool,
    ) -> Result<MaskedRequest<'c>> {
        let e = self
            .edit
            .as_ref()
            .ok_or_else(|| ModelError::input("modes", "not an edit"))?;
        let latents = self.latents.f_squeeze_dim(0)?;
        let t = self.prep.schedule.timesteps[self.index];
        let guidance = match &self.prep.guidance {
            Some(g) => Some(g.f_to_kind(Kind::Double)?.f_view([-1])?.double_value(&[0])),
            None => None,
        };
        Ok(MaskedRequest {
            hidden_states: latents.f_index_select(0, &e.masked_index)?,
            token_index: e.masked_index.shallow_clone(),
            encoder_hidden_states: self.prep.text.hidden.f_squeeze_dim(0)?,
            pooled_projections: self.prep.text.pooled.f_squeeze_dim(0)?,
            // The full forward's `t / 1000` in f32, so both paths see the same timestep.
            timestep: (t / 1000.0) as f64,
            guidance,
            img_ids: self.prep.img_ids.shallow_clone(),
            txt_ids: self.prep.txt_ids.shallow_clone(),
            cache,
            full_hidden_states: with_full.then(|| latents.shallow_clone()),
        })
    }
}

/// A `[1, N, inner]` tensor of the transformer's kind (what an unsteered row's residual is).
fn like_residual(inputs: &FluxInputs, p: &FluxPipeline<'_>) -> Result<Tensor> {
    let n = inputs.hidden_states.size()[1];
    let (device, kind) = p.transformer.device_kind();
    Ok(Tensor::f_empty(
        [1, n, p.transformer.inner_dim()],
        (kind, device),
    )?)
}

/// The transformer inputs of a group of same-shaped states, one row each.
fn group_inputs(rows: &[&DenoiseState]) -> Result<FluxInputs> {
    let first = &rows[0].prep;
    let cat = |f: &dyn Fn(&DenoiseState) -> Tensor| -> Result<Tensor> {
        let parts: Vec<Tensor> = rows.iter().map(|s| f(s)).collect();
        Ok(Tensor::f_cat(&parts, 0)?)
    };
    // diffusers: `t.expand(B).to(latents.dtype) / 1000`, here one t per row.
    let t: Vec<f32> = rows
        .iter()
        .map(|s| s.prep.schedule.timesteps[s.index])
        .collect();
    let timestep = Tensor::from_slice(&t)
        .f_to_device(first.device)?
        .f_to_kind(first.kind)?
        .f_div_scalar(1000.0)?;
    // Every state of one pipeline has guidance iff the transformer embeds it.
    let guidance: Option<Vec<Tensor>> = rows
        .iter()
        .map(|s| s.prep.guidance.as_ref().map(Tensor::shallow_clone))
        .collect();
    let guidance = guidance.map(|g| Tensor::f_cat(&g, 0)).transpose()?;
    Ok(FluxInputs {
        hidden_states: cat(&|s| s.latents.shallow_clone())?,
        encoder_hidden_states: cat(&|s| s.prep.text.hidden.shallow_clone())?,
        pooled_projections: cat(&|s| s.prep.text.pooled.shallow_clone())?,
        timestep,
        img_ids: first.img_ids.shallow_clone(),
        txt_ids: first.txt_ids.shallow_clone(),
        guidance,
    })
}

/// Kind of the latents a state computes in (for callers converting outputs).
pub fn state_kind(state: &DenoiseState) -> Kind {
    state.prep.kind
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{inpaint, text_to_image, InpaintInputs};
    use crate::scheduler::{
        FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig,
    };
    use crate::tiny::model::TinyModel;
    use tch::Device;

    fn model() -> (TinyModel, FlowMatchEulerDiscreteScheduler) {
        let m = TinyModel::random_for_tests(7, Device::Cpu).unwrap();
        let cfg: FlowMatchEulerDiscreteSchedulerConfig =
            serde_json::from_value(crate::tiny::model::scheduler_config_json()).unwrap();
        (m, FlowMatchEulerDiscreteScheduler::new(cfg).unwrap())
    }

    fn pipe<'a>(m: &'a TinyModel, s: &'a FlowMatchEulerDiscreteScheduler) -> FluxPipeline<'a> {
        FluxPipeline {
            transformer: &m.transformer,
            text_encoder: &m.text_encoder,
            codec: &m.codec,
            scheduler: s,
        }
    }

    fn req(prompt: &str, seed: u64, steps: usize) -> StepRequest {
        StepRequest {
            control: None,
            prompt: prompt.into(),
            seed,
            height: 64,
            width: 64,
            steps,
            guidance_scale: 1.0,
            edit: None,
        }
    }

    #[test]
    fn stepping_alone_matches_text_to_image() {
        let (m, s) = model();
        let p = pipe(&m, &s);
        let mut st = DenoiseState::new(&p, &req("a red circle", 3, 4)).unwrap();
        while !st.is_done() {
            st.step(&p).unwrap();
        }
        assert_eq!(st.progress(), (4, 4));
        let opts = GenerateOptions {
            height: 64,
            width: 64,
            steps: 4,
            ..Default::default()
        };
        let reference = text_to_image(
            &p,
            &[GenerationRequest {
                prompt: "a red circle".into(),
                seed: 3,
            }],
            &opts,
            None,
        )
        .unwrap();
        let diff = st
            .latents()
            .f_sub(&reference.latents)
            .unwrap()
            .abs()
            .max()
            .double_value(&[]);
        assert!(diff < 1e-5, "max diff {diff}");
    }

    #[test]
    fn batch_at_different_steps_matches_alone() {
        let (m, s) = model();
        let p = pipe(&m, &s);
        let run_alone = |r: StepRequest| {
            let mut st = DenoiseState::new(&p, &r).unwrap();
            while !st.is_done() {
                st.step(&p).unwrap();
            }
            st.latents().shallow_clone()
        };
        let a_alone = run_alone(req("a red circle", 1, 4));
        let b_alone = run_alone(req("a blue square", 2, 6));
        let mut a = DenoiseState::new(&p, &req("a red circle", 1, 4)).unwrap();
        let mut b = DenoiseState::new(&p, &req("a blue square", 2, 6)).unwrap();
        b.step(&p).unwrap(); // b is one step ahead
        while !a.is_done() || !b.is_done() {
            step_batch(&p, &mut [&mut a, &mut b]).unwrap();
        }
        for (x, y) in [(a.latents(), &a_alone), (b.latents(), &b_alone)] {
            let diff = x.f_sub(y).unwrap().abs().max().double_value(&[]);
            assert!(diff < 1e-4, "max diff {diff}");
        }
    }

    #[test]
    fn edit_matches_inpaint_pipeline() {
        let (m, s) = model();
        let p = pipe(&m, &s);
        let template = Tensor::rand([1, 3, 64, 64], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
        // Repaint the top-left quarter: pixel mask and the matching 16x16 token mask.
        let mask = Tensor::zeros([1, 1, 64, 64], (Kind::Float, Device::Cpu));
        let _ = mask.narrow(2, 0, 32).narrow(3, 0, 32).fill_(1.0);
        let token_mask = crate::packing::token_mask(&mask, 4).unwrap().view([-1]);
        let mut r = req("a green triangle", 5, 4);
        r.edit = Some(EditSpec {
            template: template.shallow_clone(),
            token_mask,
            strength: 1.0,
            template_seed: None,
        });
        let mut st = DenoiseState::new(&p, &r).unwrap();
        while !st.is_done() {
            st.step(&p).unwrap();
        }
        let opts = GenerateOptions {
            height: 64,
            width: 64,
            steps: 4,
            ..Default::default()
        };
        let requests = [GenerationRequest {
            prompt: "a green triangle".into(),
            seed: 5,
        }];
        let reference = inpaint(
            &p,
            &InpaintInputs {
                requests: &requests,
                templates: &template,
                masks: &mask,
                strength: 1.0,
            },
            &opts,
            None,
        )
        .unwrap();
        let diff = st
            .latents()
            .f_sub(&reference.latents)
            .unwrap()
            .abs()
            .max()
            .double_value(&[]);
        assert!(diff < 1e-5, "max diff {diff}");
    }

    #[test]
    fn bad_edit_inputs_name_the_field() {
        let (m, s) = model();
        let p = pipe(&m, &s);
        let mut r = req("x", 1, 2);
        r.edit = Some(EditSpec {
            template: Tensor::zeros([1, 3, 32, 32], (Kind::Float, Device::Cpu)),
            token_mask: Tensor::zeros([256], (Kind::Bool, Device::Cpu)),
            strength: 1.0,
            template_seed: None,
        });
        let err = DenoiseState::new(&p, &r).err().unwrap().to_string();
        assert!(err.contains("template"), "{err}");
        r.edit = Some(EditSpec {
            template: Tensor::zeros([1, 3, 64, 64], (Kind::Float, Device::Cpu)),
            token_mask: Tensor::zeros([10], (Kind::Bool, Device::Cpu)),
            strength: 1.0,
            template_seed: None,
        });
        let err = DenoiseState::new(&p, &r).err().unwrap().to_string();
        assert!(err.contains("token_mask"), "{err}");
    }

    #[test]
    fn cached_preparation_steps_exactly_like_fresh_preparation() {
        let (m, s) = model();
        let p = pipe(&m, &s);
        let template = Tensor::rand([1, 3, 64, 64], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
        let edit = |prompt: &str, seed: u64, every: i64| {
            let mut r = req(prompt, seed, 3);
            r.edit = Some(EditSpec {
                template: template.shallow_clone(),
                token_mask: Tensor::arange(256, (Kind::Int64, Device::Cpu))
                    .remainder(every)
                    .eq(0),
                strength: 1.0,
                template_seed: Some(9),
            });
            r
        };
        let run = |mut st: DenoiseState| {
            while !st.is_done() {
                st.step(&p).unwrap();
            }
            st.latents().shallow_clone()
        };
        let mut cache = ConditioningCache::new(1 << 20);
        let requests = [
            edit("a red circle", 1, 3),
            edit("a red circle", 2, 5),
            edit("a blue square", 3, 2),
            edit("a red circle", 4, 7),
        ];
        for r in &requests {
            let fresh = run(DenoiseState::new(&p, r).unwrap());
            let cached = run(DenoiseState::new_cached(&p, r, &mut cache, Some("tpl-a")).unwrap());
            assert!(fresh.equal(&cached), "seed {}", r.seed);
        }
        let c = cache.counts();
        assert_eq!((c.prompts.hits, c.prompts.misses), (2, 2));
        assert_eq!((c.template_latents.hits, c.template_latents.misses), (3, 1));
        assert_eq!((c.template_noise.hits, c.template_noise.misses), (3, 1));
        // A template without a key is never shared; a budget of 0 keeps nothing.
        let mut none = ConditioningCache::new(0);
        for r in &requests[..2] {
            let fresh = run(DenoiseState::new(&p, r).unwrap());
            let cached = run(DenoiseState::new_cached(&p, r, &mut none, None).unwrap());
            assert!(fresh.equal(&cached));
        }
        let c = none.counts();
        assert_eq!(
            (
                c.prompts.hits,
                c.template_latents.hits,
                c.template_latents.misses
            ),
            (0, 0, 0)
        );
        assert_eq!(c.prompts.bytes + c.template_noise.bytes, 0);
    }
}
