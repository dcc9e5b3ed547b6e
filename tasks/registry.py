"""Reading the worker registry and the fleet's weight version from Redis.

Workers write their ``WorkerInfo`` under ``rq:worker:<node>`` with a TTL
refreshed by a heartbeat (``workers.node.runtime``), and their name into the
set ``rq:workers`` (``keys.WORKERS``); a worker whose key expired is gone.
Producers, the trainer and ``rollout-queue status`` read it here: the set's
names, then their entries, in one script (one round trip), never a ``SCAN``
of the keyspace.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import BrokerUnavailable, RedisMayEvict
from rollout_queue.tasks.schemas import WorkerInfo
from rollout_queue.tasks.settings import ClientSettings


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
    runs in a worker's consumer loop (``workers.queue.dedup``)."""
    from rollout_queue.tasks.app import redis_tls_options

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


# The registry's entries, by name (sorted), in one round trip: the set's names,
# then their keys in MGETs of at most 1,000 (Lua's unpack has a stack limit).
# KEYS[1]: ``keys.WORKERS``; ARGV[1]: the entries' prefix.
ENTRIES_SCRIPT = """
local names = redis.call('SMEMBERS', KEYS[1])
table.sort(names)
local entries = {}
for first = 1, #names, 1000 do
  local batch = {}
  for i = first, math.min(first + 999, #names) do
    batch[#batch + 1] = ARGV[1] .. names[i]
  end
  for _, entry in ipairs(redis.call('MGET', unpack(batch))) do
    entries[#entries + 1] = entry
  end
end
return entries
"""


def live_workers(client: redis.Redis, pool: str | None = None) -> list[WorkerInfo]:
    """Every worker (of ``pool``, if given) whose heartbeat has not expired."""
    try:
        values: list[Any] = read_entries(client)
    except redis.RedisError as exc:
        raise BrokerUnavailable(f"could not read the worker registry: {exc}") from exc
    return workers_of(values, pool)


def read_entries(client: Any) -> Any:
    """The registry's entries (``ENTRIES_SCRIPT``), on ``client`` or queued in a pipeline:
    what ``workers_of`` reads."""
    return client.eval(ENTRIES_SCRIPT, 1, keys.WORKERS, keys.WORKER_KEY_PREFIX)


def workers_of(values: list[Any], pool: str | None = None) -> list[WorkerInfo]:
    """The workers (of ``pool``, if given) in the entries ``read_entries`` read."""
    workers = [WorkerInfo.model_validate_json(v) for v in values if v]
    return [w for w in workers if pool is None or w.pool == pool]


def write_entry(client: redis.Redis, node: str, entry: str, ttl_ms: int) -> None:
    """A worker's heartbeat: its entry (``WorkerInfo`` JSON) for ``ttl_ms``, and its
    name in ``keys.WORKERS`` after it (``PRUNE_SCRIPT``), in one round trip."""
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.worker_key(node), entry, px=ttl_ms)
    pipe.sadd(keys.WORKERS, node)
    _execute(pipe)


def remove_entry(client: redis.Redis, node: str) -> None:
    """A worker leaving: its entry and its name."""
    pipe = client.pipeline(transaction=False)
    pipe.delete(keys.worker_key(node))
    pipe.srem(keys.WORKERS, node)
    _execute(pipe)


def _execute(pipe: Any) -> None:
    """Run ``pipe``; its first error raised as the command alone would raise it
    (redis-py's own raise prefixes the pipeline's commands to the message)."""
    for reply in pipe.execute(raise_on_error=False):
        if isinstance(reply, redis.RedisError):
            raise reply


# Drop from the set the names whose entry is gone, in one step: a worker that
# writes its entry again (SET, then SADD) is never left out.
PRUNE_SCRIPT = """
local pruned = 0
for _, node in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. node) == 0 then
    redis.call('SREM', KEYS[1], node)
    pruned = pruned + 1
  end
end
return pruned
"""


def prune_workers(client: redis.Redis) -> int:
    """Remove the names of workers whose registry entry expired from ``keys.WORKERS``."""
    return int(client.eval(PRUNE_SCRIPT, 1, keys.WORKERS, keys.WORKER_KEY_PREFIX))


