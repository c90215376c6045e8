//! In-process references for the UNet mesh tests: the reduced SD 2.1 pipeline and ControlNets
//! they serve, an SD pipeline's own images (plain and steered), and a template edit computed in
//! full and mask-aware, as the UNet engine runs them.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use diffmesh_model::components::LatentCodec;
use diffmesh_model::pipeline::noise::seeded_noise;
use diffmesh_model::stable_diffusion::control::SdControl;
use diffmesh_model::stable_diffusion::inpaint::InpaintInputs;
use diffmesh_model::stable_diffusion::stepper::SdState;
use diffmesh_model::stable_diffusion::{SdPipeline, SdRequest};
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::unet::ControlNetModel;

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

/// The reduced SD 2.1 pipeline of python/parity/gen_sd21_pipeline.py (random weights), made
/// in `out` (a test's own folder under cargo's test temp dir) unless it is there.
pub fn sd21_fixture(out: &Path) -> PathBuf {
    diffmesh_shared::testing::parity_fixture("gen_sd21_pipeline.py", out).join("sd21")
}

/// Two random ControlNets (`edges`, `depth`, diffusers' `ControlNetModel`) that fit the UNet of
/// the pipeline in `sd`, made in `out`; the folder holding them.
pub fn controlnets_fixture(sd: &Path, out: &Path) -> PathBuf {
    let unet = sd.join("unet");
    diffmesh_shared::testing::parity_fixture_with(
        "gen_sd_controlnet_pipeline.py",
        &["--for-unet".as_ref(), unet.as_os_str()],
        out,
    )
}

/// A control image as the codec prepares it (a resize to the model resolution), `[1, 3, H, W]`
/// in [0, 1].
pub fn control_tensor(control: &image::DynamicImage, height: u32, width: u32) -> Tensor {
    let rgb = image::imageops::resize(
        &control.to_rgb8(),
        width,
        height,
        image::imageops::FilterType::Triangle,
    );
    Tensor::from_slice(rgb.as_raw())
        .view([i64::from(height), i64::from(width), 3])
        .permute([2, 0, 1])
        .to_kind(Kind::Float)
        .f_div_scalar(255.0)
        .unwrap()
        .unsqueeze(0)
}

/// The pipeline's own generation of `request` from `seed`'s latents, steered by `controls`
/// (control image, scale, ControlNet; residuals summed), as RGB bytes. The scheduler must draw
/// no noise.
pub fn steered(
    pipe: &SdPipeline,
    (request, seed): &(SdRequest, u64),
    controls: &[(&image::DynamicImage, f32, &ControlNetModel)],
) -> Vec<u8> {
    let (h, w) = (request.height, request.width);
    let mut state = pipe
        .prepare(request, &latents(pipe, *seed, h, w), None)
        .unwrap();
    let steer = controls
        .iter()
        .map(|(image, scale, _)| SdControl {
            image: control_tensor(image, h as u32, w as u32),
            scale: f64::from(*scale),
        })
        .collect();
    pipe.steer(&mut state, steer).unwrap();
    let nets: Vec<&ControlNetModel> = controls.iter().map(|c| c.2).collect();
    while !state.done() {
        let r = state
            .control_step()
            .unwrap()
            .map(|step| step.residuals(&nets).unwrap());
        let mut none = |_: usize, _: usize, _: &[i64]| -> diffmesh_model::Result<Tensor> {
            unreachable!("the scheduler draws no noise")
        };
        pipe.step_batch_steered(&mut [&mut state], &mut none, &[r])
            .unwrap();
    }
    to_rgb(&pipe.decode(&state).unwrap())
}
