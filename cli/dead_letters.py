"""``rollout-queue dead-letters``: list, requeue or drop the dead-lettered items.

Workers move every queue item they cannot decode into a task to
``rq:dead:<queue>`` (``workers.queue.poison``). This lists them (newest first),
puts one back on its queue (``--requeue ID``: only if it now decodes, as a
worker would check it; otherwise refused, exit 2), or deletes one
(``--drop ID``). Each change is one Redis script, so an entry is requeued or
dropped once, whoever races for it. Imports no vLLM.

An entry that is not a dead letter (written by hand, or by another version)
is listed as malformed, with its index in its list and an id made from its
bytes (``malformed-<hash>``, stable while other entries come and go), which
``--drop`` takes; it cannot be requeued (what it holds is unknown).
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass

import pydantic
import redis

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import BrokerUnavailable, DeadLetterNotFound, PoisonMessage
from rollout_queue.tasks.registry import connect
from rollout_queue.tasks.settings import ClientSettings
from rollout_queue.workers.queue.poison import DeadLetter, check_task

# KEYS: dead-letter list, queue; ARGV: the entry's exact JSON, the raw item.
REQUEUE_SCRIPT = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[2])
return 1
"""


MALFORMED_PREFIX = "malformed-"


@dataclass(frozen=True)
class MalformedEntry:
    """An entry of a dead-letter list that does not read as a :class:`DeadLetter`."""

    key: str  # its list
    index: int  # its place in the list when read (0: newest)
    stored: bytes
    error: str  # why it does not read

    @property
    def id(self) -> str:
        return MALFORMED_PREFIX + hashlib.sha256(self.stored).hexdigest()[:12]


Entry = DeadLetter | MalformedEntry


def read(client: redis.Redis, queue: str | None = None) -> list[DeadLetter]:
    """Dead letters of ``queue`` (of every queue if None), newest first; malformed entries left out."""
    return [entry for _, _, entry in _entries(client, queue) if isinstance(entry, DeadLetter)]


def read_all(client: redis.Redis, queue: str | None = None) -> list[Entry]:
    """Every entry of ``queue``'s dead-letter list (every queue's if None), malformed ones too."""
    return [entry for _, _, entry in _entries(client, queue)]


def requeue(client: redis.Redis, entry_id: str, accept: list[str]) -> str:
    """Put the entry's raw item back on its queue; returns the queue.

    Raises ``PoisonMessage`` if the item still does not decode,
    ``DeadLetterNotFound`` if no entry has that id (or it went meanwhile).
    """
    key, stored, entry = _find(client, entry_id)
    if isinstance(entry, MalformedEntry):
        raise PoisonMessage("malformed-entry", f"entry {entry_id} is not a dead letter ({entry.error}): "
                            "what it holds is unknown")
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


def drop(client: redis.Redis, entry_id: str) -> Entry:
    key, stored, entry = _find(client, entry_id)
    if not client.lrem(key, 1, stored):  # type: ignore[arg-type]  # bytes: redis-py sends them as they are
        raise DeadLetterNotFound(f"dead letter {entry_id} went while it was being dropped")
    return entry


def _entries(client: redis.Redis, queue: str | None) -> list[tuple[str, bytes, Entry]]:
    """(list key, the entry's exact bytes, the entry) for each entry. ``client`` may
    decode responses or not: entries are read as bytes (one need not be UTF-8)."""
    if queue is not None:
        names = [keys.dead_letters(queue)]
    else:
        names = sorted(k if isinstance(k, str) else k.decode()
                       for k in client.scan_iter(match=keys.DEAD_LETTERS_KEY_PATTERN, count=500))
    found: list[tuple[str, bytes, Entry]] = []
    for key in names:
        for index, stored in enumerate(_lrange_bytes(client, key)):
            entry: Entry
            try:
                entry = DeadLetter.model_validate_json(stored)
            except (pydantic.ValidationError, ValueError) as exc:
                entry = MalformedEntry(key, index, stored, _why(exc))
            found.append((key, stored, entry))
    return found


def _lrange_bytes(client: redis.Redis, key: str) -> list[bytes]:
    """The list's items as bytes, whatever the client decodes (redis-py's NEVER_DECODE)."""
    return list(client.execute_command("LRANGE", key, 0, -1, NEVER_DECODE=True))


def _why(exc: Exception) -> str:
    if isinstance(exc, pydantic.ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{first['msg']}{f' at {where}' if where else ''} ({exc.error_count()} error(s))"
    return f"{type(exc).__name__}: {exc}"


def _find(client: redis.Redis, entry_id: str) -> tuple[str, bytes, Entry]:
    for key, stored, entry in _entries(client, None):
        if entry.id == entry_id:
            return key, stored, entry
    raise DeadLetterNotFound(f"no dead letter has id {entry_id!r}; `rollout-queue dead-letters` lists them")


def _show(entry: Entry) -> str:
    if isinstance(entry, MalformedEntry):
        text = entry.stored.decode("utf-8", "backslashreplace")
        text = text if len(text) <= 120 else text[:117] + "..."
        return (f"{entry.id}  malformed entry #{entry.index} of {entry.key}: {entry.error}\n"
                f"    raw: {text!r}\n    (not a dead letter: drop it with --drop {entry.id})")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.at))
    raw = entry.raw if entry.raw_encoding == "utf-8" else f"base64:{entry.raw}"
    raw = raw if len(raw) <= 120 else raw[:117] + "..."
    return (f"{entry.id}  {when}  queue={entry.queue}  node={entry.node}  {entry.reason}: "
            f"{entry.detail}\n    raw: {raw!r}")


def run_dead_letters(
    settings: ClientSettings, queue: str | None = None, requeue_id: str | None = None,
    drop_id: str | None = None,
) -> int:
    """The CLI: 0 done, 1 no such entry, 2 requeue refused or Redis unreachable."""
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
            entries = read_all(client, queue)
            for entry in entries:
                print(_show(entry))
            malformed = sum(isinstance(entry, MalformedEntry) for entry in entries)
            print(f"{len(entries) - malformed} dead letter(s)" + (f" in queue {queue}" if queue else "")
                  + (f", and {malformed} malformed entr{'y' if malformed == 1 else 'ies'}" if malformed else ""))
    except PoisonMessage as exc:
        if exc.kind == "malformed-entry":
            print(f"rollout-queue dead-letters: refused to requeue {requeue_id}: {exc}; drop it with "
                  f"--drop {requeue_id}", file=sys.stderr)
            return 2
        print(f"rollout-queue dead-letters: refused to requeue {requeue_id}: it still does not "
              f"decode ({exc.kind}: {exc}); drop it with --drop {requeue_id}", file=sys.stderr)
        return 2
    except DeadLetterNotFound as exc:
        print(f"rollout-queue dead-letters: {exc}", file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        print(f"rollout-queue dead-letters: {BrokerUnavailable(f'{settings.redacted_url}: {exc}')}",
              file=sys.stderr)
        return 2
    return 0
