"""Settings of a worker node (one engine), from the environment and CLI flags."""

from __future__ import annotations

import socket
from typing import Any, Literal

from celery.utils.nodenames import host_format
from pydantic import Field, field_validator, model_validator

from rollout_queue.tasks import keys
from rollout_queue.tasks.keys import node_queue
from rollout_queue.tasks.logs import LogFormat
from rollout_queue.tasks.settings import ClientSettings


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
    # The engine shares its host (CPU) or its GPU (CUDA) with the trainer: the
    # trainer hands it the weights in place (shm / CUDA IPC, weight_sync/transports)
    # and, on CUDA, may put it to sleep around each optimizer step (sleep mode on).
    colocated: bool = False
    seed: int = 0
    # Running-batch limits; None: vLLM's defaults for batch work (LLM_CLASS).
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    load_format: str = "auto"  # "dummy": random weights (benchmarks)
    # CPU only. "packed": vLLM's own (linear weights become GEMM handles, so a
    # sync reloads layer by layer and packs again); "plain": linear weights stay
    # tensors (syncs load directly and mostly in place; slower GEMMs).
    # weight_sync/cpu_weights.py.
    cpu_weights: Literal["packed", "plain"] = "packed"
    # "auto": layerwise reload on CPU with packed weights (a bare load_weights
    # leaves the old weights in use there), direct load_weights otherwise.
    weight_load_mode: Literal["auto", "layerwise", "direct"] = "auto"
    # vLLM's tool-call parser for chat prompts with tools (hermes, llama3_json,
    # pythonic...: vLLM's --tool-call-parser); None: tools are rendered, calls
    # are not parsed, and tool_choice "auto" is refused.
    tool_call_parser: str | None = None
    # Any other vLLM engine argument, by its EngineArgs name (the worker's
    # unknown flags, parsed by vLLM: workers/engine/args.py). Applied last.
    engine_args: dict[str, Any] = {}  # noqa: RUF012  pydantic copies defaults

    @model_validator(mode="after")
    def _colocated_sleeps(self) -> EngineSettings:
        """A colocated CUDA engine gives its memory back to the trainer between rollouts."""
        if self.colocated and self.device == "cuda":
            self.enable_sleep_mode = True
        return self


class WorkerSettings(EngineSettings):
    # Celery node name; %h (host name), %n (its first label) and %d (its
    # domain) are expanded as Celery's ``-n`` does: ``gpu0@%h``.
    name: str = Field(default_factory=lambda: f"worker@{socket.gethostname()}")
    max_inflight: int = Field(64, ge=1, description="tasks in flight at once (threads)")
    # The next task is fetched only while the engine's unfinished sequences
    # are below this (workers/queue/intake.py); None: the engine's max_num_seqs.
    intake_sequences: int | None = Field(None, ge=1)
    queues: list[str] = [keys.GENERATE_QUEUE]  # noqa: RUF012  pydantic copies defaults
    pool: str = keys.DEFAULT_POOL
    heartbeat_s: float = Field(2.0, gt=0.0)
    registry_ttl_s: float = 10.0
    # The heartbeat asks the engine a no-op question each beat; an engine that
    # has not answered for this long is lost (hung, or stopped): the worker
    # fences itself, hands its tasks back and exits (workers/engine/liveness.py).
    # Longer than the longest engine step (a long prefill on a slow CPU).
    engine_answer_s: float = Field(30.0, gt=0.0)
    # A node whose registry key has been gone this long is dead: the reaper
    # puts its unacknowledged tasks back in their queues (workers/queue/reaper.py).
    reap_grace_s: float = 10.0
    metrics_port: int | None = None  # Prometheus /metrics; None = off
    # Every this many generated tokens a sample's progress is saved to Redis,
    # so a redelivered task continues from there (workers/engine/progress.py); 0: off.
    checkpoint_tokens: int = Field(0, ge=0)
    # SIGTERM: finish in-flight tasks for at most this long, then checkpoint,
    # abort and requeue them for other workers; None: finish them (no deadline).
    drain_timeout: float | None = Field(None, ge=0.0)
    # Address /metrics listens on: loopback unless a scraper elsewhere needs it
    # (0.0.0.0 in a container whose port only the compose network reaches).
    metrics_host: str = "127.0.0.1"
    # Without RQ_WEIGHT_SYNC_SECRET a worker refuses to start, unless told that an
    # open control plane is intended (loopback-only setups, the quickstart):
    # then any Redis client can pause it, sleep it or sync weights into it.
    insecure_control: bool = False
    # Celery's own state-changing control commands (shutdown, pool_restart,
    # add_consumer, rate_limit...) are unsigned: off unless enabled.
    allow_celery_control: bool = False
    # A signed command is valid this long either side of its issue time.
    control_max_age_s: float = Field(30.0, gt=0.0)
    log_level: str = "INFO"
    # "json": one JSON object per log line (time, level, logger, message, node).
    log_format: LogFormat = "text"
    # A fault for tests (RQ_FAULT_DIE_BEFORE_ACK=1): the worker kills itself with
    # SIGKILL when it would ack a task it ran, its result already stored.
    fault_die_before_ack: bool = False
    # Also consume a queue of this worker's own, where the gateway sends the
    # next turn of a session this worker served (its prefix cache holds the
    # conversation). Off by default: a worker of two queues polls the second
    # (workers/queue/reliable_redis.py: rq_multi_queue_block_s).
    sticky_sessions: bool = False
    # Serve without first running the engine through the shapes of its first
    # tasks (workers/engine/warm_up.py): those tasks then wait for vLLM's
    # lazy compiles (seconds to a minute on CPU).
    skip_warm_up: bool = False

    @field_validator("name")
    @classmethod
    def _expand_node_name(cls, name: str) -> str:
        return host_format(name)

    @property
    def consumed_queues(self) -> list[str]:
        """``queues``, and with ``sticky_sessions`` the worker's own queue (``keys.node_queue``)."""
        return [*self.queues, node_queue(self.name)] if self.sticky_sessions else list(self.queues)

    def control_secret(self) -> str | None:
        """The HMAC key of signed commands; None when unset or empty."""
        secret = self.weight_sync_secret.get_secret_value() if self.weight_sync_secret else ""
        return secret or None

    def insecure_start_refusal(self) -> str | None:
        """Why this worker must not start (no secret, no ``--insecure-control``), or None."""
        if self.control_secret() is not None or self.insecure_control:
            return None
        return (
            "rollout-queue worker: RQ_WEIGHT_SYNC_SECRET is not set, so any Redis client could pause, "
            "sleep or load weights into this worker; set RQ_WEIGHT_SYNC_SECRET (the same on trainers "
            "and workers), or pass --insecure-control (RQ_INSECURE_CONTROL=1) for a loopback-only setup"
        )
