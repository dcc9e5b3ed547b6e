"""What happens to a ``generate`` message when it reaches this worker.

Installed as the task's Celery strategy (``Task.Strategy``), which runs in
the consumer's event loop for every message before Celery builds a request:

1. a task that already finished is acked and not run (``workers.dedup``);
2. the task is counted into the intake until its requests are in the engine
   (``workers.intake``: the next fetch waits for that);
3. Celery's default strategy takes it from there (reserve, pool, ack late).

``die_before_ack`` is a fault for tests (``RQ_FAULT_DIE_BEFORE_ACK``): the
process kills itself with SIGKILL when it would ack a task it ran, its result
already stored.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from celery import signals
from celery.worker.strategy import default as default_strategy

from rollout_queue.workers.dedup import DuplicateGuard
from rollout_queue.workers.intake import Intake

log = logging.getLogger(__name__)


def install(task: Any, guard: DuplicateGuard, intake: Intake, *, die_before_ack: bool = False) -> None:
    """Route ``task``'s deliveries through the guard and the intake (before consuming)."""

    def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
        handle = default_strategy(task, app, consumer, **kwargs)

        def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                       **options: Any) -> Any:
            headers = message.headers or {}
            task_id = headers.get("id")
            state = guard.finished(task_id) if task_id else None
            if state is not None:
                guard.count()
                log.warning("task %s was delivered again after it finished (%s); acked, not run",
                            task_id, state)
                ack(log, consumer.connection_errors)  # as Celery's Request.acknowledge calls it
                return None
            if die_before_ack:
                ack = _dying(ack)
            if not task_id or headers.get("eta"):
                # A countdown (a requeue) waits in Celery's timer: not counted.
                return handle(message, body, ack, reject, callbacks, **options)
            intake.fetched(task_id, headers)
            try:
                return handle(message, body, ack, reject, callbacks, **options)
            except BaseException:
                intake.entered(task_id)  # Celery refused it: it never reaches the engine
                raise

        return on_message

    def ended(task_id: str | None = None, **_: Any) -> None:
        if task_id:
            intake.entered(task_id)  # also when the task failed before reaching the engine

    def revoked(request: Any = None, **_: Any) -> None:
        # Revoked or expired, before it ran (Celery then drops the request)
        # or while it waited for a thread: it never reaches the engine.
        ended(getattr(request, "id", None))

    signals.task_postrun.connect(ended, weak=False)
    signals.task_revoked.connect(revoked, weak=False)
    task.Strategy = strategy


def _dying(ack: Any) -> Any:
    def die(*_: Any, **__: Any) -> None:
        log.warning("fault injection: dying with the result stored and the message not acked")
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)

    return die
