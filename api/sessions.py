"""Sticky sessions: a conversation's next turn goes to the worker that served its last.

A request names its session with the ``X-Session-ID`` header or OpenAI's
``user`` field. After a turn, ``served`` records which worker answered it
(``keys.session_key``, expiring after ``keys.SESSION_TTL_S`` of quiet), if
that worker runs sticky sessions (consumes its own queue, as its registry
entry says): a worker without them could never be sent the next turn, so no
key is written (a gateway in front of workers without ``--sticky-sessions``
keeps no session state at all, however many sessions its clients name). The
next turn goes to that worker's own queue (``keys.node_queue``: workers
started with ``--sticky-sessions``), where its prefix cache still holds the
conversation. It goes to the shared queue instead when that worker is gone
from the registry, is not serving (syncing, fenced, paused), does not consume
its own queue, or is over its capacity (requests waiting in its engine: its
running batch is full). A turn sent to a worker that dies before taking it is
moved back to the shared queue by the reaper (``FALLBACK_QUEUE_HEADER``).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import redis.asyncio as aioredis
from pydantic import ValidationError

from rollout_queue.tasks import keys
from rollout_queue.tasks.schemas import WorkerInfo

log = logging.getLogger("rollout_queue.api")

Route = Literal["new", "sticky", "shared"]


class Sessions:
    def __init__(self, redis_url: str, shared_queue: str, ttl_s: int = keys.SESSION_TTL_S) -> None:
        self._url = redis_url
        self._client: aioredis.Redis | None = None
        self.shared_queue = shared_queue
        self.ttl_s = ttl_s

    def _redis(self) -> aioredis.Redis:
        if self._client is None:
            self._client = aioredis.from_url(self._url, socket_connect_timeout=5, decode_responses=True)
        return self._client

    async def queue_for(self, session: str | None) -> tuple[str, Route]:
        """The queue this turn goes to, and why (``new``: no earlier turn known)."""
        if not session:
            return self.shared_queue, "new"
        try:
            found = await self._redis().get(keys.session_key(session))
            if found is None:
                return self.shared_queue, "new"
            node = str(found)
            raw = await self._redis().get(keys.worker_key(node))
        except aioredis.RedisError as exc:  # the shared queue still serves it
            log.warning("could not read session %s's worker: %s", session[:32], exc)
            return self.shared_queue, "shared"
        own = keys.node_queue(node)
        try:
            info = WorkerInfo.model_validate_json(raw) if raw else None
        except ValidationError:
            info = None
        if (info is None or not info.live_at(time.time()) or info.state != "serving"
                or own not in info.queues or self.shared_queue not in info.queues or info.waiting_requests > 0):
            return self.shared_queue, "shared"
        return own, "sticky"

    async def served(self, session: str | None, worker: str) -> None:
        """Remember the worker that answered this session's turn, if it runs sticky sessions.

        ``worker``: the node, or several comma-joined (a split request): the first is kept.
        """
        if not session:
            return
        node = worker.split(",")[0]
        try:
            raw = await self._redis().get(keys.worker_key(node))
            if not _runs_sticky_sessions(node, raw):
                return
            await self._redis().set(keys.session_key(session), node, ex=self.ttl_s)
        except aioredis.RedisError as exc:
            log.warning("could not record session %s's worker: %s", session[:32], exc)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _runs_sticky_sessions(node: str, registry_entry: str | bytes | None) -> bool:
    """Whether the worker consumes its own queue (``--sticky-sessions``), per its registry entry."""
    if not registry_entry:
        return False
    try:
        info = WorkerInfo.model_validate_json(registry_entry)
    except ValidationError:
        return False
    return keys.node_queue(node) in info.queues
