"""Settings of a worker node (one engine), from the environment and CLI flags."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, SecretStr

from tasks.settings import ClientSettings


class EngineSettings(ClientSettings):
    model: str = ""
    device: Literal["cpu", "cuda"] = "cuda"
    dtype: str = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = None
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False
    seed: int = 0
    # Running-batch limits; None: vLLM's defaults for batch work (LLM_CLASS).
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    load_format: str = "auto"  # "dummy": random weights (benchmarks)
    # CPU only. "packed": vLLM's own (linear weights become GEMM handles, so a
    # sync reloads layer by layer and packs again); "plain": linear weights stay
    # tensors (syncs load directly and mostly in place; slower GEMMs).
    # workers/cpu_weights.py.
    cpu_weights: Literal["packed", "plain"] = "packed"
    # "auto": layerwise reload on CPU with packed weights (a bare load_weights
    # leaves the old weights in use there), direct load_weights otherwise.
    weight_load_mode: Literal["auto", "layerwise", "direct"] = "auto"


class WorkerSettings(EngineSettings):
    name: str = Field(default_factory=lambda: f"worker@{socket.gethostname()}")
    max_inflight: int = Field(64, ge=1, description="tasks in flight at once (threads)")
    # The next task is fetched only while the engine's unfinished sequences
    # are below this (workers/intake.py); None: the engine's max_num_seqs.
    intake_sequences: int | None = Field(None, ge=1)
    queues: list[str] = ["generate"]  # noqa: RUF012  pydantic copies defaults
    pool: str = "default"
    heartbeat_s: float = Field(2.0, gt=0.0)
    registry_ttl_s: float = 10.0
    # A node whose registry key has been gone this long is dead: the reaper
    # puts its unacknowledged tasks back in their queues (workers/reaper.py).
    reap_grace_s: float = 10.0
    metrics_port: int | None = None  # Prometheus /metrics; None = off
    # Address /metrics listens on: loopback unless a scraper elsewhere needs it
    # (0.0.0.0 in a container whose port only the compose network reaches).
    metrics_host: str = "127.0.0.1"
    weight_sync_secret: SecretStr | None = None
    log_level: str = "INFO"
    # A fault for tests (FAULT_DIE_BEFORE_ACK=1): the worker kills itself with
    # SIGKILL when it would ack a task it ran, its result already stored.
    fault_die_before_ack: bool = False
