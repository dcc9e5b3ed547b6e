"""Weight sync, the trainer's face: push new policy weights into every worker.

    from rollout_queue import sync_weights      # or rollout_queue.tasks / rollout_queue.weight_sync
    report = sync_weights.broadcast(model, version=7, pause="wait")   # a SyncReport
    sync_weights.catch_up(model); sync_weights.status(); sync_weights.close()

Colocated training (workers started with ``--colocated`` on the trainer's GPU):

    sync_weights.sleep(level=1)          # before the optimizer step: the engines free their memory
    optimizer.step()
    sync_weights.wake(model)             # the new weights handed over, KV cache back, tasks flow

The protocol is the rest of this package (its phases are drawn in
``weight_sync.sender``); here are the process-wide senders, one per pool,
whose rendezvous store and process group live on between syncs. Imports
without torch: the sender imports it when it first syncs.
"""

from __future__ import annotations

from typing import Any

from rollout_queue.tasks import control, keys
from rollout_queue.tasks.errors import WeightSyncError
from rollout_queue.tasks.schemas import PauseMode
from rollout_queue.weight_sync.protocol import SyncReport
from rollout_queue.weight_sync.sender import Weights, WeightSender
from rollout_queue.weight_sync.settings import SyncSettings

_senders: dict[str, WeightSender] = {}


def sender(pool: str = keys.DEFAULT_POOL, settings: SyncSettings | None = None) -> WeightSender:
    """The process-wide sender of ``pool`` (its store and group live on between syncs)."""
    if pool not in _senders or settings is not None:
        if pool in _senders:
            _senders[pool].close()
        _senders[pool] = WeightSender(settings, pool)
    return _senders[pool]


def broadcast(
    weights: Weights,
    version: int | None = None,
    timeout: float = 120.0,
    pause: PauseMode = "wait",
    pool: str = keys.DEFAULT_POOL,
) -> SyncReport:
    """Push ``weights`` to every live worker of ``pool``; returns a ``SyncReport``."""
    return sender(pool).sync(weights, version=version, timeout=timeout, pause=pause)


def catch_up(
    weights: Weights, timeout: float = 120.0, pause: PauseMode = "wait", pool: str = keys.DEFAULT_POOL,
) -> SyncReport | None:
    """Sync only the workers of ``pool`` behind its current version (see ``WeightSender.catch_up``)."""
    return sender(pool).catch_up(weights, timeout=timeout, pause=pause)


def sleep(
    level: int = 1, pool: str = keys.DEFAULT_POOL, timeout: float = control.SLEEP_TIMEOUT,
) -> dict[str, Any]:
    """Put every live worker of ``pool`` to sleep (vLLM level 1: weights offloaded to
    host memory, KV cache dropped; level 2: both dropped, the next ``wake`` must
    bring weights). Tasks sent meanwhile wait in their queue. Returns each
    worker's answer."""
    return control.sleep(level, pool=pool, timeout=timeout)


def wake(
    weights: Weights | None = None,
    version: int | None = None,
    pool: str = keys.DEFAULT_POOL,
    timeout: float = 120.0,
) -> SyncReport | None:
    """Wake every worker of ``pool``; with ``weights``, first hand them over (the sync
    wakes the engines' weights, loads the new ones, and the KV cache wakes after):
    a pool put to sleep at level 2 must be woken with weights. Tasks flow again
    once it returns. Returns the sync's report (None without weights)."""
    report = None
    if weights is not None:
        report = broadcast(weights, version=version, timeout=timeout, pause="wait", pool=pool)
        control.wake_up(["kv_cache"], pool=pool, timeout=timeout)
    else:
        control.wake_up(None, pool=pool, timeout=timeout)
    return report


def status(pool: str = keys.DEFAULT_POOL) -> dict[str, int]:
    """Weight version of every live worker of ``pool``."""
    return sender(pool).status()


def close(pool: str | None = None) -> None:
    """Close the process group(s) and stores; the next sync builds new ones."""
    for name in [pool] if pool else list(_senders):
        if name in _senders:
            _senders.pop(name).close()


__all__ = [
    "SyncSettings", "WeightSender", "WeightSyncError", "broadcast", "catch_up", "close", "sender", "sleep",
    "status", "wake",
]
