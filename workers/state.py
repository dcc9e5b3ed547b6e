"""``NodeState``: the one owner of a worker node's serving state.

What keeps a worker from serving, each held as its own condition and lifted
only by its own transition:

    lifecycle  starting → running → stopping       ready() / stopping()
    updating   a weight sync runs                  begin_update() / finish_update() | fail_update()
    intake     held closed by the sync's pause      hold_intake() / release_intake()
    sleeping   the engine's KV cache is asleep      sleep() / wake()
    paused     by an operator                       pause() / resume()
    fence      weights behind the fleet's, or       fence(reason) / lift(*reasons),
               half-loaded, or Redis full           finish_update() lifts any (and only it
               (a ``FenceReason``)                  a half-loaded one)

Every transition goes through :meth:`NodeState._change`, the only writer.
Everything else asks: ``current`` (the ``WorkerState`` the registry, the
metrics, ``rollout-queue status`` and control replies show), ``consuming``
(whether the worker takes tasks from its queues), ``intake_open`` / ``wait_for_intake``
(whether requests may enter the engine), ``refusal`` (why a task is requeued).
Listeners added with :meth:`on_change` see each change of ``current`` or
``consuming`` (the runtime: registry heartbeat and queue consumption).

Pure logic: no Redis, no engine.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from rollout_queue.tasks.schemas import WorkerState

log = logging.getLogger(__name__)

OPERATOR_PAUSE = "paused by an operator"  # the refusal of a task while paused
SLEEPING = "sleeping"  # the refusal of a task while asleep


class FenceReason(enum.Enum):
    """Why a worker's weights (or its engine) keep it from serving."""

    FLEET_AHEAD = "fleet ahead"  # the pool's fleet version is above this worker's (heartbeat)
    MISSED_SYNC = "missed sync"  # a sync to a newer version failed before changing any weight
    HALF_LOADED = "half-loaded"  # a failed sync left weights it could not roll back
    ENGINE_LOST = "engine lost"  # the engine died or stopped answering: the worker leaves
    # Redis refuses writes (used memory past maxmemory, noeviction): the worker takes
    # no task until Redis has room; the tasks it holds run on (their results retry).
    REDIS_FULL = "redis full"


# Lifted when the heartbeat sees the worker at the fleet's version again; a
# half-loaded worker waits for a sync (its version number is not its weights).
CAUGHT_UP = (FenceReason.FLEET_AHEAD, FenceReason.MISSED_SYNC)


@dataclass(frozen=True)
class Fence:
    reason: FenceReason
    detail: str  # what the log, and a requeued task's message, say
    # A missed sync's round may still commit for the others: until the trainer
    # has written the pool's version the heartbeat would read the old one as
    # caught up. Held until round ``round`` is over, or time.monotonic() passes
    # ``until`` (the round's deadline: a trainer that never says).
    until: float | None = None
    round: str | None = None

    def held(self) -> bool:
        """Whether the heartbeat may not lift it yet (``until`` not passed)."""
        return self.until is not None and time.monotonic() < self.until


Lifecycle = Literal["starting", "running", "stopping"]


@dataclass(frozen=True)
class _Conditions:
    lifecycle: Lifecycle = "starting"
    updating: bool = False
    intake_held: bool = False
    sleeping: bool = False
    paused: bool = False
    fence: Fence | None = None


