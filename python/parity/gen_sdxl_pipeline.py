"""A reduced StableDiffusionXLPipeline with random weights, saved by diffusers' `save_pretrained` in
the layout people download, and what diffusers computes with it, for the Rust parity test
(model/tests/sd_pipeline_parity.rs).

    python gen_sdxl_pipeline.py OUT_DIR

Writes OUT_DIR/sdxl (tokenizer/ and tokenizer_2/ with CLIP's real BPE vocabulary, tokenizer_2
padding with "!" as SDXL's does; text_encoder/ a CLIPTextModel, text_encoder_2/ a
CLIPTextModelWithProjection; unet/, vae/ with SDXL's scaling factor, scheduler/ SDXL's
EulerDiscreteScheduler config), OUT_DIR/latents.safetensors (`latents` [1, 4, h, w]) and
OUT_DIR/expected/:
- encode.safetensors: `encode_prompt` of PROMPT with NEGATIVE (prompt_embeds,
  negative_prompt_embeds, pooled_prompt_embeds, negative_pooled_prompt_embeds) and without a
  negative prompt (`*_zero`: diffusers' force_zeros_for_empty_prompt);
- image_<scheduler>.safetensors: the pipeline's `output_type="pt"` image from the latents with
  the scheduler swapped in `from_config` (`euler` is the checkpoint's own).
- inpaint_<name>.safetensors: `StableDiffusionXLInpaintPipeline` images of OUT_DIR/image.png
  under OUT_DIR/mask.png, from the same latents: `plain` (OUT_DIR/inpaint, the 4-channel UNet:
  latent blending; Euler, strength 0.75) and `channels9` (OUT_DIR/inpaint9, a 9-channel UNet;
  DPM++ 2M Karras, strength 1).
OUT_DIR/cases.json lists the settings. The VAE's encoder gives a log-variance of -30 (std 3e-7),
so diffusers' posterior sample is its mean within 3e-7: diffmesh encodes images to the mean.
"""

import json
import math
import os
import shutil
import sys

import diffusers
import torch
import transformers
import numpy as np
from diffusers import (AutoencoderKL, DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler,
                       StableDiffusionXLInpaintPipeline, StableDiffusionXLPipeline, UNet2DConditionModel)
from PIL import Image
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_tokenizers  # noqa: E402

HEIGHT, WIDTH, STEPS, GUIDANCE = 32, 32, 4, 5.0
PROMPT = "a photo of a cat, sitting on a red sofa"
NEGATIVE = "blurry, low quality"
SCHEDULERS = {
    "euler": None,
    "dpmpp_2m_karras": (DPMSolverMultistepScheduler, dict(use_karras_sigmas=True, algorithm_type="dpmsolver++",
                                                         solver_order=2)),
    "ddim": (DDIMScheduler, {}),
}


def randomize(model, gen, scale=1.0):
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.02 * noise)
            else:
                p.copy_(scale * noise / math.sqrt(p[0].numel()))


def text_side(work, gen):
    clip_dir = os.path.join(work, "clip")
    gen_tokenizers.write_clip_vocab_merges(clip_dir)
    tokenizer = CLIPTokenizer.from_pretrained(clip_dir)
    tokenizer_2 = CLIPTokenizer.from_pretrained(clip_dir, pad_token="!")
    base = dict(vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=77, bos_token_id=49406, eos_token_id=49407)
    encoder = CLIPTextModel(CLIPTextConfig(**base, hidden_act="quick_gelu")).eval()
    encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**base, hidden_act="gelu", projection_dim=16)).eval()
    randomize(encoder, gen)
    randomize(encoder_2, gen)
    return tokenizer, tokenizer_2, encoder, encoder_2


INPAINTS = {"plain": ("inpaint", 4, None, 0.75), "channels9": ("inpaint9", 9, "dpmpp_2m_karras", 1.0)}


def unet(gen, in_channels=4):
    model = UNet2DConditionModel(
        sample_size=HEIGHT // 2, in_channels=in_channels, out_channels=4, block_out_channels=[32, 64],
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"], up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"],
        attention_head_dim=[2, 4], transformer_layers_per_block=[1, 2], cross_attention_dim=64, layers_per_block=1,
        norm_num_groups=16, use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=16 + 6 * 8).eval()
    randomize(model, gen, scale=0.5)
    return model


def vae(gen):
    model = AutoencoderKL(block_out_channels=[32, 64], layers_per_block=1, latent_channels=4, norm_num_groups=16,
                          down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                          scaling_factor=0.13025, sample_size=HEIGHT).eval()
    randomize(model, gen, scale=0.5)
    with torch.no_grad():
        # The log-variance half after quant_conv (SDXL's VAE has one).
        conv = model.quant_conv
        conv.weight[4:] = 0.0
        conv.bias[4:] = -30.0
    return model


