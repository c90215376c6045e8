//! ControlNet-steered Stable Diffusion against diffusers 0.42.1 (python/parity/
//! gen_sd_controlnet_pipeline.py): `StableDiffusionControlNetPipeline` and
//! `StableDiffusionXLControlNetPipeline` from given latents with one ControlNet and with two
//! (`MultiControlNetModel`, each with its own image and scale), within 2e-3 of diffusers'
//! images; a steered request batched with an unsteered one ends as each does alone; and a
//! steered state stepped without its residuals is refused.
mod py_fixture;

use diffmesh_model::stable_diffusion::control::SdControl;
use diffmesh_model::stable_diffusion::{SdPipeline, SdRequest};
use diffmesh_model::unet::ControlNetModel;
use py_fixture::{generate, max_abs_diff, read_tensors};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};

#[derive(serde::Deserialize)]
struct Cases {
    height: i64,
    width: i64,
    steps: usize,
    guidance_scale: f64,
    prompt: String,
    negative_prompt: String,
    single_scale: f64,
    multi_scales: Vec<f64>,
    control_images: Vec<String>,
    cases: std::collections::BTreeMap<String, Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    controlnets: Vec<String>,
}

fn fixture() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| generate("gen_sd_controlnet_pipeline.py", &[], "parity-sd-controlnet"))
}

fn cases(dir: &Path) -> Cases {
    serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap()
}

/// A control image as the pipelines take it: `[1, 3, H, W]` in [0, 1].
fn control_image(path: &Path) -> Tensor {
    let signed = diffmesh_model::pipeline::cli::read_image(path).unwrap();
    // read_image gives [-1, 1] from u8 / 255; undo it exactly enough for 1e-7.
    signed.f_add_scalar(1.0).unwrap().f_div_scalar(2.0).unwrap()
}

fn request(c: &Cases) -> SdRequest {
    SdRequest {
        prompt: c.prompt.clone(),
        negative_prompt: Some(c.negative_prompt.clone()),
        height: c.height,
        width: c.width,
        steps: c.steps,
        guidance_scale: c.guidance_scale,
        scheduler: None,
    }
}

fn latents(dir: &Path) -> Tensor {
    read_tensors(&dir.join("latents.safetensors"))
        .remove("latents")
        .unwrap()
}

fn no_noise(_: usize, _: &[i64]) -> diffmesh_model::Result<Tensor> {
    unreachable!("the checkpoints' DDIM and Euler draw no noise")
}

fn steered_matches_diffusers(case: &str) {
    let dir = fixture();
    let c = cases(dir);
    let pipe = SdPipeline::load(&dir.join(case), Device::Cpu, Kind::Float).unwrap();
    let nets: Vec<ControlNetModel> = c.cases[case]
        .controlnets
        .iter()
        .map(|n| {
            let folder = dir.join(format!("{case}_controlnets")).join(n);
            ControlNetModel::load(&folder, Device::Cpu, Kind::Float).unwrap()
        })
        .collect();
    let images: Vec<Tensor> = c
        .control_images
        .iter()
        .map(|p| control_image(&dir.join(p)))
        .collect();
    let expected = read_tensors(&dir.join(format!("{case}_expected.safetensors")));
    let req = request(&c);
    let x = latents(dir);
    let plain = pipe.generate(&req, &x, &mut no_noise).unwrap();
    let err = max_abs_diff(&plain, &expected["plain"]);
    println!("{case} plain: max abs err {err:.2e}");
    assert!(err <= 2e-3, "{case} plain: {err}");
    let runs: [(&str, Vec<f64>); 2] = [
        ("single", vec![c.single_scale]),
        ("multi", c.multi_scales.clone()),
    ];
    for (key, scales) in runs {
        let controls = scales
            .iter()
            .zip(&images)
            .map(|(&scale, image)| SdControl {
                image: image.shallow_clone(),
                scale,
            })
            .collect();
        let chosen: Vec<&ControlNetModel> = nets.iter().take(scales.len()).collect();
        let got = pipe
            .generate_steered(&req, &x, controls, &chosen, &mut no_noise)
            .unwrap();
        let want = &expected[key];
        let err = max_abs_diff(&got, want);
        let moved = max_abs_diff(want, &expected["plain"]);
        println!("{case} {key}: max abs err {err:.2e} (the ControlNets move it by {moved:.2e})");
        assert!(moved > 0.02, "{case} {key}: the ControlNets barely steer");
        assert!(err <= 2e-3, "{case} {key}: {err}");
    }
}

#[test]
fn sd21_controlnet_pipelines_match_diffusers() {
    steered_matches_diffusers("sd21");
}

#[test]
fn sdxl_controlnet_pipelines_match_diffusers() {
    steered_matches_diffusers("sdxl");
}

#[test]
fn steered_and_plain_requests_batch_as_they_run_alone() {
    let dir = fixture();
    let c = cases(dir);
    let pipe = SdPipeline::load(&dir.join("sd21"), Device::Cpu, Kind::Float).unwrap();
    let net = ControlNetModel::load(
        &dir.join("sd21_controlnets").join("edges"),
        Device::Cpu,
        Kind::Float,
    )
    .unwrap();
    let req = request(&c);
    let x = latents(dir);
    let image = control_image(&dir.join(&c.control_images[0]));
    let steer = || SdControl {
        image: image.shallow_clone(),
        scale: 0.9,
    };
    let alone_steered = pipe
        .generate_steered(&req, &x, vec![steer()], &[&net], &mut no_noise)
        .unwrap();
    let alone_plain = pipe.generate(&req, &x, &mut no_noise).unwrap();

    let mut steered = pipe.prepare(&req, &x, None).unwrap();
    pipe.steer(&mut steered, vec![steer()]).unwrap();
    let mut plain = pipe.prepare(&req, &x, None).unwrap();
    // Stepped without its residuals, a steered state is refused (and not stepped).
    let err = pipe
        .step_batch(
            &mut [&mut plain, &mut steered],
            &mut |_, _, _| unreachable!(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("steered"), "{err}");
    assert_eq!(steered.next_step(), 0);
    while !steered.done() {
        let r = steered
            .control_step()
            .unwrap()
            .map(|s| s.residuals(&[&net]).unwrap());
        pipe.step_batch_steered(
            &mut [&mut plain, &mut steered],
            &mut |_, _, _| unreachable!(),
            &[None, r],
        )
        .unwrap();
    }
    for (what, batched, alone) in [
        ("steered", pipe.decode(&steered).unwrap(), alone_steered),
        ("plain", pipe.decode(&plain).unwrap(), alone_plain),
    ] {
        let err = max_abs_diff(&batched, &alone);
        println!("{what} batched vs alone: {err:.2e}");
        assert!(err <= 1e-5, "{what}: {err}");
    }
    // A control image of the wrong size is refused, naming it.
    let mut other = pipe.prepare(&req, &x, None).unwrap();
    let small = SdControl {
        image: Tensor::zeros([1, 3, 8, 8], (Kind::Float, Device::Cpu)),
        scale: 1.0,
    };
    let err = pipe.steer(&mut other, vec![small]).unwrap_err();
    assert!(err.to_string().contains("controls[0].image"), "{err}");
}