class NodeState:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._now = _Conditions()
        self._intake = threading.Event()  # set: requests may enter the engine
        self._intake.set()
        self._listeners: list[Callable[[NodeState], None]] = []

    # ----------------------------------------------------------- questions

    @property
    def current(self) -> WorkerState:
        """The state shown outside, the first that holds of: stopping, starting,
        syncing, sleeping, paused, fenced, serving."""
        now = self._now
        if now.lifecycle != "running":
            return now.lifecycle
        if now.updating:
            return "syncing"
        if now.sleeping:
            return "sleeping"
        if now.paused:
            return "paused"
        if now.fence is not None:
            return "fenced"
        return "serving"

    @property
    def consuming(self) -> bool:
        """Whether the worker takes tasks from its queues (a sync does not stop it:
        tasks taken meanwhile wait for intake)."""
        now = self._now
        return now.fence is None and not now.paused and not now.sleeping

    @property
    def fence_reason(self) -> FenceReason | None:
        fence = self._now.fence
        return None if fence is None else fence.reason

    @property
    def paused(self) -> bool:
        return self._now.paused

    @property
    def sleeping(self) -> bool:
        return self._now.sleeping

    def refusal(self) -> str | None:
        """Why a task must go back to the queue; None: this worker may run it.

        Not for Redis being full: a requeue is a write Redis would refuse (Celery
        then drops the message), and the tasks held run on, their results retried."""
        now = self._now
        if now.fence is not None and now.fence.reason is not FenceReason.REDIS_FULL:
            return now.fence.detail
        if now.paused:
            return OPERATOR_PAUSE
        if now.sleeping:
            return SLEEPING
        return None

    @property
    def intake_open(self) -> bool:
        return self._intake.is_set()

    def wait_for_intake(self, timeout: float) -> bool:
        """Block until requests may enter the engine; False when ``timeout`` passed first."""
        return self._intake.wait(max(0.0, timeout))

    def on_change(self, listener: Callable[[NodeState], None]) -> None:
        """Call ``listener(self)`` after each change of ``current`` or ``consuming``."""
        self._listeners.append(listener)

    # --------------------------------------------------------- transitions

    def ready(self) -> None:
        self._change(lifecycle="running")

    def stopping(self) -> None:
        self._change(lifecycle="stopping")

    def pause(self) -> None:
        self._change(paused=True)

    def resume(self) -> None:
        """Lift the operator's pause only: a fenced or sleeping worker stays out."""
        self._change(paused=False)

    def sleep(self) -> None:
        """Before the engine sleeps: no request may enter it from here."""
        self._change(sleeping=True)

    def wake(self) -> None:
        """The engine's KV cache is awake again."""
        self._change(sleeping=False)

    def fence(self, reason: FenceReason, detail: str) -> None:
        """Fence for ``reason``; a lost engine's fence is final (the worker is
        leaving): no later fence replaces it, so none can be lifted in its place."""
        with self._lock:
            now = self._now.fence
            if now is not None and now.reason is FenceReason.ENGINE_LOST:
                return
            self._change(fence=Fence(reason, detail))

    @property
    def held_for(self) -> str | None:
        """The sync round whose end the fence waits for (None: not held)."""
        fence = self._now.fence
        return fence.round if fence is not None and fence.held() else None

    def lift(self, *reasons: FenceReason, round_over: bool = False) -> None:
        """Lift the fence if it is for one of ``reasons``, and not held for a
        round that may still commit (``round_over``: the caller saw it end)."""
        with self._lock:
            fence = self._now.fence
            if fence is not None and fence.reason in reasons and (round_over or not fence.held()):
                self._change(fence=None)

    def begin_update(self) -> None:
        self._change(updating=True)

    def finish_update(self) -> None:
        """The engine serves the new weights: any fence is lifted (sleep and pause stay)."""
        self._change(updating=False, fence=None)

    def fail_update(self, fence: Fence | None) -> None:
        """The sync failed; ``fence``: what it left (None: the weights it had, still current).

        A half-loaded fence stays whatever a later failed sync says: one called off
        before it changed a weight does not make the weights whole (only
        :meth:`finish_update` does), and a missed-sync fence the heartbeat lifts
        must not stand in for it."""
        with self._lock:
            if fence is None or self.fence_reason is FenceReason.HALF_LOADED:
                self._change(updating=False)
            else:
                self._change(updating=False, fence=fence)

    def hold_intake(self) -> None:
        """A sync pauses the engine: requests wait until :meth:`release_intake`."""
        self._change(intake_held=True)

    def release_intake(self) -> None:
        """The engine resumed; intake opens unless the KV cache is asleep."""
        self._change(intake_held=False)

    # ------------------------------------------------------- the one writer

    def _change(self, **changes: object) -> None:
        with self._lock:
            before = (self.current, self.consuming, self.refusal())
            self._now = replace(self._now, **changes)  # type: ignore[arg-type]
            if self._now.intake_held or self._now.sleeping:
                self._intake.clear()
            else:
                self._intake.set()
            refusal = self.refusal()
            if refusal is not None and refusal != before[2]:
                log.warning("fenced: %s", refusal)
            changed = (self.current, self.consuming) != before[:2]
        # Outside the lock: a listener writes to Redis (the registry), and no other
        # thread's transition (a control command on the consumer's loop) waits on it.
        if changed:
            for listener in self._listeners:
                listener(self)
