//! `StableDiffusionXLPipeline` against diffusers 0.42.1 on a reduced random-weight SDXL
//! directory (python/parity/gen_sdxl_pipeline.py): the prompt encoding (with a negative prompt
//! and with the zeros SDXL conditions on without one) within 1e-4, and the whole pipeline from
//! given latents through `cargo xtask generate`'s code path with the checkpoint's Euler
//! scheduler and with `--scheduler dpmpp_2m_karras` and `ddim` swapped in, within 2e-3; and
//! `StableDiffusionXLInpaintPipeline` with a plain 4-channel UNet (latent blending, strength
//! 0.75, Euler) and a 9-channel inpainting UNet (DPM++ 2M Karras), within 2e-3.
mod py_fixture;

use diffmesh_model::sdxl::{generate_file, SdxlFileArgs, SdxlPipeline, SdxlRequest};
use py_fixture::{generate, max_abs_diff, read_tensors};
use tch::{Device, Kind};

#[derive(serde::Deserialize)]
struct Cases {
    height: i64,
    width: i64,
    steps: usize,
    guidance_scale: f64,
    prompt: String,
    negative_prompt: String,
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
    let cases: Cases =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let model_dir = dir.join("sdxl");
    let pipe = SdxlPipeline::load(&model_dir, Device::Cpu, Kind::Float).unwrap();
    let want = read_tensors(&dir.join("expected").join("encode.safetensors"));
    let check = |what: &str, got: &tch::Tensor, tolerance: f64| {
        let err = max_abs_diff(got, &want[what]);
        println!("{what}: max abs err {err:.2e}");
        assert!(err <= tolerance, "{what}: {err}");
    };
    tch::no_grad(|| {
        let prompt = pipe.encode_prompt(&cases.prompt).unwrap();
        let negative = pipe
            .negative(Some(&cases.negative_prompt), &prompt)
            .unwrap();
        let zeros = pipe.negative(None, &prompt).unwrap();
        check("prompt_embeds", &prompt.embeds, 1e-4);
        check("pooled_prompt_embeds", &prompt.pooled, 1e-4);
        check("negative_prompt_embeds", &negative.embeds, 1e-4);
        check("negative_pooled_prompt_embeds", &negative.pooled, 1e-4);
        check("negative_prompt_embeds_zero", &zeros.embeds, 0.0);
        check("negative_pooled_prompt_embeds_zero", &zeros.pooled, 0.0);
    });
    assert_eq!(cases.schedulers.len(), 3);
    for name in &cases.schedulers {
        let out = dir.join(format!("ours_{name}.safetensors"));
        let request = SdxlRequest {
            prompt: cases.prompt.clone(),
            negative_prompt: Some(cases.negative_prompt.clone()),
            height: cases.height,
            width: cases.width,
            steps: cases.steps,
            guidance_scale: cases.guidance_scale,
            // The checkpoint's own scheduler is Euler.
            scheduler: (name != "euler").then(|| name.clone()),
        };
        generate_file(&SdxlFileArgs {
            model_dir: model_dir.clone(),
            request,
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
        generate_file(&SdxlFileArgs {
            model_dir: dir.join(&case.dir),
            request: SdxlRequest {
                prompt: cases.prompt.clone(),
                negative_prompt: Some(cases.negative_prompt.clone()),
                height: cases.height,
                width: cases.width,
                steps: cases.steps,
                guidance_scale: cases.guidance_scale,
                scheduler: case.scheduler.clone(),
            },
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
    let pipe = SdxlPipeline::load(&dir.join("sdxl"), Device::Cpu, Kind::Float).unwrap();
    let latents = read_tensors(&dir.join("latents.safetensors"))["latents"].shallow_clone();
    let base = SdxlRequest {
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
            SdxlRequest {
                height: 30,
                ..base.clone()
            },
        ),
        (
            "latents",
            SdxlRequest {
                width: 48,
                ..base.clone()
            },
        ),
        (
            "scheduler",
            SdxlRequest {
                scheduler: Some("lms".into()),
                ..base.clone()
            },
        ),
        (
            "num_inference_steps",
            SdxlRequest {
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
    use diffmesh_model::sdxl::inpaint::InpaintInputs;
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
