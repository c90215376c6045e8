#!/bin/bash
# Shared by the chaos scripts (sourced): one nats-server with JetStream on port 14222 and the
# whole mesh from release binaries (the tiny default model, one replica of each service, the
# API on 18080, health ports 9100-9140), the load generator's edits by template, and the
# report and teardown. Set before sourcing: OUT (results: the load generator's JSON, every
# log); optional BIN (binaries, default target/release), RPS, DUR, SEED, RETRIES (the load
# generator's repeats of a request that got no answer, with an Idempotency-Key; default 0),
# GATEWAYS (default 1; with 2 or more, gateway1..N listen on 18081.. with health ports
# 9141.., and haproxy, the balancer of compose/, serves the API on 18080 in front of them).
# Needs the venv's torch for the denoiser (`cargo xtask setup`) and a release build:
#   cargo build --release -p diffmesh-cachestore -p diffmesh-codec -p diffmesh-router \
#     -p diffmesh-denoiser -p diffmesh-gateway -p xtask
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
B=${BIN:-target/release}
RPS=${RPS:-3}; DUR=${DUR:-60}; SEED=${SEED:-1}; RETRIES=${RETRIES:-0}; GATEWAYS=${GATEWAYS:-1}
PYTHON=${DIFFMESH_PYTHON:-$HOME/.cache/diffmesh/venv/bin/python}
export LD_LIBRARY_PATH=$("$PYTHON" -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
SERVICES=(cachestore codec router denoiser gateway)
declare -A HEALTH_PORT=([cachestore]=9100 [codec]=9110 [router]=9120 [denoiser]=9130 [gateway]=9140)
declare -A API_PORT=([gateway]=18080)
GATEWAY_NAMES=(gateway)
if [ "$GATEWAYS" -gt 1 ]; then
  GATEWAY_NAMES=()
  for i in $(seq "$GATEWAYS"); do
    GATEWAY_NAMES+=("gateway$i")
    HEALTH_PORT[gateway$i]=$((9140 + i))
    API_PORT[gateway$i]=$((18080 + i))
  done
  SERVICES=(cachestore codec router denoiser "${GATEWAY_NAMES[@]}")
  HAPROXY=$(command -v haproxy || echo /usr/sbin/haproxy)
  [ -x "$HAPROXY" ] || { echo "GATEWAYS=$GATEWAYS needs haproxy (cargo xtask setup)" >&2; exit 2; }
fi
declare -A PID_OF=()
rm -rf "$OUT"; mkdir -p "$OUT"
store=$(mktemp -d)

start_nats() { # on its port and store, again after a kill
  nats-server -js -a 127.0.0.1 -p 14222 -sd "$store" >> "$OUT/nats.log" 2>&1 &
  PID_OF[nats]=$!
}

start_svc() { # name (a service, or gatewayN): one replica, logging to $OUT/<name>.log
  # (appended across restarts)
  env NATS_URL=nats://127.0.0.1:14222 RUST_LOG=info HEALTH_ADDR=127.0.0.1:${HEALTH_PORT[$1]} \
    GATEWAY_BIND=127.0.0.1:${API_PORT[$1]:-0} DENOISER_MODEL_DIR=weights/tiny DENOISER_WORKER_ID=denoiser-0 \
    OMP_NUM_THREADS=1 "$B/diffmesh-${1%%[0-9]*}" >> "$OUT/$1.log" 2>&1 &
  PID_OF[$1]=$!
}

start_balancer() { # haproxy on 18080 over the gateways, compose/haproxy/haproxy.cfg's rules
  { sed -n '/^global/,/^resolvers/p' compose/haproxy/haproxy.cfg | sed '$d'
    printf 'frontend api\n  bind 127.0.0.1:18080\n  default_backend gateways\n\n'
    sed -n '/^backend gateways/,$p' compose/haproxy/haproxy.cfg | grep -v 'server-template\|default-server'
    echo "  default-server check inter 1s fall 2 rise 2"
    for g in "${GATEWAY_NAMES[@]}"; do echo "  server $g 127.0.0.1:${API_PORT[$g]}"; done
  } > "$OUT/haproxy.cfg"
  "$HAPROXY" -db -f "$OUT/haproxy.cfg" >> "$OUT/haproxy.log" 2>&1 &
  PID_OF[balancer]=$!
}

wait_ready() { # name ...: until each answers /readyz (up to 2 min each)
  for name in "$@"; do
    for _ in $(seq 240); do
      curl -sf "http://127.0.0.1:${HEALTH_PORT[$name]}/readyz" > /dev/null && break
      sleep 0.5
    done
  done
}

start_mesh() {
  start_nats
  sleep 1
  for svc in "${SERVICES[@]}"; do start_svc "$svc"; done
  wait_ready codec denoiser "${GATEWAY_NAMES[@]}"
  if [ "$GATEWAYS" -gt 1 ]; then start_balancer; sleep 2; fi
}

kill_hard() { # name: SIGKILL, and reap it
  kill -9 "${PID_OF[$1]}" 2> /dev/null
  wait "${PID_OF[$1]}" 2> /dev/null
}

start_load() { # in the background: LOAD_PID
  "$B/xtask" load --url http://127.0.0.1:18080 --rps "$RPS" --duration "$DUR" --seed "$SEED" \
    --mask-ratios ../shared/data/mask-ratios/production-edit.txt \
    --nats-url nats://127.0.0.1:14222 --retries "$RETRIES" \
    --out-dir "$OUT" --label load --json > "$OUT/load.json" 2>&1 &
  LOAD_PID=$!
}

restart_during_load() { # pause between restarts, then the command of one restart: from 12 s
  # after the load starts until it ends; RESTARTS counts them
  local pause=$1
  shift
  sleep 12
  RESTARTS=0
  while kill -0 "$LOAD_PID" 2> /dev/null; do
    "$@"
    RESTARTS=$((RESTARTS + 1))
    sleep "$pause"
  done
  wait "$LOAD_PID"
}

report() { # metric-name regex: the load's summary, its slowest request, the non-zero counters
  head -n 1 "$OUT/load.json"
  echo "slowest: $(grep -oE '^ +[0-9]+\.[0-9]+,?$' "$OUT/load.json" | tr -d ' ,' | sort -g | tail -n 1) s"
  for svc in "${SERVICES[@]}"; do
    curl -s "http://127.0.0.1:${HEALTH_PORT[$svc]}/metrics" | grep -E "^diffmesh_($1)" \
      | grep -v ' 0$' | sed "s/^/$svc /"
  done
}

teardown() {
  for svc in "${SERVICES[@]}" balancer; do kill -TERM "${PID_OF[$svc]:-}" 2> /dev/null; done
  sleep 3
  kill -9 "${PID_OF[@]}" 2> /dev/null
  wait "${PID_OF[@]}" 2> /dev/null
  rm -rf "$store"
}
