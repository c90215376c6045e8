"""Reference outputs from diffusers for the Rust parity tests of AutoencoderKL and
FlowMatchEulerDiscreteScheduler (model/tests/vae_parity.rs, model/tests/scheduler_parity.rs).

    python gen_vae_scheduler.py scheduler OUT_DIR
    python gen_vae_scheduler.py vae OUT_DIR

`scheduler` writes OUT_DIR/cases.json (configs, how set_timesteps was called, the resulting sigmas
and timesteps as float32 values) and OUT_DIR/<case>.safetensors (inputs and outputs of step() over
the whole schedule and of scale_noise() at every step index).

`vae` writes one diffusers-format folder per reduced config: OUT_DIR/<case>/{config.json,
diffusion_pytorch_model.safetensors} with random weights, plus OUT_DIR/<case>/io.safetensors with
`sample`, `latent_mean`, `latent_logvar`, `decoded` (= decode(mean)) and `forward` (= vae(sample)
with sample_posterior=False). All fp32 on CPU.
"""

import json
import os
import sys

import numpy as np
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
from safetensors.torch import save_file

FLUX_DEV_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def calculate_shift(seq_len, cfg):
    # Copy of diffusers.pipelines.flux.pipeline_flux.calculate_shift (importing the pipeline module
    # needs `transformers`, which the parity venv does not have).
    base_seq, max_seq = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
    base_shift, max_shift = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_seq - base_seq)
    b = base_shift - m * base_seq
    return seq_len * m + b


def scheduler_cases():
    cases = []
    for steps in (1, 4, 28):
        # Plain set_timesteps(num_inference_steps) (numpy float64 path), static shift.
        for shift in (1.0, 3.0):
            cases.append(dict(config={"shift": shift}, mode="default", steps=steps, mu=None))
        # The Flux pipeline path: custom sigmas linspace(1, 1/n, n) + dynamic shifting by image size.
        for seq_len in (16, 256, 1024, 4096):
            mu = calculate_shift(seq_len, FLUX_DEV_SCHEDULER)
            cases.append(dict(config=FLUX_DEV_SCHEDULER, mode="flux", steps=steps, mu=mu, seq_len=seq_len))
        # Dynamic shifting on the float64 path with explicit mu.
        for mu in (0.5, 1.15):
            cases.append(dict(config={"use_dynamic_shifting": True}, mode="default", steps=steps, mu=mu))
        # Custom sigmas with a static shift (float32 path).
        cases.append(dict(config={"shift": 3.0}, mode="flux", steps=steps, mu=None))
    # Less common options diffmesh also mirrors.
    cases.append(dict(config={"shift": 3.0, "shift_terminal": 0.1}, mode="default", steps=8, mu=None))
    cases.append(dict(config={"shift": 2.0, "invert_sigmas": True}, mode="default", steps=6, mu=None))
    cases.append(
        dict(config={"use_dynamic_shifting": True, "time_shift_type": "linear"}, mode="flux", steps=5, mu=0.7)
    )
    cases.append(dict(config={"num_train_timesteps": 500, "shift": 1.7}, mode="default", steps=7, mu=None))
    return cases


