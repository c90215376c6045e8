#!/bin/bash
# The only codec killed and started again under edits (docs/BENCHMARKS.md, "The codec restarted
# under edits"): scripts/chaos/service-restarts.sh with SVC=codec.
#   RPS=3 EVERY=10 DOWN=4 SEED=1 bash scripts/chaos/codec-restarts.sh
SVC=codec exec bash "$(dirname "$0")/service-restarts.sh"
