"""Poison: queue items no worker can decode go to a dead-letter list.

A queue item is poison when kombu cannot make a message of it (not JSON,
not an envelope object, no ``properties`` or ``delivery_tag``, a body its
``body_encoding`` cannot decode) or when Celery cannot make a task of the
message (a content type the app does not accept, such as pickle; a body
that does not deserialize; no task name, or one this worker does not know;
a task message Celery chokes on; a ``generate`` message with headers it
cannot use or callbacks to follow, ``workers.queue.delivery``). Before, the first kind killed the worker
at every start and stalled every reaper; the second was dropped, or killed
the worker too.

Each poison item moves, in one Redis script, from where the worker holds it
to the bounded list ``rq:dead:<queue>`` (newest first, ``DEAD_LETTERS_MAX``
per queue), as a :class:`DeadLetter`: the raw item, the reason, the time,
the node and an id. It is logged once, counted
(``rollout_queue_dead_letters_total{queue,reason}``, ``workers.node.metrics``),
acknowledged, and the worker serves on. ``rollout-queue dead-letters``
(``cli.dead_letters``) lists, requeues and drops them.

Each check sits where the decoding happens, so nothing is decoded twice:

* the envelope, before kombu builds a message from it:
  :func:`check_envelope`, called by the reliable fetch
  (``workers.queue.reliable_redis``) and by the reaper (``workers.queue.reaper``) on a
  processing list's items; the item moves from the processing list
  (:func:`dead_letter_fetched`);
* the body and the task protocol, in Celery's consumer, which decodes the
  body once and refuses untrusted content types before reading them:
  :class:`DeadLetteringConsumer` turns each of its refusals, and any error
  there, into a dead letter; the message moves from kombu's ``unacked``
  hash (:func:`dead_letter_unacked`).
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
import uuid
from typing import Any, Literal

import redis
from celery.exceptions import NotRegistered
from celery.worker.consumer.consumer import Consumer
from kombu.compression import decompress
from kombu.exceptions import ContentDisallowed
from kombu.serialization import loads, prepare_accept_content
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads as json_loads
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict
from vine import promise

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import InvalidRequest, PoisonMessage

log = logging.getLogger(__name__)

# Per queue; past it the oldest entries are trimmed (a flood of poison must
# not fill Redis, whose noeviction policy would then refuse real tasks).
DEAD_LETTERS_MAX = 10_000
# In the default registry, which a worker's /metrics serves (workers.node.metrics):
# the reliable fetch, Celery's consumer and the reaper count into it.
DEAD_LETTERS = Counter(
    "rollout_queue_dead_letters", "Queue items no task could be decoded from, moved to rq:dead:<queue>",
    ["queue", "reason"],
)

# KEYS: processing list, dead-letter list; ARGV: item, entry, bound.
# Moves only an item still there (another reaper may have moved it).
FROM_LIST_SCRIPT = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[3]) - 1)
return 1
"""
# KEYS: unacked hash, unacked index, the node's in-flight set, dead-letter
# list; ARGV: delivery tag, entry, bound.
FROM_UNACKED_SCRIPT = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('LPUSH', KEYS[4], ARGV[2])
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[3]) - 1)
return 1
"""


class DeadLetter(BaseModel):
    """One entry of ``rq:dead:<queue>`` (JSON)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    queue: str
    node: str
    reason: str  # PoisonMessage.kind
    detail: str  # what was wrong, in words
    at: float  # unix time
    raw: str  # the item as it was in Redis ...
    raw_encoding: Literal["utf-8", "base64"] = "utf-8"  # ... base64 when not UTF-8

    @classmethod
    def of(cls, item: bytes | str, queue: str, node: str, poison: PoisonMessage) -> DeadLetter:
        raw, encoding = _as_text(item)
        return cls(id=uuid.uuid4().hex[:12], queue=queue, node=node, reason=poison.kind,
                   detail=str(poison), at=time.time(), raw=raw, raw_encoding=encoding)

    def item(self) -> bytes:
        """The raw item, byte for byte."""
        if self.raw_encoding == "base64":
            return base64.b64decode(self.raw)
        return self.raw.encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def check_envelope(item: bytes | str) -> dict[str, Any]:
    """The kombu envelope in ``item``; ``PoisonMessage`` if kombu would choke on it.

    Checks what kombu's ``Message`` and the reliable fetch's ``QoS.append``
    read: properties, delivery tag and info, headers, the body and its
    ``body_encoding``. The body's content is Celery's to judge.
    """
    try:
        payload = json_loads(bytes_to_str(item))  # as kombu's Redis transport reads it
    except Exception as exc:  # JSONDecodeError, or kombu's "__type__" hook
        raise PoisonMessage("not-json", f"not JSON: {type(exc).__name__}: {exc}") from exc
    if not isinstance(payload, dict):
        raise PoisonMessage("not-an-envelope",
                            f"JSON {type(payload).__name__}, not a kombu message envelope (an object)")
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        raise PoisonMessage("no-properties", "the envelope has no 'properties' object")
    tag = properties.get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        raise PoisonMessage("no-delivery-tag", "the envelope's properties have no 'delivery_tag' string")
    delivery = properties.get("delivery_info")
    if not (isinstance(delivery, dict) and isinstance(delivery.get("exchange"), str)
            and isinstance(delivery.get("routing_key"), str)):
        raise PoisonMessage("bad-envelope",
                            "properties.delivery_info needs 'exchange' and 'routing_key' strings")
    if not isinstance(payload.get("headers"), dict | None):
        raise PoisonMessage("bad-envelope", "the envelope's 'headers' is not an object")
    for field in ("content-type", "content-encoding"):
        if not isinstance(payload.get(field), str | None):
            raise PoisonMessage("bad-envelope", f"the envelope's {field!r} is not a string")
    _body_bytes(payload)
    return payload


