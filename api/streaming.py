"""``StreamRelay``: a ``stream: true`` request's tokens, from the worker as they come.

A streamed request is sent as a task of its own with the ``rq_stream``
header (``tasks.streaming``): its worker publishes delta outputs to the
task's Redis Stream, and the relay reads them with ``XREAD BLOCK`` and
yields each ``SampleDelta`` at once; then the final result, which the
``ResultWatcher`` brings as for any task (usage, rollout info). Streamed
requests do not share tasks: a task streams to one reader.

The relay never hangs: a failed task ends it with the task's error, and
while the stream is idle it checks the registry entry of the worker serving
the task (``StreamFollower.worker_gone``). A reader that stops early (the
client went away) has the task's prompts aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rollout_queue.api.batcher import Share
from rollout_queue.api.results import ResultWatcher
from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import BrokerUnavailable, GatewaySaturated
from rollout_queue.tasks.schemas import PromptKind, SampleDelta, SamplingParams
from rollout_queue.tasks.streaming import IDLE_CHECK_S, StreamFollower

log = logging.getLogger("rollout_queue.api")

# (prompts, params, task_id, expires_s) -> None; sends one streamed generate task.
# (prompts, params, task_id, expires_s, queue) -> None
StreamSender = Callable[[list[Any], SamplingParams, str, float, str | None], None]
Aborter = Callable[[str, list[int]], Awaitable[None]]


class StreamRelay:
    def __init__(
        self,
        redis_url: str,
        send: StreamSender,
        abort: Aborter,
        watcher: ResultWatcher,
        *,
        timeout_s: float,
        max_streams: int,
    ) -> None:
        self._url = redis_url
        self._send = send
        self._abort = abort
        self._watcher = watcher
        self.timeout_s = timeout_s
        self.max_streams = max_streams
        self.open_streams = 0
        self._redis: aioredis.Redis | None = None
        self._cleanups: set[asyncio.Task[None]] = set()

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            # Each reading stream holds a connection while its XREAD blocks.
            self._redis = aioredis.from_url(
                self._url, socket_connect_timeout=5, socket_timeout=IDLE_CHECK_S + 10
            )
        return self._redis

    async def close(self) -> None:
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()

    async def relay(
        self, kind: PromptKind, prompts: list[Any], params: SamplingParams, queue: str | None = None,
    ) -> AsyncIterator[SampleDelta | Share]:
        """Send the task (to ``queue``; None: the gateway's); yield its deltas as they come,
        then its ``Share`` (whole result)."""
        if self.open_streams >= self.max_streams:
            raise GatewaySaturated(
                f"the gateway has {self.max_streams} streams open (API_MAX_INFLIGHT_TASKS); retry later"
            )
        self.open_streams += 1
        task_id = self._watcher.new_task_id()
        follower = StreamFollower(task_id)
        self._watcher.expect(task_id)
        result: asyncio.Task[Any] | None = None
        try:
            try:
                await asyncio.to_thread(self._send, prompts, params, task_id, self.timeout_s, queue)
            except BaseException:
                self._watcher.forget(task_id)
                raise
            result = asyncio.ensure_future(self._watcher.wait(task_id, self.timeout_s))
            async for delta in self._follow(follower, result):
                yield delta
            outcome = await result
            yield Share(
                outputs=outcome.outputs, task_id=task_id, signature=outcome.signature,
                weight_version=outcome.weight_version, worker=outcome.worker,
                batch_prompts=len(prompts),
            )
        finally:
            # No await here: a client that went away cancels this generator's
            # scope, which would cancel every await again; the cleanup runs as
            # a task of its own.
            self.open_streams -= 1
            abandoned = result is not None and not result.done()
            if result is not None and not result.done():
                result.cancel()
            self._spawn(self._cleanup(task_id, len(prompts) if abandoned else 0))

    async def _cleanup(self, task_id: str, abandoned_prompts: int) -> None:
        """Abort the prompts of a stream given up before its end (frees the engine); drop the stream."""
        if abandoned_prompts:
            try:
                await self._abort(task_id, list(range(abandoned_prompts)))
            except Exception as exc:  # noqa: BLE001  the task then runs to its end; nothing else breaks
                log.warning("could not abort the abandoned stream %s: %s", task_id, exc)
        with contextlib.suppress(RedisError, OSError):
            await self._client().delete(keys.token_stream(task_id))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _follow(self, follower: StreamFollower, result: asyncio.Task[Any]) -> AsyncIterator[SampleDelta]:
        """Deltas until the stream's end, or the result if the stream stops short of it."""
        client = self._client()
        key = keys.token_stream(follower.task_id)
        while not follower.ended:
            try:
                read: Any = await client.xread({key: follower.last_id}, block=int(IDLE_CHECK_S * 1000))
            except (RedisError, OSError) as exc:
                raise BrokerUnavailable(f"could not read the token stream of {follower.task_id}: {exc}") from exc
            entries = read[0][1] if read else []
            for entry_id, fields in entries:
                for delta in follower.feed(entry_id, fields):
                    yield delta
            if entries:
                continue
            if result.done():
                return  # failed (the caller raises it), or no end event was written
            if follower.worker is not None and not await client.exists(keys.worker_key(follower.worker)):
                follower.worker_gone()
