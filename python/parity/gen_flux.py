"""Parity fixtures for diffmesh's Flux transformer (model/tests/flux_parity.rs).

Builds reduced FluxTransformer2DModel configs with random weights using diffusers, saves each as a
diffusers component folder (config.json + safetensors via save_pretrained), plus the inputs and
diffusers' fp32 CPU output as safetensors:

    OUT/<case>/transformer/{config.json, diffusion_pytorch_model.safetensors}
    OUT/<case>/inputs.safetensors   hidden_states, encoder_hidden_states, pooled_projections,
                                    timestep, img_ids, txt_ids[, guidance]
    OUT/<case>/output.safetensors   sample
    OUT/manifest.json               list of case names

Usage: python gen_flux.py --out DIR
"""
import argparse
import json
import math
import os

import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import save_file

# name -> (config overrides, batch, image tokens (int or (h, w) grid), text tokens)
CASES = {
    # odd token counts, random position ids, no guidance
    "basic": (dict(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12,
                   guidance_embeds=False, axes_dims_rope=[4, 6, 6]), 1, 37, 7),
    # batch 2, guidance, out_channels != in_channels, pipeline-style grid ids
    "guidance_batch": (dict(in_channels=12, out_channels=8, num_layers=1, num_single_layers=3,
                            attention_head_dim=24, num_attention_heads=3, joint_attention_dim=20,
                            pooled_projection_dim=10, guidance_embeds=True, axes_dims_rope=[8, 8, 8]),
                       2, (6, 5), 5),
    # batch 3, a single text token, guidance
    "odd_batch3": (dict(in_channels=8, num_layers=2, num_single_layers=1, attention_head_dim=8,
                        num_attention_heads=4, joint_attention_dim=16, pooled_projection_dim=8,
                        guidance_embeds=True, axes_dims_rope=[2, 2, 4]), 3, 13, 1),
    # patch_size 2 widens proj_out; no double blocks
    "patch2_singles_only": (dict(patch_size=2, in_channels=16, out_channels=4, num_layers=0,
                                 num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                                 joint_attention_dim=12, pooled_projection_dim=6,
                                 guidance_embeds=False, axes_dims_rope=[4, 4, 8]), 1, 9, 3),
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
                p.copy_(noise / math.sqrt(p.shape[1]))


def image_ids(spec, gen):
    if isinstance(spec, tuple):  # the Flux pipeline's _prepare_latent_image_ids
        h, w = spec
        ids = torch.zeros(h, w, 3)
        ids[..., 1] = torch.arange(h)[:, None]
        ids[..., 2] = torch.arange(w)[None, :]
        return ids.reshape(h * w, 3)
    return torch.randint(0, 48, (spec, 3), generator=gen).float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    for seed, (name, (cfg, batch, img_spec, txt)) in enumerate(CASES.items()):
        gen = torch.Generator().manual_seed(1234 + seed)
        model = FluxTransformer2DModel(**cfg).eval()
        randomize(model, gen)
        case_dir = os.path.join(args.out, name)
        model.save_pretrained(os.path.join(case_dir, "transformer"), safe_serialization=True)

        img_ids = image_ids(img_spec, gen)
        n = img_ids.shape[0]
        txt_ids = torch.zeros(txt, 3) if txt == 1 else torch.randint(0, 4, (txt, 3), generator=gen).float()
        inputs = {
            "hidden_states": torch.randn(batch, n, cfg["in_channels"], generator=gen),
            "encoder_hidden_states": torch.randn(batch, txt, cfg["joint_attention_dim"], generator=gen),
            "pooled_projections": torch.randn(batch, cfg["pooled_projection_dim"], generator=gen),
            "timestep": torch.rand(batch, generator=gen),
            "img_ids": img_ids,
            "txt_ids": txt_ids,
        }
        if cfg["guidance_embeds"]:
            inputs["guidance"] = 1.0 + 4.0 * torch.rand(batch, generator=gen)
        with torch.no_grad():
            out = model(**inputs, return_dict=False)[0]
        save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(case_dir, "inputs.safetensors"))
        save_file({"sample": out.contiguous()}, os.path.join(case_dir, "output.safetensors"))
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump({"cases": list(CASES)}, f)


if __name__ == "__main__":
    main()
