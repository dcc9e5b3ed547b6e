"""Whether a worker's engine still answers, asked on each heartbeat.

An engine is lost when its core process died (vLLM then marks the client
``errored`` and fails every request with ``EngineDeadError``) or when it stops
answering: a hung or stopped core (``kill -STOP``) keeps its process and its
sockets, fails nothing and serves nothing. Each heartbeat sends the core a
no-op question (``is_sleeping``, answered between two of its steps) and looks
at the previous one: unanswered for ``engine_answer_s`` means lost. No probe
runs while a weight sync holds the core (its transfer runs inside a step-less
RPC that may rightly take longer).

What a lost engine means for the node is the runtime's (``WorkerRuntime``):
fence, hand every task back, exit non-zero for a supervisor to restart it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Probed(Protocol):
    engine: Any

    def probe(self) -> concurrent.futures.Future[Any]: ...


class EngineWatch:
    def __init__(self, host: Probed, answer_s: float) -> None:
        self.host = host
        self.answer_s = answer_s
        self.answered_at = 0.0  # wall clock of the last answer (the registry shows it)
        self._probe: concurrent.futures.Future[Any] | None = None
        self._asked = 0.0  # monotonic time the outstanding probe was sent

    def check(self, *, busy: bool = False) -> str | None:
        """One heartbeat's look: why the engine is lost, or None while it answers.
        ``busy``: a sync holds the engine; its outstanding question is forgotten."""
        engine = self.host.engine
        if engine is not None and bool(getattr(engine, "errored", False)):
            return "the engine core died"
        if busy:
            self._probe = None
            return None
        now = time.monotonic()
        probe = self._probe
        if probe is not None:
            if not probe.done():
                waited = now - self._asked
                if waited > self.answer_s:
                    return (f"the engine has not answered for {waited:.0f} s (hung or stopped; "
                            f"--engine-answer-s {self.answer_s:g})")
                return None
            self._probe = None
            # A failed answer from a live client: the next beat asks again (a
            # dead core shows as ``errored`` above).
            if not probe.cancelled() and probe.exception() is None:
                self.answered_at = time.time()
        try:
            self._probe = self.host.probe()
        except Exception as exc:  # noqa: BLE001  the heartbeat must go on; the next beat asks again
            log.warning("could not ask the engine whether it answers: %s", exc)
            return None
        self._asked = now
        return None
