"""A kombu Redis transport whose fetch cannot lose a message (workers only).

kombu's Redis transport takes a message off its queue with ``BRPOP`` and
records it in the ``unacked`` hash in a second round trip. A worker killed
between the two loses the message for good: it is in no list and no hash,
so neither ``visibility_timeout`` nor the reaper can bring it back. (Seen
here: ``kill -9`` while a worker pulled a burst of tasks lost one of 30.)

This transport closes that gap with the "processing list" pattern:

* fetch moves the message atomically from its queue into the node's
  processing list ``rq:processing:<node>``: ``BLMOVE`` (blocking, on the
  main list of the first queue the worker consumes) or, before blocking, a
  Lua script that pops the first non-empty list of every consumed queue and
  priority, in kombu's order, and pushes the item onto the processing list
  in the same step;
* Redis cannot block on several lists and move atomically, so a worker that
  consumes more than one queue blocks on its first queue for at most
  ``rq_multi_queue_block_s`` (default 0.05 s) before it sweeps the others
  again: a message on its first queue is taken at once, one on another
  queue (a per-worker queue, say) within that time;
* ``QoS.append`` then, in one ``MULTI``, records the message in ``unacked``
  (as kombu does), adds its tag to the node's in-flight set
  ``rq:inflight:<node>`` and removes it from the processing list.

The fetch script and the ``MULTI`` also name the node in the reapers' index
``rq:ledger-nodes`` (``workers.queue.ledger_index``), so that a sweep finds
the node by it rather than by a walk of the keyspace.

So at every instant a message is in its queue, in a processing list, or in
``unacked`` with its tag in a node's in-flight set; the reaper
(``workers.queue.reaper``) restores what a dead node holds in either.

An item kombu could not make a message of (``workers.queue.poison.check_envelope``:
not JSON, no properties or delivery tag, a body its encoding cannot decode)
never reaches kombu: it moves from the processing list to the queue's
dead-letter list in one script, and the fetch goes on. Messages Celery's
consumer cannot make a task of are dead-lettered from ``unacked``
(``rq_dead_letter_delivered``, called by ``workers.queue.poison.DeadLetteringConsumer``). Producers,
acks, restores and everything else are kombu's own. Selected by the worker
(``broker_transport``), with ``rq_processing_key`` / ``rq_inflight_key``
in the transport options; ``global_keyprefix`` is not supported.

A worker fetches only while its engine has room (``workers.queue.intake``, given
in the node's :class:`FetchHooks`; not in the transport options, which
Celery's ``inspect stats`` sends as JSON); a short timer on the event loop
makes it look again as engine requests finish.

A worker whose prefetch is full sends nothing to the broker until a task
ends, and a task that ends while Redis is down waits in the result
backend's retries: such a worker would not notice a Redis restart for
minutes. The event loop therefore also pings the broker every
``rq_probe_interval`` seconds (default 5); a connection error there is the
consumer's "connection lost", and Celery reconnects as usual.

Redis past its ``maxmemory`` (policy ``noeviction``) refuses the fetch's
writes (``OutOfMemoryError``: Celery took it for an unrecoverable error and
the worker exited). Here a refused fetch is an empty one: the transport
fetches nothing for a while (0.5 s, doubling to 5 s), a message taken
whose record was refused goes back to the head of its queue, and the node's
handler (``FetchHooks.on_full``, the runtime's fence) is told. Any other
write refused for memory on the consumer's path counts as a lost connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from kombu.asynchronous import get_event_loop
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps

from rollout_queue.tasks import broker, keys
from rollout_queue.tasks.errors import PoisonMessage
from rollout_queue.workers.queue.poison import check_envelope, dead_letter_fetched, dead_letter_unacked

logger = logging.getLogger(__name__)

# KEYS[1..n-2]: queue lists in the order BRPOP would try them; KEYS[n-1]: the
# processing list; KEYS[n]: the reapers' ledger index (keys.LEDGER_NODES), which
# names the node (ARGV[1]) with the list it fills. Returns {list, item} or nil,
# atomically. Built by fetch_args().
FETCH_SCRIPT = """
local processing = KEYS[#KEYS - 1]
for i = 1, #KEYS - 2 do
  local item = redis.call('RPOP', KEYS[i])
  if item then
    redis.call('LPUSH', processing, item)
    redis.call('SADD', KEYS[#KEYS], ARGV[1])
    return {KEYS[i], item}
  end
end
return false
"""


def fetch_args(lists: list[str], node: str) -> list[Any]:
    """``FETCH_SCRIPT``'s arguments after the script: its key count, its keys, its ARGV."""
    return [len(lists) + 2, *lists, keys.processing_key(node), keys.LEDGER_NODES, node]


# KEYS[1]: the processing list, KEYS[2]: the queue list it came from; ARGV[1]: the
# item. A message whose record Redis refused (full) goes back where the next fetch
# takes it. Allowed when Redis is full: the LREM frees memory before the RPUSH.
GIVE_BACK_SCRIPT = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) > 0 then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

# A fetch refused because Redis is full: no fetch for this long, doubling.
FULL_BACKOFF_MIN_S = 0.5
FULL_BACKOFF_MAX_S = 5.0

# How often a worker gated by its engine's room looks again (see Transport).
ROOM_CHECK_S = 0.02


@dataclass
class FetchHooks:
    """What the worker's node tells its transport, and the transport it: built
    once by the worker (``workers.node.main``) and bound to the transport class
    (:meth:`Transport.bound`; kombu builds transports from a class, never from
    an object).

    ``has_room``: may the next message be fetched (``workers.queue.intake``)?
    None: kombu's prefetch alone. ``on_full``: told the Redis error when
    Redis refuses a fetch for memory (the runtime's fence). ``handed_on``:
    delivery tags whose messages the reaper handed to other workers
    (``workers.queue.handed_on``): acking one would drop the new holder's record.
    ``result_head``: a task id's stored result, as ``(key, bytes)`` to read of
    it in the ledger's ``MULTI`` (``workers.queue.dedup``: the delivery's
    duplicate check then makes no round trip of its own); None: not read there.
    """

    has_room: Callable[[], bool] | None = None
    on_full: Callable[[str], None] | None = None
    handed_on: set[str] = field(default_factory=set)
    result_head: Callable[[str], tuple[str, int]] | None = None

    def forget_on_ack(self, delivery_tag: str) -> None:
        """The next ack (or reject) of ``delivery_tag`` only clears this process's own
        bookkeeping: Redis is left alone."""
        self.handed_on.add(delivery_tag)


def _noop() -> None:
    pass


class QoS(kombu_redis.QoS):
    def can_consume(self) -> bool:
        """kombu's prefetch limit, and the worker's engine has room (``workers.queue.intake``).

        The room decides whether a fetch *starts*; a fetch already sent is
        read whatever the room (kombu would otherwise pause it, and its
        message would wait in the processing list, where the reaper takes a
        fetch stuck for 30 s for a lost one).
        """
        if not self.channel._in_poll and time.monotonic() < self.channel.rq_full_until:
            return False  # Redis refused the last fetch for memory: wait
        has_room = self.channel.rq_has_room
        if has_room is None or self.channel._in_poll or not self._fetches_tasks():
            return bool(super().can_consume())
        return bool(super().can_consume() and has_room())

    def _handed_on(self, delivery_tag: str) -> bool:
        """Whether the tag's message went to another worker (forgotten here now)."""
        handed_on = self.channel.rq_hooks.handed_on
        if delivery_tag not in handed_on:
            return False
        handed_on.discard(delivery_tag)
        return True

    def _fetches_tasks(self) -> bool:
        """Whether this channel consumes a task queue. The broadcast (pidbox) channel
        does not, and must read its control commands whatever the engine's room:
        kombu asks its ``can_consume`` before it reads them too."""
        fanout = self.channel.active_fanout_queues
        return any(queue not in fanout for queue in self.channel.active_queues)

    def ack(self, delivery_tag: str) -> None:
        if self._handed_on(delivery_tag):
            virtual.QoS.ack(self, delivery_tag)
            return
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if self._handed_on(delivery_tag):
            virtual.QoS.ack(self, delivery_tag)
            return
        super().reject(delivery_tag, requeue=requeue)

    def append(self, message: Any, delivery_tag: str) -> None:
        """kombu's unacked record, the in-flight set and the processing list, in one MULTI;
        with them, the head of the task's stored result (``FetchHooks.result_head``),
        left on the message as ``rq_result_head`` for the delivery's duplicate check."""
        channel = self.channel
        raw = channel.rq_fetched.pop(delivery_tag, None)
        delivery = message.delivery_info
        head = self._result_head(message)
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()})
            pipe.hset(self.unacked_key, delivery_tag,
                      dumps([message._raw, delivery["exchange"], delivery["routing_key"]]))
            if channel.rq_inflight_key:
                pipe.sadd(channel.rq_inflight_key, delivery_tag)
            pipe.sadd(keys.LEDGER_NODES, channel.rq_node)  # the reapers' index (workers.queue.ledger_index)
            pipe.srem(keys.handed_on(channel.rq_node), delivery_tag)  # ours again
            if raw is not None:
                pipe.lrem(channel.rq_processing_key, 1, raw)
            if head is not None:
                pipe.getrange(head[0], 0, head[1] - 1)
            try:
                # A command refused as queued (Redis full) still raises; one that
                # fails as it runs comes back in its place, read below.
                replies = pipe.execute(raise_on_error=False)
            except redis.exceptions.OutOfMemoryError:
                if raw is not None:  # still in the processing list: the fetch gives it back
                    channel.rq_fetched[delivery_tag] = raw
                raise
        recorded = replies[:-1] if head is not None else replies
        failed = [reply for reply in recorded if isinstance(reply, Exception)]
        if failed:
            raise failed[0]
        if head is not None and not isinstance(replies[-1], Exception):
            message.rq_result_head = replies[-1]  # the check reads it itself when absent
        virtual.QoS.append(self, message, delivery_tag)

    def _result_head(self, message: Any) -> tuple[str, int] | None:
        """Which stored result to read in the ledger's MULTI, and how much of it."""
        result_head = self.channel.rq_hooks.result_head
        task_id = (message.headers or {}).get("id")
        if result_head is None or not isinstance(task_id, str) or not task_id:
            return None
        return result_head(task_id)


