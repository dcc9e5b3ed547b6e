"""The trainer's settings of the weight sync: ``SyncSettings`` and its per-phase
``SyncTimeouts`` (``RQ_RENDEZVOUS_HOST``, ``RQ_BUCKET_BYTES``, ``RQ_TRANSPORT``...).

Read from the environment when built (``SyncSettings()``), never at import time.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from rollout_queue.tasks.settings import ENV_PREFIX, Settings
from rollout_queue.weight_sync.protocol import WorkerTimeouts

TransportChoice = Literal["auto", "gloo", "nccl", "shm", "cuda_ipc"]


class SyncTimeouts(BaseModel):
    """Deadline of each weight-sync phase, seconds; ``worker``: the workers' own
    deadlines, which travel in the plan."""

    membership: float = 5.0
    trigger: float = 10.0
    ready: float = 120.0
    transfer: float = 300.0
    commit: float = 60.0
    worker: WorkerTimeouts = WorkerTimeouts()


class SyncSettings(Settings):
    """The trainer's side of the weight sync."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    # Address workers use to reach the trainer's TCPStore. Bound as given.
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = 0  # 0: pick a free port
    bucket_bytes: int = Field(default=1 << 30, ge=1 << 20)
    # Pieces a bucket travels in, so loading overlaps the wire. None: 128 MiB
    # over gloo (measured on CPU: same load cost in 8 or 32 calls as in one),
    # the whole bucket over NCCL (not yet measured on the GPU in pieces).
    chunk_bytes: int | None = Field(default=None, ge=1 << 20)
    # Tensors this large go out straight from the trainer's memory, as pieces
    # of their own, instead of being copied into a bucket buffer first (0: never).
    # A worker loading directly (CUDA) receives them straight into the
    # parameters that hold them (weight_sync/inplace.py).
    direct_bytes: int = Field(default=16 << 20, ge=0)
    # How the weights reach each worker (weight_sync/transports): "auto" hands
    # them over in place to workers started with --colocated that share this
    # process's host ("shm") or GPU ("cuda_ipc"), and over a process group to
    # the others ("nccl" on CUDA, "gloo" on CPU); a name forces that transport
    # for every worker.
    transport: TransportChoice = "auto"
    # HMAC key the sync trigger is signed with; the workers' RQ_WEIGHT_SYNC_SECRET.
    weight_sync_secret: SecretStr | None = None
    timeouts: SyncTimeouts = SyncTimeouts()


__all__ = ["SyncSettings", "SyncTimeouts", "TransportChoice"]
