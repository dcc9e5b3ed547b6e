"""Steering the fleet: engine control commands for trainers and operators.

Each function broadcasts the workers' ``rq_engine`` remote-control command
(``workers.node.control``) to every live worker in the registry (of ``pool``, if
given) or to the named ``workers``, waits for one reply per worker until
``timeout``, and returns ``{node: result}``.

    from rollout_queue.tasks import control
    control.sleep(level=1)            # colocated training: free GPU memory
    ...                               # optimizer step
    control.wake_up(["weights"]); sync_weights.broadcast(model); control.wake_up(["kv_cache"])

Commands that change a worker's state are signed with ``RQ_WEIGHT_SYNC_SECRET``
(``ClientSettings.weight_sync_secret``, see ``tasks.auth``); a worker refuses
them unsigned or wrongly signed, and that refusal comes back as
:class:`ControlFailed`. Read-only ones (``engine_stats``, ``world_size``)
travel unsigned.

Raises :class:`ControlTimeout` naming the workers that did not answer,
:class:`ControlFailed` naming those that answered with an error (the others'
replies ride along), and :class:`ControlError` when there is nobody to ask.
Celery broadcasts over Redis are PUB/SUB: a worker that is reconnecting
misses the command, which is why every call waits for named replies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_queue.tasks import keys, registry
from rollout_queue.tasks.app import app, settings
from rollout_queue.tasks.auth import signed_arguments
from rollout_queue.tasks.errors import ControlError, ControlFailed, ControlTimeout

DEFAULT_TIMEOUT = 10.0
# Sleep and wake move the whole model between devices: give them longer.
SLEEP_TIMEOUT = 120.0

__all__ = [
    "engine_stats",
    "pause",
    "reset_prefix_cache",
    "resume",
    "sleep",
    "wake_up",
    "world_size",
]


def _destination(workers: Sequence[str] | None, pool: str | None) -> list[str]:
    if workers is not None:
        names = sorted(set(workers))
        if not names:
            raise ControlError("no workers named; pass worker node names or None for all live workers")
        return names
    client = registry.connect(settings())
    try:
        live = registry.live_workers(client, pool)
    finally:
        client.close()
    if not live:
        where = f" in pool {pool!r}" if pool else ""
        raise ControlError(
            f"no live workers{where} in the registry at {settings().redacted_url}; "
            "start workers (`rollout-queue worker`) or check REDIS_URL"
        )
    return sorted(w.node for w in live)


def engine_command(
    op: str,
    args: dict[str, Any] | None = None,
    *,
    workers: Sequence[str] | None = None,
    pool: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> dict[str, Any]:
    """Send ``rq_engine(op, args)`` and collect ``{node: result}`` from every target."""
    destination = _destination(workers, pool)
    arguments = signed_arguments(keys.CONTROL_ENGINE, {"op": op, "args": dict(args or {})},
                                 settings().weight_sync_secret, destination=destination)
    replies = app.control.broadcast(
        keys.CONTROL_ENGINE,
        arguments=arguments,
        destination=destination,
        reply=True,
        timeout=timeout,
    )
    answers: dict[str, Any] = {}
    for reply in replies or []:
        answers.update(reply)
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for node, answer in answers.items():
        if node not in destination:
            continue
        if isinstance(answer, dict) and answer.get("ok") is True:
            results[node] = answer.get("result")
        elif isinstance(answer, dict) and "error" in answer:
            # Celery answers {"error": "No such command"} for an unknown command.
            errors[node] = str(answer["error"])
        else:
            errors[node] = f"unexpected reply {answer!r}"
    missing = [node for node in destination if node not in answers]
    if missing:
        raise ControlTimeout(f"{op} (timeout {timeout:g}s)", missing)
    if errors:
        raise ControlFailed(op, errors, results)
    return results


def sleep(
    level: int = 1,
    workers: Sequence[str] | None = None,
    *,
    pool: str | None = None,
    timeout: float = SLEEP_TIMEOUT,
) -> dict[str, Any]:
    """Put engines to sleep (level 1: offload weights, drop KV cache; level 2: drop both).

    The workers stop taking tasks until :func:`wake_up` (with ``kv_cache``).
    Needs workers started with ``--enable-sleep-mode`` on a backend that has it
    (CUDA, ROCm); others answer with an error naming the reason.
    """
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
    return engine_command("sleep", {"level": level}, workers=workers, pool=pool, timeout=timeout)


def wake_up(
    tags: Sequence[str] | None = None,
    workers: Sequence[str] | None = None,
    *,
    pool: str | None = None,
    timeout: float = SLEEP_TIMEOUT,
) -> dict[str, Any]:
    """Wake engines: ``tags=None`` wakes everything; ``["weights"]`` then ``["kv_cache"]``
    lets a weight sync land before the KV cache is reallocated. Workers take
    tasks again once their KV cache is awake."""
    args: dict[str, Any] = {"tags": list(tags) if tags is not None else None}
    return engine_command("wake_up", args, workers=workers, pool=pool, timeout=timeout)


def reset_prefix_cache(
    workers: Sequence[str] | None = None, *, pool: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> dict[str, Any]:
    """Drop every cached KV block (each worker answers whether the reset succeeded)."""
    return engine_command("reset_prefix_cache", workers=workers, pool=pool, timeout=timeout)


def world_size(
    workers: Sequence[str] | None = None, *, pool: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> int:
    """Total engine ranks of the targeted workers (what a weight sync's world adds up)."""
    replies = engine_command("world_size", workers=workers, pool=pool, timeout=timeout)
    return sum(int(ranks) for ranks in replies.values())


def engine_stats(
    workers: Sequence[str] | None = None, *, pool: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> dict[str, dict[str, Any]]:
    """Per worker: weight_version, state, in-flight and waiting requests, tok/s, KV usage..."""
    return engine_command("stats", workers=workers, pool=pool, timeout=timeout)


def pause(
    workers: Sequence[str] | None = None, *, pool: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> dict[str, Any]:
    """Stop intake: the workers stop consuming their queues (tasks in flight finish)."""
    return engine_command("pause", workers=workers, pool=pool, timeout=timeout)


def resume(
    workers: Sequence[str] | None = None, *, pool: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> dict[str, Any]:
    """Resume intake after :func:`pause`."""
    return engine_command("resume", workers=workers, pool=pool, timeout=timeout)
