//! In-process references for the UNet mesh tests: an SD pipeline's own images, and a template
//! edit computed in full and mask-aware, as the UNet engine runs them.
use std::sync::Arc;

use diffmesh_model::components::LatentCodec;
use diffmesh_model::pipeline::noise::seeded_noise;
use diffmesh_model::stable_diffusion::inpaint::InpaintInputs;
use diffmesh_model::stable_diffusion::stepper::SdState;
use diffmesh_model::stable_diffusion::{SdPipeline, SdRequest};
use diffmesh_model::tch::{Device, Kind, Tensor};

/// `state` stepped to its end alone (its scheduler must draw no noise: DDIM, Euler).
pub fn finish(pipe: &SdPipeline, state: &mut SdState) {
    while !state.done() {
        let mut none = |_: usize, _: usize, _: &[i64]| -> diffmesh_model::Result<Tensor> {
            unreachable!("the scheduler draws no noise")
        };
        pipe.step_batch(&mut [state], &mut none).unwrap();
    }
}

/// `state` stepped to its end alone and decoded (`[1, 3, H, W]` in [0, 1]).
pub fn run_alone(pipe: &SdPipeline, mut state: SdState) -> Tensor {
    finish(pipe, &mut state);
    pipe.decode(&state).unwrap()
}

/// An image in [0, 1] as the RGB8 bytes the mesh answers with.
pub fn to_rgb(image01: &Tensor) -> Vec<u8> {
    let signed = image01
        .f_mul_scalar(2.0)
        .unwrap()
        .f_sub_scalar(1.0)
        .unwrap();
    diffmesh_denoiser::model::tensor_to_rgb(&signed).unwrap()
}

/// The engine's initial latents for `seed` at `height` x `width`.
pub fn latents(pipe: &SdPipeline, seed: u64, height: i64, width: i64) -> Tensor {
    let f = pipe.vae.downscale_factor();
    let shape = [1, pipe.vae.latent_channels(), height / f, width / f];
    seeded_noise(seed, &shape, Device::Cpu, Kind::Float).unwrap()
}

/// A template edit as the engine runs it: `image` (`[1, 3, H, W]` in [-1, 1]) captured under
/// `capture` from `template_seed`'s noise, edited under `edit` inside the pixel rectangle
/// `(x0, y0, x1, y1)` from latents carrying the template's noise outside it and `edit_seed`'s
/// inside. Returns the edit computed in full and mask-aware, both `[1, 3, H, W]` in [0, 1].
pub fn template_edit(
    pipe: &SdPipeline,
    image: &Tensor,
    rect: (i64, i64, i64, i64),
    (capture, template_seed): (&SdRequest, u64),
    (edit, edit_seed): (&SdRequest, u64),
) -> (Tensor, Tensor) {
    let (x0, y0, x1, y1) = rect;
    let (h, w) = (edit.height, edit.width);
    let mask = Tensor::zeros([1, 1, h, w], (Kind::Float, Device::Cpu));
    let _ = mask
        .narrow(2, y0, y1 - y0)
        .narrow(3, x0, x1 - x0)
        .fill_(1.0);
    let (noise, own) = (
        latents(pipe, template_seed, h, w),
        latents(pipe, edit_seed, h, w),
    );
    let m = mask.upsample_nearest2d([noise.size()[2], noise.size()[3]], None, None);
    let mixed = &noise + (&own - &noise) * &m;
    let inputs = InpaintInputs {
        image,
        mask: &mask,
        strength: 1.0,
    };
    let full = run_alone(pipe, pipe.prepare(edit, &mixed, Some(&inputs)).unwrap());
    let mut captured = pipe.prepare_capture(capture, &noise, image, 1.0).unwrap();
    finish(pipe, &mut captured);
    let template = Arc::new(captured.into_template().unwrap());
    let aware = pipe.prepare_edit(edit, &mixed, &inputs, template).unwrap();
    (full, run_alone(pipe, aware))
}

/// The pixels of `image` (`[.., H, W]`) in the rectangle `(x0, y0, x1, y1)`.
pub fn crop(image: &Tensor, (x0, y0, x1, y1): (i64, i64, i64, i64)) -> Tensor {
    image.narrow(-2, y0, y1 - y0).narrow(-1, x0, x1 - x0)
}
