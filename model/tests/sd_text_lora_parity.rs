//! LoRAs of the UNet family's text encoders against diffusers 0.42.1 + PEFT
//! (python/parity/gen_sd_text_lora.py): reduced SDXL (two CLIP encoders) and SD 2.1 (one)
//! pipelines, one random LoRA over each UNet and its text encoders in diffusers' layout
//! (`text_encoder.`/`text_encoder_2.` keys, PEFT metadata) and in kohya's (`lora_te_`,
//! `lora_te1_`, `lora_te2_`, alpha tensors). Patched in place around the encoding, the prompt
//! embeddings equal those of `load_lora_weights` within 1e-5, the base encoders come back bit for
//! bit, and SDXL's whole image with the kohya file (UNet and both encoders) equals diffusers'.
mod py_fixture;

use diffmesh_model::lora::{LoraPatcher, OriginalsOn, WeightedLora};
use diffmesh_model::stable_diffusion::stepper::SdState;
use diffmesh_model::stable_diffusion::text_lora::{TextLora, TextLoraPatchers};
use diffmesh_model::stable_diffusion::{SdPipeline, SdPrompt, SdRequest};
use diffmesh_model::unet::lora::{read_unet_lora, LoraTargets, UNetLora};
use py_fixture::{generate, max_abs_diff, read_tensors};
use std::collections::HashMap;
use std::path::Path;
use tch::{Device, Kind, Tensor};

const PROMPT: &str = "a photo of a cat, sitting on a red sofa";
const NEGATIVE: &str = "blurry, low quality";

fn read(pipe: &SdPipeline, dir: &Path, file: &str) -> UNetLora {
    let unet_modules = pipe.unet.linear_modules();
    let text_modules = pipe.text_linear_modules();
    let targets = LoraTargets {
        config: &pipe.unet.config,
        unet_modules: &unet_modules,
        text_modules: &text_modules,
    };
    read_unet_lora(file, &dir.join(file), targets).unwrap()
}

/// Prompt and negative conditioning, named as diffusers' `encode_prompt` returns them.
fn encode(pipe: &SdPipeline) -> HashMap<String, Tensor> {
    let prompt = pipe.encode_prompt(PROMPT).unwrap();
    let negative = pipe.negative(Some(NEGATIVE), &prompt).unwrap();
    let mut out = HashMap::new();
    for (name, p) in [("prompt", prompt), ("negative_prompt", negative)] {
        let SdPrompt { embeds, pooled } = p;
        out.insert(format!("{name}_embeds"), embeds);
        if let Some(pooled) = pooled {
            let pooled_name = match name {
                "prompt" => "pooled_prompt_embeds",
                _ => "negative_pooled_prompt_embeds",
            };
            out.insert(pooled_name.to_string(), pooled);
        }
    }
    out
}

fn compare(got: &HashMap<String, Tensor>, expected: &HashMap<String, Tensor>, case: &str) -> f64 {
    let mut worst: f64 = 0.0;
    for (name, tensor) in got {
        let want = &expected[&format!("{case}_{name}")];
        worst = worst.max(max_abs_diff(tensor, want));
    }
    worst
}

