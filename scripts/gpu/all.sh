#!/bin/bash
# The one device call of docs/GPU.md "Everything in one call" (issue 51), run from the
# repository root with `.gpu/` packed by scripts/gpu/pack-all.sh carried (binaries, diffusers):
#  1. the GPU tests (denoiser crate, `gpu_*`);
#  2. FLUX.1-dev's whole pipeline at 1024x1024, 28 steps, bf16, random weights (CLIP-L, T5-XXL,
#     transformer, VAE): ours, then diffusers' on the same device;
#  3. the whole mesh with its denoiser on the GPU under load (scripts/gpu/mesh.sh);
#  4. the engine's continuous vs static batching and disaggregation on the GPU (engine.sh);
#  5. FLUX.1-dev's mask-aware step at masks 0.11 and 0.2 with the cache streamed from pinned
#     memory, and the batch-8 figure: a bf16 cache, then fp8 with the fused decode kernel and
#     fp8 through tch;
#  6. LoRA switch costs at FLUX.1-dev size, base copies on the device and in host memory.
# Every step's log lands in $WORK and the lot is re-packed into $OUT/results.tar.gz after each
# step, so a call stopped at its limit still brings back what finished. With DEVICE=cpu it runs
# the same steps on reduced sizes (how it is tried out before a device call). ONLY="a b" runs
# just the steps named (a rerun on a warm machine); BUDGET (s) skips steps once it is spent.
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
TORCH_LIB=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
# NVRTC for the fused kernels: the CUDA wheels' own copy, wherever pip put it.
NVRTC_DIR=$(dirname "$(find "$TORCH_LIB/../.." -name 'libnvrtc.so*' 2>/dev/null | head -n 1)" 2>/dev/null)
export LD_LIBRARY_PATH=$TORCH_LIB${NVRTC_DIR:+:$NVRTC_DIR}
START=$(date +%s)
BUDGET=${BUDGET:-470}
OUT=${OUT:-/tmp/gpu-all}
WORK=${WORK:-/tmp/gpu-all-work}
BIN=/tmp/gpu-all-bin
DEVICE=${DEVICE:-cuda}
rm -rf "$WORK" "$BIN"
mkdir -p "$OUT" "$WORK" "$BIN"
tar -xJf .gpu/all.tar.xz -C "$BIN"
# diffusers (not on the device) beside its torch and transformers.
rm -rf /tmp/site && mkdir -p /tmp/site && tar -xJf .gpu/site.tar.xz -C /tmp/site \
  && export PYTHONPATH=/tmp/site
# shellcheck source=scripts/gpu/lib.sh
. scripts/gpu/lib.sh
LOGS=$WORK STEP_JSON=1 TAILN=${TAILN:-6}
pack() { tar -czf "$OUT/results.tar.gz" -C "$WORK" . ; }
after_step() { pack; }
step_wanted() { # whether step $1 runs: named in ONLY (when set) and the budget not spent
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]]; then return 1; fi
  if [ $(( $(date +%s) - START )) -gt "$BUDGET" ]; then
    echo "=== $1 skipped: the budget of ${BUDGET}s is spent"
    return 1
  fi
}
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$WORK/gpu.txt"
  E2E="--config flux-dev --device cuda --size 1024 --steps 28 --runs 2"
  MASK="--device cuda --dtype bf16 --flux-dev --mask-aware-runs 3"
  LORA="--device cuda --dtype bf16 --flux-dev --rounds 3"
else
  E2E="--config small --device cpu --size 128 --steps 4 --runs 1"
  MASK="--device cpu --mask-aware-runs 1"
  LORA="--device cpu --rounds 1"
fi
if [ "$DEVICE" = cuda ]; then
  TAILN=20 step gpu-tests 150 "$BIN/denoiser-tests" --ignored gpu_ --nocapture --test-threads 1
fi
# shellcheck disable=SC2086 # option lists
step e2e-diffmesh 150 "$BIN/diffmesh-flux-e2e-bench" $E2E
# shellcheck disable=SC2086
step e2e-diffusers 180 python3 python/gpu/diffusers_flux_e2e.py $E2E
M=("$BIN/diffmesh-engine-bench" --parts mask-aware --mask-ratios .gpu/production-edit.txt
  --quality-edits 1 --quality-steps 4 --masked-attention auto)
# shellcheck disable=SC2086
step mask-bf16 120 "${M[@]}" $MASK --latency-cache-dtype bf16
# shellcheck disable=SC2086
step mask-fp8-fused 120 "${M[@]}" $MASK --latency-cache-dtype fp8
# shellcheck disable=SC2086
step mask-fp8-tch 120 "${M[@]}" $MASK --latency-cache-dtype fp8 --no-fused-kernels
if step_wanted mesh; then
  echo "=== mesh $(date +%T)"
  OUT=$WORK/mesh BIN_DIR=$BIN GPU_RUNS=${GPU_RUNS:-8:20 30:15} CPU_RUNS=${MESH_CPU_RUNS:-none} \
    timeout 180 bash scripts/gpu/mesh.sh
  pack
fi
if step_wanted engine; then
  echo "=== engine $(date +%T)"
  OUT=$WORK ENGINE_BENCH=$BIN/diffmesh-engine-bench DEVICE=$DEVICE REQUESTS=${REQUESTS:-400} \
    LIMIT=${LIMIT:-80} bash scripts/gpu/engine.sh
  pack
fi
# shellcheck disable=SC2086
step lora-device 100 "$BIN/diffmesh-lora-bench" --no-tiny $LORA --originals device
# shellcheck disable=SC2086
step lora-host 100 "$BIN/diffmesh-lora-bench" --no-tiny $LORA --originals host
echo "=== done $(date +%T)"
