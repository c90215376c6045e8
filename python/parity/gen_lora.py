"""Parity fixtures for diffmesh's LoRA patching (services/denoiser/tests/lora_parity.rs).

A reduced FluxTransformer2DModel with random weights, two random LoRA adapters written the way
users get them, and diffusers' outputs with the adapters loaded through its PEFT backend as
`FluxPipeline.load_lora_weights` loads them, then `set_adapters` (unmerged LoRA layers):

    OUT/transformer/{config.json, diffusion_pytorch_model.safetensors}
    OUT/lora_a.safetensors   `FluxPipeline.save_lora_weights` with PEFT metadata (r 4, alpha 8,
                             a rank_pattern and an alpha_pattern), many kinds of layers
    OUT/lora_b.safetensors   a plain state dict without metadata (alpha = rank), rank 2
    OUT/inputs.safetensors   hidden_states, encoder_hidden_states, pooled_projections, timestep,
                             img_ids, txt_ids
    OUT/outputs.safetensors  base, a (weight 0.7), ab (a 0.7 and b -0.5)

With `--shipped MODEL_DIR LORA` it also writes OUT/shipped_{inputs,outputs}.safetensors: the
shipped tiny transformer (MODEL_DIR/transformer) with the shipped LoRA file loaded by diffusers
(weight 1), which checks the files `diffmesh-train-tiny lora` writes load in diffusers.

Usage: python gen_lora.py --out DIR [--shipped MODEL_DIR LORA]
"""
import argparse
import math
import os

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

CONFIG = dict(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12,
              guidance_embeds=False, axes_dims_rope=[4, 6, 6])


def randomize(params, gen, scale=1.0):
    with torch.no_grad():
        for name, p in params:
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.05 * noise)
            else:
                p.copy_(scale * noise / math.sqrt(p.shape[1]))


def adapter_state(cfg: LoraConfig, gen) -> dict:
    """A LoRA's state dict for `cfg` with random A and B (PEFT initialises B at zero)."""
    model = FluxTransformer2DModel(**CONFIG)
    model.add_adapter(cfg)
    randomize([(n, p) for n, p in model.named_parameters() if "lora_" in n], gen, scale=0.5)
    return {k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shipped", nargs=2, metavar=("MODEL_DIR", "LORA"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    gen = torch.Generator().manual_seed(4321)
    os.makedirs(args.out, exist_ok=True)

    base = FluxTransformer2DModel(**CONFIG).eval()
    randomize(base.named_parameters(), gen)
    base.save_pretrained(os.path.join(args.out, "transformer"), safe_serialization=True)

    cfg_a = LoraConfig(
        r=4, lora_alpha=8,
        target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                        "add_v_proj", "to_add_out", "ff.net.0.proj", "ff.net.2", "proj_mlp",
                        "proj_out", "norm1.linear", "x_embedder", "context_embedder"],
        rank_pattern={"single_transformer_blocks.1.proj_out": 2},
        alpha_pattern={"to_k": 3},
    )
    state_a = adapter_state(cfg_a, gen)
    FluxPipeline.save_lora_weights(args.out, transformer_lora_layers=state_a,
                                   transformer_lora_adapter_metadata=cfg_a.to_dict(),
                                   weight_name="lora_a.safetensors")
    cfg_b = LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v", "proj_mlp"])
    state_b = adapter_state(cfg_b, gen)
    save_file({f"transformer.{k}": v for k, v in state_b.items()},
              os.path.join(args.out, "lora_b.safetensors"))

    n, txt = 20, 5
    inputs = {
        "hidden_states": torch.randn(1, n, CONFIG["in_channels"], generator=gen),
        "encoder_hidden_states": torch.randn(1, txt, CONFIG["joint_attention_dim"], generator=gen),
        "pooled_projections": torch.randn(1, CONFIG["pooled_projection_dim"], generator=gen),
        "timestep": torch.rand(1, generator=gen),
        "img_ids": torch.randint(0, 48, (n, 3), generator=gen).float(),
        "txt_ids": torch.randint(0, 4, (txt, 3), generator=gen).float(),
    }

    model = FluxTransformer2DModel.from_pretrained(os.path.join(args.out, "transformer")).eval()
    outputs = {}
    with torch.no_grad():
        outputs["base"] = model(**inputs, return_dict=False)[0]
        for name in ("a", "b"):
            # What `FluxPipeline.load_lora_weights` does (the model's own `load_lora_adapter`
            # ignores the file's metadata, so alpha would silently become the rank).
            state, alphas, metadata = FluxPipeline.lora_state_dict(
                os.path.join(args.out, f"lora_{name}.safetensors"), return_alphas=True,
                return_lora_metadata=True)
            FluxPipeline.load_lora_into_transformer(state, network_alphas=alphas, transformer=model,
                                                    adapter_name=name, metadata=metadata)
        model.set_adapters(["a"], weights=[0.7])
        outputs["a"] = model(**inputs, return_dict=False)[0]
        model.set_adapters(["a", "b"], weights=[0.7, -0.5])
        outputs["ab"] = model(**inputs, return_dict=False)[0]
    for name in ("a", "ab"):
        # A test that cannot fail would compare outputs the adapters do not change.
        assert (outputs[name] - outputs["base"]).abs().max() > 1e-2, name
    save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(args.out, "inputs.safetensors"))
    save_file({k: v.contiguous() for k, v in outputs.items()}, os.path.join(args.out, "outputs.safetensors"))
    if args.shipped:
        shipped(args.out, *args.shipped, gen)


def shipped(out: str, model_dir: str, lora: str, gen) -> None:
    model = FluxTransformer2DModel.from_pretrained(os.path.join(model_dir, "transformer")).eval()
    cfg = model.config
    n, txt = 256, 16
    inputs = {
        "hidden_states": torch.randn(1, n, cfg.in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(1, txt, cfg.joint_attention_dim, generator=gen),
        "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, generator=gen),
        "timestep": torch.rand(1, generator=gen),
        "img_ids": torch.randint(0, 16, (n, 3), generator=gen).float(),
        "txt_ids": torch.zeros(txt, 3),
    }
    outputs = {}
    with torch.no_grad():
        outputs["base"] = model(**inputs, return_dict=False)[0]
        state, alphas, metadata = FluxPipeline.lora_state_dict(lora, return_alphas=True,
                                                               return_lora_metadata=True)
        FluxPipeline.load_lora_into_transformer(state, network_alphas=alphas, transformer=model,
                                                adapter_name="shipped", metadata=metadata)
        model.set_adapters(["shipped"], weights=[1.0])
        outputs["lora"] = model(**inputs, return_dict=False)[0]
    assert (outputs["lora"] - outputs["base"]).abs().max() > 1e-3
    save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(out, "shipped_inputs.safetensors"))
    save_file({k: v.contiguous() for k, v in outputs.items()}, os.path.join(out, "shipped_outputs.safetensors"))


if __name__ == "__main__":
    main()
