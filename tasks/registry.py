"""Reading the worker registry and the fleet's weight version from Redis.

Workers write their ``WorkerInfo`` under ``rq:worker:<node>`` with a TTL
refreshed by a heartbeat (``workers.heartbeat``); a worker whose key expired
is gone. Producers, the trainer and ``rollout-queue status`` read it here.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tasks import keys
from tasks.errors import BrokerUnavailable
from tasks.schemas import WorkerInfo
from tasks.settings import ClientSettings


def connect(
    settings: ClientSettings,
    *,
    connect_timeout: float = 5,
    read_timeout: float = 30,
    decode: bool = True,
    give_up_at_once: bool = False,
) -> redis.Redis:
    """A client for ``settings.redis_url``. ``give_up_at_once`` turns off
    redis-py's retries, for callers that must not block: the duplicate check
    runs in a worker's consumer loop (``workers.dedup``)."""
    from tasks.app import redis_tls_options

    retry = {"retry": Retry(NoBackoff(), 0)} if give_up_at_once else {}
    return redis.Redis.from_url(
        settings.redis_url.get_secret_value(),
        socket_connect_timeout=connect_timeout,
        socket_timeout=read_timeout,
        health_check_interval=0 if give_up_at_once else 10,
        decode_responses=decode,
        **retry,
        **(redis_tls_options(settings) or {}),
    )


def live_workers(client: redis.Redis, pool: str | None = None) -> list[WorkerInfo]:
    """Every worker (of ``pool``, if given) whose heartbeat has not expired."""
    try:
        names = sorted(client.scan_iter(match=keys.WORKER_KEY_PATTERN, count=500))
        values: list[Any] = client.mget(names) if names else []
    except redis.RedisError as exc:
        raise BrokerUnavailable(f"could not read the worker registry: {exc}") from exc
    workers = [WorkerInfo.model_validate_json(v) for v in values if v]
    return [w for w in workers if pool is None or w.pool == pool]


def fleet_version(client: redis.Redis, pool: str = keys.DEFAULT_POOL) -> int:
    try:
        value = client.get(keys.fleet_version(pool))
    except redis.RedisError as exc:
        raise BrokerUnavailable(f"could not read the fleet weight version: {exc}") from exc
    return int(value) if value else 0


def eviction_warning(client: redis.Redis) -> str | None:
    """What is wrong if Redis may evict keys (a ``maxmemory-policy`` other than
    ``noeviction`` with a ``maxmemory`` set): an evicted queue, ``unacked`` entry or
    result is a lost task. None when it cannot (or INFO cannot be read)."""
    try:
        memory = client.info("memory")
    except redis.RedisError:
        return None
    policy, limit = memory.get("maxmemory_policy", "noeviction"), int(memory.get("maxmemory") or 0)
    if policy == "noeviction" or limit == 0:
        return None
    return (f"Redis may evict keys when full (maxmemory {memory.get('maxmemory_human', limit)}, "
            f"maxmemory-policy {policy}): an evicted queue, unacked entry or result is a lost task; "
            "run it with maxmemory-policy noeviction (docs/RELIABILITY.md, \"Running Redis for this\")")


def queue_depths(client: redis.Redis, queues: list[str]) -> dict[str, int]:
    return {queue: int(client.llen(queue)) for queue in queues}
