"""``rollout-queue dead-letters``: list, requeue or drop the dead-lettered items.

Workers move every queue item they cannot decode into a task to
``rq:dead:<queue>`` (``workers.poison``). This lists them (newest first),
puts one back on its queue (``--requeue ID``: only if it now decodes, as a
worker would check it; otherwise refused, exit 2), or deletes one
(``--drop ID``). Each change is one Redis script, so an entry is requeued or
dropped once, whoever races for it. Imports no vLLM.
"""

from __future__ import annotations

import sys
import time

import redis

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import BrokerUnavailable, DeadLetterNotFound, PoisonMessage
from rollout_queue.tasks.registry import connect
from rollout_queue.tasks.settings import ClientSettings
from rollout_queue.workers.poison import DeadLetter, check_task

# KEYS: dead-letter list, queue; ARGV: the entry's exact JSON, the raw item.
REQUEUE_SCRIPT = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[2])
return 1
"""


def read(client: redis.Redis, queue: str | None = None) -> list[DeadLetter]:
    """Dead letters of ``queue`` (of every queue if None), newest first."""
    return [entry for _, _, entry in _entries(client, queue)]


def requeue(client: redis.Redis, entry_id: str, accept: list[str]) -> str:
    """Put the entry's raw item back on its queue; returns the queue.

    Raises ``PoisonMessage`` if the item still does not decode,
    ``DeadLetterNotFound`` if no entry has that id (or it went meanwhile).
    """
    key, stored, entry = _find(client, entry_id)
    item = entry.item()
    payload = check_task(item, accept)
    # A dead node's processing list does not name the queue: the item's own
    # routing key does (Celery's queues route by their name).
    queue = entry.queue
    if queue == keys.UNKNOWN_QUEUE:
        queue = payload["properties"]["delivery_info"]["routing_key"]
    if not client.eval(REQUEUE_SCRIPT, 2, key, queue, stored, item):
        raise DeadLetterNotFound(f"dead letter {entry_id} went while it was being requeued")
    return queue


def drop(client: redis.Redis, entry_id: str) -> DeadLetter:
    key, stored, entry = _find(client, entry_id)
    if not client.lrem(key, 1, stored):
        raise DeadLetterNotFound(f"dead letter {entry_id} went while it was being dropped")
    return entry


def _entries(client: redis.Redis, queue: str | None) -> list[tuple[str, str, DeadLetter]]:
    """(list key, the entry's exact JSON, the entry) for each dead letter."""
    if queue is not None:
        names = [keys.dead_letters(queue)]
    else:
        names = sorted(str(k) for k in client.scan_iter(match=keys.DEAD_LETTERS_KEY_PATTERN, count=500))
    found = []
    for key in names:
        for stored in client.lrange(key, 0, -1):
            found.append((key, str(stored), DeadLetter.model_validate_json(stored)))
    return found


def _find(client: redis.Redis, entry_id: str) -> tuple[str, str, DeadLetter]:
    for key, stored, entry in _entries(client, None):
        if entry.id == entry_id:
            return key, stored, entry
    raise DeadLetterNotFound(f"no dead letter has id {entry_id!r}; `rollout-queue dead-letters` lists them")


def _show(entry: DeadLetter) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.at))
    raw = entry.raw if entry.raw_encoding == "utf-8" else f"base64:{entry.raw}"
    raw = raw if len(raw) <= 120 else raw[:117] + "..."
    return (f"{entry.id}  {when}  queue={entry.queue}  node={entry.node}  {entry.reason}: "
            f"{entry.detail}\n    raw: {raw!r}")


def run_dead_letters(
    settings: ClientSettings, queue: str | None = None, requeue_id: str | None = None,
    drop_id: str | None = None,
) -> int:
    """The CLI: 0 done, 1 no such entry or Redis unreachable, 2 requeue refused."""
    from rollout_queue.tasks.app import celery_config

    client = connect(settings)
    try:
        if requeue_id is not None:
            accept = celery_config(settings)["accept_content"]
            target = requeue(client, requeue_id, accept)
            print(f"requeued dead letter {requeue_id} on queue {target}")
        elif drop_id is not None:
            drop(client, drop_id)
            print(f"dropped dead letter {drop_id}")
        else:
            entries = read(client, queue)
            for entry in entries:
                print(_show(entry))
            print(f"{len(entries)} dead letter(s)" + (f" in queue {queue}" if queue else ""))
    except PoisonMessage as exc:
        print(f"rollout-queue dead-letters: refused to requeue {requeue_id}: it still does not "
              f"decode ({exc.kind}: {exc}); drop it with --drop {requeue_id}", file=sys.stderr)
        return 2
    except DeadLetterNotFound as exc:
        print(f"rollout-queue dead-letters: {exc}", file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        print(f"rollout-queue dead-letters: {BrokerUnavailable(f'{settings.redacted_url}: {exc}')}",
              file=sys.stderr)
        return 1
    return 0
