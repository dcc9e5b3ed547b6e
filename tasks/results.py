"""``ResultWatcher``: waits for many ``generate`` results on an event loop, no thread per task.

Shared by the gateway (``api.results``) and the asyncio client (``tasks.aio``).
Celery's Redis result backend stores a task's result under
``celery-task-meta-<task_id>`` and publishes the same payload on a channel of
that name. A watcher names its tasks ``<namespace>-<instance>-<uuid>``
(``api-…`` for the gateway, ``aio-…`` for the client), so one pattern
subscription (``celery-task-meta-<namespace>-<instance>-*``), made once at
start-up, brings every result of this watcher and nobody else's; no
per-task subscribe, no thread per waiting task. A slow poll (``MGET`` of
the pending keys) covers a message missed while the connection was down.
Results are decoded with the Celery backend's own decoder (compression,
serializer, exception rebuilding) and deleted once read, with the task's
abort set (``keys.abort_key``). A result nobody waits for any more (its
client went away, or the request timed out while a worker still ran it) is
deleted when it arrives: the watcher keeps watching for it for
``abandoned_ttl_s`` (the longest a task may still run), instead of leaving it
in Redis for ``RQ_RESULT_EXPIRES`` (6 h).

A result comes back as the task's ``GenerationResult`` dict; a failed task
raises its own error (``tasks.errors``, rebuilt as ``.get()`` rebuilds it), a
wait past its timeout ``ResultTimeout``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from celery import states
from redis.exceptions import RedisError

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import BrokerUnavailable, ResultTimeout
from rollout_queue.tasks.settings import redact_url

__all__ = ["ResultWatcher"]

log = logging.getLogger("rollout_queue.results")

# How long a closing watcher lets its deletes and aborts under way finish.
CLOSE_GRACE_S = 5.0


class ResultWatcher:
    """Waits for the results of the tasks it named (:meth:`new_task_id`).

    ``namespace`` starts its task ids; ``timeout_hint`` ends a ``ResultTimeout``'s
    message (what the waiter can do about it).
    """

    def __init__(
        self, redis_url: str, backend: Any, poll_s: float = 1.0, abandoned_ttl_s: float = 3600.0,
        *, namespace: str = "api", timeout_hint: str = "check that workers consume the task's queue "
        "(`rollout-queue status`)",
    ) -> None:
        self.namespace = namespace
        self.instance = uuid.uuid4().hex[:10]
        self._timeout_hint = timeout_hint
        self._url = redis_url
        self._backend = backend
        self._poll_s = poll_s
        self._abandoned_ttl_s = abandoned_ttl_s
        key_prefix = backend.task_keyprefix
        self._key_prefix = key_prefix.decode() if isinstance(key_prefix, bytes) else str(key_prefix)
        # Task id → its result's meta and when it was delivered (loop time).
        self._futures: dict[str, asyncio.Future[tuple[dict[str, Any], float]]] = {}
        # Tasks whose result nobody will read: task id → when to stop watching (loop time).
        self._abandoned: dict[str, float] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._watching: list[asyncio.Task[Any]] = []  # the listener and the poll
        self._redis: aioredis.Redis | None = None
        self._pubsub: Any = None

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        self._redis = aioredis.from_url(self._url, socket_connect_timeout=5, health_check_interval=10)
        self._pubsub = self._redis.pubsub()
        try:
            await self._pubsub.psubscribe(f"{self._key_prefix}{self.namespace}-{self.instance}-*")
        except (RedisError, OSError) as exc:
            await self._pubsub.aclose()
            await self._redis.aclose()
            raise BrokerUnavailable(
                f"could not subscribe to results at {redact_url(self._url)} "
                f"({type(exc).__name__}: {str(exc).strip()[:200]}); check REDIS_URL and that Redis is up"
            ) from exc
        self._watching = [self._spawn(self._listen()), self._spawn(self._poll())]

    async def close(self) -> None:
        for task in self._watching:
            task.cancel()
        # The deletes and aborts under way finish first (a result read just before
        # the close would stay in Redis for RQ_RESULT_EXPIRES); Redis gone, in time.
        under_way = self._background - set(self._watching)
        if under_way:
            await asyncio.wait(under_way, timeout=CLOSE_GRACE_S)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for future in self._futures.values():
            if not future.done():
                future.cancel()
        if self._pubsub is not None:
            await self._pubsub.aclose()
        if self._redis is not None:
            await self._redis.aclose()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # --------------------------------------------------------------- waiting

    def new_task_id(self) -> str:
        return f"{self.namespace}-{self.instance}-{uuid.uuid4().hex}"

    def expect(self, task_id: str) -> None:
        """Register interest in ``task_id`` before its task is sent (no lost result)."""
        self._futures[task_id] = asyncio.get_running_loop().create_future()

    def forget(self, task_id: str) -> None:
        """Stop waiting (the task was never sent)."""
        future = self._futures.pop(task_id, None)
        if future is not None and not future.done():
            future.cancel()

    async def result(self, task_id: str, timeout: float | None) -> dict[str, Any]:
        """The task's result (a ``GenerationResult`` dict); raises its error, or
        ``ResultTimeout`` after ``timeout`` s (None: wait as long as it takes)."""
        return await self._await(task_id, None, timeout)

    async def sent(self, task_id: str, send: Callable[[], object], timeout: float | None) -> dict[str, Any]:
        """Send the task ``task_id`` names (``send``: blocking, run in a thread) and
        return its result as :meth:`result` does, the send included in ``timeout``
        (a loaded host holds sends up). A send that fails raises its error."""
        self.expect(task_id)  # before the send: no result goes unseen
        return await self._await(task_id, send, timeout)

    async def _await(
        self, task_id: str, send: Callable[[], object] | None, timeout: float | None
    ) -> dict[str, Any]:
        """Wait for the result of ``task_id`` (after ``send``, if given) until ``timeout``.

        The result is returned if this watcher had it by the deadline, also when
        the send is still held up then; else ``ResultTimeout``, and the task is
        abandoned (its result deleted when it comes). A result read off the
        socket after the deadline is late, though it landed earlier while the
        event loop was held: the outcome does not hang on the order in which the
        loop's turns run after a hold (``asyncio.wait_for`` let such a result in)."""
        future = self._futures[task_id]
        due = None if timeout is None else asyncio.get_running_loop().time() + timeout
        deadline = asyncio.timeout_at(due)
        try:
            try:
                async with deadline:
                    if send is not None:
                        await asyncio.to_thread(send)
                    await future
            except TimeoutError:
                if not deadline.expired():
                    raise
            except asyncio.CancelledError:
                self._give_up(task_id, future)  # the client went away: its task ends without a reader
                raise
            meta = self._delivered_by(future, due)
            if meta is None:
                self._give_up(task_id, future)  # a worker may still be running it, or the send be under way
                raise self._timed_out(task_id, timeout)
        finally:
            self.forget(task_id)
        return self._outcome(task_id, meta, timeout)

    @staticmethod
    def _delivered_by(future: asyncio.Future[tuple[dict[str, Any], float]], due: float | None) -> dict[str, Any] | None:
        """The result in ``future`` if it was delivered by ``due`` (loop time), else None."""
        if not future.done() or future.cancelled():
            return None
        meta, delivered_at = future.result()
        return meta if due is None or delivered_at <= due else None

    def _give_up(self, task_id: str, future: asyncio.Future[Any]) -> None:
        """Nobody will read the task's result: it is deleted now if it came, else when it comes."""
        if future.done() and not future.cancelled():
            self._spawn(self._delete(task_id))
        else:
            self._abandon(task_id)

    def _timed_out(self, task_id: str, timeout: float | None) -> ResultTimeout:
        return ResultTimeout(f"no result for task {task_id} within {timeout:g}s; {self._timeout_hint}")

    def _outcome(self, task_id: str, meta: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """A ready task's result, or its error raised; its result key is deleted."""
        self._spawn(self._delete(task_id))
        status = meta["status"]
        if status == states.SUCCESS:
            result: dict[str, Any] = meta["result"]
            return result
        if status == states.REVOKED:
            # A call's task expires when its timeout does (``expires``): a worker that
            # fetched it later stores REVOKED, which can arrive before this wait ends
            # (its clock started after the publish). That is the call's timeout too.
            within = f"no result within {timeout:g}s: " if timeout is not None else ""
            raise ResultTimeout(f"{within}task {task_id} was revoked or expired before a worker served it")
        error = meta.get("result")
        if isinstance(error, BaseException):
            raise error
        raise RuntimeError(f"task {task_id} ended in state {status}: {error!r}")

    def abort(self, task_id: str, prompts: int, ttl_s: float) -> None:
        """Ask the task's worker to stop generating its ``prompts`` prompts (nobody will
        read them): their indices go to the task's abort set (``keys.abort_key``),
        which the running task reads; in the background, failures only logged."""
        self._spawn(self._abort(task_id, prompts, ttl_s))

    async def _abort(self, task_id: str, prompts: int, ttl_s: float) -> None:
        assert self._redis is not None
        key = keys.abort_key(task_id)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.sadd(key, *range(prompts))
                pipe.expire(key, max(1, int(ttl_s)))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("could not abort the %d prompt(s) of %s: %s", prompts, task_id, exc)

    @property
    def abandoned(self) -> int:
        """Results watched for only to be deleted."""
        return len(self._abandoned)

    def _abandon(self, task_id: str) -> None:
        self._abandoned[task_id] = asyncio.get_running_loop().time() + self._abandoned_ttl_s

    # ------------------------------------------------------------ background

    def _key(self, task_id: str) -> str:
        return f"{self._key_prefix}{task_id}"

    def _deliver(self, task_id: str, payload: Any) -> None:
        future = self._futures.get(task_id)
        abandoned = task_id in self._abandoned
        if (future is None or future.done()) and not abandoned:
            return
        meta = self._backend.decode_result(payload)
        if meta.get("status") not in states.READY_STATES:
            return
        if abandoned:
            del self._abandoned[task_id]
            self._spawn(self._delete(task_id))
        elif future is not None:
            future.set_result((meta, asyncio.get_running_loop().time()))

    async def _listen(self) -> None:
        prefix = len(self._key_prefix)
        while True:
            try:
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            except (RedisError, OSError) as exc:
                log.warning("result subscription lost (%s); reconnecting", exc)
                await asyncio.sleep(0.5)
                continue
            if message is None or message.get("type") != "pmessage":
                continue
            channel = message["channel"]
            channel = channel.decode() if isinstance(channel, bytes) else channel
            try:
                self._deliver(channel[prefix:], message["data"])
            except Exception:  # one undecodable result must not stop the listener
                log.exception("could not decode the result on %s", channel)

    async def _poll(self) -> None:
        assert self._redis is not None
        while True:
            await asyncio.sleep(self._poll_s)
            now = asyncio.get_running_loop().time()
            for task_id, until in list(self._abandoned.items()):
                if until < now:  # it never ended (lost); its result, if any, expires
                    del self._abandoned[task_id]
            pending = [task_id for task_id, f in self._futures.items() if not f.done()]
            pending += list(self._abandoned)
            if not pending:
                continue
            try:
                values = await self._redis.mget([self._key(t) for t in pending])
            except (RedisError, OSError) as exc:
                log.warning("could not poll %d pending results: %s", len(pending), exc)
                continue
            for task_id, value in zip(pending, values):
                if value is not None:
                    try:
                        self._deliver(task_id, value)
                    except Exception:
                        log.exception("could not decode the result of %s", task_id)

    async def _delete(self, task_id: str) -> None:
        """Delete a read (or abandoned) result and the task's abort set, if it has one."""
        assert self._redis is not None
        try:
            await self._redis.delete(self._key(task_id), keys.abort_key(task_id))
        except (RedisError, OSError):
            pass  # they expire anyway (result_expires; the abort set sooner)
