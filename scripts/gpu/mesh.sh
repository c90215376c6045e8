#!/bin/bash
# Run on the device machine (from the repository root, .gpu/mesh.tar.xz packed by
# scripts/gpu/pack-mesh.sh): the whole mesh from the carried release binaries, the tiny default
# model, one denoiser on the GPU and then one on the CPU, each under the load generator's edits
# by template. Logs, load results and the denoiser's metrics go to $OUT. Without a GPU (or
# nvidia-smi) only the CPU run runs, which is how the script is tried out before a device call.
# GPU_RUNS / CPU_RUNS: the load runs as "rps:seconds" words (CPU_RUNS=none: no CPU run).
export LD_LIBRARY_PATH=$(${PYTHON:-python3} -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT=${OUT:-/tmp/gpu-mesh}
# BIN_DIR: binaries already unpacked (scripts/gpu/all.sh); else .gpu/mesh.tar.xz is.
B=${BIN_DIR:-/tmp/mesh-bin}
mkdir -p "$OUT" "$B"
[ -n "${BIN_DIR:-}" ] || tar -xJf .gpu/mesh.tar.xz -C "$B"
NATS_PORT=${NATS_PORT:-4222} # another where a server already runs on 4222
ready() { # wait until http://127.0.0.1:$1/readyz answers 200
  python3 - "$1" <<'PY'
import sys, time, urllib.request
port = sys.argv[1]
for _ in range(240):
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).status == 200:
            sys.exit(0)
    except Exception:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
}
run_mesh() { # label device dtype then load runs as "rps:duration" ...
  local label=$1 device=$2 dtype=$3
  shift 3
  local dir
  dir=$(mktemp -d)
  local pids=()
  $B/nats-server -js -a 127.0.0.1 -p $NATS_PORT -sd "$dir/nats" > "$OUT/$label-nats.log" 2>&1 &
  pids+=($!)
  sleep 1
  local i=0
  for svc in cachestore codec router denoiser gateway; do
    local port=$((9100 + i * 10))
    env NATS_URL=nats://127.0.0.1:$NATS_PORT RUST_LOG=info HEALTH_ADDR=127.0.0.1:$port \
      GATEWAY_BIND=127.0.0.1:8080 DENOISER_MODEL_DIR=weights/tiny DENOISER_WORKER_ID=denoiser-0 \
      DENOISER_DEVICE=$device DENOISER_DTYPE=$dtype ROUTER_PROFILE=$([ "$device" = cuda ] && echo tiny-h100 || echo tiny-cpu) \
      $B/diffmesh-$svc > "$OUT/$label-$svc.log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
  done
  if ready 9130 && ready 9140; then
    echo "=== $label: mesh ready $(date +%T)"
    for run in "$@"; do
      local rps=${run%%:*} secs=${run##*:}
      timeout 150 $B/xtask load --url http://127.0.0.1:8080 --rps "$rps" --duration "$secs" \
        --seed 1 --mask-ratios .gpu/production-edit.txt --json > "$OUT/$label-rps$rps.json" 2>&1
      echo "=== $label rps $rps ($secs s): rc $? $(tail -n 1 "$OUT/$label-rps$rps.json")"
    done
    python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9130/metrics").read().decode())' \
      > "$OUT/$label-denoiser-metrics.txt" 2>&1
  else
    echo "=== $label: mesh not ready"
  fi
  grep -h "model loaded\|ERROR\|panicked" "$OUT/$label-denoiser.log" | head -5
  kill -TERM "${pids[@]:1}" 2>/dev/null
  sleep 3
  kill -TERM "${pids[0]}" 2>/dev/null
  sleep 1
  kill -KILL "${pids[@]}" 2>/dev/null
  wait 2>/dev/null
}
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  # shellcheck disable=SC2086 # GPU_RUNS is a list of "rps:seconds" words
  run_mesh gpu cuda auto ${GPU_RUNS:-8:30 30:20}
else
  echo "=== no GPU here: the CPU run only"
fi
# CPU_RUNS=none skips the CPU run (all.sh on a device: its time is the GPU's).
# shellcheck disable=SC2086
[ "${CPU_RUNS:-3:30}" = none ] || run_mesh cpu cpu auto ${CPU_RUNS:-3:30}
