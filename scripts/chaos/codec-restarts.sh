#!/bin/bash
# The mesh under the load generator's edits by template, its only codec killed (SIGKILL) every
# EVERY seconds from 12 s after the load starts and started again DOWN seconds later: what a
# codec restart costs the requests in flight, some of them waiting for pre-processing, some
# finished and waiting for post-processing (docs/BENCHMARKS.md, "The codec restarted under
# edits").
#   cargo build --release -p diffmesh-cachestore -p diffmesh-codec -p diffmesh-router \
#     -p diffmesh-denoiser -p diffmesh-gateway -p xtask
#   RPS=3 EVERY=10 DOWN=4 SEED=1 bash scripts/chaos/codec-restarts.sh
# Needs the venv's torch for the denoiser (`cargo xtask setup`). Ports: NATS 14222, gateway
# 18080, health 9100-9140. BIN picks other binaries (default target/release). Results in
# $OUT: the load generator's JSON and every log.
set -u
cd "$(dirname "$0")/../.."
RPS=${RPS:-3}; DUR=${DUR:-60}; EVERY=${EVERY:-10}; DOWN=${DOWN:-4}; SEED=${SEED:-1}
OUT=${OUT:-/tmp/codec-restarts-seed$SEED}
B=${BIN:-target/release}
PYTHON=${DIFFMESH_PYTHON:-$HOME/.cache/diffmesh/venv/bin/python}
export LD_LIBRARY_PATH=$("$PYTHON" -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
rm -rf "$OUT"; mkdir -p "$OUT"
store=$(mktemp -d)
nats-server -js -a 127.0.0.1 -p 14222 -sd "$store" > "$OUT/nats.log" 2>&1 &
nats_pid=$!
sleep 1
start_svc() { # name, health port
  env NATS_URL=nats://127.0.0.1:14222 RUST_LOG=info HEALTH_ADDR=127.0.0.1:$2 \
    GATEWAY_BIND=127.0.0.1:18080 MODEL_DIR=models/tiny WORKER_ID=denoiser-0 OMP_NUM_THREADS=1 \
    "$B/diffmesh-$1" >> "$OUT/$1.log" 2>&1 &
}
pids=()
i=0
for svc in cachestore codec router denoiser gateway; do
  start_svc "$svc" $((9100 + i * 10))
  pids+=($!)
  [ "$svc" = codec ] && codec_pid=$!
  i=$((i + 1))
done
for port in 9110 9130 9140; do
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/readyz" > /dev/null && break; sleep 0.5; done
done
"$B/xtask" load --url http://127.0.0.1:18080 --rps "$RPS" --duration "$DUR" --seed "$SEED" \
  --mask-ratios ../shared/data/mask-ratios/production-edit.txt \
  --nats-url nats://127.0.0.1:14222 --out-dir "$OUT" --label load --json > "$OUT/load.json" 2>&1 &
load=$!
sleep 12
restarts=0
while kill -0 "$load" 2> /dev/null; do
  kill -9 "$codec_pid"; wait "$codec_pid" 2> /dev/null
  sleep "$DOWN"
  start_svc codec 9110
  codec_pid=$!
  restarts=$((restarts + 1))
  sleep "$((EVERY - DOWN))"
done
wait "$load"
echo "codec restarts: $restarts (down $DOWN s each)"
head -n 1 "$OUT/load.json"
echo "slowest: $(grep -oE '^ +[0-9]+\.[0-9]+,?$' "$OUT/load.json" | tr -d ' ,' | sort -g | tail -n 1) s"
for port in 9120 9130 9140; do
  curl -s "http://127.0.0.1:$port/metrics" \
    | grep -E '^diffmesh_(nats_request_(resends|failures)_total|(gateway|denoiser)_failures_total)' \
    | grep -v ' 0$' | sed "s/^/$port /"
done
kill -TERM "$codec_pid" "${pids[@]}" 2> /dev/null; sleep 3
kill -9 "$nats_pid" "$codec_pid" "${pids[@]}" 2> /dev/null
rm -rf "$store"
