"""Reduced SD 2.1-like and SDXL-like pipelines with random weights, two random ControlNets each
(`ControlNetModel.from_unet`, re-randomised), and what diffusers' ControlNet pipelines compute
with them, for the Rust parity test (model/tests/sd_controlnet_parity.rs) and the mesh test of
steered UNet generations (tests/tests/unet_serving.rs).

    python gen_sd_controlnet_pipeline.py OUT_DIR
    python gen_sd_controlnet_pipeline.py --for-unet UNET_DIR OUT_DIR

The second form only writes OUT_DIR/edges and OUT_DIR/depth: two random ControlNets that fit
the UNet saved in UNET_DIR (for a mesh test that serves that UNet's pipeline).

For each CASE in sd21, sdxl (built as gen_sd21_pipeline.py and gen_sdxl_pipeline.py build
theirs):
    OUT_DIR/CASE/                       the base pipeline (save_pretrained)
    OUT_DIR/CASE_controlnets/edges      ControlNetModel (save_pretrained)
    OUT_DIR/CASE_controlnets/depth      a second one
    OUT_DIR/CASE_expected.safetensors   `single`: StableDiffusion(XL)ControlNetPipeline with
                                        `edges` on control_a.png at scale SINGLE_SCALE;
                                        `multi`: both (MultiControlNetModel) on control_a.png and
                                        control_b.png at MULTI_SCALES
    OUT_DIR/latents.safetensors, OUT_DIR/control_a.png, OUT_DIR/control_b.png, OUT_DIR/cases.json
The conditioning embedding downscales by 2 (two widths), as the reduced VAE does.
"""

import json
import os
import shutil
import sys

import diffusers
import torch
import transformers
from diffusers import (ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline,
                       StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline,
                       UNet2DConditionModel)
from PIL import Image
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_sd21_pipeline as sd21  # noqa: E402
import gen_sdxl_pipeline as xl  # noqa: E402

SINGLE_SCALE = 0.8
MULTI_SCALES = [0.7, 0.4]
NAMES = ["edges", "depth"]


def build(case, work, gen):
    """The base pipeline's parts and its classes (base, steered)."""
    if case == "sd21":
        tokenizer, encoder = sd21.text_side(work, gen)
        parts = dict(vae=sd21.vae(gen), text_encoder=encoder, tokenizer=tokenizer, unet=sd21.unet(gen),
                     scheduler=sd21.scheduler(), safety_checker=None, feature_extractor=None,
                     requires_safety_checker=False)
        return parts, StableDiffusionPipeline, StableDiffusionControlNetPipeline
    tokenizer, tokenizer_2, encoder, encoder_2 = xl.text_side(work, gen)
    parts = dict(vae=xl.vae(gen), text_encoder=encoder, text_encoder_2=encoder_2, tokenizer=tokenizer,
                 tokenizer_2=tokenizer_2, unet=xl.unet(gen), scheduler=xl.scheduler())
    return parts, StableDiffusionXLPipeline, StableDiffusionXLControlNetPipeline


def control_image(path, gen):
    pixels = (torch.rand(xl.HEIGHT, xl.WIDTH, 3, generator=gen) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels, "RGB").save(path)


def controlnets_for(unet, out, gen):
    """Two random ControlNets of `unet`'s shape saved under OUT/<name>; the networks."""
    nets = []
    for name in NAMES:
        net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32)).eval()
        xl.randomize(net, gen, scale=0.5)
        net.save_pretrained(os.path.join(out, name), safe_serialization=True)
        nets.append(net)
    return nets


def main():
    if sys.argv[1] == "--for-unet":
        unet = UNet2DConditionModel.from_pretrained(sys.argv[2])
        controlnets_for(unet, sys.argv[3], torch.Generator().manual_seed(11))
        return
    out = sys.argv[1]
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    gen = torch.Generator().manual_seed(7)
    latents = torch.randn(1, 4, xl.HEIGHT // 2, xl.WIDTH // 2, generator=gen)
    save_file({"latents": latents}, os.path.join(out, "latents.safetensors"))
    images = [os.path.join(out, f"control_{c}.png") for c in "ab"]
    for path in images:
        control_image(path, gen)
    cases = {}
    for case in ["sd21", "sdxl"]:
        work = os.path.join(out, "work")
        parts, base_class, steered_class = build(case, work, gen)
        base_class(**parts).save_pretrained(os.path.join(out, case))
        shutil.rmtree(work)
        nets = controlnets_for(parts["unet"], os.path.join(out, f"{case}_controlnets"), gen)
        base = base_class.from_pretrained(os.path.join(out, case), torch_dtype=torch.float32)
        expected = {}
        with torch.no_grad():
            for key, chosen, scale in [("single", nets[:1], SINGLE_SCALE), ("multi", nets, MULTI_SCALES)]:
                controlnet = chosen[0] if len(chosen) == 1 else chosen
                pipe = steered_class(**base.components, controlnet=controlnet)
                control = [Image.open(p) for p in images[:len(chosen)]]
                image = pipe(prompt=xl.PROMPT, negative_prompt=xl.NEGATIVE, image=control[0] if len(chosen) == 1 else control,
                             height=xl.HEIGHT, width=xl.WIDTH, num_inference_steps=xl.STEPS,
                             guidance_scale=xl.GUIDANCE, controlnet_conditioning_scale=scale,
                             latents=latents.clone(), output_type="pt").images
                expected[key] = image.float().contiguous()
            expected["plain"] = base(prompt=xl.PROMPT, negative_prompt=xl.NEGATIVE, height=xl.HEIGHT, width=xl.WIDTH,
                                     num_inference_steps=xl.STEPS, guidance_scale=xl.GUIDANCE,
                                     latents=latents.clone(), output_type="pt").images.float().contiguous()
        save_file(expected, os.path.join(out, f"{case}_expected.safetensors"))
        cases[case] = {"controlnets": NAMES}
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump({"cases": cases, "height": xl.HEIGHT, "width": xl.WIDTH, "steps": xl.STEPS,
                   "guidance_scale": xl.GUIDANCE, "prompt": xl.PROMPT, "negative_prompt": xl.NEGATIVE,
                   "single_scale": SINGLE_SCALE, "multi_scales": MULTI_SCALES,
                   "control_images": ["control_a.png", "control_b.png"]}, f, indent=2)


if __name__ == "__main__":
    main()
