"""The kombu Redis transport of producers (and, below the worker's own, of workers).

kombu's Redis channel makes a new ``redis.Redis`` client for every command
it sends outside its fetch (``conn_or_acquire``): each task's ``LPUSH`` and
``task-sent`` event on a producer, each ledger record, ack and task event on
a worker. A client is cheap to use but not to make (redis-py builds its
table of ~170 response callbacks each time: 0.1-0.2 ms on the CPU test
machine, two per ``apply_async``, five per task on a worker). This channel
makes one per connection pool and uses it for each of those commands; the
pool still hands each command a connection, so threads share the client as
they share the pool. A new pool (kombu makes one after a reconnect) gets a
new client.

Selected by :func:`tasks.app.celery_config` (``broker_transport``); the
worker's ``workers.queue.reliable_redis`` transport builds on this one.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    _rq_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the fetch's client: kombu keeps it (Channel.client)
            return super()._create_client(asynchronous=True)
        client = self._rq_client
        if client is None or client.connection_pool is not self.pool:
            client = self._rq_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel


# ``broker_transport``, by the name kombu shows in URLs (``rq-redis-client://:**@host``).
TRANSPORT = "rq-redis-client"
TRANSPORT_ALIASES[TRANSPORT] = f"{__name__}:Transport"
