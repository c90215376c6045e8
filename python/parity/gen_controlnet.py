"""Parity fixtures for diffmesh's Flux ControlNet (model/tests/controlnet_parity.rs).

Builds reduced FluxControlNetModel + FluxTransformer2DModel pairs with random weights (no weight
keeps diffusers' zero init, which would hide bugs), runs the ControlNet the way
FluxControlNetPipeline does, and feeds its residuals to the transformer:

    OUT/<case>/transformer/, OUT/<case>/controlnet/   diffusers component folders
    OUT/<case>/inputs.safetensors    hidden_states, controlnet_cond, encoder_hidden_states,
                                     pooled_projections, timestep, img_ids, txt_ids[, guidance]
    OUT/<case>/output.safetensors    double_<i>, single_<i> (the ControlNet's scaled residuals),
                                     sample (the transformer's output with them added)
    OUT/manifest.json                {"cases": [...], "scales": {case: conditioning_scale}}

    OUT/shipped/{inputs,output}.safetensors   with --shipped DIR: the same for a ControlNet
                                              folder as diffusers loads it (random inputs)

Usage: python gen_controlnet.py --out DIR [--shipped CONTROLNET_DIR]
"""
import argparse
import json
import os

import torch
from diffusers import FluxControlNetModel, FluxTransformer2DModel
from safetensors.torch import save_file

from gen_flux import image_ids, randomize

# name -> (shared config, base blocks (double, single), ControlNet blocks (double, single),
#          batch, image tokens, text tokens, conditioning scale)
CASES = {
    # fewer ControlNet blocks than base blocks: diffusers' interval rule reuses residuals
    "fewer_blocks": (dict(in_channels=16, attention_head_dim=16, num_attention_heads=2,
                          joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=False,
                          axes_dims_rope=[4, 6, 6]), (3, 3), (1, 2), 2, (5, 4), 7, 0.7),
    # guidance-embedded, double-block residuals only (the single list is None in diffusers)
    "guidance_double_only": (dict(in_channels=8, attention_head_dim=8, num_attention_heads=4,
                                  joint_attention_dim=16, pooled_projection_dim=8,
                                  guidance_embeds=True, axes_dims_rope=[2, 2, 4]),
                             (2, 1), (2, 0), 1, (3, 3), 3, 1.0),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shipped", help="a FluxControlNetModel folder to run as diffusers loads it")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    scales = {}
    for seed, (name, (cfg, base, ctrl, batch, grid, txt, scale)) in enumerate(CASES.items()):
        gen = torch.Generator().manual_seed(4321 + seed)
        transformer = FluxTransformer2DModel(**cfg, num_layers=base[0], num_single_layers=base[1]).eval()
        controlnet = FluxControlNetModel(**cfg, num_layers=ctrl[0], num_single_layers=ctrl[1]).eval()
        randomize(transformer, gen)
        randomize(controlnet, gen)
        case_dir = os.path.join(args.out, name)
        transformer.save_pretrained(os.path.join(case_dir, "transformer"), safe_serialization=True)
        controlnet.save_pretrained(os.path.join(case_dir, "controlnet"), safe_serialization=True)

        img_ids = image_ids(grid, gen)
        n = img_ids.shape[0]
        inputs = {
            "hidden_states": torch.randn(batch, n, cfg["in_channels"], generator=gen),
            "controlnet_cond": torch.randn(batch, n, cfg["in_channels"], generator=gen),
            "encoder_hidden_states": torch.randn(batch, txt, cfg["joint_attention_dim"], generator=gen),
            "pooled_projections": torch.randn(batch, cfg["pooled_projection_dim"], generator=gen),
            "timestep": torch.rand(batch, generator=gen),
            "img_ids": img_ids,
            "txt_ids": torch.randint(0, 4, (txt, 3), generator=gen).float(),
        }
        if cfg["guidance_embeds"]:
            inputs["guidance"] = 1.0 + 4.0 * torch.rand(batch, generator=gen)
        shared = {k: v for k, v in inputs.items() if k != "controlnet_cond"}
        with torch.no_grad():
            double, single = controlnet(**shared, controlnet_cond=inputs["controlnet_cond"],
                                        conditioning_scale=scale, return_dict=False)
            sample = transformer(**shared, controlnet_block_samples=double,
                                 controlnet_single_block_samples=single, return_dict=False)[0]
        out = {"sample": sample}
        for kind, samples in (("double", double), ("single", single)):
            for i, s in enumerate(samples or []):
                out[f"{kind}_{i}"] = s
        save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(case_dir, "inputs.safetensors"))
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(case_dir, "output.safetensors"))
        scales[name] = scale
    if args.shipped:
        shipped(args.shipped, os.path.join(args.out, "shipped"))
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump({"cases": list(CASES), "scales": scales}, f)


def shipped(src: str, out: str) -> None:
    """Random inputs for the ControlNet in `src` and its residuals as diffusers computes them."""
    net = FluxControlNetModel.from_pretrained(src).eval()
    cfg = net.config
    gen = torch.Generator().manual_seed(99)
    n, txt = 256, 9
    inputs = {
        "hidden_states": torch.randn(1, n, cfg.in_channels, generator=gen),
        "controlnet_cond": torch.randn(1, n, cfg.in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(1, txt, cfg.joint_attention_dim, generator=gen),
        "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, generator=gen),
        "timestep": torch.rand(1, generator=gen),
        "img_ids": image_ids((16, 16), gen),
        "txt_ids": torch.zeros(txt, 3),
    }
    with torch.no_grad():
        double, single = net(**inputs, return_dict=False)
    outputs = {f"double_{i}": s for i, s in enumerate(double or [])}
    outputs.update({f"single_{i}": s for i, s in enumerate(single or [])})
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(out, "inputs.safetensors"))
    save_file({k: v.contiguous() for k, v in outputs.items()}, os.path.join(out, "output.safetensors"))


if __name__ == "__main__":
    main()
