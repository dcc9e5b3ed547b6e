"""Where a task that is not done stands, read from Redis, for a test's failure message:
its stored state, and every key that names it or its delivery (queues, processing
lists, kombu's ``unacked``, the workers' in-flight and handed-on sets)."""

from __future__ import annotations

import redis

from rollout_queue.tasks import keys
from rollout_queue.tasks.app import app
from rollout_queue.workers.queue.dedup import status_of_head


def whereabouts(redis_url: str, task_id: str) -> str:
    try:
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
        raw = client.get(app.backend.get_key_for_task(task_id))
        state = "no result key" if raw is None else status_of_head(raw) or "unreadable"
        places, tags = [], set()
        for tag, entry in client.hgetall(keys.KOMBU_UNACKED).items():
            if task_id.encode() in entry:
                tags.add(tag)
                places.append(f"unacked[{tag.decode()}]")
        for key in client.scan_iter(count=1000):
            kind = client.type(key)
            if kind == b"list" and any(task_id.encode() in item for item in client.lrange(key, 0, -1)):
                places.append(f"list {key.decode(errors='replace')}")
            elif kind == b"set" and tags & set(client.smembers(key)):
                places.append(f"set {key.decode(errors='replace')}")
        return f"{task_id}: state {state}, in {', '.join(places) or 'no key'}"
    except Exception as exc:  # noqa: BLE001  a failure message's detail must not raise
        return f"{task_id}: not read ({exc})"