class Channel(broker.Channel):
    QoS = QoS
    from_transport_options = broker.Channel.from_transport_options + (  # type: ignore[assignment]
        "rq_processing_key", "rq_inflight_key", "rq_multi_queue_block_s",
    )
    rq_processing_key: str = ""
    rq_inflight_key: str = ""
    # The longest block on the first queue when other queues are consumed too.
    rq_multi_queue_block_s: float = 0.05
    # kombu puts a channel's delivered, unacked messages back in their queues
    # when the channel closes. Not here: the consumer closes its channel when
    # the broker connection drops while tasks run on (they ack after the
    # reconnect), so a restore would hand running tasks to other workers, and
    # with Redis down it crashed the worker (Celery 5.7 closes the channel of a
    # connection it already detached: AttributeError in kombu's _connparams,
    # "Unrecoverable error", seen in a Redis-restart test). What a worker holds
    # when it stops or dies is restored by the reaper, from its ledger.
    do_restore = False
    # () -> bool: may the next message be fetched? (None: kombu's prefetch alone)
    rq_has_room: Callable[[], bool] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.rq_processing_key:
            raise ValueError("the reliable Redis transport needs the rq_processing_key option")
        # Kept here: a message of a channel closed by a reconnect is still acked
        # through it, when the channel has no connection any more.
        self.rq_hooks: FetchHooks = self.connection.hooks
        self.rq_has_room = self.rq_hooks.has_room
        self._rq_connparams = super()._connparams(asynchronous=False)
        if self.global_keyprefix:
            raise ValueError("the reliable Redis transport does not support global_keyprefix")
        # delivery tag → the exact bytes in the processing list (for LREM).
        self.rq_fetched: dict[str, bytes] = {}
        self.rq_node = keys.node_of_processing_key(self.rq_processing_key)
        # The queue of the message being handed to the consumer: Celery's
        # consumer decides on it synchronously, inside that call.
        self.rq_delivering: str | None = None
        self._rq_pending: tuple[str, str | None] = ("EVAL", None)
        self._rq_block_next = False
        # Redis refused a fetch for memory: none until this (monotonic) time.
        self.rq_full_until = 0.0
        self._rq_full_backoff = 0.0

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        """kombu's, or, once Celery has closed this channel, the ones it was opened with.

        After a lost broker connection Celery 5.7 closes the consumer's channel
        while tasks run on; their acks still go through this channel, and
        kombu would build a client from the closed transport (AttributeError:
        an "Unrecoverable error" that killed the worker, seen in a Redis
        restart test). With the saved parameters the ack reaches Redis on a
        fresh connection once it is back, or fails as a connection error,
        which Celery logs; the result is stored either way, and a message
        left unacked comes back later to be acked unrun (``workers.queue.dedup``).
        """
        if self.connection is None:
            if asynchronous:
                raise redis.exceptions.ConnectionError("this channel was closed")
            return dict(self._rq_connparams)
        return dict(super()._connparams(asynchronous=asynchronous))

    def _fetch_keys(self, queues: list[str]) -> list[str]:
        return [self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]

    # Asynchronous fetch (the worker's event loop): replaces BRPOP.

    def _brpop_start(self, timeout: float | None = None) -> None:
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        lists = self._fetch_keys(queues)
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]
        if self._rq_block_next:
            # Every list was empty a moment ago: wait on the first queue's
            # main list (in the order the worker was given its queues, not
            # the sweep's rotating order, which made a worker of two queues
            # block on the idle one after each task and take the next
            # message only when the block timed out: +1 s a task).
            first = self._fetch_keys(self.active_queues[:1])[0]
            if len(self.active_queues) > 1:
                timeout = min(timeout or self.rq_multi_queue_block_s, self.rq_multi_queue_block_s)
            self._rq_pending = ("BLMOVE", first)
            args: list[Any] = ["BLMOVE", first, self.rq_processing_key, "RIGHT", "LEFT",
                               timeout or 0]
        else:
            self._rq_pending = ("EVAL", None)
            args = ["EVAL", FETCH_SCRIPT, *fetch_args(lists, self.rq_node)]
        self.client.connection.send_command(*args)

    def _brpop_read(self, **options: Any) -> bool:
        command, key = self._rq_pending
        try:
            try:
                reply = self.client.parse_response(self.client.connection, command, **options)
            except redis.exceptions.OutOfMemoryError as exc:  # before: it is a connection error too
                self._rq_redis_full(exc)
                raise virtual.Empty() from exc
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if command == "BLMOVE":
                source, item = key, reply
            else:
                source, item = reply if reply else (None, None)
            if item is None:
                # After an empty sweep, block; after a quiet wait, sweep again
                # (priority lists and other queues get their turn).
                self._rq_block_next = command == "EVAL"
                raise virtual.Empty()
            self._rq_block_next = False
            self._rq_full_backoff = 0.0
            return self._deliver_fetched(bytes_to_str(source), item)
        finally:
            self._in_poll = None  # type: ignore[assignment]
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()

    # Synchronous fetch (basic_get, drain without an event loop).

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        while True:  # past any poison, to the first message or an empty queue
            with self.conn_or_acquire() as client:
                reply = client.eval(FETCH_SCRIPT, *fetch_args(self._fetch_keys([queue]), self.rq_node))
            if not reply:
                raise virtual.Empty()
            payload = self._check_fetched(queue, reply[1])
            if payload is not None:
                return payload

    def _deliver_fetched(self, source: str, item: bytes) -> bool:
        """Hand a fetched item to the consumer; False if it was poison (dead-lettered)."""
        queue = source.rsplit(self.sep, 1)[0]
        self._queue_cycle.rotate(queue)
        payload = self._check_fetched(queue, item)
        if payload is None:
            return False
        self.rq_delivering = queue
        try:
            self.connection._deliver(payload, queue)
        except redis.exceptions.OutOfMemoryError as exc:
            tag = payload["properties"]["delivery_tag"]
            if tag in self.rq_fetched:  # its record was refused: back to the queue
                with self.conn_or_acquire() as client:
                    client.eval(GIVE_BACK_SCRIPT, 2, self.rq_processing_key, source,
                                self.rq_fetched.pop(tag))
            else:  # recorded, refused later: the reaper restores what no task holds
                logger.warning("delivery of %s refused by a full Redis: %s", tag, exc)
            self._rq_redis_full(exc)
            return False
        finally:
            self.rq_delivering = None
        return True

    def _rq_redis_full(self, exc: redis.exceptions.OutOfMemoryError) -> None:
        """Redis refused a write of the fetch for memory: back off, and tell the node."""
        self._rq_full_backoff = min(FULL_BACKOFF_MAX_S, max(FULL_BACKOFF_MIN_S, 2 * self._rq_full_backoff))
        self.rq_full_until = time.monotonic() + self._rq_full_backoff
        logger.warning("Redis is full (%s): no fetch for %.1f s", exc, self._rq_full_backoff)
        loop = get_event_loop()
        if loop is not None:  # wakes the loop to fetch again (QoS.can_consume)
            loop.call_later(self._rq_full_backoff, _noop)
        handler = self.rq_hooks.on_full
        if handler is not None:
            handler(str(exc))

    def _check_fetched(self, queue: str, item: bytes) -> dict[str, Any] | None:
        """The envelope of a fetched item, or None once a poison item is dead-lettered."""
        try:
            payload = check_envelope(item)
        except PoisonMessage as poison:
            with self.conn_or_acquire() as client:
                dead_letter_fetched(client, self.rq_processing_key, item, queue=queue,
                                    node=self.rq_node, poison=poison)
            return None
        self.rq_fetched[payload["properties"]["delivery_tag"]] = item
        return payload

    def rq_dead_letter_delivered(self, message: Any, poison: PoisonMessage) -> None:
        """Move a delivered message no task can be read from to its queue's dead letters."""
        with self.conn_or_acquire() as client:
            dead_letter_unacked(client, message.delivery_tag, dumps(message._raw),
                                ledger=self.rq_inflight_key or keys.inflight_key(self.rq_node),
                                queue=self.rq_delivering or keys.UNKNOWN_QUEUE,
                                node=self.rq_node, poison=poison)


