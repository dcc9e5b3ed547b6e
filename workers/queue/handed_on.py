"""A worker declared dead that is still running: what it must not do once back.

A host cut from Redis for longer than the registry TTL plus the reaper's
grace is declared dead by the other workers: the reaper puts the messages it
held back in their queues, and another worker runs them. The cut-off worker
never stopped: its engine finishes those tasks while the link is down. When
the link returns it must not store their results (another worker's are, or
will be, the task's) nor ack their messages (the same delivery tag now names
the new holder's delivery: the ack would drop that worker's record, and its
task would be lost if it died too).

The reaper names each message it takes from a node in that node's
``rq:handed-on:<node>`` set (``workers.queue.reaper``). :class:`HandedOn` reads it:

* before a task starts (no wait: Redis away means nobody could have
  handed it on yet, as far as this worker can tell);
* after its generation ends, waiting for Redis (the result needs Redis
  anyway): a task handed on raises Celery's ``Ignore`` (no result stored),
  and its ack clears only this process's bookkeeping
  (``workers.queue.reliable_redis.FetchHooks.forget_on_ack``);
* every heartbeat (:meth:`notice`), and the first task that finds its tag
  there: a worker that finds the set logs that it was declared dead and how
  many tasks went on. Its heartbeat has already put
  it back in the registry, so it serves again.

The tasks' two reads are off the hot path while the heartbeat vouches for
them: no reaper hands on a message of this node while the node's registry
entry lives (nor for ``reap_grace_s`` after). A heartbeat read that finds the
set empty reads the entry's remaining TTL in the same round trip; until that
much time has passed, a task's check reads nothing. A heartbeat that fails
(Redis away) vouches for nothing, so a task that ends as the link returns
reads the set as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from celery.exceptions import Ignore

from rollout_queue.tasks import keys

log = logging.getLogger(__name__)

# As long as a worker waits for Redis to store a result (ClientSettings.result_store_timeout).
WAIT_FOR_REDIS_S = 300.0


class HandedOn:
    def __init__(
        self, client: redis.Redis, node: str, forget_on_ack: Callable[[str], None],
        wait_s: float = WAIT_FOR_REDIS_S,
    ) -> None:
        self.client = client
        # The transport's: the next ack of a tag only clears this process's bookkeeping.
        self.forget_on_ack = forget_on_ack
        self.node = node
        self.key = keys.handed_on(node)
        self.wait_s = wait_s
        self.seen = 0  # tags already reported by notice()
        # Until this time.monotonic(), nothing of this node can have been handed
        # on (the heartbeat found the set empty and the registry entry alive).
        self.clear_until = 0.0

    def check(self, task: Any, *, wait: bool) -> None:
        """Raise ``Ignore`` when the reaper handed ``task``'s message to another worker.

        ``wait``: read through a Redis outage (up to ``wait_s``); else a failed
        read counts as "not handed on".
        """
        # Celery's task context carries the message's properties, where kombu's
        # Redis transport keeps the delivery tag (not in ``delivery_info``).
        tag = (getattr(task.request, "properties", None) or {}).get("delivery_tag")
        if not tag or time.monotonic() < self.clear_until:
            return
        deadline = time.monotonic() + (self.wait_s if wait else 0.0)
        while True:
            try:
                handed_on = bool(self.client.sismember(self.key, tag))
                break
            except redis.RedisError:
                if time.monotonic() >= deadline:
                    return  # the result store that follows fails or succeeds on its own
                time.sleep(0.5)
        if not handed_on:
            return
        if not self.seen:  # say so now: tasks that end as the link returns can empty
            try:           # the set before a heartbeat reads it
                self._declared_dead(int(self.client.scard(self.key)))  # type: ignore[arg-type]
            except redis.RedisError:
                pass
        self.forget_on_ack(str(tag))
        try:
            self.client.srem(self.key, tag)
        except redis.RedisError:
            pass  # expires with the set
        log.warning(
            "task %s was handed to another worker while this one was cut off from Redis (declared dead); "
            "its result is not stored and its message not acked here", task.request.id,
        )
        raise Ignore()

    def notice(self) -> None:
        """Log once per new batch when the fleet declared this worker dead; vouch for the
        tasks' checks while this node's registry entry lives, when nothing was handed on."""
        read_at = time.monotonic()
        with self.client.pipeline(transaction=False) as pipe:
            pipe.scard(self.key)
            pipe.pttl(keys.worker_key(self.node))  # -2: no entry; -1: no TTL (not ours)
            count, entry_ms = (int(value) for value in pipe.execute())
        if count > self.seen:
            self._declared_dead(count)
        self.seen = count
        self.clear_until = read_at + entry_ms / 1000 if count == 0 and entry_ms > 0 else 0.0

    def _declared_dead(self, count: int) -> None:
        self.seen = count
        log.warning(
            "%s was declared dead while cut off from Redis: %d task(s) it held were handed to other "
            "workers; back in the registry, serving again", self.node, count,
        )
