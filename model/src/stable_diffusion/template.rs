//! FlashPS on the Stable Diffusion loop: a template's capture and its mask-aware edits as
//! states [`SdPipeline::step_batch`] steps beside the others.
//!
//! A capture is the template image run as an inpainting request that repaints nothing, so
//! outside any mask an edit's latents follow the capture's exactly (latent blending puts the
//! template's latents, noised with the same noise, there after every step); at each step it
//! records every `Transformer2DModel`'s cache of its rows ([`SdTemplate`]). An edit is an
//! inpainting request of the same schedule and guidance whose UNet computes only its masked
//! tokens at each level, each row reading the template row of its branch. Its initial latents
//! must carry the template's noise outside the mask (the caller mixes them), as the Flux
//! engine's `template_seed` does.
use super::inpaint::InpaintInputs;
use super::stepper::{Attention, SdState};
use super::{SdPipeline, SdRequest};
use crate::error::{ModelError, Result};
use std::sync::Arc;
use tch::{Kind, Tensor};

pub use super::inputs::{SdTemplate, TemplateSteps};

impl SdPipeline {
    /// The state of a template's capture: `image` `[1, 3, H, W]` in [-1, 1] run as an
    /// inpainting request of `strength` that repaints nothing, from `latents` (its noise).
    pub fn prepare_capture(
        &self,
        req: &SdRequest,
        latents: &Tensor,
        image: &Tensor,
        strength: f64,
    ) -> Result<SdState> {
        let nothing =
            Tensor::f_zeros([1, 1, req.height, req.width], (Kind::Float, image.device()))?;
        let inputs = InpaintInputs {
            image,
            mask: &nothing,
            strength,
        };
        let mut state = self.prepare(req, latents, Some(&inputs))?;
        state.attention = Attention::Capture(
            std::iter::repeat_with(|| None)
                .take(state.steps())
                .collect(),
        );
        Ok(state)
    }

    /// The state of a mask-aware edit of `template`: an inpainting request with the
    /// template's step count, strength and guidance (the error names the field that differs).
    pub fn prepare_edit(
        &self,
        req: &SdRequest,
        latents: &Tensor,
        inpaint: &InpaintInputs,
        template: Arc<dyn TemplateSteps>,
    ) -> Result<SdState> {
        let mut state = self.prepare(req, latents, Some(inpaint))?;
        if template.steps() != state.steps() {
            return Err(ModelError::input(
                "num_inference_steps",
                format!(
                    "{} steps; the template was captured with {}",
                    state.steps(),
                    template.steps()
                ),
            ));
        }
        if template.start() != state.next_step() {
            return Err(ModelError::input(
                "strength",
                format!(
                    "starts at step {}; the template's trajectory starts at {}",
                    state.next_step(),
                    template.start()
                ),
            ));
        }
        if template.rows() != state.rows() {
            return Err(ModelError::input(
                "guidance_scale",
                format!(
                    "{} UNet rows a step; the template was captured with {}",
                    state.rows(),
                    template.rows()
                ),
            ));
        }
        let [h, w] = state.latent_side();
        let mask = tch::no_grad(|| -> Result<Tensor> {
            Ok(inpaint
                .mask
                .f_ge(0.5)?
                .f_to_kind(Kind::Float)?
                .f_upsample_nearest2d([h, w], None, None)?
                .f_view([h, w])?)
        })?;
        state.attention = Attention::Edit { template, mask };
        Ok(state)
    }
}

impl SdState {
    /// A finished capture's template; `None` when this state was not a capture or has steps
    /// left.
    pub fn into_template(self) -> Option<SdTemplate> {
        let rows = self.rows();
        match (self.done(), self.attention) {
            (true, Attention::Capture(steps)) => Some(SdTemplate {
                steps: steps.into_iter().map(|s| s.map(Arc::new)).collect(),
                rows,
            }),
            _ => None,
        }
    }
}
