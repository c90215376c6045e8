#!/bin/bash
# The mesh on one nats-server under the load generator's edits by template, the server killed
# (SIGKILL) and started again on its port and store every EVERY seconds from 12 s after the
# load starts: what a fault of the message bus costs the requests in flight
# (docs/BENCHMARKS.md, "A NATS server restarted every second under edits").
#   RPS=5 EVERY=1 SEED=1 bash scripts/chaos/server-restarts.sh
# Set-up, ports and BIN: scripts/chaos/lib.sh. Results in $OUT.
RPS=${RPS:-5}; DUR=${DUR:-40}; EVERY=${EVERY:-1}; SEED=${SEED:-1}
OUT=${OUT:-/tmp/server-restarts-seed$SEED}
source "$(dirname "$0")/lib.sh"
start_mesh
start_load
restart_once() {
  kill_hard nats
  start_nats
}
restart_during_load "$EVERY" restart_once
echo "restarts: $RESTARTS"
report '(nats_request_(resends|failures)|jetstream_retries|gateway_recovered_outcomes)_total'
teardown
