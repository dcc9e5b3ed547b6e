"""Why a generation run gives its task back to the queue (all ``Requeue``:
nothing was wrong with the task)."""

from __future__ import annotations

from rollout_queue.tasks.errors import Requeue

__all__ = ["AbortedForSync", "EngineLost", "HandedOff"]


class AbortedForSync(Requeue):
    """In-flight requests were aborted by a ``pause="abort"`` sync: requeue the task."""


class HandedOff(Requeue):
    """The worker is leaving (SIGTERM past its drain deadline): requeue the task at once."""


class EngineLost(Requeue):
    """The engine died or stopped answering: the task goes back to the queue at
    once, for another worker (nothing was wrong with it; the worker leaves)."""