class Transport(kombu_redis.Transport):
    Channel = Channel
    # A write refused for memory outside the fetch (declaring the queues as the
    # consumer starts, or as the Redis-full fence lifts, on a Redis full again) is
    # a lost connection to Celery: it reconnects, with its backoff, instead of
    # exiting on an "unrecoverable" error. The fetch handles its own (above).
    connection_errors = (*kombu_redis.Transport.connection_errors, redis.exceptions.OutOfMemoryError)
    hooks = FetchHooks()  # no node's: kombu's prefetch alone (see bound())

    @classmethod
    def bound(cls, hooks: FetchHooks) -> type[Transport]:
        """This transport class, with the node's ``hooks``."""
        return type("NodeTransport", (cls,), {"hooks": hooks})

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        cycle: Any = self.cycle  # kombu's MultiChannelPoller (typed None until registered)
        old = getattr(cycle, "_rq_probe_tref", None)
        if old is not None:
            old.cancel()  # a reconnect registers again
        interval = connection.client.transport_options.get("rq_probe_interval", 5.0)
        if interval > 0:
            cycle._rq_probe_tref = loop.call_repeatedly(interval, self._probe_broker)
        old = getattr(cycle, "_rq_room_tref", None)
        if old is not None:
            old.cancel()
        if self.hooks.has_room is not None:
            # Room comes back as engine requests finish, which wakes nothing
            # on this loop: a short timer makes it look again (each loop tick
            # asks QoS.can_consume before fetching).
            cycle._rq_room_tref = loop.call_repeatedly(ROOM_CHECK_S, _noop)

    def on_readable(self, fileno: int) -> None:  # type: ignore[override]  # kombu's Redis transport narrows it so
        """kombu's, except that a fetch connection the server closed while no fetch was
        pending is a lost connection.

        kombu (5.6) reads bytes arriving on a fetch connection with no fetch
        pending and no credit (the engine has no room: the intake gate) as
        the server closing an idle connection, and drops it silently, to
        reconnect once credit returns. A Redis restart then went unseen by
        the consumer until its engine had room again (over a minute, seen in
        a Redis-restart test), and its other connections (the broadcast
        channel's) stayed broken as long. Raised here, the error is the
        consumer's "connection lost": Celery reconnects them all at once.
        """
        cycle: Any = self.cycle  # kombu's MultiChannelPoller (typed None until registered)
        found = cycle._fd_to_chan.get(fileno)
        if found is not None and fileno not in getattr(cycle, "_paused_brpop", ()):
            channel, kind = found
            if kind == "BRPOP" and not channel._in_poll and not channel.qos.can_consume():
                channel.client.connection.disconnect()
                raise redis.exceptions.ConnectionError(
                    "Redis closed this worker's fetch connection while no fetch was pending "
                    "(a restart, or a server-side timeout); reconnecting")
        cycle.on_readable(fileno)

    def _probe_broker(self) -> None:
        """PING on a pooled connection (never the one a fetch is blocked on).

        Connection errors propagate to the consumer (the hub re-raises them).
        """
        cycle: Any = self.cycle
        for channel in list(cycle._channels):
            try:
                with channel.conn_or_acquire() as client:
                    client.ping()
            except channel.connection_errors as exc:
                logger.warning("broker probe failed: %s", exc)
                raise
            return