def fleet_version(client: redis.Redis, pool: str = keys.DEFAULT_POOL) -> int:
    try:
        value = client.get(keys.fleet_version(pool))
    except redis.RedisError as exc:
        raise BrokerUnavailable(f"could not read the fleet weight version: {exc}") from exc
    return int(value) if value else 0


def eviction_policy(client: redis.Redis) -> str | None:
    """Redis's ``maxmemory-policy`` (INFO, else CONFIG GET), or None when the server
    answers neither (a managed Redis may disable both). Connection errors propagate."""
    try:
        policy = client.info("memory").get("maxmemory_policy")
    except redis.ResponseError:
        policy = None
    if policy is None:
        try:
            policy = (client.config_get("maxmemory-policy") or {}).get("maxmemory-policy")
        except redis.ResponseError:
            return None
    return policy.decode() if isinstance(policy, bytes) else None if policy is None else str(policy)


def check_eviction_policy(client: redis.Redis, *, allow: bool) -> str | None:
    """Refuse a Redis that may evict keys (an evicted queue, ``unacked`` entry or result
    is a lost task): raise ``RedisMayEvict`` unless its ``maxmemory-policy`` is
    ``noeviction`` or ``allow`` (``RQ_ALLOW_EVICTING_REDIS``) is set.

    Returns a line to log when going on anyway (``allow``, or a policy that could not
    be read: a managed Redis that disables INFO and CONFIG is not blocked), else None.
    Connection errors propagate (the caller's own error for an unreachable Redis)."""
    policy = eviction_policy(client)
    if policy is None:
        return ("could not read Redis's maxmemory-policy (INFO and CONFIG GET refused); going on: "
                "make sure it is noeviction, or queued tasks may be evicted when Redis is full")
    if policy == "noeviction":
        return None
    if allow:
        return (f"Redis's maxmemory-policy is {policy}, not noeviction: it may evict queued tasks, "
                "unacked entries and results when full (going on: RQ_ALLOW_EVICTING_REDIS is set)")
    raise RedisMayEvict(
        f"Redis's maxmemory-policy is {policy}: when full it would evict queued tasks, unacked "
        "entries and results; set it to noeviction (CONFIG SET maxmemory-policy noeviction, or "
        "--maxmemory-policy noeviction), or accept the risk with RQ_ALLOW_EVICTING_REDIS=1 "
        "(--allow-evicting-redis)"
    )


def preflight(settings: ClientSettings) -> str | None:
    """A worker's or the gateway's check before it starts: Redis answers within
    ``broker_connect_timeout`` (else ``BrokerUnavailable``) and may not evict keys
    (``check_eviction_policy``; returns its line to log)."""
    import time

    client = connect(settings, connect_timeout=2, read_timeout=10)
    deadline = time.monotonic() + settings.broker_connect_timeout
    try:
        while True:
            try:
                client.ping()
                return check_eviction_policy(client, allow=settings.allow_evicting_redis)
            except redis.AuthenticationError as exc:
                raise BrokerUnavailable(
                    f"Redis at {settings.redacted_url} refused this client ({exc}); check the "
                    "password in RQ_REDIS_URL / REDIS_URL"
                ) from exc
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    raise BrokerUnavailable(
                        f"Redis at {settings.redacted_url} did not answer for "
                        f"{settings.broker_connect_timeout:g} s ({type(exc).__name__}: {exc}); check "
                        "RQ_REDIS_URL / REDIS_URL and that Redis is up"
                    ) from exc
                time.sleep(0.5)
            except redis.RedisError as exc:  # e.g. a wrong password
                raise BrokerUnavailable(
                    f"Redis at {settings.redacted_url} refused this client ({type(exc).__name__}: {exc}); "
                    "check RQ_REDIS_URL / REDIS_URL"
                ) from exc
    finally:
        client.close()


def queue_depths(client: redis.Redis, queues: list[str]) -> dict[str, int]:
    return {queue: int(client.llen(queue)) for queue in queues}
