# syntax=docker/dockerfile:1.7
#
# diffmesh-denoiser: the engine thread with the model (libtorch through tch), step-level batching
# (health and metrics on 9090).
#
# Unlike the other services' images, the builder needs g++ (torch-sys compiles a C++ shim),
# python3 and the PyPI `torch` wheel, whose libtorch tch 0.24 links against (it must be exactly
# 2.11.0); the runtime needs libtorch's shared libraries (about 1 GB), the CUDA libraries the
# wheel depends on (about 2.7 GB, GPU only) and the model directory.
#
# Build from the repository root:
#   docker build -f compose/denoiser.Dockerfile -t diffmesh/denoiser:dev .          # CUDA wheel (GPU or CPU)
#   docker build -f compose/denoiser.Dockerfile \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t diffmesh/denoiser:cpu .
# The CPU-only wheel makes a much smaller image; the default PyPI wheel is the CUDA build, which
# also runs on CPU-only hosts.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

# ---------------------------------------------------------------------------------------------
FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ python3 python3-venv python3-pip \
 && rm -rf /var/lib/apt/lists/*

# torch-sys finds libtorch by asking the Python on PATH for the installed torch package
# (LIBTORCH_USE_PYTORCH=1); the venv puts that Python first.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    LIBTORCH_USE_PYTORCH=1
ARG TORCH_VERSION=2.11.0
# Empty: PyPI (the CUDA wheel). Set to a PyTorch wheel index for another variant (cpu, cuXYZ).
ARG TORCH_INDEX_URL=
# torch is pinned (TORCH_VERSION); hadolint misreads the optional --index-url expansion.
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv "$VIRTUAL_ENV" \
 && pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"

# Stage the libraries the binary needs under /stage at the SAME absolute paths as here: the
# binary carries an rpath to torch/lib (model/link_torch.rs) and libtorch_cuda finds the CUDA
# libraries through $ORIGIN/../../nvidia/*/lib, so keeping the layout keeps both working.
# /etc/ld.so.conf.d/diffmesh-torch.conf lists every dir so dlopen by name (NVRTC through
# cudarc) finds them too; /opt/libtorch/lib is a stable alias used for LD_LIBRARY_PATH.
# libtorch_python.so is dropped: tch does not use it and it needs libpython; static archives too.
RUN set -eu; \
    lib="$(python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"; \
    site="$(dirname "$(dirname "$lib")")"; \
    mkdir -p "/stage$lib" /stage/etc/ld.so.conf.d /stage/opt/libtorch; \
    cp -a "$lib/." "/stage$lib/"; \
    rm -f "/stage$lib/libtorch_python.so"; \
    echo "$lib" > /stage/etc/ld.so.conf.d/diffmesh-torch.conf; \
    if [ -d "$site/nvidia" ]; then \
      mkdir -p "/stage$site"; cp -a "$site/nvidia" "/stage$site/"; \
      find "/stage$site/nvidia" -name '*.a' -delete; \
      for d in "$site"/nvidia/*/lib; do echo "$d" >> /stage/etc/ld.so.conf.d/diffmesh-torch.conf; done; \
    fi; \
    ln -s "$lib" /stage/opt/libtorch/lib; \
    echo "torch libraries staged:"; cat /stage/etc/ld.so.conf.d/diffmesh-torch.conf; du -sh /stage

WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target,id=diffmesh-target-torch \
    cargo build --release --locked -p diffmesh-denoiser -p diffmesh-controlnet \
 && install -D -m 0755 target/release/diffmesh-denoiser /out/diffmesh-denoiser \
 && install -D -m 0755 target/release/diffmesh-controlnet /out/diffmesh-controlnet

# ---------------------------------------------------------------------------------------------
FROM debian:${DEBIAN_RELEASE}-slim AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# libstdc++6/libgomp1: libtorch's C++ runtime (libgomp also ships in torch/lib; the system one
# is a fallback). curl: the container health check.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl libstdc++6 libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /opt/diffmesh --create-home diffmesh
COPY --from=builder /stage/ /
RUN ldconfig
COPY --from=builder /out/diffmesh-denoiser /usr/local/bin/diffmesh-denoiser
# The ControlNet worker (compose service `controlnet`) runs from this image too.
COPY --from=builder /out/diffmesh-controlnet /usr/local/bin/diffmesh-controlnet
RUN ! ldd /usr/local/bin/diffmesh-denoiser | grep 'not found'
WORKDIR /opt/diffmesh
# The default model (tiny, trained, shipped in the repo). The CUDA C sources of kernels/ are
# expected inside the binary (include_str!), so the image needs no copy of them.
COPY --chown=diffmesh:diffmesh weights/tiny /opt/diffmesh/weights/tiny
COPY --chown=diffmesh:diffmesh weights/tiny-controlnets /opt/diffmesh/weights/tiny-controlnets
USER 10001:10001
# NVIDIA_DRIVER_CAPABILITIES: what the NVIDIA container toolkit mounts from the host when a GPU
# is reserved (the driver's libcuda.so.1 comes from the host, never from the image). Which GPUs
# are visible is left to the reservation (compose `devices`, `docker run --gpus`).
ENV RUST_LOG=info \
    HEALTH_ADDR=0.0.0.0:9090 \
    DENOISER_MODEL_DIR=/opt/diffmesh/weights/tiny \
    DENOISER_CONTROLNET_DIR=/opt/diffmesh/weights/tiny-controlnets \
    CONTROLNET_DIR=/opt/diffmesh/weights/tiny-controlnets \
    LD_LIBRARY_PATH=/opt/libtorch/lib \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
LABEL org.opencontainers.image.title="diffmesh-denoiser"
EXPOSE 9090
# /readyz on the health port: the process is up and connected to NATS. Loading the model takes a
# while on first start: a longer start period than the other services.
# Shell form on purpose: the port comes from HEALTH_ADDR at run time.
# hadolint ignore=DL3025
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD curl -fsS "http://127.0.0.1:${HEALTH_ADDR##*:}/readyz" >/dev/null || exit 1
ENTRYPOINT ["/usr/local/bin/diffmesh-denoiser"]
