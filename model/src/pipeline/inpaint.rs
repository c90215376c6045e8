//! Template inpainting (`FluxInpaintPipeline.__call__` for the 16-channel transformer): after every
//! Euler step, unmasked latents are replaced by the template latents re-noised to the next sigma
//! (`scale_noise(template, sigmas[i + 1], noise)`), and by the clean template latents after the
//! last step, so the unmasked region ends exactly on the template.
//!
//! The blend mask is per token: a token is masked when any pixel under it is (see
//! [`crate::packing`]), where diffusers interpolates the mask per latent pixel. This is the mask
//! mask-aware serving computes with, so full-compute and mask-aware runs blend identically.
use super::{FluxPipeline, GenerateOptions, GenerationRequest, Observer, Prepared, StepEvent};
use crate::error::{ModelError, Result};
use crate::noise_scheduler::scale_noise_with_sigmas;
use crate::packing::{pack_latents, token_mask, MASK_THRESHOLD};
use tch::{Kind, Tensor};

/// Templates and masks of a batch (one row per request, or one row shared by all).
#[derive(Debug)]
pub struct InpaintInputs<'a> {
    pub requests: &'a [GenerationRequest],
    /// `[B or 1, 3, H, W]` in [-1, 1], `H x W` = `opts.height x opts.width`.
    pub templates: &'a Tensor,
    /// `[B or 1, 1, H, W]` in [0, 1]; pixels `>= 0.5` are repainted.
    pub masks: &'a Tensor,
    /// Fraction of the schedule to run, in (0, 1]; 1 starts from pure noise.
    pub strength: f64,
}

#[derive(Debug)]
pub struct InpaintOutput {
    /// Model output composited onto the template: masked pixels from `decoded`, all others
    /// exactly the template's.
    pub images: Tensor,
    /// The decoded model-resolution output before compositing (unclamped).
    pub decoded: Tensor,
    /// Final packed latents `[B, N, 4C]`; unmasked tokens equal the template latents.
    pub latents: Tensor,
    /// `[B, N]` bool, true for repainted tokens.
    pub token_mask: Tensor,
}

/// Expand a `[1, ...]` tensor to `batch` rows, or check it already has them.
pub(crate) fn rows(
    t: &Tensor,
    batch: i64,
    field: &str,
    channels: i64,
    h: i64,
    w: i64,
) -> Result<Tensor> {
    let s = t.size();
    if s.len() != 4 || s[1] != channels || s[2] != h || s[3] != w || (s[0] != 1 && s[0] != batch) {
        return Err(ModelError::input(
            field,
            format!("expected [{batch} or 1, {channels}, {h}, {w}], got {s:?}"),
        ));
    }
    Ok(t.f_expand([batch, channels, h, w], false)?)
}

/// Repaint the masked region of each template according to its prompt.
pub fn inpaint(
    p: &FluxPipeline<'_>,
    inputs: &InpaintInputs<'_>,
    opts: &GenerateOptions,
    mut observer: Observer<'_>,
) -> Result<InpaintOutput> {
    tch::no_grad(|| {
        let prep = Prepared::new(p, inputs.requests, opts)?;
        let (b, h, w) = (prep.batch, opts.height, opts.width);
        let templates = rows(inputs.templates, b, "templates", 3, h, w)?;
        let masks = rows(inputs.masks, b, "masks", 1, h, w)?;
        let start = prep.schedule.start_index(inputs.strength)?;

        let image_latents = p
            .codec
            .encode(&templates.f_to_device(prep.device)?.f_to_kind(prep.kind)?)?;
        let image_latents = pack_latents(&image_latents.f_to_kind(prep.kind)?)?;
        let seeds: Vec<u64> = inputs.requests.iter().map(|r| r.seed).collect();
        let noise = prep.noise(&seeds, p.codec.latent_channels())?;
        if noise.size() != image_latents.size() {
            return Err(ModelError::input(
                "templates",
                format!(
                    "encoded to {:?}, expected {:?}",
                    image_latents.size(),
                    noise.size()
                ),
            ));
        }
        let token_mask = token_mask(
            &masks.f_to_device(prep.device)?,
            2 * p.codec.downscale_factor(),
        )?;
        let blend = token_mask.f_to_kind(prep.kind)?.f_unsqueeze(-1)?;
        let keep = blend.f_neg()?.f_add_scalar(1.0)?;

        let schedule = &prep.schedule;
        let mut latents =
            scale_noise_with_sigmas(&image_latents, &[schedule.sigmas[start]], &noise)?;
        for index in start..schedule.len() {
            let v = prep.velocity(p.transformer, &latents, index)?;
            latents = schedule.step(index, &v, &latents)?;
            let proper = if index + 1 < schedule.len() {
                schedule.scale_noise(&image_latents, index + 1, &noise)?
            } else {
                image_latents.shallow_clone()
            };
            // diffusers: (1 - init_mask) * init_latents_proper + init_mask * latents.
            latents = keep.f_mul(&proper)?.f_add(&blend.f_mul(&latents)?)?;
            if let Some(obs) = observer.as_mut() {
                obs(&StepEvent {
                    index,
                    schedule,
                    latents: &latents,
                })?;
            }
        }

        let decoded = prep.decode(p.codec, &latents)?;
        let pixel_mask = masks
            .f_to_device(decoded.device())?
            .f_ge(MASK_THRESHOLD as f64)?;
        let template = templates
            .f_to_device(decoded.device())?
            .f_to_kind(decoded.kind())?;
        let images = decoded.f_where_self(&pixel_mask, &template)?;
        debug_assert_eq!(token_mask.kind(), Kind::Bool);
        Ok(InpaintOutput {
            images,
            decoded,
            latents,
            token_mask,
        })
    })
}