def scheduler():
    return EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                  steps_offset=1, timestep_spacing="leading", interpolation_type="linear")


def write_image_and_mask(out, gen):
    """OUT_DIR/image.png (random pixels) and OUT_DIR/mask.png, with grey levels either side of the
    0.5 the pipelines binarise at."""
    pixels = (torch.rand(HEIGHT, WIDTH, 3, generator=gen) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels, "RGB").save(os.path.join(out, "image.png"))
    mask = np.zeros((HEIGHT, WIDTH), dtype=np.uint8)
    mask[4:20, 10:30] = 255
    mask[24:28, 2:6] = 200  # binarised: repainted
    mask[28:30, 20:24] = 100  # binarised: kept
    Image.fromarray(mask, "L").save(os.path.join(out, "mask.png"))


def main():
    out = sys.argv[1]
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    gen = torch.Generator().manual_seed(0)
    work = os.path.join(out, "work")
    tokenizer, tokenizer_2, encoder, encoder_2 = text_side(work, gen)
    the_vae, the_unet = vae(gen), unet(gen)
    pipe = StableDiffusionXLPipeline(vae=the_vae, text_encoder=encoder, text_encoder_2=encoder_2,
                                     tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=the_unet,
                                     scheduler=scheduler(), add_watermarker=False)
    folder = os.path.join(out, "sdxl")
    pipe.save_pretrained(folder)
    for name, channels, _, _ in INPAINTS.values():
        inpaint = StableDiffusionXLInpaintPipeline(
            vae=the_vae, text_encoder=encoder, text_encoder_2=encoder_2, tokenizer=tokenizer,
            tokenizer_2=tokenizer_2, unet=the_unet if channels == 4 else unet(gen, channels), scheduler=scheduler(),
            add_watermarker=False)
        inpaint.save_pretrained(os.path.join(out, name))
    shutil.rmtree(work)
    loaded = StableDiffusionXLPipeline.from_pretrained(folder, torch_dtype=torch.float32, add_watermarker=False)
    latents = torch.randn(1, 4, HEIGHT // 2, WIDTH // 2, generator=gen)
    save_file({"latents": latents}, os.path.join(out, "latents.safetensors"))
    exp = os.path.join(out, "expected")
    os.makedirs(exp)
    with torch.no_grad():
        e, ne, p, npool = loaded.encode_prompt(PROMPT, negative_prompt=NEGATIVE)
        ez, nez, pz, npz = loaded.encode_prompt(PROMPT)
        save_file({"prompt_embeds": e, "negative_prompt_embeds": ne, "pooled_prompt_embeds": p,
                   "negative_pooled_prompt_embeds": npool, "prompt_embeds_zero": ez,
                   "negative_prompt_embeds_zero": nez, "pooled_prompt_embeds_zero": pz,
                   "negative_pooled_prompt_embeds_zero": npz}, os.path.join(exp, "encode.safetensors"))
        own = loaded.scheduler
        for name, swap in SCHEDULERS.items():
            loaded.scheduler = own if swap is None else swap[0].from_config(own.config, **swap[1])
            image = loaded(prompt=PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH,
                           num_inference_steps=STEPS, guidance_scale=GUIDANCE, latents=latents.clone(),
                           output_type="pt").images
            save_file({"image": image.float().contiguous()}, os.path.join(exp, f"image_{name}.safetensors"))
        write_image_and_mask(out, gen)
        for key, (name, _, sched, strength) in INPAINTS.items():
            pipe = StableDiffusionXLInpaintPipeline.from_pretrained(os.path.join(out, name), torch_dtype=torch.float32,
                                                                    add_watermarker=False)
            if sched is not None:
                pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config,
                                                                         **SCHEDULERS[sched][1])
            image = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, image=Image.open(os.path.join(out, "image.png")),
                         mask_image=Image.open(os.path.join(out, "mask.png")), height=HEIGHT, width=WIDTH,
                         strength=strength, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                         latents=latents.clone(), output_type="pt").images
            save_file({"image": image.float().contiguous()}, os.path.join(exp, f"inpaint_{key}.safetensors"))
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump({"pipeline": "sdxl", "height": HEIGHT, "width": WIDTH, "steps": STEPS, "guidance_scale": GUIDANCE, "prompt": PROMPT,
                   "negative_prompt": NEGATIVE, "own_scheduler": "euler", "schedulers": list(SCHEDULERS),
                   "inpaints": {k: {"dir": v[0], "scheduler": v[2], "strength": v[3]} for k, v in INPAINTS.items()}},
                  f, indent=2)


if __name__ == "__main__":
    main()
