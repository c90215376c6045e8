# syntax=docker/dockerfile:1.7
#
# diffmesh-cachestore: the activation-cache tiers: memory, disk, JetStream object store (health and metrics on 9090).
# Plain Rust: the binary must not link libtorch (the build checks; only the denoiser does).
#
# Build from the repository root (the build context is the workspace):
#   docker build -f compose/cachestore.Dockerfile -t diffmesh/cachestore:dev .
# compose/cachestore.Dockerfile.dockerignore keeps target/, run/ and .git out of the context.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

# ---------------------------------------------------------------------------------------------
FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY . .
# Cache mounts keep the crate registry and the target dir between builds; the binary is copied
# out of the cached target dir in the same step because the mount is gone afterwards.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target,id=diffmesh-target-plain \
    cargo build --release --locked -p diffmesh-cachestore --bin diffmesh-cachestore \
 && if ldd target/release/diffmesh-cachestore | grep libtorch >/dev/null; then \
      echo "diffmesh-cachestore links libtorch: it needs a runtime with libtorch (see denoiser.Dockerfile)" >&2; exit 1; \
    fi \
 && install -D -m 0755 target/release/diffmesh-cachestore /out/diffmesh-cachestore

# ---------------------------------------------------------------------------------------------
FROM debian:${DEBIAN_RELEASE}-slim AS runtime
# curl: the health check; ca-certificates: TLS to NATS/OTLP endpoints when configured.
# /var/lib/diffmesh: the disk tier; a volume mounted there inherits this ownership.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /opt/diffmesh --create-home diffmesh \
 && install -d -o diffmesh -g diffmesh /var/lib/diffmesh
COPY --from=builder /out/diffmesh-cachestore /usr/local/bin/diffmesh-cachestore
WORKDIR /opt/diffmesh
USER 10001:10001
ENV RUST_LOG=info \
    CACHESTORE_DISK_DIR=/var/lib/diffmesh/cachestore \
    HEALTH_ADDR=0.0.0.0:9090
LABEL org.opencontainers.image.title="diffmesh-cachestore"
EXPOSE 9090
# /readyz on the health port: the process is up and connected to NATS.
# Shell form on purpose: the port comes from HEALTH_ADDR at run time.
# hadolint ignore=DL3025
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD curl -fsS "http://127.0.0.1:${HEALTH_ADDR##*:}/readyz" >/dev/null || exit 1
ENTRYPOINT ["/usr/local/bin/diffmesh-cachestore"]
