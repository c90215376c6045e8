"""diffusers' FLUX.1 text-to-image pipeline with random weights, timed by phase as
`diffmesh-flux-e2e-bench` times ours (the same configurations, sizes and step count), so the two
JSON lines compare. The prompt embeddings come from transformers' CLIPTextModel and
T5EncoderModel called on token ids (no tokenizer files), then `FluxPipeline` runs from those
embeddings: 28 steps and the VAE decode, `output_type="pt"`.

python3 diffusers_flux_e2e.py [--config flux-dev|small] [--device cuda|cpu] [--size 1024]
  [--steps 28] [--runs 2]
"""

import argparse
import json
import statistics
import time

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers import FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel


def configs(name):
    """FLUX.1-dev's published configurations, or the bench's reduced `small` ones."""
    if name == "flux-dev":
        clip = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                    num_attention_heads=12, eos_token_id=2)
        t5 = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                  feed_forward_proj="gated-gelu")
        transformer = dict(num_layers=19, num_single_layers=38, attention_head_dim=128,
                           num_attention_heads=24, joint_attention_dim=4096,
                           pooled_projection_dim=768, guidance_embeds=True,
                           axes_dims_rope=(16, 56, 56))
        vae = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2)
    elif name == "small":
        clip = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=2, eos_token_id=2)
        t5 = dict(d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
                  feed_forward_proj="gated-gelu")
        transformer = dict(num_layers=1, num_single_layers=1, attention_head_dim=32,
                           num_attention_heads=2, joint_attention_dim=128,
                           pooled_projection_dim=64, guidance_embeds=True,
                           axes_dims_rope=(8, 12, 12))
        vae = dict(block_out_channels=(32, 32), layers_per_block=1)
    else:
        raise SystemExit(f"--config: `{name}` is not flux-dev or small")
    blocks = len(vae["block_out_channels"])
    vae.update(down_block_types=("DownEncoderBlock2D",) * blocks,
               up_block_types=("UpDecoderBlock2D",) * blocks, latent_channels=16,
               scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
               use_post_quant_conv=False)
    return clip, t5, transformer, vae


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--t5-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    clip_cfg, t5_cfg, tr_cfg, vae_cfg = configs(args.config)

    torch.manual_seed(0)
    built = time.perf_counter()
    # Made on the device in the target dtype: FLUX.1-dev's 12B parameters never exist in f32.
    torch.set_default_dtype(dtype)
    with torch.device(device):
        clip = CLIPTextModel(CLIPTextConfig(**clip_cfg)).eval()
        t5 = T5EncoderModel(T5Config(**t5_cfg)).eval()
        transformer = FluxTransformer2DModel(**tr_cfg).eval()
        vae = AutoencoderKL(**vae_cfg).eval()
    torch.set_default_dtype(torch.float32)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    sync(device)
    build_s = time.perf_counter() - built
    params = sum(p.numel() for m in (clip, t5, transformer, vae) for p in m.parameters())
    print(f"{args.config} on {args.device}: {params / 1e9:.2f}B parameters built in "
          f"{build_s:.1f} s", flush=True)

    gen = torch.Generator(device="cpu").manual_seed(7)
    clip_ids = torch.randint(0, clip.config.vocab_size, (1, 77), generator=gen).to(device)
    t5_ids = torch.randint(0, t5.config.vocab_size, (1, args.t5_tokens),
                           generator=gen).to(device)
    runs = []
    for run in range(args.runs + 1):
        with torch.inference_mode():
            sync(device)
            t = time.perf_counter()
            pooled = clip(clip_ids).pooler_output
            hidden = t5(t5_ids)[0]
            sync(device)
            encode = (time.perf_counter() - t) * 1e3
            ends = []
            start = time.perf_counter()

            def on_step_end(_pipe, _i, _t, kwargs):
                sync(device)
                ends.append((time.perf_counter() - start) * 1e3)
                return kwargs

            out = pipe(prompt_embeds=hidden, pooled_prompt_embeds=pooled, height=args.size,
                       width=args.size, num_inference_steps=args.steps, guidance_scale=3.5,
                       max_sequence_length=args.t5_tokens, output_type="pt",
                       generator=torch.Generator(device="cpu").manual_seed(7),
                       callback_on_step_end=on_step_end).images
            sync(device)
            pipeline = (time.perf_counter() - start) * 1e3
        steps = [b - a for a, b in zip(ends, ends[1:])]
        decode = pipeline - ends[-1]
        finite = bool(torch.isfinite(out).all())
        warm = " (warm-up)" if run == 0 else ""
        print(f"run {run}{warm}: encode {encode:.1f} ms, step median "
              f"{statistics.median(steps):.1f} ms, decode {decode:.1f} ms, "
              f"pipeline {pipeline:.1f} ms (+ encode; images finite: {finite})", flush=True)
        if run > 0:
            runs.append(dict(encode=encode, steps=steps, decode=decode,
                             total=encode + pipeline))
    print(json.dumps({
        "impl": "diffusers",
        "config": args.config,
        "device": args.device,
        "dtype": str(dtype),
        "size": args.size,
        "steps": args.steps,
        "t5_tokens": args.t5_tokens,
        "parameters": params,
        "build_s": build_s,
        "encode_ms": statistics.median(r["encode"] for r in runs),
        "step_ms": statistics.median(s for r in runs for s in r["steps"]),
        "decode_ms": statistics.median(r["decode"] for r in runs),
        "pipeline_ms": statistics.median(r["total"] for r in runs),
        "runs": len(runs),
    }))


if __name__ == "__main__":
    main()
