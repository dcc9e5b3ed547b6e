"""Following a streamed ``generate`` task's tokens as they are generated.

A task sent with the ``rq_stream`` header has its worker publish incremental
outputs (vLLM's delta output kind) to a Redis Stream per task
(``keys.token_stream``), as ``StreamEvent`` entries: ``start`` (which worker,
which attempt), ``delta`` (the new text and tokens of the task's samples
since the worker's previous write: one event carries the deltas of many
prompts, in the order they were generated), ``end``.
The final ``GenerationResult`` still goes to the result backend. Tasks sent
without the header publish nothing (streaming costs nothing unless asked for).

``StreamFollower`` is the reader's state, shared by the Python producer
(:func:`stream`, ``generate.stream(prompts, params)``) and the gateway
(``api.streaming``). A stream never hangs on a dead worker: while it is idle
the reader checks the task's state (a failure ends the stream with the
task's error) and the registry entry of the worker that started it (gone
after tokens were delivered: ``StreamInterrupted``; gone before: the task is
redelivered and its next attempt streams from the start).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import redis
from celery import states
from celery.result import AsyncResult

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import BrokerUnavailable, ResultTimeout, StreamInterrupted
from rollout_queue.tasks.schemas import GenerationResult, SampleDelta, SamplingParams, StreamEvent

STREAM_HEADER = "rq_stream"
# How long one XREAD blocks before the reader checks the task and its worker:
# the bound on how late a dead worker or a failed task is noticed, beyond the
# registry's own heartbeat expiry.
IDLE_CHECK_S = 1.0


class StreamFollower:
    """Turns a task's stream entries into deltas, in order; raises when they cannot go on."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.last_id = "0-0"
        self.attempt: str | None = None
        self.worker: str | None = None
        self.delivered = 0  # deltas handed on, over every attempt
        self.ended = False
        self._next_seq = 0

    def feed(self, entry_id: str, fields: Mapping[Any, Any]) -> list[SampleDelta]:
        """One stream entry → the deltas it carries (none for ``start`` / ``end``)."""
        self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        raw = fields.get("event", fields.get(b"event"))
        event = StreamEvent.model_validate_json(raw)
        if event.kind == "start":
            if self.delivered:
                raise StreamInterrupted(
                    f"task {self.task_id} started again on {event.worker} after {self.delivered} "
                    f"deltas had come from {self.worker} (its worker was lost or the task was "
                    "retried); tokens already delivered cannot be taken back: send the request again"
                )
            self.attempt, self.worker, self._next_seq = event.attempt, event.worker, event.seq + 1
            return []
        if event.attempt != self.attempt:
            return []  # an earlier attempt's late entry
        if event.seq != self._next_seq:
            raise StreamInterrupted(
                f"task {self.task_id}'s stream skipped from event {self._next_seq} to {event.seq}: "
                f"the reader fell more than {keys.TOKEN_STREAM_MAXLEN} events behind"
            )
        self._next_seq += 1
        if event.kind == "end":
            self.ended = True
            return []
        self.delivered += len(event.deltas)
        return event.deltas

    def worker_gone(self) -> None:
        """The worker that started the task left the registry (heartbeat expired)."""
        if self.delivered:
            raise StreamInterrupted(
                f"worker {self.worker} stopped (its heartbeat expired) while streaming task "
                f"{self.task_id}, after {self.delivered} deltas; send the request again"
            )
        # Nothing delivered: the reaper redelivers the task; follow its next attempt.
        self.attempt = self.worker = None


def stream(
    task: Any,
    prompts: Any,
    params: SamplingParams | Mapping[str, Any] | None = None,
    *,
    timeout: float = 3600.0,
    **options: Any,
) -> Iterator[SampleDelta | GenerationResult]:
    """Send one streamed task; yield its ``SampleDelta`` s as they come, then its result.

    ``timeout``: seconds for the whole generation (``ResultTimeout`` past it).
    ``options`` are ``apply_async`` options (queue, time limits...). The task
    is never split (it has a task id of its own). Raises the task's error if it
    fails, ``StreamInterrupted`` if its worker dies after tokens were delivered.
    """
    from rollout_queue.tasks.app import settings
    from rollout_queue.tasks.registry import connect

    task_id = options.pop("task_id", None) or f"stream-{uuid.uuid4().hex}"
    headers = {**(options.pop("headers", None) or {}), STREAM_HEADER: True}
    client = connect(settings())
    result: AsyncResult = task.apply_async((prompts, params), task_id=task_id, headers=headers, **options)
    follower = StreamFollower(task_id)
    key = keys.token_stream(task_id)
    deadline = time.monotonic() + timeout
    try:
        while not follower.ended:
            if time.monotonic() > deadline:
                raise ResultTimeout(f"streamed task {task_id} did not finish within {timeout:g}s")
            try:
                read: Any = client.xread({key: follower.last_id}, block=int(IDLE_CHECK_S * 1000))
            except redis.RedisError as exc:
                raise BrokerUnavailable(f"could not read the token stream of {task_id}: {exc}") from exc
            entries = read[0][1] if read else []
            for entry_id, fields in entries:
                yield from follower.feed(entry_id, fields)
            if entries:
                continue
            state = result.state
            if state in states.READY_STATES:
                break  # failed (raised below), or finished with no end event written
            if follower.worker is not None and not client.exists(keys.worker_key(follower.worker)):
                follower.worker_gone()
        final = result.get(timeout=max(1.0, deadline - time.monotonic()), propagate=True)
        result.forget()  # read once, here: do not leave it in the backend
        yield GenerationResult.model_validate(final)
    except BaseException:
        # Nobody reads this task any more: its worker skips or aborts every prompt.
        if not follower.ended:
            _abort_all(client, task_id, len(prompts) if isinstance(prompts, list) else 1)
        raise
    finally:
        try:
            client.delete(key)
        except redis.RedisError:
            pass  # it expires anyway (keys.TOKEN_STREAM_TTL_S)
        client.close()


def _abort_all(client: redis.Redis, task_id: str, prompts: int) -> None:
    """Mark every prompt of ``task_id`` abandoned (``keys.abort_key``), best effort."""
    key = keys.abort_key(task_id)
    try:
        client.sadd(key, *range(prompts))
        client.expire(key, keys.TOKEN_STREAM_TTL_S)
    except redis.RedisError:
        pass
