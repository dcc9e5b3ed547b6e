"""What happens to a ``generate`` message when it reaches this worker.

Installed as the task's Celery strategy (``Task.Strategy``), which runs in
the consumer's event loop for every message before Celery builds a request:

1. its headers are checked (:func:`check_headers`) and it may carry no
   callbacks, errbacks, chain or chord (:func:`check_no_links`): a message
   that fails either is refused before any work, dead-lettered with a reason
   naming what was wrong (``workers.queue.poison.DeadLetteringConsumer``), and its
   task fails with that reason;
2. a task that already finished is acked and not run (``workers.queue.dedup``);
3. the task is counted into the intake until its requests are in the engine
   (``workers.queue.intake``: the next fetch waits for that);
4. Celery's default strategy takes it from there (reserve, pool, ack late).

A traced task (``tasks.trace``) gets its ``received`` stamp as the strategy
is entered and its ``handed`` stamp as Celery's takes over, in the message's
headers, which Celery's request copies for the task.

``die_before_ack`` is a fault for tests (``RQ_FAULT_DIE_BEFORE_ACK``): the
process kills itself with SIGKILL when it would ack a task it ran, its result
already stored.
"""

from __future__ import annotations

import logging
import math
import os
import signal
from collections.abc import Callable
from typing import Any

from celery import signals
from celery.worker.strategy import default as default_strategy

from rollout_queue.tasks import trace
from rollout_queue.tasks.errors import PoisonMessage
from rollout_queue.tasks.generate import (
    FIRST_PROMPT_HEADER,
    MIN_VERSION_HEADER,
    ON_NEW_WEIGHTS,
    ON_NEW_WEIGHTS_HEADER,
    SENT_AT_HEADER,
    SEQUENCES_HEADER,
    SIGNATURE_HEADER,
)
from rollout_queue.tasks.streaming import STREAM_HEADER
from rollout_queue.workers.queue.dedup import DuplicateGuard
from rollout_queue.workers.queue.intake import Intake

log = logging.getLogger(__name__)

# What a task message may carry for a generate task to follow: never read from the wire.
LINKS = ("callbacks", "errbacks", "chain", "chord")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _time_limits(value: Any) -> bool:
    """Celery's ``timelimit`` header: ``[hard, soft]``, each seconds or null."""
    return isinstance(value, list | tuple) and len(value) == 2 and all(
        v is None or (_is_number(v) and v >= 0) for v in value)


# Header → (is it valid?, what it must be). Absent or null: the default.
HEADER_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    SIGNATURE_HEADER: (lambda v: isinstance(v, str), "a string"),
    SENT_AT_HEADER: (_is_number, "a unix time (a number)"),
    MIN_VERSION_HEADER: (_count, "a weight version (an integer >= 0)"),
    SEQUENCES_HEADER: (_count, "a count of sequences (an integer >= 0)"),
    FIRST_PROMPT_HEADER: (_count, "a prompt index (an integer >= 0)"),
    ON_NEW_WEIGHTS_HEADER: (lambda v: v in ON_NEW_WEIGHTS, f"one of {', '.join(ON_NEW_WEIGHTS)}"),
    STREAM_HEADER: (lambda v: isinstance(v, bool | int | str), "a flag"),
    "timelimit": (_time_limits, "[hard, soft] seconds (numbers >= 0 or null)"),
    trace.TRACE_HEADER: (trace.valid, "a dict of stamp names to unix times"),
}


def check_headers(headers: dict[str, Any]) -> None:
    """``PoisonMessage("bad-headers")`` naming the first header a generate task cannot use."""
    for name, (valid, expected) in HEADER_RULES.items():
        value = headers.get(name)
        if value is not None and not valid(value):
            shown = repr(value)
            raise PoisonMessage("bad-headers", f"header {name!r} is {shown[:80]}"
                                f"{'...' if len(shown) > 80 else ''}; it must be {expected}")


def check_no_links(embed: Any) -> None:
    """``PoisonMessage("links-refused")`` if the message asks for tasks to follow it."""
    found = [name for name in LINKS if isinstance(embed, dict) and embed.get(name)]
    if found:
        raise PoisonMessage("links-refused", f"the message carries {', '.join(found)}: generate tasks "
                            "run no follow-up task from the wire; send it from the caller once the "
                            "result is in")


def check_message(message: Any) -> None:
    """Headers and links of a generate message, before any work (``PoisonMessage``)."""
    check_headers(message.headers or {})
    payload = message.payload  # decoded once: Celery's request reads the same cache
    check_no_links(payload[2] if isinstance(payload, list | tuple) and len(payload) == 3 else None)


def install(task: Any, guard: DuplicateGuard, intake: Intake, *, die_before_ack: bool = False) -> None:
    """Route ``task``'s deliveries through the guard and the intake (before consuming)."""

    def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
        handle = default_strategy(task, app, consumer, **kwargs)

        def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                       **options: Any) -> Any:
            traced = trace.requested(message.headers)
            trace.stamp(traced, "received")
            check_message(message)  # PoisonMessage: dead-lettered by the consumer
            headers = message.headers or {}
            task_id = headers.get("id")
            # The result's head came with the ledger record (reliable_redis), else it is read now.
            state = guard.finished(task_id, getattr(message, "rq_result_head", None)) if task_id else None
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
                trace.stamp(traced, "handed")
                return handle(message, body, ack, reject, callbacks, **options)
            intake.fetched(task_id, headers)
            trace.stamp(traced, "handed")
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
