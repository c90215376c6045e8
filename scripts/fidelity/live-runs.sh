#!/usr/bin/env bash
# Live runs for the simulator-fidelity check (docs/BENCHMARKS.md, "Simulator fidelity").
#
#   scripts/fidelity/live-runs.sh OUT_DIR RPS:SEED:LABEL ...
#
# Against a mesh already up (`ROUTER_PROFILE=... cargo xtask up --detach --nats-url
# nats://127.0.0.1:14222 --port 18080 --denoisers 2`), runs `cargo xtask load` once per
# RPS:SEED:LABEL and appends to OUT_DIR/runs.txt, per run: p95 and mean latency, the time
# outside the denoisers (mean latency less the mean from queued on a denoiser to its last step:
# the simulator's --request-overhead-s), the CPU seconds per request of every mesh process but
# the denoisers (/proc/<pid>/stat: the simulator's --background-cpu-s), the load generator's own
# CPU seconds per request (reported, not in the background figure), and the router's
# step-prediction ratio so far (live steps over the profile's prediction).
set -euo pipefail
out=$1
shift
url=${URL:-http://127.0.0.1:18080}
nats=${NATS_URL:-nats://127.0.0.1:14222}
pids=${RUN_DIR:-run}/pids
router_metrics=${ROUTER_METRICS:-http://127.0.0.1:9120/metrics}
masks=${MASK_RATIOS:-../shared/data/mask-ratios/production-edit.txt}
duration=${DURATION:-60}
hz=$(getconf CLK_TCK)
mkdir -p "$out"

# utime + stime, in clock ticks, of the mesh's processes but the denoisers. Fields are counted
# after the ")" that closes the command name, which may hold spaces.
background_ticks() {
    local total=0 name pid stat rest
    while read -r name pid; do
        case $name in denoiser*) continue ;; esac
        stat=$(cat "/proc/$pid/stat" 2>/dev/null) || continue
        rest=${stat##*) }
        read -r -a f <<<"$rest"
        total=$((total + f[11] + f[12]))
    done <"$pids"
    echo "$total"
}

for run in "$@"; do
    IFS=: read -r rps seed label <<<"$run"
    before=$(background_ticks)
    /usr/bin/time -f '%U %S' -o "$out/$label.loadgen-cpu" \
        cargo xtask load --url "$url" --rps "$rps" --duration "$duration" --seed "$seed" \
        --mask-ratios "$masks" --nats-url "$nats" --out-dir "$out" --label "$label" --json |
        tail -1 >"$out/$label.summary.json"
    after=$(background_ticks)
    ratio=$(curl -s "$router_metrics" | awk '
        /^diffmesh_router_step_prediction_ratio_sum/ {s=$2}
        /^diffmesh_router_step_prediction_ratio_count/ {c=$2}
        END {if (c > 0) printf "%.3f (%d steps)", s / c, c; else print "n/a"}')
    python3 - "$out/$label.summary.json" "$((after - before))" "$hz" \
        "$out/$label.loadgen-cpu" "$ratio" >>"$out/runs.txt" <<'EOF'
import json, sys
summary, ticks, hz, loadgen, ratio = sys.argv[1:]
s = json.load(open(summary))
done = max(s["completed"], 1)
u, k = map(float, open(loadgen).read().split()[-2:])
print(f'{s["label"]} p95 {s["p95"]:.4f} mean {s["mean_latency"]:.4f} completed {s["completed"]} '
      f'overhead {s["mean_latency"] - s["events"]["at_denoiser"]["mean"]:.4f} '
      f'bg_cpu_s_per_req {int(ticks) / int(hz) / done:.4f} loadgen_cpu_s_per_req {(u + k) / done:.4f} '
      f'wait_p99 {s["events"]["wait"]["p99"]:.4f} step_prediction_ratio {ratio}')
EOF
    tail -1 "$out/runs.txt"
done
