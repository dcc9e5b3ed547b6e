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
guarded, two runs of one task at once, ends with either run's result.

Every other state (``FAILURE``, ``RETRY``, ``REVOKED``, ``STARTED``) may not
replace a ``SUCCESS``. Celery reads the state, then writes: two round trips,
and the write alone is what its retries (``ensure``) and redis-py's
(``retry_on_timeout``) send again. A worker cut off from Redis just as it
stored a task's ``STARTED`` sent that write again once its link was back,
after the worker the task had been handed to had stored its ``SUCCESS``: the
task stayed ``STARTED`` for good (its first run, handed on, stores nothing).
Here the read and the write are one optimistic transaction (``WATCH``, read,
``MULTI``/``EXEC``), and what is retried is the whole transaction: the state
is read again each time. redis-py does not resend a transaction whose
connection failed while it watched; a key changed between read and write
fails the ``EXEC``, and the transaction runs again.

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
from redis.exceptions import OutOfMemoryError, WatchError

log = logging.getLogger(__name__)

# Transactions of one non-final write whose key changed under them before it gives up.
WATCHED_ATTEMPTS = 10


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
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        key, value = self.get_key_for_task(task_id), self.encode(meta)
        try:
            if state == states.SUCCESS:
                self._set_with_state(key, value, state)
            else:
                if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
                    raise BackendStoreError("value too large for Redis backend")
                expires = self.failure_expires if state == states.FAILURE else None
                self.ensure(self._set_unless_succeeded, (key, value, expires))
        except BackendStoreError as exc:
            raise BackendStoreError(str(exc), state=state, task_id=task_id) from exc
        return result

    def _set_unless_succeeded(self, key: str, value: Any, expires: Any = None) -> bool:
        """Celery's ``_set`` (the value, its expiry, its publish) unless ``key`` holds a
        ``SUCCESS``, read and written in one transaction; whether it was written."""
        if expires is None:
            expires = self.expires
        attempts = 0
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    current = pipe.get(key)
                    if current is not None and self.decode(current).get("status") == states.SUCCESS:
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.set(key, value, ex=expires or None)
                    pipe.publish(key, value)
                    pipe.execute()
                    return True
                except WatchError:
                    # Changed under the transaction, or its connection failed while it
                    # watched (a connection error now reaches ``ensure``): read again.
                    attempts += 1
                    if attempts == WATCHED_ATTEMPTS:
                        raise
                    pipe.reset()

    def on_connection_error(self, max_retries: int | None, exc: Exception, intervals: Any,
                            retries: int) -> float:
        if not isinstance(exc, OutOfMemoryError):
            return float(super().on_connection_error(max_retries, exc, intervals, retries))
        pause = float(next(intervals))
        why = str(exc).rsplit("caused error: ", 1)[-1].strip()  # not the pipeline's whole command
        log.error("Redis is full (%s): a result write was refused; retry %d/%s in %.1f s (free memory "
                  "in Redis or raise its maxmemory)", why, retries, max_retries or "inf", pause)
        return pause
