"""Parity fixtures for diffmesh's discrete schedulers (model/tests/discrete_scheduler_parity.rs).

For each case: a diffusers scheduler built `from_config` of a checkpoint-like base config with
overrides (as pipelines swap schedulers), its saved `scheduler_config.json`, and after
`set_timesteps(steps)`: the timesteps, the sigmas (where the method has them), the initial noise
sigma, and a trajectory driven by random model outputs: at each step the scaled model input, the
model output, the noise an ancestral step drew, and the sample after the step.

    OUT/<case>/scheduler_config.json
    OUT/<case>/reference.safetensors   timesteps, sigmas?, init_noise_sigma, samples [S+1, ...],
                                       scaled [S, ...], model_outputs [S, ...], noises? [S, ...]
    OUT/cases.json                     [{name, steps, named?}]: `named` is the `--scheduler` name
                                       that gives this scheduler on the base config

Usage: python gen_discrete_schedulers.py --out DIR
"""
import argparse
import json
import os

import torch
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler)
from diffusers.schedulers import scheduling_euler_ancestral_discrete as ancestral_module
from safetensors.torch import save_file

# SDXL's scheduler_config.json (EulerDiscreteScheduler, epsilon, leading spacing, offset 1).
SDXL = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            prediction_type="epsilon", timestep_spacing="leading", steps_offset=1, interpolation_type="linear",
            use_karras_sigmas=False, clip_sample=False, set_alpha_to_one=False, sample_max_value=1.0,
            skip_prk_steps=True, trained_betas=None)
# SD2.1 (768, v-prediction): DDIMScheduler's config.
SD21 = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            prediction_type="v_prediction", timestep_spacing="leading", steps_offset=1, clip_sample=False,
            set_alpha_to_one=False, skip_prk_steps=True, trained_betas=None)

# name -> (class, base, overrides, steps, `--scheduler` name giving it from the base or None)
CASES = {
    "euler_sdxl": (EulerDiscreteScheduler, SDXL, {}, 30, "euler"),
    "euler_karras_v": (EulerDiscreteScheduler, SD21, dict(use_karras_sigmas=True, timestep_spacing="linspace"), 25, None),
    "euler_trailing_sigma_min": (EulerDiscreteScheduler, SDXL, dict(timestep_spacing="trailing",
                                                                    final_sigmas_type="sigma_min"), 7, None),
    "euler_a_sdxl": (EulerAncestralDiscreteScheduler, SDXL, {}, 20, "euler_a"),
    "euler_a_v_linspace": (EulerAncestralDiscreteScheduler, SD21, dict(timestep_spacing="linspace"), 9, None),
    "dpmpp_2m_sdxl": (DPMSolverMultistepScheduler, SDXL, dict(algorithm_type="dpmsolver++", solver_order=2,
                                                              use_karras_sigmas=False), 25, "dpmpp_2m"),
    "dpmpp_2m_karras_sdxl": (DPMSolverMultistepScheduler, SDXL, dict(algorithm_type="dpmsolver++", solver_order=2,
                                                                     use_karras_sigmas=True), 20, "dpmpp_2m_karras"),
    "dpmpp_2m_karras_v_long": (DPMSolverMultistepScheduler, SD21, dict(use_karras_sigmas=True), 30, None),
    "dpmpp_2m_heun_trailing": (DPMSolverMultistepScheduler, SDXL, dict(solver_type="heun", timestep_spacing="trailing",
                                                                       use_karras_sigmas=False), 10, None),
    "dpmpp_1s_linear_linspace": (DPMSolverMultistepScheduler, dict(beta_schedule="linear"),
                                 dict(solver_order=1, timestep_spacing="linspace"), 8, None),
    "ddim_sd21": (DDIMScheduler, SD21, {}, 50, None),
    "ddim_sdxl": (DDIMScheduler, SDXL, {}, 12, "ddim"),
    "ddim_trailing_clipped": (DDIMScheduler, dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
                              dict(timestep_spacing="trailing", clip_sample=True), 13, None),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    manifest = []
    for seed, (name, (cls, base, overrides, steps, named)) in enumerate(CASES.items()):
        gen = torch.Generator().manual_seed(777 + seed)
        sched = cls.from_config({**base, **overrides})
        case_dir = os.path.join(args.out, name)
        sched.save_config(case_dir)
        if named is not None:
            # The base config the `--scheduler` name is applied to.
            with open(os.path.join(case_dir, "base_config.json"), "w") as f:
                json.dump({"_class_name": "EulerDiscreteScheduler", **base}, f)
        sched.set_timesteps(steps)
        ref = {"timesteps": sched.timesteps.double(),
               "init_noise_sigma": torch.tensor([float(sched.init_noise_sigma)], dtype=torch.float64)}
        if cls is not DDIMScheduler:
            ref["sigmas"] = sched.sigmas.float()
        shape = (2, 4, 6, 5)
        sample = torch.randn(shape, generator=gen) * sched.init_noise_sigma
        samples, scaled, outputs, noises = [sample], [], [], []
        for t in sched.timesteps:
            scaled.append(sched.scale_model_input(sample, t))
            out = torch.randn(shape, generator=gen)
            outputs.append(out)
            noise = torch.randn(shape, generator=gen)
            noises.append(noise)
            ancestral_module.randn_tensor = lambda *a, noise=noise, **k: noise.clone()
            sample = sched.step(out, t, sample, return_dict=False)[0]
            samples.append(sample)
        ref["samples"] = torch.stack(samples)
        ref["scaled"] = torch.stack(scaled)
        ref["model_outputs"] = torch.stack(outputs)
        if cls is EulerAncestralDiscreteScheduler:
            ref["noises"] = torch.stack(noises)
        save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(case_dir, "reference.safetensors"))
        manifest.append({"name": name, "steps": steps, "named": named})
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
