"""Parity fixtures for UNet LoRA files (model/tests/unet_lora_parity.rs).

A reduced SDXL-shaped UNet2DConditionModel with random weights, one random LoRA written in the two
layouts people have, and diffusers' outputs with each loaded as `StableDiffusionXLPipeline.
load_lora_weights` loads them (its `lora_state_dict` conversion, then the UNet's PEFT adapter):

    OUT/unet/{config.json, diffusion_pytorch_model.safetensors}
    OUT/lora_diffusers.safetensors  `save_lora_weights` (`unet.<module>.lora_A.weight`, PEFT
                                    metadata r 4, lora_alpha 8)
    OUT/lora_kohya.safetensors      the same A and B in kohya's SDXL layout: SGM block names
                                    (`lora_unet_input_blocks_4_1_...`), lora_down/lora_up, alpha 2
                                    per module (scale 0.5), and a text-encoder adapter key
    OUT/inputs.safetensors          sample, timestep, encoder_hidden_states, text_embeds, time_ids
    OUT/outputs.safetensors         base, diffusers, kohya

With `--unet DIR` the UNet is the one in DIR (diffmesh's tiny trained UNet, weights/tiny-unet/unet)
instead of a random one; the inputs follow its config (no added conditioning where it has none).

Usage: python gen_unet_lora.py [--unet DIR] --out DIR
"""
import argparse
import math
import os
import re

import torch
from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

CONFIG = dict(in_channels=4, out_channels=4, block_out_channels=[32, 64, 64],
              down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
              up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
              attention_head_dim=[2, 4, 4], transformer_layers_per_block=[1, 2, 2], cross_attention_dim=40,
              layers_per_block=2, norm_num_groups=16, use_linear_projection=True, addition_embed_type="text_time",
              addition_time_embed_dim=8, projection_class_embeddings_input_dim=16 + 6 * 8)
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "time_emb_proj",
           "linear_1", "linear_2"]
LAYERS = CONFIG["layers_per_block"]


def randomize(params, gen, scale=1.0):
    with torch.no_grad():
        for name, p in params:
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.05 * noise)
            else:
                p.copy_(scale * noise / math.sqrt(p[0].numel()))


def to_sgm(module: str) -> str:
    """diffusers' module path in SGM's block names (the inverse of diffusers' mapping)."""
    m = re.match(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", module)
    if m:
        b, kind, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        i = 1 + b * (LAYERS + 1) + layer
        return f"input_blocks.{i}.{0 if kind == 'resnets' else 1}.{resnet_rest(rest)}"
    m = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)", module)
    if m:
        i = {("resnets", "0"): 0, ("attentions", "0"): 1, ("resnets", "1"): 2}[(m[1], m[2])]
        return f"middle_block.{i}.{resnet_rest(m[3])}"
    m = re.match(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", module)
    if m:
        b, kind, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        i = b * (LAYERS + 1) + layer
        return f"output_blocks.{i}.{0 if kind == 'resnets' else 1}.{resnet_rest(rest)}"
    return {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
            "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}[module]


def resnet_rest(rest: str) -> str:
    return "emb_layers.1" if rest == "time_emb_proj" else rest


def load_lora(path, gen_state=None):
    """A fresh UNet with the file loaded as `StableDiffusionXLPipeline.load_lora_weights` does."""
    unet = UNet2DConditionModel.from_pretrained(OUT_UNET).eval()
    state, alphas, metadata = StableDiffusionXLPipeline.lora_state_dict(path, unet_config=unet.config,
                                                                       return_lora_metadata=True)
    unet_state = {k: v for k, v in state.items() if k.startswith("unet.")}
    unet_alphas = {k: v for k, v in (alphas or {}).items() if k.startswith("unet.")} or None
    unet.load_lora_adapter(unet_state, network_alphas=unet_alphas, prefix="unet", adapter_name="x",
                           metadata=metadata)
    return unet


OUT_UNET = None


def main() -> None:
    global OUT_UNET, LAYERS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--unet", help="a UNet2DConditionModel folder to adapt instead of a random one")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    gen = torch.Generator().manual_seed(99)
    if args.unet:
        unet = UNet2DConditionModel.from_pretrained(args.unet).eval()
    else:
        unet = UNet2DConditionModel(**CONFIG).eval()
        randomize(unet.named_parameters(), gen)
    LAYERS = unet.config.layers_per_block
    OUT_UNET = os.path.join(args.out, "unet")
    unet.save_pretrained(OUT_UNET, safe_serialization=True)

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    unet.add_adapter(cfg)
    randomize([(n, p) for n, p in unet.named_parameters() if "lora_" in n], gen, scale=0.5)
    state = {k: v.contiguous() for k, v in get_peft_model_state_dict(unet).items()}
    StableDiffusionXLPipeline.save_lora_weights(args.out, unet_lora_layers=state,
                                                unet_lora_adapter_metadata=cfg.to_dict(),
                                                weight_name="lora_diffusers.safetensors")
    kohya = {}
    for key, value in state.items():
        module, which = re.match(r"(.*)\.lora_([AB])\.weight", key).groups()
        name = "lora_unet_" + to_sgm(module).replace(".", "_")
        kohya[f"{name}.{'lora_down' if which == 'A' else 'lora_up'}.weight"] = value
        kohya[f"{name}.alpha"] = torch.tensor(2.0)
    kohya["lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"] = torch.randn(4, 8)
    kohya["lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight"] = torch.randn(8, 4)
    save_file(kohya, os.path.join(args.out, "lora_kohya.safetensors"))

    c = unet.config
    inputs = {
        "sample": torch.randn(1, c.in_channels, 16, 12, generator=gen),
        "timestep": torch.tensor([321.0]),
        "encoder_hidden_states": torch.randn(1, 6, c.cross_attention_dim, generator=gen),
    }
    added = None
    if c.addition_embed_type == "text_time":
        pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
        inputs["text_embeds"] = torch.randn(1, pooled, generator=gen)
        inputs["time_ids"] = torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0]])
        added = {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]}
    outputs = {}
    with torch.no_grad():
        base = UNet2DConditionModel.from_pretrained(OUT_UNET).eval()
        run = lambda m: m(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"],
                          added_cond_kwargs=added, return_dict=False)[0]
        outputs["base"] = run(base)
        outputs["diffusers"] = run(load_lora(os.path.join(args.out, "lora_diffusers.safetensors")))
        outputs["kohya"] = run(load_lora(os.path.join(args.out, "lora_kohya.safetensors")))
    save_file(inputs, os.path.join(args.out, "inputs.safetensors"))
    save_file({k: v.contiguous() for k, v in outputs.items()}, os.path.join(args.out, "outputs.safetensors"))


if __name__ == "__main__":
    main()
