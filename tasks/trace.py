"""A per-task phase trace: where one task's time goes, from ``apply_async`` to ``.get()``.

Opt-in per call (``generate.apply_async(..., trace=True)``, or every call of a
producer with ``RQ_TRACE_PHASES=1``). A traced task carries the
``rq_trace`` header, a dict of wall-clock stamps (``time.time()``; the
phases are only meaningful between processes of one host, whose clocks
agree); the producer stamps it, the worker adds its own on the way and
returns them all as the result's ``trace`` field, and ``.get()`` adds the
last one. No Redis read or write is added for it, and an untraced task
costs a header lookup at each point.

The stamps, in the order a task passes them (:data:`STAMPS`):

==============  =======================================================================
``called``      producer: ``apply_async`` entered
``sent``        producer: validated, subscribed to the result; Celery hands the message to kombu
``received``    worker: the task's Celery strategy got the message (fetched, in the ledger)
``handed``      worker: our strategy's checks done (headers, dedup, intake); Celery's own
                strategy takes it (request, reserve, pool)
``started``     worker: the task body runs on its thread (after Celery's pre-run work)
``submit``      worker: prompts parsed, admitted, tokenized; requests handed to the engine loop
``added``       worker: every request is in vLLM's ``AsyncLLM`` (``add_request`` returned)
``first_token`` engine: the first token's output processed by ``AsyncLLM`` (vLLM's request stats)
``last_output`` worker: the last request's final output on the engine loop
``returned``    worker: the task body returns the result (outputs built)
``storing``     worker: the result backend begins to store it (encode, ``SET`` + ``PUBLISH``)
``read``        producer: ``.get()`` returns it (the result's notice read, result decoded)
==============  =======================================================================

A phase is the time between two consecutive stamps (:func:`phases_ms`),
named after the stamp it ends at (:data:`PHASES`). The stamps are on one
task's critical path; ``apply_async`` itself returns a little after
``sent`` (the publish, then Celery's ``task-sent`` event), so its return is
not one of them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from itertools import pairwise
from typing import Any

TRACE_HEADER = "rq_trace"

STAMPS = (
    "called", "sent", "received", "handed", "started", "submit", "added",
    "first_token", "last_output", "returned", "storing", "read",
)

# Phase name -> (the stamp it starts at, the stamp it ends at).
PHASES: dict[str, tuple[str, str]] = {
    "publish": ("called", "sent"),
    "redis_fetch": ("sent", "received"),
    "strategy": ("received", "handed"),
    "handoff": ("handed", "started"),
    "prepare": ("started", "submit"),
    "engine_add": ("submit", "added"),
    "first_token": ("added", "first_token"),
    "decode": ("first_token", "last_output"),
    "build_result": ("last_output", "returned"),
    "before_store": ("returned", "storing"),
    "store_read": ("storing", "read"),
}


def stamp(trace: MutableMapping[str, Any] | None, name: str, at: float | None = None) -> None:
    """Record stamp ``name`` (now, or ``at``) in ``trace``; nothing when the task is untraced."""
    if trace is not None:
        trace[name] = time.time() if at is None else at


def requested(headers: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The trace a task's headers carry (a dict of stamps), or None when it is not traced."""
    trace = headers.get(TRACE_HEADER) if headers else None
    return trace if isinstance(trace, dict) else None


def valid(value: Any) -> bool:
    """What the ``rq_trace`` header may be: a dict of stamp names to unix times."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in value.items())


# The phases inside vLLM's engine (its request's life there); the rest is the queue's.
ENGINE_PHASES = ("first_token", "decode")


def phases_ms(trace: Mapping[str, float]) -> dict[str, float]:
    """Each phase's duration in milliseconds, for the phases whose two stamps are in ``trace``;
    with every stamp, ``total`` (``called`` to ``read``) and ``outside_engine`` (the total
    less the engine's phases: what the queue adds to the task, whatever the engine did)."""
    found = {name: (trace[end] - trace[start]) * 1000.0
             for name, (start, end) in PHASES.items() if start in trace and end in trace}
    if "called" in trace and "read" in trace:
        found["total"] = (trace["read"] - trace["called"]) * 1000.0
        if all(name in found for name in ENGINE_PHASES):
            found["outside_engine"] = found["total"] - sum(found[name] for name in ENGINE_PHASES)
    return found


def in_order(trace: Mapping[str, float]) -> list[str]:
    """The stamps of ``trace`` that come before the one ahead of them in :data:`STAMPS`
    (empty: every stamp present is in order)."""
    present = [name for name in STAMPS if name in trace]
    return [later for earlier, later in pairwise(present) if trace[later] < trace[earlier]]


def on_before_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Celery's ``before_task_publish``: a traced message's ``sent`` stamp, right before kombu
    publishes it (connected by ``tasks.generate`` on the first traced call only)."""
    stamp(requested(headers), "sent")
