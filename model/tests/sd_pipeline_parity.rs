//! The Stable Diffusion pipelines against diffusers 0.42.1 on reduced random-weight directories:
//! `StableDiffusionXLPipeline` (python/parity/gen_sdxl_pipeline.py; the prompt encoding with a
//! negative prompt and with the zeros SDXL conditions on without one) and SD 2.1's
//! `StableDiffusionPipeline` (gen_sd21_pipeline.py; one encoder's last hidden states, the
//! empty negative prompt encoded, DDIM with v-prediction as its own scheduler), each encoding
//! within 1e-4; the whole pipeline from given latents through `cargo xtask generate`'s code path
//! with the checkpoint's scheduler and two others swapped in by `--scheduler`, within 2e-3; and
//! the inpainting pipelines with a plain 4-channel UNet (latent blending, strength 0.75, Euler)
//! and a 9-channel inpainting UNet (DPM++ 2M Karras), within 2e-3.
mod py_fixture;

use diffmesh_model::stable_diffusion::{generate_file, SdFileArgs, SdPipeline, SdRequest};
use py_fixture::{generate, max_abs_diff, read_tensors};
use std::path::Path;
use tch::{Device, Kind};

#[derive(serde::Deserialize)]
struct Cases {
    /// The pipeline's folder: `sd21` or `sdxl`.
    pipeline: String,
    height: i64,
    width: i64,
    steps: usize,
    guidance_scale: f64,
    prompt: String,
    negative_prompt: String,
    /// The checkpoint's own scheduler, run without `--scheduler`.
    own_scheduler: String,
    schedulers: Vec<String>,
    inpaints: std::collections::BTreeMap<String, Inpaint>,
}

#[derive(serde::Deserialize)]
struct Inpaint {
    dir: String,
    scheduler: Option<String>,
    strength: f64,
}

#[test]
fn sdxl_pipeline_matches_diffusers() {
    let dir = generate("gen_sdxl_pipeline.py", &[], "parity-sdxl-pipeline");
    pipelines_match_diffusers(&dir, |pipe, cases, check| {
        let prompt = pipe.encode_prompt(&cases.prompt).unwrap();
        let negative = pipe
            .negative(Some(&cases.negative_prompt), &prompt)
            .unwrap();
        let zeros = pipe.negative(None, &prompt).unwrap();
        check("prompt_embeds", &prompt.embeds, 1e-4);
        check(
            "pooled_prompt_embeds",
            prompt.pooled.as_ref().unwrap(),
            1e-4,
        );
        check("negative_prompt_embeds", &negative.embeds, 1e-4);
        check(
            "negative_pooled_prompt_embeds",
            negative.pooled.as_ref().unwrap(),
            1e-4,
        );
        check("negative_prompt_embeds_zero", &zeros.embeds, 0.0);
        check(
            "negative_pooled_prompt_embeds_zero",
            zeros.pooled.as_ref().unwrap(),
            0.0,
        );
    });
}

#[test]
fn sd21_pipeline_matches_diffusers() {
    let dir = generate("gen_sd21_pipeline.py", &[], "parity-sd21-pipeline");
    pipelines_match_diffusers(&dir, |pipe, cases, check| {
        let prompt = pipe.encode_prompt(&cases.prompt).unwrap();
        assert!(prompt.pooled.is_none() && !pipe.is_xl());
        let negative = pipe
            .negative(Some(&cases.negative_prompt), &prompt)
            .unwrap();
        // SD encodes the empty negative prompt (no zeros).
        let empty = pipe.negative(None, &prompt).unwrap();
        check("prompt_embeds", &prompt.embeds, 1e-4);
        check("negative_prompt_embeds", &negative.embeds, 1e-4);
        check("prompt_embeds_empty", &prompt.embeds, 1e-4);
        check("negative_prompt_embeds_empty", &empty.embeds, 1e-4);
    });
}

type Check<'a> = &'a dyn Fn(&str, &tch::Tensor, f64);

