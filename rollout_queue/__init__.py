"""rollout-queue: a Celery + Redis generation backend for RL training and batch inference, on vLLM.

What a producer or a trainer imports:

    from rollout_queue import generate, sync_weights, control
    out = generate.delay(["2+2="], {"temperature": 0.7, "max_tokens": 64}).get(timeout=60)
    report = sync_weights.broadcast(model)

Installed, the code lives under this one package, so that a trainer's own
``tasks``, ``api`` or ``cli`` packages never meet ours: ``rollout_queue.tasks``
(the contract), ``rollout_queue.weight_sync`` (the sync protocol),
``rollout_queue.workers`` (a worker node), ``rollout_queue.api`` (the gateway),
``rollout_queue.cli`` (the ``rollout-queue`` command). In this repository
they are the top-level folders of the same names (this package links them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_queue.tasks import (
        GenerationResult,
        RolloutError,
        SampleDelta,
        SamplingParams,
        SplitResult,
        SyncReport,
        WeightSyncError,
        WorkerInfo,
        configure,
        control,
        generate_many,
        sync_weights,
    )

    # From their own modules: ``app``, ``generate`` and ``signature`` also name
    # modules of ``rollout_queue.tasks``, which mypy would take them for.
    from rollout_queue.tasks.app import app
    from rollout_queue.tasks.generate import generate
    from rollout_queue.tasks.signature import signature

__all__ = [
    "GenerationResult",
    "RolloutError",
    "SampleDelta",
    "SamplingParams",
    "SplitResult",
    "SyncReport",
    "WeightSyncError",
    "WorkerInfo",
    "app",
    "configure",
    "control",
    "generate",
    "generate_many",
    "signature",
    "sync_weights",
]


def __getattr__(name: str) -> Any:
    """The names above, from ``rollout_queue.tasks`` on first use: importing a
    subpackage (``python -m rollout_queue.cli``, a worker) does not build the
    Celery app first."""
    if name in __all__:
        return getattr(importlib.import_module("rollout_queue.tasks"), name)
    raise AttributeError(f"module 'rollout_queue' has no attribute {name!r}")
