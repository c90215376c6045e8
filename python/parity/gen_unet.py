"""Parity fixtures for diffmesh's UNet2DConditionModel (model/tests/unet_parity.rs).

Builds reduced SD2.1-like and SDXL-like UNet2DConditionModel configs with random weights using
diffusers, saves each as a diffusers component folder (config.json + safetensors via
save_pretrained), plus the inputs (diffusers' forward argument names) and diffusers' fp32 CPU
output:

    OUT/<case>/unet/{config.json, diffusion_pytorch_model.safetensors}
    OUT/<case>/inputs.safetensors   sample, timestep, encoder_hidden_states[, text_embeds, time_ids]
    OUT/<case>/output.safetensors   sample
    OUT/manifest.json               list of case names, and the cases with ControlNets

For the ControlNet cases, two random `ControlNetModel`s built `from_unet` (then re-randomised, so
the zero convs are not zero) and:

    OUT/<case>/controlnet/, OUT/<case>/controlnet_2/
    OUT/<case>/controlnet_inputs.safetensors   the UNet's inputs, controlnet_cond, conditioning_scale
    OUT/<case>/controlnet_output.safetensors   down_block_res_samples.{i}, mid_block_res_sample
    OUT/<case>/controlled_inputs.safetensors   the UNet's inputs with the summed residuals of both
                                               (MultiControlNetModel, scales 0.7 and 0.4) under
                                               down_block_additional_residuals.{i},
                                               mid_block_additional_residual
    OUT/<case>/controlled_output.safetensors   sample

Usage: python gen_unet.py --out DIR
"""
import argparse
import json
import math
import os

import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel
from safetensors.torch import save_file

# SD2.1's shape of config: heads per level (`attention_head_dim`, a misnomer in diffusers),
# linear projections, v-prediction checkpoints (the UNet itself does not know), three
# cross-attention levels and a plain last one.
SD21 = dict(
    in_channels=4,
    out_channels=4,
    block_out_channels=[32, 64, 64],
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    attention_head_dim=[2, 4, 4],
    cross_attention_dim=24,
    layers_per_block=2,
    norm_num_groups=8,
    use_linear_projection=True,
    upcast_attention=True,
)

# SDXL's: a plain first level, several transformer layers deeper down, added conditioning
# (pooled text embeds + six time ids through `add_time_proj`).
SDXL = dict(
    in_channels=4,
    out_channels=4,
    block_out_channels=[32, 64, 96],
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    attention_head_dim=[2, 4, 6],
    transformer_layers_per_block=[1, 2, 3],
    cross_attention_dim=40,
    layers_per_block=2,
    norm_num_groups=16,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=16 + 6 * 8,
)

# name -> (config, batch, latent height, latent width, text tokens, pooled text width or None)
CASES = {
    "sd21": (SD21, 2, 16, 16, 7, None),
    # sizes that do not divide by the 4x downsampling: the up blocks take their skips' sizes
    "sd21_odd": (dict(SD21, use_linear_projection=False, layers_per_block=1, freq_shift=1,
                      flip_sin_to_cos=False), 1, 13, 10, 5, None),
    "sdxl": (SDXL, 2, 16, 12, 6, 16),
    "sdxl_one_level_attention": (dict(SDXL, transformer_layers_per_block=2, layers_per_block=1,
                                      down_block_types=["DownBlock2D", "DownBlock2D",
                                                        "CrossAttnDownBlock2D"],
                                      up_block_types=["CrossAttnUpBlock2D", "UpBlock2D",
                                                      "UpBlock2D"]),
                                 1, 8, 8, 3, 16),
}


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Replace every parameter so no weight keeps a trivial init (ones/zeros) that would hide bugs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.05 * noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))


CONTROL_CASES = ["sd21", "sdxl"]
SCALES = [0.7, 0.4]


def controlnets(model, case_dir, inputs, added, gen):
    nets = []
    for i in range(2):
        net = ControlNetModel.from_unet(model).eval()
        randomize(net, gen)
        net.save_pretrained(os.path.join(case_dir, "controlnet" if i == 0 else f"controlnet_{i + 1}"),
                            safe_serialization=True)
        nets.append(net)
    b, _, h, w = inputs["sample"].shape
    cond = torch.rand(b, 3, 8 * h, 8 * w, generator=gen)
    args = (inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"])
    with torch.no_grad():
        down, mid = nets[0](*args, controlnet_cond=cond, conditioning_scale=SCALES[0],
                            added_cond_kwargs=added, return_dict=False)
        both_down, both_mid = MultiControlNetModel(nets)(*args, controlnet_cond=[cond, 1.0 - cond],
                                                         conditioning_scale=SCALES, added_cond_kwargs=added,
                                                         return_dict=False)
        controlled = model(*args, added_cond_kwargs=added, down_block_additional_residuals=both_down,
                           mid_block_additional_residual=both_mid, return_dict=False)[0]
    save_file({**{k: v.contiguous() for k, v in inputs.items()}, "controlnet_cond": cond,
               "conditioning_scale": torch.tensor([SCALES[0]])},
              os.path.join(case_dir, "controlnet_inputs.safetensors"))
    out = {f"down_block_res_samples.{i}": t.contiguous() for i, t in enumerate(down)}
    out["mid_block_res_sample"] = mid.contiguous()
    save_file(out, os.path.join(case_dir, "controlnet_output.safetensors"))
    residuals = {f"down_block_additional_residuals.{i}": t.contiguous() for i, t in enumerate(both_down)}
    residuals["mid_block_additional_residual"] = both_mid.contiguous()
    save_file({**{k: v.contiguous() for k, v in inputs.items()}, **residuals},
              os.path.join(case_dir, "controlled_inputs.safetensors"))
    save_file({"sample": controlled.contiguous(), "controlnet_cond_2": (1.0 - cond).contiguous()},
              os.path.join(case_dir, "controlled_output.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    for seed, (name, (cfg, batch, h, w, txt, pooled)) in enumerate(CASES.items()):
        gen = torch.Generator().manual_seed(4321 + seed)
        model = UNet2DConditionModel(**cfg).eval()
        randomize(model, gen)
        case_dir = os.path.join(args.out, name)
        model.save_pretrained(os.path.join(case_dir, "unet"), safe_serialization=True)
        inputs = {
            "sample": torch.randn(batch, cfg["in_channels"], h, w, generator=gen),
            # One timestep per row, fractional (schedulers such as Euler give those).
            "timestep": 999.0 * torch.rand(batch, generator=gen),
            "encoder_hidden_states": torch.randn(batch, txt, cfg["cross_attention_dim"], generator=gen),
        }
        added = None
        if pooled is not None:
            inputs["text_embeds"] = torch.randn(batch, pooled, generator=gen)
            # original size, crop top-left, target size, as SDXL's pipeline builds them
            inputs["time_ids"] = torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0],
                                               [768.0, 1344.0, 16.0, 8.0, 1024.0, 1024.0]])[:batch]
            added = {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]}
        with torch.no_grad():
            out = model(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"],
                        added_cond_kwargs=added, return_dict=False)[0]
        save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(case_dir, "inputs.safetensors"))
        save_file({"sample": out.contiguous()}, os.path.join(case_dir, "output.safetensors"))
        if name in CONTROL_CASES:
            controlnets(model, case_dir, inputs, added, gen)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump({"cases": list(CASES), "controlnet_cases": CONTROL_CASES}, f)


if __name__ == "__main__":
    main()
