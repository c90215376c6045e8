//! Cheap previews of an image mid-trajectory: the current latents mapped to RGB pixel by pixel
//! with one linear map (latent channels plus a bias to RGB), not decoded. ComfyUI's "latent2rgb"
//! previews use such maps, fitted by hand per model family; here the map is fitted when the
//! model loads, by least squares on calibration images run through the model's own encoder,
//! so any checkpoint (and random weights) gets one. A preview costs one small matmul and a
//! resize, against a VAE decode for the real image.
use crate::components::LatentCodec;
use crate::error::Result;
use crate::pipeline::noise::seeded_noise;
use tch::{Device, Kind, Tensor};

/// Calibration images, and their side in latent pixels.
const CALIBRATION_IMAGES: i64 = 12;
const CALIBRATION_LATENT_SIDE: i64 = 8;

/// A latent-to-RGB map fitted for one codec.
pub struct LatentPreview {
    /// `[C + 1, 3]`: per channel (and the bias) its weight in R, G, B.
    map: Tensor,
    /// How well the map explains the calibration images: RMS error in [-1, 1] pixel units.
    pub fit_rms: f64,
}

impl LatentPreview {
    /// Fit the map for `codec`: calibration images of smooth random colour fields (fixed seeds)
    /// encoded by it, regressed on the images averaged down to latent resolution.
    pub fn fit(codec: &dyn LatentCodec, device: Device) -> Result<Self> {
        tch::no_grad(|| {
            let f = codec.downscale_factor().max(1);
            let side = CALIBRATION_LATENT_SIDE * f;
            let coarse = seeded_noise(
                0x5eed_1a7e,
                &[CALIBRATION_IMAGES, 3, 3, 3],
                Device::Cpu,
                Kind::Float,
            )?;
            // Smooth fields in [-1, 1]: what an image looks like at latent resolution.
            let images = coarse
                .f_tanh()?
                .f_upsample_bilinear2d([side, side], false, None, None)?
                .f_to_device(device)?;
            let latents = codec
                .encode(&images)?
                .f_to_kind(Kind::Float)?
                .f_to_device(Device::Cpu)?;
            let (h, w) = (latents.size()[2], latents.size()[3]);
            let target = images
                .f_to_device(Device::Cpu)?
                .f_adaptive_avg_pool2d([h, w])?;
            let x = with_bias(&latents)?;
            let y = target.f_permute([0, 2, 3, 1])?.f_reshape([-1, 3])?;
            let (map, _, _, _) = x.f_linalg_lstsq(&y, None::<f64>, "gelsd")?;
            let rms = x
                .f_matmul(&map)?
                .f_sub(&y)?
                .f_square()?
                .f_mean(Kind::Float)?
                .f_sqrt()?
                .f_double_value(&[])?;
            Ok(Self { map, fit_rms: rms })
        })
    }

    /// The preview of `latents` `[1, C, h, w]` (scaled as the pipeline holds them) at
    /// `height` x `width`: `[1, 3, height, width]` in [-1, 1].
    pub fn rgb(&self, latents: &Tensor, height: i64, width: i64) -> Result<Tensor> {
        tch::no_grad(|| {
            let latents = latents.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?;
            let (h, w) = (latents.size()[2], latents.size()[3]);
            let rgb = with_bias(&latents)?
                .f_matmul(&self.map)?
                .f_reshape([1, h, w, 3])?
                .f_permute([0, 3, 1, 2])?
                .f_contiguous()?;
            Ok(rgb
                .f_upsample_bilinear2d([height, width], false, None, None)?
                .f_clamp(-1.0, 1.0)?)
        })
    }
}

/// `[N, C, h, w]` latents as rows `[N * h * w, C + 1]`, the last column ones.
fn with_bias(latents: &Tensor) -> Result<Tensor> {
    let c = latents.size()[1];
    let rows = latents.f_permute([0, 2, 3, 1])?.f_reshape([-1, c])?;
    let ones = Tensor::f_ones([rows.size()[0], 1], (Kind::Float, Device::Cpu))?;
    Ok(Tensor::f_cat(&[&rows, &ones], 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A codec whose latents are a known linear function of the averaged pixels: the fit must
    /// recover it, and the preview of an encoded image is that image at latent resolution.
    struct Linear;

    impl LatentCodec for Linear {
        fn encode(&self, images: &Tensor) -> Result<Tensor> {
            let pooled = images.f_avg_pool2d([4, 4], [4, 4], [0, 0], false, true, None::<i64>)?;
            let r = pooled.f_narrow(1, 0, 1)?;
            let g = pooled.f_narrow(1, 1, 1)?;
            let b = pooled.f_narrow(1, 2, 1)?;
            // Four channels: mixes of R, G, B plus an offset.
            Ok(Tensor::f_cat(
                &[
                    r.f_add(&g)?,
                    g.f_sub(&b)?,
                    b.f_mul_scalar(2.0)?,
                    r.f_add_scalar(0.5)?,
                ],
                1,
            )?)
        }
        fn decode(&self, _: &Tensor) -> Result<Tensor> {
            unreachable!()
        }
        fn latent_channels(&self) -> i64 {
            4
        }
        fn downscale_factor(&self) -> i64 {
            4
        }
    }

    #[test]
    fn the_fit_recovers_a_linear_codec() {
        let preview = LatentPreview::fit(&Linear, Device::Cpu).unwrap();
        assert!(preview.fit_rms < 1e-4, "rms {}", preview.fit_rms);
        let image = Tensor::rand([1, 3, 16, 16], (Kind::Float, Device::Cpu)) * 1.6 - 0.8;
        let latents = Linear.encode(&image).unwrap();
        let got = preview.rgb(&latents, 4, 4).unwrap();
        let want = image.avg_pool2d([4, 4], [4, 4], [0, 0], false, true, None::<i64>);
        let err = (got - want).abs().max().double_value(&[]);
        assert!(err < 1e-4, "max error {err}");
    }
}
