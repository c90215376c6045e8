#!/bin/bash
# Run on the device machine (from the repository root, .gpu/ packed by scripts/gpu/pack.sh):
# correctness on the GPU first, then the engine's mask-aware figures: the per-request attention
# loop against the padded batch call, bf16 against fp8 caches, the medium config and FLUX.1-dev
# at full size (random weights), then LoRA switch costs and a ControlNet's cost beside FLUX.1-dev. Each step's log goes to $OUT; about 3
# minutes on an H100 before the LoRA steps were added (2026-12-01, not yet run on a GPU).
# The binaries' rpath points at the build machine's venv: name the device's own torch instead.
export LD_LIBRARY_PATH=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
export RUST_BACKTRACE=1
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
G=.gpu
# shellcheck source=scripts/gpu/lib.sh
. scripts/gpu/lib.sh
LOGS=$OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
TAILN=30 step gpu-tests 120 $G/denoiser-tests --ignored gpu_ --nocapture --test-threads 1
B="$G/diffmesh-engine-bench --parts mask-aware --device cuda --dtype bf16 --mask-ratios $G/production-edit.txt --quality-edits 1 --quality-steps 4"
step medium-loop 45 $B --mask-aware-runs 7 --masked-attention per-request
step medium-padded 45 $B --mask-aware-runs 7 --masked-attention auto
step medium-padded-fp8 45 $B --mask-aware-runs 7 --masked-attention auto --latency-cache-dtype fp8
step flux-loop 90 $B --mask-aware-runs 3 --flux-dev --masked-attention per-request
step flux-padded 90 $B --mask-aware-runs 3 --flux-dev --masked-attention auto
step flux-padded-fp8 90 $B --mask-aware-runs 3 --flux-dev --masked-attention auto --latency-cache-dtype fp8
# LoRA switches (random rank-16 LoRA over every attention and MLP layer, bf16): base copies on the
# device against in host memory (docs/BENCHMARKS.md "LoRA").
L="$G/diffmesh-lora-bench --no-tiny --device cuda --dtype bf16 --flux-dev --rounds 5"
step lora-device 120 $L --originals device
step lora-host 120 $L --originals host
# A ControlNet's forward against FLUX.1-dev's at full size (random weights, bf16): InstantX-like
# (5x10) and XLabs-like (2x0) depths (docs/BENCHMARKS.md "ControlNet").
step controlnet-flux 120 $G/diffmesh-controlnet-bench --device cuda --config flux-dev --layouts 5x10,2x0
