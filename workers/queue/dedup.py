"""A finished task is never run again: deliveries of finished tasks are acked unrun.

A message can come back after its task finished: the worker stored the
result and died before its ack reached Redis (the reaper then restores the
message), a connection dropped between the two, or the visibility timeout
fired. Celery alone would run the task again. So every delivery of a
``generate`` task first reads the task's state in the result backend; when it
is final (``SUCCESS``, ``FAILURE``, ``REVOKED``), the message is acked without
running, one line is logged, and ``duplicate_deliveries`` counts it
(``rollout_queue_duplicate_deliveries_total`` on ``/metrics``).

The check is one ``GETRANGE`` of the stored result's first bytes: Celery
writes the state first (``{"status": ...``), and a compressed result is a
zlib stream whose prefix decompresses on its own, so the cost does not grow
with the result (a 512-prompt result with logprobs is megabytes). The
worker's fetch reads it in the same ``MULTI`` that records the message in
its ledger (``workers.queue.reliable_redis.FetchHooks.result_head``; the
broker and the result backend are one Redis), so the check costs no round
trip of its own; a delivery without it (that command failed) reads it here.
It runs in the consumer's event loop, before Celery's strategy builds the
request, so a duplicate never writes ``STARTED`` over the stored result either.

If the read fails (Redis away), the task runs: a duplicate run is better
than a lost task. ``workers.queue.delivery`` calls it for every delivery.
"""

from __future__ import annotations

import logging
import re
import threading
import zlib
from typing import Any

import redis
from celery import states
from celery.backends.base import COMPRESSED_PAYLOAD_MAGIC
from kombu.utils.encoding import bytes_to_str
from redis.exceptions import RedisError

from rollout_queue.tasks.registry import connect
from rollout_queue.tasks.settings import ClientSettings

log = logging.getLogger(__name__)

# Enough for the state and a compressed stream's header and first block.
HEAD_BYTES = 512
_STATUS = re.compile(rb'^\{\s*"status"\s*:\s*"([A-Z_]+)"')


def quick_client(settings: ClientSettings) -> redis.Redis:
    """A client for the check that gives up at once: it runs in the consumer's
    event loop, and the result backend's own client retries for as long as a
    result store may (a delivery read as Redis went down blocked the loop, so
    the worker did not notice the outage for over a minute)."""
    return connect(settings, connect_timeout=1, read_timeout=2, decode=False, give_up_at_once=True)


class DuplicateGuard:
    """Reads a task's stored state; counts the deliveries it refused to run."""

    def __init__(self, backend: Any, client: redis.Redis) -> None:
        self.backend = backend
        self.client = client
        self.duplicate_deliveries = 0
        self._lock = threading.Lock()

    def result_head(self, task_id: str) -> tuple[str, int]:
        """The key of ``task_id``'s stored result and how many bytes of it the check reads."""
        return bytes_to_str(self.backend.get_key_for_task(task_id)), HEAD_BYTES

    def stored_state(self, task_id: str, head: bytes | str | None = None) -> str | None:
        """The state stored for ``task_id``, or None when nothing is stored. ``head``: the
        result's first bytes, read already (``b""``: nothing stored); None: read them here."""
        if head is None:
            head = self.client.getrange(self.backend.get_key_for_task(task_id), 0, HEAD_BYTES - 1)
        if not head:
            return None
        state = status_of_head(head if isinstance(head, bytes) else head.encode())
        if state is None:  # an encoding this fast path does not read: decode it all
            raw = self.client.get(self.backend.get_key_for_task(task_id))
            meta = self.backend.decode_result(raw) if raw else {}
            state = str(meta.get("status") or "") or None
        return state

    def finished(self, task_id: str, head: bytes | str | None = None) -> str | None:
        """The final state stored for ``task_id``; None if it may run (also when Redis fails).
        ``head``: as :meth:`stored_state`'s."""
        try:
            state = self.stored_state(task_id, head)
        except (RedisError, OSError, ValueError) as exc:
            log.warning("could not read the state of task %s (%s); running it", task_id, exc)
            return None
        return state if state in states.READY_STATES else None

    def count(self) -> None:
        with self._lock:
            self.duplicate_deliveries += 1


def status_of_head(head: bytes) -> str | None:
    """The state a stored result starts with (compressed or not); None: unreadable."""
    if head.startswith(COMPRESSED_PAYLOAD_MAGIC):
        content_type, _, body = head[len(COMPRESSED_PAYLOAD_MAGIC):].partition(b"\x00")
        if content_type not in (b"application/x-gzip", b"application/x-zlib", b"zlib", b"gzip"):
            return None
        try:
            # wbits 47: zlib or gzip header, detected.
            head = zlib.decompressobj(wbits=47).decompress(body)
        except zlib.error:
            return None
    match = _STATUS.match(head)
    return match.group(1).decode() if match else None
