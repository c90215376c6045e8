#!/bin/bash
# Run on the device machine (from the repository root, .gpu/ packed by scripts/gpu/pack-mesh.sh):
# the engine bench's batching and disaggregation parts with the engine on the GPU (tiny default
# model, bf16): continuous against static batching and pre/post-processing inline against on
# codec workers, Poisson arrivals at 70% of the GPU engine's measured capacity. The JSON and
# the human-readable lines go to $OUT/engine-<part>.log.
export LD_LIBRARY_PATH=$(${PYTHON:-python3} -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT=${OUT:-/tmp/gpu-engine}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
B="${ENGINE_BENCH:-.gpu/diffmesh-engine-bench} --mask-ratios .gpu/production-edit.txt --engine-device $DEVICE --dtype auto"
for part in batching disaggregation; do
  echo "=== engine $part on $DEVICE $(date +%T)"
  timeout "${LIMIT:-120}" $B --parts "$part" --requests "${REQUESTS:-300}" --rounds 2 \
    --torch-threads 2 --codec-workers 4 > "$OUT/engine-$part.log" 2>&1
  echo "=== engine $part rc $?"
  grep -v '^{' "$OUT/engine-$part.log" | tail -n 12
  tail -n 1 "$OUT/engine-$part.log"
done