def gen_scheduler(out):
    cases = scheduler_cases()
    gen = torch.Generator().manual_seed(0)
    for i, case in enumerate(cases):
        case["name"] = f"case{i:02d}"
        sched = FlowMatchEulerDiscreteScheduler(**case["config"])
        n = case["steps"]
        if case["mode"] == "flux":
            sigmas = np.linspace(1.0, 1 / n, n)
            sched.set_timesteps(sigmas=sigmas, mu=case["mu"])
        else:
            sched.set_timesteps(num_inference_steps=n, mu=case["mu"])
        case["sigmas"] = [float(x) for x in sched.sigmas.tolist()]
        case["timesteps"] = [float(x) for x in sched.timesteps.tolist()]
        assert sched.sigmas.dtype == torch.float32 and sched.timesteps.dtype == torch.float32

        # step() over the whole schedule the way the pipelines call it (begin_index 0).
        shape = (2, 3, 4, 5)
        tensors = {}
        sample = torch.randn(shape, generator=gen)
        tensors["sample_0"] = sample.clone()
        sched.set_begin_index(0)
        for k, t in enumerate(sched.timesteps):
            model_output = torch.randn(shape, generator=gen)
            tensors[f"model_output_{k}"] = model_output
            sample = sched.step(model_output, t, sample, return_dict=False)[0]
            tensors[f"sample_{k + 1}"] = sample.clone()

        # scale_noise() at every step index, as the inpaint pipeline uses it after a step.
        clean = torch.randn(shape, generator=gen)
        noise = torch.randn(shape, generator=gen)
        tensors["clean"] = clean
        tensors["noise"] = noise
        for k in range(n):
            sched._begin_index = 0
            sched._step_index = k
            ts = sched.timesteps[k : k + 1].repeat(shape[0])
            tensors[f"scaled_{k}"] = sched.scale_noise(clean, ts, noise)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, case["name"] + ".safetensors"))
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)


def vae_cases():
    base = dict(act_fn="silu", sample_size=32)
    return [
        # name, config, input shape
        (
            "c4_l1_attn",
            dict(
                base,
                block_out_channels=[32, 64],
                layers_per_block=1,
                latent_channels=4,
                norm_num_groups=8,
                scaling_factor=0.18215,
            ),
            (2, 3, 24, 40),
        ),
        (
            "c16_l2_attn_flux",
            dict(
                base,
                block_out_channels=[32, 64],
                layers_per_block=2,
                latent_channels=16,
                norm_num_groups=16,
                scaling_factor=0.3611,
                shift_factor=0.1159,
                use_quant_conv=False,
                use_post_quant_conv=False,
            ),
            (3, 3, 32, 24),
        ),
        (
            "c4_l2_noattn_3lvl",
            dict(
                base,
                block_out_channels=[32, 32, 64],
                layers_per_block=2,
                latent_channels=4,
                norm_num_groups=32,
                mid_block_add_attention=False,
            ),
            (2, 3, 20, 28),
        ),
        (
            # odd sizes: the encoder's asymmetric (0,1,0,1) padding path.
            "c16_l1_odd",
            dict(
                base,
                block_out_channels=[32, 64],
                layers_per_block=1,
                latent_channels=16,
                norm_num_groups=32,
                shift_factor=0.05,
                scaling_factor=0.5,
            ),
            (2, 3, 17, 23),
        ),
    ]


def gen_vae(out):
    torch.manual_seed(0)
    names = []
    for name, cfg, shape in vae_cases():
        n_levels = len(cfg["block_out_channels"])
        cfg = dict(
            cfg,
            down_block_types=["DownEncoderBlock2D"] * n_levels,
            up_block_types=["UpDecoderBlock2D"] * n_levels,
        )
        vae = AutoencoderKL(**cfg).eval()
        # Random weights everywhere, including norms (default init leaves them at 1/0).
        with torch.no_grad():
            for p in vae.parameters():
                p.copy_(torch.randn_like(p) * (0.5 / max(1, p[0].numel()) ** 0.5) + (0.0 if p.dim() > 1 else 0.1))
        d = os.path.join(out, name)
        vae.save_pretrained(d, safe_serialization=True)
        sample = torch.rand(shape) * 2 - 1
        with torch.no_grad():
            dist = vae.encode(sample).latent_dist
            decoded = vae.decode(dist.mean).sample
            forward = vae(sample, sample_posterior=False).sample
        save_file(
            {
                "sample": sample,
                "latent_mean": dist.mean.contiguous(),
                "latent_logvar": dist.logvar.contiguous(),
                "decoded": decoded.contiguous(),
                "forward": forward.contiguous(),
            },
            os.path.join(d, "io.safetensors"),
        )
        names.append(name)
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(names, f)


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("scheduler", "vae"):
        sys.exit(__doc__)
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    if sys.argv[1] == "scheduler":
        gen_scheduler(out)
    else:
        gen_vae(out)


if __name__ == "__main__":
    main()
