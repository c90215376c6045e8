#!/bin/bash
# The mesh under the load generator's edits by template, its only replica of SVC (codec,
# router, denoiser, cachestore or gateway) killed (SIGKILL) every EVERY seconds from 12 s after
# the load starts and started again DOWN seconds later: what a restart of that service costs
# the requests in flight (docs/BENCHMARKS.md, "The codec restarted under edits" and "The
# router restarted under edits").
#   SVC=router RPS=3 EVERY=10 DOWN=4 SEED=1 bash scripts/chaos/service-restarts.sh
# Set-up, ports and BIN: scripts/chaos/lib.sh. Results in $OUT.
SVC=${SVC:-codec}; EVERY=${EVERY:-10}; DOWN=${DOWN:-4}; SEED=${SEED:-1}
case "$SVC" in
  codec | router | denoiser | cachestore | gateway) ;;
  *) echo "SVC must be codec, router, denoiser, cachestore or gateway, not '$SVC'" >&2; exit 2 ;;
esac
[ "$EVERY" -gt "$DOWN" ] || { echo "EVERY ($EVERY) must exceed DOWN ($DOWN)" >&2; exit 2; }
OUT=${OUT:-/tmp/$SVC-restarts-seed$SEED}
source "$(dirname "$0")/lib.sh"
start_mesh
start_load
restart_once() {
  kill_hard "$SVC"
  sleep "$DOWN"
  start_svc "$SVC"
}
restart_during_load "$((EVERY - DOWN))" restart_once
echo "$SVC restarts: $RESTARTS (down $DOWN s each)"
report 'nats_request_(resends|failures)_total|[a-z]+_failures_total|gateway_recovered_outcomes_total|router_(adoptions|replacements)_total'
teardown
