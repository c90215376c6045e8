#!/bin/bash
# Build here (release) the services, the load generator and take nats-server, packed for
# scripts/gpu/mesh.sh into .gpu/mesh.tar.xz (xz: the working tree and carried files travel
# within 64 MiB, the tracked files alone are about 21 MB), and the engine bench for
# scripts/gpu/engine.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p diffmesh-cachestore -p diffmesh-codec -p diffmesh-router \
  -p diffmesh-denoiser -p diffmesh-gateway -p diffmesh-benches -p xtask
mkdir -p .git/info .gpu
grep -qx /.gpu/ .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
stage=$(mktemp -d)
for bin in diffmesh-cachestore diffmesh-codec diffmesh-router diffmesh-denoiser diffmesh-gateway xtask; do
  cp "target/release/$bin" "$stage/"
  strip "$stage/$bin"
done
cp "$(command -v nats-server)" "$stage/"
tar -cJf .gpu/mesh.tar.xz -C "$stage" .
cp target/release/diffmesh-engine-bench .gpu/
strip .gpu/diffmesh-engine-bench
cp ../shared/data/mask-ratios/production-edit.txt .gpu/
rm -rf "$stage"
ls -la .gpu
