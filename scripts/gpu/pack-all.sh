#!/bin/bash
# Build here (release) everything scripts/gpu/all.sh runs and pack it into .gpu/ (ignored by
# git): the five services, the load generator (xtask), nats-server, the engine, LoRA and FLUX.1
# pipeline benches and the denoiser's test binary, stripped, in one xz tarball (xz -9e: its 64 MiB
# window shares the code the binaries have in common, half the size of xz's default); and
# diffusers unpacked into a second one. Then one device call with `carry: [".gpu"]` (docs/GPU.md):
# the tracked files (about 34 MB) and .gpu/ (about 21 MB) travel within the 64 MiB a call takes.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p diffmesh-cachestore -p diffmesh-codec -p diffmesh-router \
  -p diffmesh-denoiser -p diffmesh-gateway -p xtask
cargo build --release -p diffmesh-benches --bin diffmesh-engine-bench --bin diffmesh-lora-bench
cargo build --release -p diffmesh-model --bin diffmesh-flux-e2e-bench
# shellcheck source=scripts/gpu/lib.sh
. scripts/gpu/lib.sh
tests=$(denoiser_tests_binary)
mkdir -p .git/info .gpu .whl
grep -qx /.gpu/ .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
stage=$(mktemp -d)
for bin in diffmesh-cachestore diffmesh-codec diffmesh-router diffmesh-denoiser diffmesh-gateway \
  xtask diffmesh-engine-bench diffmesh-lora-bench diffmesh-flux-e2e-bench; do
  cp "target/release/$bin" "$stage/"
done
cp "$tests" "$stage/denoiser-tests"
strip "$stage"/*
cp "$(command -v nats-server)" "$stage/"
tar -cf - -C "$stage" . | xz -9e -T2 > .gpu/all.tar.xz
rm -rf "$stage"
cp ../shared/data/mask-ratios/production-edit.txt .gpu/
# diffusers for the comparison (the device has torch and transformers, no network), unpacked
# as pip would into a site folder and compressed.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 -d .whl diffusers==0.42.1 \
  importlib_metadata==10.2.0
site=$(mktemp -d)
for wheel in .whl/diffusers-0.42.1-*.whl .whl/importlib_metadata-10.2.0-*.whl; do
  unzip -q -o "$wheel" -d "$site"
done
tar -cf - -C "$site" . | xz -9 -T2 > .gpu/site.tar.xz
rm -rf "$site"
ls -la .gpu
