"""How much work a worker takes from Redis: by engine room, not by free threads.

Celery alone reserves up to ``--max-inflight`` tasks (its threads) as fast as
it can fetch them, whatever the engine can hold: two idle workers split 24
small tasks 16 : 8, and a worker whose engine is full keeps fetching while
another idles. Here a worker fetches the next task only when

1. every task it took is in its engine already (none is between the fetch
   and the engine: one task at a time goes in, so two workers racing for a
   burst alternate instead of one taking it all), and
2. its engine's unfinished sequences (requests x ``n``) are below its
   budget, ``intake_sequences`` (default: the engine's ``max_num_seqs``, the
   most it runs at once), and
3. while it generates, the engine's scheduler reports no waiting requests
   (KV cache full: more would only wait inside this worker).

So a busy worker leaves tasks in Redis for idle ones, and a worker with half
the budget holds half as many sequences. A task bigger than the room left is
still taken whole once the room is not zero (tasks are not split here), so
the engine runs full and finishes what it holds.

The rule is enforced where kombu decides whether to fetch
(``workers.queue.reliable_redis.QoS.can_consume``); task sizes come from the task's
``rq_sequences`` header (prompts x n), stamped by the producer.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from rollout_queue.tasks.generate import SEQUENCES_HEADER


class Engine(Protocol):
    """What the intake reads of ``workers.engine.host.EngineHost``."""

    def unfinished_sequences(self) -> int: ...

    @property
    def stats(self) -> Any: ...


class Intake:
    def __init__(self, engine: Engine, budget: int) -> None:
        self.engine = engine
        self.budget = budget
        # Task id → sequences: taken from Redis, not yet in the engine.
        self._fetched: dict[str, int] = {}
        self._lock = threading.Lock()
        # The most sequences this worker held right after taking a task
        # (unfinished in the engine + the task's): what the rule allows.
        self.peak_sequences = 0

    def has_room(self) -> bool:
        with self._lock:
            if self._fetched:
                return False
        load = self.engine.unfinished_sequences()
        if load >= self.budget:
            return False
        return not (load > 0 and self.engine.stats.snapshot().waiting_requests > 0)

    def fetched(self, task_id: str, headers: dict[str, Any]) -> None:
        """A task's message reached this worker (consumer thread)."""
        try:
            sequences = max(1, int(headers.get(SEQUENCES_HEADER) or 1))
        except (TypeError, ValueError):
            sequences = 1
        held = self.engine.unfinished_sequences() + sequences
        with self._lock:
            self._fetched[task_id] = sequences
            self.peak_sequences = max(self.peak_sequences, held)

    def reset_peak(self) -> int:
        """The peak so far, starting a new one."""
        with self._lock:
            peak, self.peak_sequences = self.peak_sequences, 0
        return peak

    def entered(self, task_id: str) -> None:
        """The task's requests are in the engine, or it ended without them (idempotent)."""
        with self._lock:
            self._fetched.pop(task_id, None)