def check_task(item: bytes | str, accept: list[str]) -> dict[str, Any]:
    """What a worker's consumer checks too: ``check_envelope``, then a body of an
    accepted content type that decodes to a Celery (protocol 2) task message."""
    payload = check_envelope(item)
    headers = payload.get("headers") or {}
    if not isinstance(headers.get("task"), str) or not isinstance(headers.get("id"), str):
        raise PoisonMessage("not-a-task", "the headers carry no 'task' and 'id' strings")
    body = _body_bytes(payload)
    try:
        if headers.get("compression"):
            body = decompress(body, headers["compression"])
        decoded = loads(body, payload.get("content-type"), payload.get("content-encoding"),
                        accept=prepare_accept_content(accept))
    except ContentDisallowed as exc:
        raise PoisonMessage("content-refused", str(exc)) from exc
    except Exception as exc:  # any decoder's error: the body is undecodable
        raise PoisonMessage("undecodable-body", f"{type(exc).__name__}: {exc}") from exc
    if not (isinstance(decoded, list | tuple) and len(decoded) == 3 and isinstance(decoded[0], list)
            and isinstance(decoded[1], dict) and isinstance(decoded[2], dict)):
        raise PoisonMessage("not-a-task", "the body is not [args, kwargs, embed]")
    return payload


def _body_bytes(payload: dict[str, Any]) -> bytes:
    """The body as kombu's ``Message`` decodes it (``body_encoding``, then UTF-8)."""
    body = payload.get("body")
    if body is None or body == "":
        return b""
    if not isinstance(body, str):
        raise PoisonMessage("bad-envelope", f"the body is a JSON {type(body).__name__}, not a string")
    encoding = payload["properties"].get("body_encoding")
    if encoding is not None and not isinstance(encoding, str):
        raise PoisonMessage("bad-body-encoding", f"body_encoding {encoding!r} is not a string")
    try:
        if encoding and encoding.lower() != "utf-8":
            if encoding != "base64":
                raise PoisonMessage("bad-body-encoding",
                                    f"unknown body_encoding {encoding!r} (kombu knows base64)")
            return base64.b64decode(body.encode())  # as kombu's Base64 codec: not strict
        return body.encode("utf-8")
    except (binascii.Error, ValueError) as exc:  # UnicodeEncodeError: a lone surrogate
        raise PoisonMessage("bad-body-encoding", f"the body does not decode as {encoding or 'utf-8'}: "
                            f"{exc}") from exc


# ---------------------------------------------------------------------------
# Moves (one script each: the item is in exactly one place at every instant)
# ---------------------------------------------------------------------------


def dead_letter_fetched(
    client: redis.Redis, processing: str, item: bytes, *, queue: str, node: str, poison: PoisonMessage
) -> bool:
    """Move ``item`` from a processing list to ``rq:dead:<queue>``; False if it had gone."""
    entry = DeadLetter.of(item, queue, node, poison)
    moved = client.eval(FROM_LIST_SCRIPT, 2, processing, keys.dead_letters(queue), item,
                        entry.model_dump_json(), DEAD_LETTERS_MAX)
    return _moved(bool(moved), entry)


