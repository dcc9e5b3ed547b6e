"""The worker's result backend: Celery's Redis backend, for which Redis full is an outage.

Redis past its ``maxmemory`` (policy ``noeviction``) refuses a result's
``SET`` with ``OutOfMemoryError``; Celery's backend retries only connection
errors, so the result was lost (the task's message then came back and ran
again). Here it is retried as a lost connection is: with the backend's
retry policy (about ``RQ_RESULT_STORE_TIMEOUT`` seconds, backing off up to
1 s between tries), and the log says Redis is full rather than that its
connection was lost. Selected by the worker (:func:`backend_url`).

Celery's backend reads a task's stored state before every write, so that
nothing replaces a ``SUCCESS``: a round trip (and a decode) before the
write. Here a ``SUCCESS`` is written without it: a worker stores one only at
the end of a ``generate`` task's run, after its handed-on check (a task the
fleet handed to another worker while this one was cut off is dropped
unstored, ``workers.queue.handed_on``), and a delivery of a task already
finished is acked unrun (``workers.queue.dedup``); what the read still
guarded, two runs of one task at once, ends with either run's result. Every
other state (``FAILURE``, ``RETRY``, ``REVOKED``, ``STARTED``) is read
first, as Celery does: none may replace a ``SUCCESS``.

A traced task's result (``tasks.trace``) gets its ``storing`` stamp here, as
the backend begins to encode and write it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str
from redis.exceptions import OutOfMemoryError

log = logging.getLogger(__name__)


def backend_url(redis_url: str) -> str:
    """``result_backend`` for a worker on ``redis_url``: this backend, that server."""
    return f"{__name__}:ResultBackend+{redis_url}"


class ResultBackend(RedisBackend):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        errors: tuple[type[BaseException], ...] = tuple(getattr(self, "connection_errors", ()))
        self.connection_errors = (*errors, OutOfMemoryError)

    def store_result(self, task_id: str, result: Any, state: str, *args: Any, **kwargs: Any) -> Any:
        traced = result.get("trace") if isinstance(result, dict) else None
        if isinstance(traced, dict):
            traced["storing"] = time.time()
        return super().store_result(task_id, result, state, *args, **kwargs)

    def _store_result(self, task_id: str, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        if state != states.SUCCESS:
            return super()._store_result(task_id, result, state, traceback, request, **kwargs)
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        try:
            self._set_with_state(self.get_key_for_task(task_id), self.encode(meta), state)
        except BackendStoreError as exc:
            raise BackendStoreError(str(exc), state=state, task_id=task_id) from exc
        return result

    def on_connection_error(self, max_retries: int | None, exc: Exception, intervals: Any,
                            retries: int) -> float:
        if not isinstance(exc, OutOfMemoryError):
            return float(super().on_connection_error(max_retries, exc, intervals, retries))
        pause = float(next(intervals))
        why = str(exc).rsplit("caused error: ", 1)[-1].strip()  # not the pipeline's whole command
        log.error("Redis is full (%s): a result write was refused; retry %d/%s in %.1f s (free memory "
                  "in Redis or raise its maxmemory)", why, retries, max_retries or "inf", pause)
        return pause
