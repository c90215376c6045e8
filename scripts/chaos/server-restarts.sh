#!/bin/bash
# The mesh on one nats-server under the load generator's edits by template, the server killed
# (SIGKILL) and started again on its port and store every EVERY seconds from 12 s after the
# load starts: what a fault of the message bus costs the requests in flight
# (docs/BENCHMARKS.md, "A NATS server restarted every second under edits").
#   cargo build --release -p diffmesh-cachestore -p diffmesh-codec -p diffmesh-router \
#     -p diffmesh-denoiser -p diffmesh-gateway -p xtask
#   RPS=5 EVERY=1 SEED=1 bash scripts/chaos/server-restarts.sh
# Needs the venv's torch for the denoiser (`cargo xtask setup`). Ports: NATS 14222, gateway
# 18080, health 9100-9140. Results in $OUT: the load generator's JSON and every log.
set -u
cd "$(dirname "$0")/../.."
RPS=${RPS:-5}; DUR=${DUR:-40}; EVERY=${EVERY:-1}; SEED=${SEED:-1}
OUT=${OUT:-/tmp/server-restarts-seed$SEED}
PYTHON=${DIFFMESH_PYTHON:-$HOME/.cache/diffmesh/venv/bin/python}
export LD_LIBRARY_PATH=$("$PYTHON" -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
rm -rf "$OUT"; mkdir -p "$OUT"
store=$(mktemp -d)
B=target/release
start_nats() {
  nats-server -js -a 127.0.0.1 -p 14222 -sd "$store" >> "$OUT/nats.log" 2>&1 &
  nats_pid=$!
}
start_nats
sleep 1
pids=()
i=0
for svc in cachestore codec router denoiser gateway; do
  env NATS_URL=nats://127.0.0.1:14222 RUST_LOG=info HEALTH_ADDR=127.0.0.1:$((9100 + i * 10)) \
    GATEWAY_BIND=127.0.0.1:18080 MODEL_DIR=models/tiny WORKER_ID=denoiser-0 OMP_NUM_THREADS=1 \
    "$B/diffmesh-$svc" > "$OUT/$svc.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
for port in 9130 9140; do
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/readyz" > /dev/null && break; sleep 0.5; done
done
"$B/xtask" load --url http://127.0.0.1:18080 --rps "$RPS" --duration "$DUR" --seed "$SEED" \
  --mask-ratios ../shared/data/mask-ratios/production-edit.txt \
  --nats-url nats://127.0.0.1:14222 --out-dir "$OUT" --label load --json > "$OUT/load.json" 2>&1 &
load=$!
sleep 12
restarts=0
while kill -0 "$load" 2> /dev/null; do
  kill -9 "$nats_pid"; wait "$nats_pid" 2> /dev/null
  start_nats
  restarts=$((restarts + 1))
  sleep "$EVERY"
done
wait "$load"
echo "restarts: $restarts"
head -n 1 "$OUT/load.json"
echo "slowest: $(grep -oE '^ +[0-9]+\.[0-9]+,?$' "$OUT/load.json" | tr -d ' ,' | sort -g | tail -n 1) s"
for port in 9100 9110 9120 9130 9140; do
  curl -s "http://127.0.0.1:$port/metrics" \
    | grep -E '^diffmesh_(nats_request_(resends|failures)|jetstream_retries|gateway_recovered_outcomes)_total' \
    | grep -v ' 0$' | sed "s/^/$port /"
done
kill -TERM "${pids[@]}"; sleep 3; kill -9 "$nats_pid" "${pids[@]}" 2> /dev/null
rm -rf "$store"
