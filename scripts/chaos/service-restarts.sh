#!/bin/bash
# The mesh under the load generator's edits by template, its only replica of SVC (codec,
# router, denoiser, cachestore or gateway) killed (SIGKILL) every EVERY seconds from 12 s after
# the load starts and started again DOWN seconds later: what a restart of that service costs
# the requests in flight (docs/BENCHMARKS.md, "Every service restarted under edits"). With
# GATEWAYS=2 (or more) and SVC=gateway, the gateways behind haproxy are restarted in turn, the
# API staying up; RETRIES=3 has the load generator repeat what a dying gateway cut, with the
# same Idempotency-Key (docs/BENCHMARKS.md, "Two gateways behind a balancer"). SIGNAL=TERM
# stops the service as an orchestrator does (it finishes its work first) instead of killing it;
# DOWN then counts from when it has exited.
#   SVC=router RPS=3 EVERY=10 DOWN=4 SEED=1 bash scripts/chaos/service-restarts.sh
#   SVC=gateway GATEWAYS=2 RETRIES=3 bash scripts/chaos/service-restarts.sh
# Set-up, ports and BIN: scripts/chaos/lib.sh. Results in $OUT.
SVC=${SVC:-codec}; EVERY=${EVERY:-10}; DOWN=${DOWN:-4}; SEED=${SEED:-1}; SIGNAL=${SIGNAL:-KILL}
case "$SIGNAL" in
  KILL | TERM) ;;
  *) echo "SIGNAL must be KILL or TERM, not '$SIGNAL'" >&2; exit 2 ;;
esac
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
  local victim=$SVC
  if [ "$SVC" = gateway ] && [ "$GATEWAYS" -gt 1 ]; then
    victim=${GATEWAY_NAMES[$((RESTARTS % GATEWAYS))]}
  fi
  kill "-$SIGNAL" "${PID_OF[$victim]}" 2> /dev/null
  wait "${PID_OF[$victim]}" 2> /dev/null
  sleep "$DOWN"
  start_svc "$victim"
}
restart_during_load "$((EVERY - DOWN))" restart_once
echo "$SVC restarts: $RESTARTS (SIG$SIGNAL, down $DOWN s each)"
if [ "$GATEWAYS" -gt 1 ]; then # haproxy's retries field ends "+N" when it moved the request
  echo "balancer: $(grep -cE ' [0-9]+/[0-9]+/[0-9]+/[0-9]+/\+[0-9]+ ' "$OUT/haproxy.log") requests moved to another gateway after a failed connection"
fi
report 'nats_request_(resends|failures)_total|[a-z]+_failures_total|gateway_recovered_outcomes_total|router_(adoptions|replacements)_total'
teardown
