"""Parity fixtures for LoRAs of the UNet family's text encoders (model/tests/sd_text_lora_parity.rs).

A reduced SDXL pipeline (two CLIP encoders) and a reduced SD 2.1 pipeline (one), from
gen_sdxl_pipeline.py and gen_sd21_pipeline.py, each with one random LoRA over its UNet and its
text encoders written in the two layouts people have, and what diffusers' `load_lora_weights`
makes of each:

    OUT/<p>/                       the pipeline (`save_pretrained`), p = sdxl or sd21
    OUT/<p>_diffusers.safetensors  `save_lora_weights`: `unet.`, `text_encoder.` (and
                                   `text_encoder_2.`) keys; PEFT metadata: UNet r 4 alpha 8, text
                                   encoders r 4 alpha 2 (scale 0.5)
    OUT/<p>_kohya.safetensors      the same A and B in kohya's keys: `lora_unet_<diffusers name>`,
                                   `lora_te_` (SD 2.1) or `lora_te1_` / `lora_te2_` (SDXL), alpha 3
                                   per module (scale 0.75)
    OUT/<p>_encode.safetensors     `encode_prompt` of PROMPT with NEGATIVE, loaded with no LoRA
                                   (`base_*`) and with each file (`diffusers_*`, `kohya_*`):
                                   prompt_embeds, negative_prompt_embeds (and SDXL's pooled)
    OUT/sdxl_image.safetensors     SDXL's `output_type="pt"` image from OUT/latents.safetensors with
                                   the kohya file loaded (`kohya`) and without (`base`)

Usage: python gen_sd_text_lora.py --out DIR
"""
import argparse
import json
import os
import shutil
import sys

import diffusers
import torch
import transformers
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_sd21_pipeline as sd21  # noqa: E402
import gen_sdxl_pipeline as xl  # noqa: E402

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.2"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
STEPS, GUIDANCE = 4, 5.0


def build(which, out, gen):
    """The reduced pipeline `which`, saved under OUT/<which>; its class."""
    work = os.path.join(out, "work")
    if which == "sdxl":
        tokenizer, tokenizer_2, encoder, encoder_2 = xl.text_side(work, gen)
        pipe = StableDiffusionXLPipeline(vae=xl.vae(gen), text_encoder=encoder, text_encoder_2=encoder_2,
                                         tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=xl.unet(gen),
                                         scheduler=xl.scheduler(), add_watermarker=False)
    else:
        tokenizer, encoder = sd21.text_side(work, gen)
        pipe = StableDiffusionPipeline(vae=sd21.vae(gen), text_encoder=encoder, tokenizer=tokenizer,
                                       unet=sd21.unet(gen), scheduler=sd21.scheduler(), safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(os.path.join(out, which))
    shutil.rmtree(work)
    return type(pipe)


def adapt(model, targets, r, alpha, gen):
    """A random PEFT adapter on `model`: its state dict and config."""
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    # PEFT's own injection: transformers' `add_adapter` asks for a newer PEFT than diffusers'.
    inject_adapter_in_model(cfg, model)
    randomize_lora(model, gen)
    return {k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}, cfg.to_dict()


def randomize_lora(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def write_loras(cls, which, out, gen):
    pipe = cls.from_pretrained(os.path.join(out, which), torch_dtype=torch.float32)
    unet, unet_cfg = adapt(pipe.unet, UNET_TARGETS, 4, 8, gen)
    texts = [adapt(pipe.text_encoder, TEXT_TARGETS, 4, 2, gen)]
    if which == "sdxl":
        texts.append(adapt(pipe.text_encoder_2, TEXT_TARGETS, 4, 2, gen))
    kwargs = dict(unet_lora_layers=unet, unet_lora_adapter_metadata=unet_cfg,
                  text_encoder_lora_layers=texts[0][0], text_encoder_lora_adapter_metadata=texts[0][1])
    if which == "sdxl":
        kwargs.update(text_encoder_2_lora_layers=texts[1][0], text_encoder_2_lora_adapter_metadata=texts[1][1])
    cls.save_lora_weights(out, weight_name=f"{which}_diffusers.safetensors", **kwargs)
    kohya = {}
    prefixes = ["lora_te1_", "lora_te2_"] if which == "sdxl" else ["lora_te_"]
    networks = [("lora_unet_", unet)] + [(p, t[0]) for p, t in zip(prefixes, texts)]
    for prefix, state in networks:
        for key, value in state.items():
            module, which_matrix = key.rsplit(".lora_", 1)
            if prefix != "lora_unet_" and not module.startswith("text_model."):
                # kohya's names keep transformers 4's `text_model.` (transformers 5 dropped it).
                module = "text_model." + module
            name = prefix + module.replace(".", "_")
            kohya[f"{name}.{'lora_down' if which_matrix.startswith('A') else 'lora_up'}.weight"] = value
            kohya[f"{name}.alpha"] = torch.tensor(3.0)
    save_file(kohya, os.path.join(out, f"{which}_kohya.safetensors"))


def encode(pipe, which):
    with torch.no_grad():
        if which == "sdxl":
            e, ne, p, npool = pipe.encode_prompt(xl.PROMPT, negative_prompt=xl.NEGATIVE)
            return {"prompt_embeds": e, "negative_prompt_embeds": ne, "pooled_prompt_embeds": p,
                    "negative_pooled_prompt_embeds": npool}
        e, ne = pipe.encode_prompt(xl.PROMPT, "cpu", 1, True, negative_prompt=xl.NEGATIVE)
        return {"prompt_embeds": e, "negative_prompt_embeds": ne}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = args.out
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    gen = torch.Generator().manual_seed(48)
    latents = torch.randn(1, 4, xl.HEIGHT // 2, xl.WIDTH // 2, generator=gen)
    save_file({"latents": latents}, os.path.join(out, "latents.safetensors"))
    for which in ["sdxl", "sd21"]:
        cls = build(which, out, gen)
        write_loras(cls, which, out, gen)
        encoded = {}
        images = {}
        for name in ["base", "diffusers", "kohya"]:
            pipe = cls.from_pretrained(os.path.join(out, which), torch_dtype=torch.float32)
            if name != "base":
                pipe.load_lora_weights(out, weight_name=f"{which}_{name}.safetensors")
            encoded.update({f"{name}_{k}": v.contiguous() for k, v in encode(pipe, which).items()})
            if which == "sdxl" and name != "diffusers":
                with torch.no_grad():
                    images[name] = pipe(prompt=xl.PROMPT, negative_prompt=xl.NEGATIVE, height=xl.HEIGHT,
                                        width=xl.WIDTH, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                                        latents=latents.clone(), output_type="pt").images.float().contiguous()
        save_file(encoded, os.path.join(out, f"{which}_encode.safetensors"))
        if images:
            save_file(images, os.path.join(out, f"{which}_image.safetensors"))
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump({"prompt": xl.PROMPT, "negative_prompt": xl.NEGATIVE, "height": xl.HEIGHT, "width": xl.WIDTH,
                   "steps": STEPS, "guidance_scale": GUIDANCE}, f, indent=2)


if __name__ == "__main__":
    main()
