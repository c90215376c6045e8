"""A reduced StableDiffusionPipeline (SD 2.1's layout) with random weights, saved by diffusers'
`save_pretrained`, and what diffusers computes with it, for the Rust parity test
(model/tests/sd_pipeline_parity.rs).

    python gen_sd21_pipeline.py OUT_DIR

Like gen_sdxl_pipeline.py, with SD 2.1's differences: one CLIP encoder (OpenCLIP-H's shape
reduced: gelu, its tokenizer padding with "!") whose last hidden states condition the UNet; no
added conditioning; the checkpoint's scheduler is DDIM with v-prediction (SD 2.1 768-v's);
an empty negative prompt is encoded, not zeros; VAE scaling factor 0.18215. Writes OUT_DIR/sd21
(StableDiffusionPipeline), OUT_DIR/inpaint and OUT_DIR/inpaint9
(StableDiffusionInpaintPipeline with a 4- and a 9-channel UNet), OUT_DIR/latents.safetensors,
OUT_DIR/image.png, OUT_DIR/mask.png, OUT_DIR/expected/ (encode.safetensors: prompt_embeds,
negative_prompt_embeds, and `*_empty` without a negative prompt; image_<scheduler> and
inpaint_<name>) and OUT_DIR/cases.json.
"""

import json
import os
import shutil
import sys

import diffusers
import torch
import transformers
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler,
                       StableDiffusionInpaintPipeline, StableDiffusionPipeline, UNet2DConditionModel)
from PIL import Image
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_sdxl_pipeline as xl  # noqa: E402
import gen_tokenizers  # noqa: E402

SCHEDULERS = {
    "ddim": None,
    "euler": (EulerDiscreteScheduler, {}),
    "dpmpp_2m_karras": xl.SCHEDULERS["dpmpp_2m_karras"],
}
INPAINTS = {"plain": ("inpaint", 4, "euler", 0.75), "channels9": ("inpaint9", 9, "dpmpp_2m_karras", 1.0)}


def text_side(work, gen):
    clip_dir = os.path.join(work, "clip")
    gen_tokenizers.write_clip_vocab_merges(clip_dir)
    tokenizer = CLIPTokenizer.from_pretrained(clip_dir, pad_token="!")
    encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=77, bos_token_id=49406, eos_token_id=49407, hidden_act="gelu")).eval()
    xl.randomize(encoder, gen)
    return tokenizer, encoder


def unet(gen, in_channels=4):
    model = UNet2DConditionModel(
        sample_size=xl.HEIGHT // 2, in_channels=in_channels, out_channels=4, block_out_channels=[32, 64],
        down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
        attention_head_dim=[2, 4], cross_attention_dim=32, layers_per_block=1, norm_num_groups=16,
        use_linear_projection=True).eval()
    xl.randomize(model, gen, scale=0.5)
    return model


def vae(gen):
    model = xl.vae(gen)
    model.register_to_config(scaling_factor=0.18215)
    return model


def scheduler():
    return DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
                         clip_sample=False, set_alpha_to_one=False, prediction_type="v_prediction")


def pick(pipe, name):
    swap = SCHEDULERS[name]
    if swap is not None:
        pipe.scheduler = swap[0].from_config(pipe.scheduler.config, **swap[1])


def main():
    out = sys.argv[1]
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    gen = torch.Generator().manual_seed(1)
    work = os.path.join(out, "work")
    tokenizer, encoder = text_side(work, gen)
    the_vae, the_unet = vae(gen), unet(gen)
    parts = dict(vae=the_vae, text_encoder=encoder, tokenizer=tokenizer, safety_checker=None,
                 feature_extractor=None, requires_safety_checker=False)
    folder = os.path.join(out, "sd21")
    StableDiffusionPipeline(unet=the_unet, scheduler=scheduler(), **parts).save_pretrained(folder)
    for name, channels, _, _ in INPAINTS.values():
        StableDiffusionInpaintPipeline(unet=the_unet if channels == 4 else unet(gen, channels), scheduler=scheduler(),
                                       **parts).save_pretrained(os.path.join(out, name))
    shutil.rmtree(work)
    loaded = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    latents = torch.randn(1, 4, xl.HEIGHT // 2, xl.WIDTH // 2, generator=gen)
    save_file({"latents": latents}, os.path.join(out, "latents.safetensors"))
    exp = os.path.join(out, "expected")
    os.makedirs(exp)
    with torch.no_grad():
        e, ne = loaded.encode_prompt(xl.PROMPT, "cpu", 1, True, negative_prompt=xl.NEGATIVE)
        ee, nee = loaded.encode_prompt(xl.PROMPT, "cpu", 1, True)
        save_file({"prompt_embeds": e, "negative_prompt_embeds": ne, "prompt_embeds_empty": ee,
                   "negative_prompt_embeds_empty": nee}, os.path.join(exp, "encode.safetensors"))
        own = loaded.scheduler
        for name in SCHEDULERS:
            loaded.scheduler = own
            pick(loaded, name)
            image = loaded(prompt=xl.PROMPT, negative_prompt=xl.NEGATIVE, height=xl.HEIGHT, width=xl.WIDTH,
                           num_inference_steps=xl.STEPS, guidance_scale=xl.GUIDANCE, latents=latents.clone(),
                           output_type="pt").images
            save_file({"image": image.float().contiguous()}, os.path.join(exp, f"image_{name}.safetensors"))
        xl.write_image_and_mask(out, gen)
        for key, (name, _, sched, strength) in INPAINTS.items():
            pipe = StableDiffusionInpaintPipeline.from_pretrained(os.path.join(out, name), torch_dtype=torch.float32)
            pick(pipe, sched)
            image = pipe(prompt=xl.PROMPT, negative_prompt=xl.NEGATIVE, image=Image.open(os.path.join(out, "image.png")),
                         mask_image=Image.open(os.path.join(out, "mask.png")), height=xl.HEIGHT, width=xl.WIDTH,
                         strength=strength, num_inference_steps=xl.STEPS, guidance_scale=xl.GUIDANCE,
                         latents=latents.clone(), output_type="pt").images
            save_file({"image": image.float().contiguous()}, os.path.join(exp, f"inpaint_{key}.safetensors"))
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump({"pipeline": "sd21", "height": xl.HEIGHT, "width": xl.WIDTH, "steps": xl.STEPS,
                   "guidance_scale": xl.GUIDANCE, "prompt": xl.PROMPT, "negative_prompt": xl.NEGATIVE,
                   "own_scheduler": "ddim", "schedulers": list(SCHEDULERS),
                   "inpaints": {k: {"dir": v[0], "scheduler": v[2], "strength": v[3]} for k, v in INPAINTS.items()}},
                  f, indent=2)


if __name__ == "__main__":
    main()
