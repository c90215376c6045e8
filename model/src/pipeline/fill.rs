//! FLUX.1-Fill (`FluxFillPipeline.__call__` at its default `strength` 1): the transformer sees,
//! after each token's latents, the packed latents of the image with the masked region blanked and
//! the packed pixel mask (`f x f` mask pixels per latent pixel, `4 f^2` values per token), and
//! repaints the masked region from noise. Nothing is blended: the model keeps the rest itself.
//!
//! As everywhere in diffmesh, the masked image is encoded to the VAE's posterior mean where
//! diffusers samples the posterior with the request's generator.
use super::inpaint::rows;
use super::{FluxPipeline, GenerateOptions, GenerateOutput, GenerationRequest, Observer, Prepared};
use crate::error::Result;
use crate::packing::{pack_latents, MASK_THRESHOLD};
use tch::{Kind, Tensor};

/// Images and masks of a Fill batch (one row per request, or one row shared by all).
#[derive(Debug)]
pub struct FillInputs<'a> {
    pub requests: &'a [GenerationRequest],
    /// `[B or 1, 3, H, W]` in [-1, 1], `H x W` = `opts.height x opts.width`.
    pub images: &'a Tensor,
    /// `[B or 1, 1, H, W]` in [0, 1]; pixels `>= 0.5` are repainted (diffusers binarises so).
    pub masks: &'a Tensor,
}

/// Conditioning channels per token the Fill transformer takes after the latents.
pub fn fill_conditioning_channels(latent_channels: i64, downscale_factor: i64) -> i64 {
    4 * latent_channels + 4 * downscale_factor * downscale_factor
}

/// The packed conditioning `[B, N, 4C + 4f^2]`: masked image latents, then the mask.
pub fn fill_conditioning(
    p: &FluxPipeline<'_>,
    images: &Tensor,
    binary_masks: &Tensor,
    kind: Kind,
) -> Result<Tensor> {
    let f = p.codec.downscale_factor();
    let masked = images.f_mul(&binary_masks.f_neg()?.f_add_scalar(1.0)?)?;
    let masked_latents = pack_latents(&p.codec.encode(&masked.f_to_kind(kind)?)?.f_to_kind(kind)?)?;
    // diffusers: mask[:, 0].view(B, h, f, w, f).permute(0, 2, 4, 1, 3) -> [B, f*f, h, w], packed.
    let [b, _, height, width] = <[i64; 4]>::try_from(binary_masks.size().as_slice())
        .map_err(|_| crate::error::ModelError::input("masks", "expected [B, 1, H, W]"))?;
    let (h, w) = (height / f, width / f);
    let mask = binary_masks
        .f_select(1, 0)?
        .f_reshape([b, h, f, w, f])?
        .f_permute([0, 2, 4, 1, 3])?
        .f_reshape([b, f * f, h, w])?;
    let mask = pack_latents(&mask.f_to_kind(kind)?)?;
    Ok(Tensor::f_cat(&[masked_latents, mask], 2)?)
}

/// Repaint the masked region of each image according to its prompt, from `initial` packed
/// latents when given (`latents=`), else from each request's seeded noise.
pub fn fill(
    p: &FluxPipeline<'_>,
    inputs: &FillInputs<'_>,
    opts: &GenerateOptions,
    initial: Option<&Tensor>,
    observer: Observer<'_>,
) -> Result<GenerateOutput> {
    tch::no_grad(|| {
        let channels = p.codec.latent_channels();
        let extra = fill_conditioning_channels(channels, p.codec.downscale_factor());
        let prep = Prepared::with_conditioning(p, inputs.requests, opts, None, extra)?;
        let (b, h, w) = (prep.batch, opts.height, opts.width);
        let images = rows(inputs.images, b, "image", 3, h, w)?
            .f_to_device(prep.device)?
            .f_to_kind(Kind::Float)?;
        let masks = rows(inputs.masks, b, "mask", 1, h, w)?
            .f_to_device(prep.device)?
            .f_ge(MASK_THRESHOLD as f64)?
            .f_to_kind(Kind::Float)?;
        let conditioning = fill_conditioning(p, &images, &masks, prep.kind)?;
        let latents = prep.initial_latents(inputs.requests, channels, initial)?;
        prep.denoise_and_decode(p, latents, Some(&conditioning), observer)
    })
}