/// The fixture in `dir` (a generator's OUT_DIR): `encode` checks the prompt encoding, then
/// every text-to-image scheduler and both inpainting pipelines run through `cargo xtask
/// generate`'s code path against diffusers' images.
fn pipelines_match_diffusers(dir: &Path, encode: impl Fn(&SdPipeline, &Cases, Check)) {
    let cases: Cases =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let model_dir = dir.join(&cases.pipeline);
    let pipe = SdPipeline::load(&model_dir, Device::Cpu, Kind::Float).unwrap();
    let want = read_tensors(&dir.join("expected").join("encode.safetensors"));
    let check = |what: &str, got: &tch::Tensor, tolerance: f64| {
        let err = max_abs_diff(got, &want[what]);
        println!("{what}: max abs err {err:.2e}");
        assert!(err <= tolerance, "{what}: {err}");
    };
    tch::no_grad(|| encode(&pipe, &cases, &check));
    assert_eq!(cases.schedulers.len(), 3);
    let request = |scheduler: Option<String>| SdRequest {
        prompt: cases.prompt.clone(),
        negative_prompt: Some(cases.negative_prompt.clone()),
        height: cases.height,
        width: cases.width,
        steps: cases.steps,
        guidance_scale: cases.guidance_scale,
        scheduler,
    };
    for name in &cases.schedulers {
        let out = dir.join(format!("ours_{name}.safetensors"));
        generate_file(&SdFileArgs {
            model_dir: model_dir.clone(),
            request: request((*name != cases.own_scheduler).then(|| name.clone())),
            latents: dir.join("latents.safetensors"),
            seed: 0,
            inpaint: None,
            out: out.clone(),
            device: Device::Cpu,
            kind: Kind::Float,
        })
        .unwrap();
        let got = &read_tensors(&out)["image"];
        let expected = &read_tensors(
            &dir.join("expected")
                .join(format!("image_{name}.safetensors")),
        )["image"];
        let err = max_abs_diff(got, expected);
        let spread = (expected.max() - expected.min()).double_value(&[]);
        println!("{name}: image max abs err {err:.2e} (value spread {spread:.2})");
        assert!(spread > 0.1, "{name}: a flat image proves nothing");
        assert!(err <= 2e-3, "{name}: {err}");
    }
    assert_eq!(cases.inpaints.len(), 2);
    for (name, case) in &cases.inpaints {
        let out = dir.join(format!("ours_inpaint_{name}.safetensors"));
        let scheduler = case.scheduler.clone().filter(|s| *s != cases.own_scheduler);
        generate_file(&SdFileArgs {
            model_dir: dir.join(&case.dir),
            request: request(scheduler),
            latents: dir.join("latents.safetensors"),
            seed: 0,
            inpaint: Some((dir.join("image.png"), dir.join("mask.png"), case.strength)),
            out: out.clone(),
            device: Device::Cpu,
            kind: Kind::Float,
        })
        .unwrap();
        let got = &read_tensors(&out)["image"];
        let file = format!("inpaint_{name}.safetensors");
        let expected = &read_tensors(&dir.join("expected").join(file))["image"];
        let err = max_abs_diff(got, expected);
        println!("inpaint {name}: image max abs err {err:.2e}");
        assert!(err <= 2e-3, "inpaint {name}: {err}");
    }
}

#[test]
fn sdxl_refuses_bad_requests_naming_the_field() {
    let dir = generate("gen_sdxl_pipeline.py", &[], "parity-sdxl-pipeline-errors");
    let pipe = SdPipeline::load(&dir.join("sdxl"), Device::Cpu, Kind::Float).unwrap();
    let latents = read_tensors(&dir.join("latents.safetensors"))["latents"].shallow_clone();
    let base = SdRequest {
        prompt: "x".into(),
        negative_prompt: None,
        height: 32,
        width: 32,
        steps: 2,
        guidance_scale: 5.0,
        scheduler: None,
    };
    let mut no_noise = |_: usize, _: &[i64]| -> diffmesh_model::Result<tch::Tensor> {
        panic!("no ancestral step here")
    };
    for (field, req) in [
        (
            "height",
            SdRequest {
                height: 30,
                ..base.clone()
            },
        ),
        (
            "latents",
            SdRequest {
                width: 48,
                ..base.clone()
            },
        ),
        (
            "scheduler",
            SdRequest {
                scheduler: Some("lms".into()),
                ..base.clone()
            },
        ),
        (
            "num_inference_steps",
            SdRequest {
                steps: 0,
                ..base.clone()
            },
        ),
    ] {
        let err = pipe
            .generate(&req, &latents, &mut no_noise)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    use diffmesh_model::stable_diffusion::inpaint::InpaintInputs;
    let opts = (Kind::Float, Device::Cpu);
    let (image, mask) = (
        tch::Tensor::zeros([1, 3, 32, 32], opts),
        tch::Tensor::ones([1, 1, 32, 32], opts),
    );
    let small = tch::Tensor::ones([1, 1, 16, 32], opts);
    for (field, inputs) in [
        (
            "mask_image",
            InpaintInputs {
                image: &image,
                mask: &small,
                strength: 1.0,
            },
        ),
        (
            "strength",
            InpaintInputs {
                image: &image,
                mask: &mask,
                strength: 0.1,
            },
        ),
        (
            "strength",
            InpaintInputs {
                image: &image,
                mask: &mask,
                strength: 1.5,
            },
        ),
    ] {
        let err = pipe
            .inpaint(&base, &inputs, &latents, &mut no_noise)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
}
