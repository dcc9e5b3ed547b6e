"""The contract between producers and workers. Imports without vLLM or a GPU.

    from rollout_queue import generate, sync_weights
    out = generate.delay(["2+2="], {"temperature": 0.7, "max_tokens": 64}).get()
    report = sync_weights.broadcast(model, version=7)
    for item in generate.stream(["2+2="], {"max_tokens": 64}): ...   # SampleDelta..., GenerationResult
    for index, result in generate_many(prompts, params, chunk_size=64): ...
    result = await generate.async_(["2+2="], {"max_tokens": 64})   # tasks.aio: asyncio, as_completed
    control.sleep(level=1); control.wake_up()    # also pause, resume, engine_stats...

Owns what producers, trainers and workers agree on: the ``generate`` task and
its schemas, its asyncio client (``aio``), the Celery app and client settings, Redis key and task names
(``keys``), the error tree (``errors``), the worker registry, control commands
and their signing. The weight sync (``sync_weights``, ``SyncReport``) lives
in ``weight_sync``, which imports this package; the two names are handed out
here on first use (``__getattr__``) so that ``from rollout_queue.tasks import
sync_weights`` keeps working without an import from here into ``weight_sync``. Imports celery, kombu, redis and
pydantic; never ``workers``, ``api``, ``cli`` or vLLM, and torch only lazily
where a sync sends tensors: a trainer or a pipeline imports it on any host.
"""

from __future__ import annotations

import importlib
from typing import Any

from rollout_queue.tasks import control
from rollout_queue.tasks.app import app, configure
from rollout_queue.tasks.errors import RolloutError, WeightSyncError
from rollout_queue.tasks.generate import generate
from rollout_queue.tasks.producer import generate_many
from rollout_queue.tasks.schemas import GenerationResult, SampleDelta, SamplingParams, WorkerInfo
from rollout_queue.tasks.signature import signature
from rollout_queue.tasks.split import SplitResult

# Names of the weight sync handed out from here (the package above this one).
_FROM_WEIGHT_SYNC = {
    "sync_weights": ("rollout_queue.weight_sync.sync_weights", None),
    "SyncReport": ("rollout_queue.weight_sync.protocol", "SyncReport"),
}

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
    """``sync_weights`` and ``SyncReport``, from ``weight_sync`` on first use."""
    if name in _FROM_WEIGHT_SYNC:
        module_name, attribute = _FROM_WEIGHT_SYNC[name]
        module = importlib.import_module(module_name)
        return module if attribute is None else getattr(module, attribute)
    raise AttributeError(f"module 'rollout_queue.tasks' has no attribute {name!r}")
