"""Weight sync, the trainer's face: push new policy weights into every worker.

    from rollout_queue.tasks import sync_weights
    report = sync_weights.broadcast(model, version=7, pause="wait")   # a SyncReport
    sync_weights.catch_up(model); sync_weights.status(); sync_weights.close()

The protocol lives in the ``weight_sync`` package (its phases are drawn in
``weight_sync.sender``); here are the process-wide senders, one per pool,
whose rendezvous store and process group live on between syncs. Imports
without torch: the sender imports it when it first syncs.
"""

from __future__ import annotations

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import WeightSyncError
from rollout_queue.tasks.schemas import PauseMode
from rollout_queue.tasks.settings import SyncSettings
from rollout_queue.weight_sync.protocol import SyncReport
from rollout_queue.weight_sync.sender import Weights, WeightSender

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


def status(pool: str = keys.DEFAULT_POOL) -> dict[str, int]:
    """Weight version of every live worker of ``pool``."""
    return sender(pool).status()


def close(pool: str | None = None) -> None:
    """Close the process group(s) and stores; the next sync builds new ones."""
    for name in [pool] if pool else list(_senders):
        if name in _senders:
            _senders.pop(name).close()


__all__ = ["WeightSender", "WeightSyncError", "broadcast", "catch_up", "close", "sender", "status"]
