#!/bin/bash
# Helpers the GPU scripts share (sourced, not run).

# The release build of the denoiser's library tests (the `gpu_*` checks), built if needed.
denoiser_tests_binary() {
  cargo test --release -p diffmesh-denoiser --lib --no-run --message-format=json \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("executable") and m["target"]["name"] == "diffmesh_denoiser":
        print(m["executable"])'
}

# step NAME LIMIT COMMAND...: COMMAND under `timeout LIMIT`, its output in $LOGS/NAME.log; prints
# its exit code and time, the log's last TAILN (8) lines that are not JSON and, with
# STEP_JSON=1, its last JSON line. A `step_wanted NAME` function, where defined, may skip the
# step (non-zero), and an `after_step` function, where defined, runs after it.
step() {
  local name=$1 limit=$2
  shift 2
  if declare -F step_wanted > /dev/null && ! step_wanted "$name"; then return 0; fi
  echo "=== $name (limit ${limit}s) $(date +%T)"
  local t0
  t0=$(date +%s%N)
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc $rc in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  grep -v '^{' "$LOGS/$name.log" | tail -n "${TAILN:-8}"
  if [ "${STEP_JSON:-0}" = 1 ]; then
    grep '^{' "$LOGS/$name.log" | tail -n 1 | cut -c 1-1500
  fi
  if declare -F after_step > /dev/null; then after_step; fi
}
