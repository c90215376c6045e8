//! UNet LoRA files against diffusers 0.42.1 + PEFT (python/parity/gen_unet_lora.py): one random
//! adapter of a reduced SDXL-shaped UNet, written by `save_lora_weights` (diffusers' layout,
//! PEFT metadata with lora_alpha 8 over r 4) and in kohya's SDXL layout (SGM block names,
//! lora_down/lora_up, alpha tensors, a text-encoder key), loaded as diffusers'
//! `load_lora_weights` loads them and by us patched into the weights in place: the same outputs
//! within 1e-4, and restoring gives the base model back bit for bit. The same with diffmesh's
//! tiny trained UNet (weights/tiny-unet) adapted instead of a random one.
mod py_fixture;

use diffmesh_model::lora::{LoraPatcher, WeightedLora};
use diffmesh_model::unet::lora::{read_unet_lora, LoraTargets};
use diffmesh_model::unet::{UNet2DConditionModel, UNetInputs};
use py_fixture::{generate, max_abs_diff, read_tensors};
use tch::{Device, Kind, Tensor};

#[test]
fn unet_loras_in_both_layouts_match_diffusers() {
    let dir = generate("gen_unet_lora.py", &["--out"], "parity-unet-lora");
    loras_match_diffusers(&dir, 40);
}

/// The same with diffmesh's tiny trained UNet (weights/tiny-unet) as the adapted model.
#[test]
fn tiny_unet_loras_in_both_layouts_match_diffusers() {
    let tiny = py_fixture::repo_root().join("weights/tiny-unet/unet");
    let tiny = tiny.to_str().unwrap();
    let dir = generate(
        "gen_unet_lora.py",
        &["--unet", tiny, "--out"],
        "parity-tiny-unet-lora",
    );
    loras_match_diffusers(&dir, 20);
}

/// The fixture in `dir`: each layout's file, read by us (over `min_layers` layers) and patched
/// in place, gives diffusers' output within 1e-4; restoring gives the base output exactly.
fn loras_match_diffusers(dir: &std::path::Path, min_layers: usize) {
    let unet = UNet2DConditionModel::load(&dir.join("unet"), Device::Cpu, Kind::Float).unwrap();
    let mut x = read_tensors(&dir.join("inputs.safetensors"));
    let inputs = UNetInputs {
        sample: x.remove("sample").unwrap(),
        timestep: x.remove("timestep").unwrap(),
        encoder_hidden_states: x.remove("encoder_hidden_states").unwrap(),
        text_embeds: x.remove("text_embeds"),
        time_ids: x.remove("time_ids"),
    };
    let expected = read_tensors(&dir.join("outputs.safetensors"));
    let forward = || tch::no_grad(|| unet.forward(&inputs)).unwrap();
    let base = forward();
    assert!(max_abs_diff(&base, &expected["base"]) <= 1e-4);
    let modules = unet.linear_modules();
    let mut patcher = LoraPatcher::new(unet.var_store().unwrap());
    for (name, text_keys) in [("diffusers", 0), ("kohya", 2)] {
        let path = dir.join(format!("lora_{name}.safetensors"));
        // No text encoders given: their keys are counted and left out.
        let targets = LoraTargets {
            config: &unet.config,
            unet_modules: &modules,
            text_modules: &[],
        };
        let lora = read_unet_lora(name, &path, targets).unwrap();
        assert_eq!(lora.text_encoder_keys, text_keys, "{name}");
        assert!(
            lora.adapter.deltas.len() > min_layers,
            "{name}: {} layers",
            lora.adapter.deltas.len()
        );
        patcher.check(&lora.adapter).unwrap();
        let set = [WeightedLora {
            adapter: &lora.adapter,
            weight: 1.0,
        }];
        patcher.apply(&set).unwrap();
        let err = max_abs_diff(&forward(), &expected[name]);
        let effect = max_abs_diff(&expected[name], &expected["base"]);
        println!("{name}: max abs err {err:.2e} (the LoRA moves the output by {effect:.2})");
        assert!(
            effect > 0.1,
            "{name}: an adapter that changes nothing proves nothing"
        );
        assert!(err <= 1e-4, "{name}: {err}");
        patcher.apply(&[]).unwrap();
        let back: Tensor = forward();
        assert_eq!(max_abs_diff(&back, &base), 0.0, "{name}: restored exactly");
    }
}

#[test]
fn unet_lora_refusals_name_the_key() {
    let dir = generate("gen_unet_lora.py", &["--out"], "parity-unet-lora-errors");
    let unet = UNet2DConditionModel::load(&dir.join("unet"), Device::Cpu, Kind::Float).unwrap();
    let modules = unet.linear_modules();
    let scratch = tempfile::tempdir().unwrap();
    let opts = (Kind::Float, Device::Cpu);
    let cases: Vec<(&str, Vec<(&str, Tensor)>)> = vec![
        (
            "lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight",
            vec![
                (
                    "lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight",
                    Tensor::zeros([4, 32, 3, 3], opts),
                ),
                (
                    "lora_unet_input_blocks_1_0_in_layers_2.lora_up.weight",
                    Tensor::zeros([32, 4, 1, 1], opts),
                ),
            ],
        ),
        (
            "mid_block.attentions.0.proj_in",
            vec![(
                "unet.mid_block.attentions.0.proj_in.lora_A.weight",
                Tensor::zeros([4, 64], opts),
            )],
        ),
        (
            "transformer.x.lora_A.weight",
            vec![("transformer.x.lora_A.weight", Tensor::zeros([4, 64], opts))],
        ),
    ];
    for (field, tensors) in cases {
        let path = scratch.path().join("bad.safetensors");
        Tensor::write_safetensors(&tensors, &path).unwrap();
        let targets = LoraTargets {
            config: &unet.config,
            unet_modules: &modules,
            text_modules: &[],
        };
        let err = read_unet_lora("bad", &path, targets)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
}