#[test]
fn text_encoder_loras_in_both_layouts_match_diffusers() {
    let dir = generate("gen_sd_text_lora.py", &["--out"], "parity-sd-text-lora");
    for (which, encoders, names) in [("sdxl", 2, 4), ("sd21", 1, 2)] {
        let pipe = SdPipeline::load(&dir.join(which), Device::Cpu, Kind::Float).unwrap();
        assert_eq!(pipe.text_linear_modules().len(), encoders, "{which}");
        let expected = read_tensors(&dir.join(format!("{which}_encode.safetensors")));
        let base = encode(&pipe);
        assert_eq!(base.len(), names, "{which}");
        let err = compare(&base, &expected, "base");
        assert!(err <= 1e-5, "{which} base: {err}");
        // The host keeps the base copies for SDXL, the device (the same here) for SD 2.1.
        let originals = match which {
            "sdxl" => OriginalsOn::Host,
            _ => OriginalsOn::Device,
        };
        let mut patchers = TextLoraPatchers::new(&pipe, originals);
        assert_eq!(patchers.encoders(), encoders);
        for layout in ["diffusers", "kohya"] {
            let lora = read(&pipe, &dir, &format!("{which}_{layout}.safetensors"));
            assert_eq!(lora.text_encoder_keys, 0, "{which} {layout}: none left out");
            assert_eq!(lora.text_encoders.len(), encoders);
            for (e, adapter) in lora.text_encoders.iter().enumerate() {
                let layers = adapter.as_ref().map_or(0, |a| a.deltas.len());
                // 6 linear layers a CLIP layer, 3 layers.
                assert_eq!(layers, 18, "{which} {layout}: encoder {e}");
            }
            assert!(!lora.adapter.deltas.is_empty(), "{which} {layout}: UNet");
            let set = [TextLora {
                adapters: &lora.text_encoders,
                weight: 1.0,
            }];
            let (patched, stats) = patchers.with_patched(&set, || Ok(encode(&pipe))).unwrap();
            assert_eq!(stats.layers, 2 * 18 * encoders, "patched, then restored");
            let err = compare(&patched, &expected, layout);
            let effect = compare(&base, &expected, layout);
            println!("{which} {layout}: max abs err {err:.2e} (the LoRA moves the embeddings by {effect:.2})");
            assert!(
                effect > 0.05,
                "{which} {layout}: a LoRA that moves nothing proves nothing"
            );
            assert!(err <= 1e-5, "{which} {layout}: {err}");
            let back = encode(&pipe);
            assert_eq!(
                compare(&back, &expected, "base"),
                compare(&base, &expected, "base")
            );
            for (name, t) in &back {
                assert_eq!(
                    max_abs_diff(t, &base[name]),
                    0.0,
                    "{which}: {name} restored exactly"
                );
            }
            // Restored too when what runs patched fails, or panics.
            let failed = patchers.with_patched(&set, || -> diffmesh_model::Result<()> {
                Err(diffmesh_model::ModelError::input("prompt", "refused"))
            });
            assert!(failed.is_err());
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                patchers.with_patched(&set, || -> diffmesh_model::Result<()> {
                    panic!("in the middle of an encoding")
                })
            }));
            assert!(panicked.is_err());
            assert!(!patchers.poisoned());
            for (name, t) in &encode(&pipe) {
                assert_eq!(
                    max_abs_diff(t, &base[name]),
                    0.0,
                    "{which}: {name} after a failure"
                );
            }
        }
    }
}

#[test]
fn sdxl_image_with_a_kohya_lora_on_unet_and_both_encoders_matches_diffusers() {
    let dir = generate(
        "gen_sd_text_lora.py",
        &["--out"],
        "parity-sd-text-lora-image",
    );
    let pipe = SdPipeline::load(&dir.join("sdxl"), Device::Cpu, Kind::Float).unwrap();
    let expected = read_tensors(&dir.join("sdxl_image.safetensors"));
    let latents = read_tensors(&dir.join("latents.safetensors"))
        .remove("latents")
        .unwrap();
    let request = SdRequest {
        prompt: PROMPT.into(),
        negative_prompt: Some(NEGATIVE.into()),
        height: 32,
        width: 32,
        steps: 4,
        guidance_scale: 5.0,
        scheduler: None,
    };
    let mut no_noise = |_: usize, _: &[i64]| -> diffmesh_model::Result<Tensor> {
        unreachable!("Euler is not ancestral")
    };
    let base = pipe.generate(&request, &latents, &mut no_noise).unwrap();
    assert!(max_abs_diff(&base, &expected["base"]) <= 2e-3);

    let lora = read(&pipe, &dir, "sdxl_kohya.safetensors");
    let mut unet = LoraPatcher::new(pipe.unet.var_store().unwrap());
    unet.apply(&[WeightedLora {
        adapter: &lora.adapter,
        weight: 1.0,
    }])
    .unwrap();
    let mut text = TextLoraPatchers::new(&pipe, OriginalsOn::Host);
    let set = [TextLora {
        adapters: &lora.text_encoders,
        weight: 1.0,
    }];
    // The prompts encoded with the patched encoders; the steps with the patched UNet.
    let run = |state: SdState| {
        let mut states = [state];
        while !states[0].done() {
            let mut batch: Vec<_> = states.iter_mut().collect();
            let mut noise = |_: usize, _: usize, _: &[i64]| -> diffmesh_model::Result<Tensor> {
                unreachable!("Euler is not ancestral")
            };
            pipe.step_batch(&mut batch, &mut noise).unwrap();
        }
        pipe.decode(&states[0]).unwrap()
    };
    let (state, _) = text
        .with_patched(&set, || pipe.prepare(&request, &latents, None))
        .unwrap();
    let image = run(state);
    let unet_only = run(pipe.prepare(&request, &latents, None).unwrap());
    let err = max_abs_diff(&image, &expected["kohya"]);
    let effect = max_abs_diff(&expected["kohya"], &expected["base"]);
    let text_effect = max_abs_diff(&unet_only, &expected["kohya"]);
    println!(
        "sdxl image, kohya LoRA on the UNet and both encoders: max abs err {err:.2e} (the LoRA \
         moves it by {effect:.3}, its text-encoder part by {text_effect:.3})"
    );
    assert!(err <= 2e-3, "{err}");
    assert!(
        text_effect > 5.0 * 2e-3,
        "the text encoders' adapters move the image by {text_effect} only: a test of nothing"
    );
}