def dead_letter_unacked(
    client: redis.Redis, tag: str, raw: bytes | str, *, ledger: str, queue: str, node: str,
    poison: PoisonMessage,
) -> bool:
    """Move a delivered message (tag ``tag``, envelope ``raw``) from kombu's unacked
    hash and the node's in-flight set to ``rq:dead:<queue>``; False if it had gone
    (acked, or restored by a reaper)."""
    entry = DeadLetter.of(raw, queue, node, poison)
    moved = client.eval(FROM_UNACKED_SCRIPT, 4, keys.KOMBU_UNACKED, keys.KOMBU_UNACKED_INDEX, ledger,
                        keys.dead_letters(queue), tag, entry.model_dump_json(), DEAD_LETTERS_MAX)
    return _moved(bool(moved), entry)


def _moved(moved: bool, entry: DeadLetter) -> bool:
    if moved:
        DEAD_LETTERS.labels(queue=entry.queue, reason=entry.reason).inc()
        log.warning("dead-lettered an item of queue %s on %s: %s (%s); entry %s in %s "
                    "(`rollout-queue dead-letters` lists it)", entry.queue, entry.node, entry.reason,
                    entry.detail, entry.id, keys.dead_letters(entry.queue))
    else:
        log.info("a poison item (%s) had already left its place; nothing dead-lettered", entry.reason)
    return moved


# ---------------------------------------------------------------------------
# Celery's consumer
# ---------------------------------------------------------------------------


class DeadLetteringConsumer(Consumer):  # type: ignore[misc]
    """Celery's consumer, with every message it cannot make a task of dead-lettered.

    Celery logs and drops a message whose body it cannot decode, whose
    content type it refuses, or that names no task it knows; an error it
    does not expect while reading one (a task message without an id, a body
    that is not ``[args, kwargs, embed]``) escapes its event loop and stops
    the worker. Here each moves to the dead letters and is acked. Selected
    by the worker (``worker_consumer``, ``workers.node.main``); the message's
    channel is the reliable transport's (``rq_dead_letter_delivered``).
    """

    def create_task_handler(self, promise: Any = promise) -> Any:
        handle = super().create_task_handler(promise)

        def on_task_received(message: Any) -> Any:
            try:
                return handle(message)
            except (redis.RedisError, OSError):
                raise  # the broker's: Celery reconnects
            except PoisonMessage as poison:  # refused by the task's strategy (workers.queue.delivery)
                self.dead_letter(message, poison)
                task_id = (message.headers or {}).get("id")
                if isinstance(task_id, str):  # the producer sees why, not a task that never ends
                    self.app.backend.mark_as_failure(
                        task_id, InvalidRequest(f"task message refused: {poison}; dead-lettered"))
                return None
            except Exception as exc:  # noqa: BLE001  any message-borne error: never the loop's
                # Not ``self.connection_errors``: kombu's Redis transport counts
                # KeyError among them, so a task message without an id would
                # look like a lost connection and come back at every reconnect.
                self.dead_letter(message, PoisonMessage(
                    "not-a-task", f"Celery could not read the task message: {type(exc).__name__}: {exc}"))
                return None

        return on_task_received

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        kind = "content-refused" if isinstance(exc, ContentDisallowed) else "undecodable-body"
        self.dead_letter(message, PoisonMessage(kind, f"{type(exc).__name__}: {exc}"))

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        kind = "content-refused" if isinstance(exc, ContentDisallowed) else "invalid-task"
        self.dead_letter(message, PoisonMessage(kind, f"{type(exc).__name__}: {exc}"))

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self.dead_letter(message, PoisonMessage(
            "not-a-task", "no task name in the headers (protocol 2) or the body (protocol 1)"))

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        name, task_id = message.headers.get("task"), message.headers.get("id")
        self.dead_letter(message, PoisonMessage(
            "unknown-task", f"no task named {name!r} on this worker (registered: generate)"))
        if isinstance(task_id, str):  # as Celery does: the producer sees the failure
            self.app.backend.mark_as_failure(task_id, NotRegistered(str(name)))

    def dead_letter(self, message: Any, poison: PoisonMessage) -> None:
        move = getattr(message.channel, "rq_dead_letter_delivered", None)
        if move is None:  # not the reliable transport: Celery's drop
            log.error("dropped a message no task could be read from (%s: %s)", poison.kind, poison)
        else:
            move(message, poison)
        if not message.acknowledged:
            message.ack()  # kombu's bookkeeping (prefetch); in Redis it is already gone


def _as_text(item: bytes | str) -> tuple[str, Literal["utf-8", "base64"]]:
    if isinstance(item, str):
        try:
            item.encode("utf-8")
            return item, "utf-8"
        except UnicodeEncodeError:
            item = item.encode("utf-8", "surrogatepass")
    try:
        return item.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(item).decode(), "base64"
