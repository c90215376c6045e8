//! `StableDiffusionInpaintPipeline` and `StableDiffusionXLInpaintPipeline` (diffusers 0.42.1):
//! an image repainted under a mask. With
//! a plain 4-channel UNet the latents outside the mask are replaced after every step by the
//! image's own latents noised to the next step's level (latent blending); a 9-channel
//! inpainting UNet takes the latent mask and the masked image's latents as extra input channels
//! instead. `strength` starts the schedule late, as diffusers' `get_timesteps` does. The image is
//! encoded to its posterior mean (diffusers samples the posterior; serving keeps one latent per
//! image, as the Flux pipelines here do).
use super::stepper::Extra;
use super::{SdPipeline, SdRequest};
use crate::components::LatentCodec;
use crate::error::{ModelError, Result};
use tch::{Kind, Tensor};

pub use super::inputs::InpaintInputs;

impl SdPipeline {
    /// The repainted image `[1, 3, H, W]` in [0, 1] from `latents` (the initial noise, as
    /// diffusers' `latents=`).
    pub fn inpaint(
        &self,
        req: &SdRequest,
        inputs: &InpaintInputs,
        latents: &Tensor,
        noise: &mut dyn FnMut(usize, &[i64]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.run_alone(req, latents, Some(inputs), noise)
    }

    /// The step an inpainting request starts at (of `steps`), and what it adds to each step.
    pub(super) fn inpaint_extra(
        &self,
        req: &SdRequest,
        inputs: &InpaintInputs,
        latents: &Tensor,
        steps: usize,
    ) -> Result<(usize, Extra)> {
        for (field, t, channels) in [("image", inputs.image, 3), ("mask_image", inputs.mask, 1)] {
            if t.size() != [1, channels, req.height, req.width] {
                return Err(ModelError::input(
                    field,
                    format!(
                        "expected [1, {channels}, {}, {}], got {:?}",
                        req.height,
                        req.width,
                        t.size()
                    ),
                ));
            }
        }
        if !(inputs.strength > 0.0 && inputs.strength <= 1.0) {
            return Err(ModelError::input("strength", "must be in (0, 1]"));
        }
        let run = ((steps as f64 * inputs.strength) as usize).min(steps);
        if run == 0 {
            return Err(ModelError::input(
                "strength",
                format!("{} of {steps} steps leaves none to run", inputs.strength),
            ));
        }
        let (device, _) = self.unet.device_kind();
        let vae_kind = self.vae.kind();
        let latent_channels = self.vae.latent_channels();
        let extra = tch::no_grad(|| -> Result<Extra> {
            let mask = inputs.mask.f_ge(0.5)?.f_to_kind(Kind::Float)?;
            let f = self.vae.downscale_factor();
            let latent_mask = mask
                .f_upsample_nearest2d([req.height / f, req.width / f], None, None)?
                .f_to_device(device)?;
            let encode = |image: &Tensor| -> Result<Tensor> {
                let on = image.f_to_device(device)?.f_to_kind(vae_kind)?;
                Ok(self.vae.encode(&on)?.f_to_kind(Kind::Float)?)
            };
            match self.unet.config.in_channels {
                c if c == latent_channels => Ok(Extra::Blend {
                    image: encode(inputs.image)?,
                    mask: latent_mask,
                    noise: latents.f_to_device(device)?.f_to_kind(Kind::Float)?,
                }),
                c if c == 2 * latent_channels + 1 => {
                    let keep = mask.f_lt(0.5)?.f_to_kind(Kind::Float)?;
                    Ok(Extra::Concat {
                        mask: latent_mask,
                        masked: encode(&inputs.image.f_mul(&keep)?)?,
                    })
                }
                c => Err(ModelError::config(
                    "in_channels",
                    format!(
                        "an inpainting UNet takes {latent_channels} or {} channels, not {c}",
                        2 * latent_channels + 1
                    ),
                )),
            }
        })?;
        Ok((steps - run, extra))
    }
}
