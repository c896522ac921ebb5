# syntax=docker/dockerfile:1.7
# One image for every rlfleet role: `rlfleet serve trainer|rollout|coordinator`, `rlfleet run`.
#
#   docker build -t ghcr.io/rlfleet/rlfleet:0.1.0-cpu .                           # CPU (default)
#   docker build --build-arg VARIANT=cuda -t ghcr.io/rlfleet/rlfleet:0.1.0-cuda .  # NVIDIA GPUs
#   docker build --target sglang -t ghcr.io/rlfleet/rlfleet:0.1.0-sglang .         # rollout pods with SGLang
#
# Both variants start from the same Python 3.11 base and differ only in the torch wheel: the CPU
# one comes from PyTorch's CPU index (no CUDA libraries, about 1 GB smaller); the CUDA one is the
# PyPI wheel, which brings the CUDA runtime, cuDNN and NCCL as nvidia-* wheels, so the image needs
# only the node's driver (the NVIDIA container toolkit injects it). To use another CUDA build, set
# TORCH_INDEX_URL, e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128.
# The container runs as uid/gid 10001 with a read-only root filesystem in the Kubernetes
# manifests; HOME and every cache live under /tmp (an emptyDir there).

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# SGLang's own image (CUDA, Python 3.12, its kernels); rlfleet's rollout service is added to it.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.9-cu129-amd64

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/rlfleet \
    PATH=/opt/rlfleet/bin:$PATH
RUN python -m venv /opt/rlfleet

FROM base AS torch-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

FROM base AS torch-cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# `all` exposes every GPU of the host wherever the NVIDIA runtime runs this image, asked or not:
# the Helm chart sets NVIDIA_VISIBLE_DEVICES=void in pods that requested no GPU (the runtime then
# exposes none); a pod with GPUs gets its own from the device plugin.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# Rollout pods of `rollout.engine: sglang`: SGLang's image plus rlfleet, whose rollout service
# starts `python -m sglang.launch_server` as its child. Never built or run here (no GPU with
# SGLang's kernels): see docs/sglang.md for what was verified and how.
# hadolint ignore=DL3006
FROM ${SGLANG_IMAGE} AS sglang
WORKDIR /opt/rlfleet/src
COPY pyproject.toml README.m[d] ./
COPY services ./services
# hadolint ignore=DL3013
# The import check runs from / in isolated mode (-I: no script directory on sys.path), so it
# imports the installed package, not the sources copied beside it.
RUN pip install --no-cache-dir ".[k8s]" && cd / && python -I -c "import services.cli, services.rollout.sglang.engine"
ENTRYPOINT ["rlfleet"]

# hadolint ignore=DL3006
FROM torch-${VARIANT} AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="rlfleet" \
      org.opencontainers.image.description="RL post-training for LLMs as gRPC services (${VARIANT})" \
      org.opencontainers.image.source="https://github.com/rlfleet/rlfleet"
WORKDIR /opt/rlfleet/src
# torch is already installed, so pip keeps it and does not fetch another build. Everything else
# is pinned by constraints.txt to the versions the tests ran with (made by
# `python -m tests.k8s.constraints`; torch is not in it). The sglang target does not use it:
# SGLang's image brings its own pins, on another Python.
COPY pyproject.toml constraints.txt README.m[d] ./
COPY services ./services
# hadolint ignore=DL3013
# The import check runs from / in isolated mode (-I), so it tests the installed package.
RUN pip install --no-cache-dir -c constraints.txt ".[k8s,megatron]" \
 && rm -rf build ./*.egg-info \
 && cd / && python -I -c "import services.cli, services.coordinator.k8s_discovery"
COPY examples ./examples
RUN groupadd --system --gid 10001 rlfleet \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin rlfleet
USER 10001:10001
ENV HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    MPLCONFIGDIR=/tmp/matplotlib
WORKDIR /tmp
EXPOSE 50051 8080
ENTRYPOINT ["rlfleet"]
CMD ["--help"]
