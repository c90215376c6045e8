#!/bin/bash
# Build here (release) what the GPU checks run and pack it into .gpu/ (ignored by git), for one
# `device` call with `carry: [".gpu"]` running `bash scripts/gpu/checks.sh` (docs/GPU.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p diffmesh-benches --bin diffmesh-engine-bench --bin diffmesh-lora-bench
cargo build --release -p diffmesh-model --bin diffmesh-controlnet-bench
# shellcheck source=scripts/gpu/lib.sh
. scripts/gpu/lib.sh
tests=$(denoiser_tests_binary)
mkdir -p .git/info .gpu
grep -qx /.gpu/ .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
cp target/release/diffmesh-engine-bench target/release/diffmesh-lora-bench .gpu/
cp target/release/diffmesh-controlnet-bench .gpu/
cp "$tests" .gpu/denoiser-tests
strip .gpu/diffmesh-engine-bench .gpu/diffmesh-lora-bench .gpu/diffmesh-controlnet-bench .gpu/denoiser-tests
cp ../shared/data/mask-ratios/production-edit.txt .gpu/
ls -la .gpu
