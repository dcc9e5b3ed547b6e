"""Redelivery of a dead worker's tasks: the in-flight ledger and the reaper.

With Redis as the broker and late acks, kombu keeps every delivered but not
yet acknowledged message in its ``unacked`` hash and puts it back in its
queue only after ``visibility_timeout`` (hours here: it must stay above the
longest generation, or long tasks would be handed out twice). A worker killed
with SIGKILL (OOM killer, lost host) would hold its tasks that long. So:

* a worker fetches through ``workers.queue.reliable_redis``: a message moves
  atomically from its queue to the node's processing list
  ``rq:processing:<node>``, then, in one MULTI, into ``unacked`` with its
  delivery tag in the node's in-flight set ``rq:inflight:<node>``
  (:class:`InflightLedger` drops the tags that left ``unacked``: acked,
  rejected or restored);
* every worker runs a :class:`Reaper` thread; the one holding the fleet's
  sweep lease looks at the nodes named in ``rq:ledger-nodes``
  (``workers.queue.ledger_index``: an index kept where ledgers are born, with
  a walk of the keyspace every few minutes as a safety net). A node whose
  registry key (``rq:worker:<node>``, refreshed by its heartbeat) has been
  gone for ``grace_s`` seconds, as seen by this reaper with Redis reachable
  all along, while its processing list or in-flight set still exists, is
  dead. Under a per-node lock the reaper moves each message it still holds
  back to its queue, in one WATCH/MULTI transaction per message (the steps
  of kombu's ``QoS.restore_by_tag``, plus the node's list or set and the
  redelivery count), so a message is restored at most once whoever races
  for it;
* a task redelivered ``max_redeliveries`` times is not restored again: the
  reaper stores a ``RedeliveryLimitReached`` failure as its result and drops
  the message. A poison task that kills its worker cannot go round for ever.

A worker restarted under the same node name restores its previous
incarnation's messages at start (:meth:`Reaper.reclaim_own`); a message left
in a live worker's own processing list (a fetch whose reply was lost to a
dropped connection) is restored after ``stale_fetch_s``, and so is a message
in its in-flight set that no task of the process holds for that long
(:meth:`Reaper.check_orphans`: a fetch cut off by a lost connection after its
record was written, a message Celery dropped when it closed the channel, an
ack that never reached Redis).

An item no message can be made of (``workers.queue.poison.check_envelope``) is
not restored: it moves to its queue's dead-letter list, in one script. Each
item, and each node's reap, is on its own: an error on one is logged and
the pass goes on with the others (the item stays where it was, for the next
pass).

A node declared dead may still be running (cut off from Redis, not dead):
each message restored from it is also named in its ``rq:handed-on:<node>``
set, so once back it neither stores that task's result nor acks the message,
now another worker's (``workers.queue.handed_on``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import PoisonMessage, RedeliveryLimitReached
from rollout_queue.tasks.registry import prune_workers
from rollout_queue.workers.queue import ledger_index
from rollout_queue.workers.queue.poison import check_envelope, dead_letter_fetched, dead_letter_unacked

log = logging.getLogger(__name__)

# KEYS[1] the lease, ARGV[1] this node, ARGV[2] its TTL in ms: take it when
# free, renew it when ours; 1 when held by us afterwards.
SWEEP_LEASE_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


class InflightLedger:
    """This worker's set of delivery tags it holds (received, not yet acked).

    Tags are added by the fetch itself (``workers.queue.reliable_redis.QoS.append``,
    in the same MULTI as kombu's unacked record); this class keeps the set
    tidy and alive.
    """

    def __init__(self, client: redis.Redis, node: str, ttl_s: int) -> None:
        self.client = client
        self.node = node
        self.key = keys.inflight_key(node)
        # Past visibility_timeout kombu restores the messages itself.
        self.ttl_s = ttl_s

    def prune(self) -> set[str]:
        """Drop the tags no longer in kombu's ``unacked`` hash; returns those that remain."""
        tags = sorted(_text(tag) for tag in self.client.smembers(self.key))
        if not tags:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for tag in tags:
            pipe.hexists(keys.KOMBU_UNACKED, tag)
        held = pipe.execute()
        gone = [tag for tag, still in zip(tags, held) if not still]
        pipe = self.client.pipeline()
        if gone:
            pipe.srem(self.key, *gone)
        pipe.expire(self.key, self.ttl_s)
        pipe.execute()
        return set(tags) - set(gone)

    def close(self) -> None:
        """At a clean exit: drop the ledger if nothing is left in it."""
        try:
            if not self.prune():
                self.client.delete(self.key)
        except redis.RedisError as exc:
            log.warning("could not close the in-flight ledger %s: %s", self.key, exc)


@dataclass
class ReapReport:
    """What one reap of one dead node did."""

    node: str
    restored: list[str] = field(default_factory=list)  # task ids put back in their queue
    failed: list[str] = field(default_factory=list)  # task ids failed for good
    dead_lettered: list[str] = field(default_factory=list)  # poison: reasons (PoisonMessage.kind)
    errors: int = 0  # items left in place by an unexpected error (retried next pass)
    gone: int = 0  # tags already acked or restored by someone else

    def record(self, outcome: str, detail: str) -> None:
        """``detail``: the task id, or the poison's kind when dead-lettered."""
        if outcome == "restored":
            self.restored.append(detail)
        elif outcome == "failed":
            self.failed.append(detail)
        elif outcome == "dead-lettered":
            self.dead_lettered.append(detail)
        else:
            self.gone += 1


class Reaper:
    """Finds dead worker nodes and puts their unacknowledged messages back."""

    def __init__(
        self,
        app: Celery,
        client: redis.Redis,
        node: str,
        *,
        max_redeliveries: int,
        grace_s: float,
        interval_s: float,
        counter_ttl_s: int,
        ledger: InflightLedger,
        stale_fetch_s: float = 30.0,
        held: Callable[[], set[str]] | None = None,
        scan_every: int = ledger_index.SAFETY_SCAN_EVERY,
    ) -> None:
        self.app = app
        self.client = client
        self.node = node
        self.max_redeliveries = max_redeliveries
        self.grace_s = grace_s
        self.interval_s = interval_s
        self.counter_ttl_s = counter_ttl_s
        self.ledger = ledger
        self.stale_fetch_s = stale_fetch_s
        self._fetch_seen: dict[bytes, float] = {}
        # () -> the delivery tags this process's tasks hold (None: not a worker).
        self.held = held
        self._orphan_seen: dict[str, float] = {}
        self._missing_since: dict[str, float] = {}
        # Every this many sweeps the keyspace is walked too (workers.queue.ledger_index).
        self.scan_every = scan_every
        self._sweeps = 0
        self.reports: list[ReapReport] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reaper", daemon=True)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                listed = self.ledger.prune()
                self.check_own_fetches()
                self.check_orphans(listed)
                if self.holds_sweep_lease():
                    self.sweep()
                else:
                    self._missing_since.clear()  # another reaper is watching
            except redis.RedisError as exc:
                # Redis away: forget what we saw, a node that did not beat
                # while Redis was down is not dead for that.
                self._missing_since.clear()
                log.warning("reaper: Redis unavailable (%s); retrying", exc)
            except Exception:  # the thread must outlive any one bad pass
                self._missing_since.clear()
                log.exception("reaper pass failed")

    # ------------------------------------------------------------ detection

    def holds_sweep_lease(self) -> bool:
        """Take or renew the fleet's sweep lease; True while this reaper holds it.

        A sweep SCANned the whole keyspace (task results included): with every
        worker sweeping every heartbeat, Redis's idle CPU grew with the square
        of the fleet (bench/control_plane.py: SCAN was 95 % of it at 256
        workers). One holder at a time kept it linear; the sweep now reads an
        index and walks the keyspace only every ``scan_every`` passes, but
        one sweeper is still all a fleet needs. The lease lasts three
        passes, so a dead holder is replaced within that, and the new holder's
        grace period starts when it takes over.
        """
        ttl_ms = int(self.interval_s * 3 * 1000)
        held = self.client.eval(SWEEP_LEASE_SCRIPT, 1, keys.REAPER_SWEEP_LEASE, self.node, ttl_ms)
        return bool(held)

    def sweep(self) -> list[ReapReport]:
        """One pass: reap every node dead for longer than ``grace_s``.

        The nodes to look at come from the index ``keys.LEDGER_NODES``
        (``workers.queue.ledger_index``), not a walk of the keyspace; every
        ``scan_every`` passes the keyspace is walked too, as a safety net for
        nodes whose keys were born without their name there (workers from
        before the index, a race the index misses). A node unregistered and
        holding nothing leaves the index (a reaped one, the pass after).
        """
        self._sweeps += 1
        nodes = ledger_index.listed(self.client)
        if self._sweeps % self.scan_every == 0:
            nodes |= ledger_index.scan(self.client)
        others = sorted(n for n in nodes if n != self.node)
        alive = self.client.mget([keys.worker_key(n) for n in others]) if others else []
        unregistered = [node for node, registered in zip(others, alive) if registered is None]
        emptied = self.prune_index(unregistered)  # nothing left to reap: out of the index
        holding = [node for node in unregistered if node not in emptied]
        for node in set(self._missing_since) - set(holding):
            self._missing_since.pop(node, None)
        now = time.monotonic()
        reports = []
        for node in holding:
            first_seen = self._missing_since.setdefault(node, now)
            if now - first_seen >= self.grace_s:
                try:
                    report = self.reap(node)
                except redis.RedisError:
                    raise  # Redis away: the whole pass waits (see _loop)
                except Exception:  # one node's trouble is not the others'
                    log.exception("reaper: could not reap node %s; trying again next pass", node)
                    continue
                self._missing_since.pop(node, None)
                if report is not None:
                    reports.append(report)
        prune_workers(self.client)  # the registry's names of workers gone (tasks.registry)
        return reports

    def prune_index(self, nodes: list[str]) -> set[str]:
        """Drop from the ledger index those of ``nodes`` none of whose keys exists
        (``workers.queue.ledger_index.prune``); those dropped."""
        if not nodes:
            return set()
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            checked = {node: ledger_index.ledger_keys(node, _own_queues(channel, node)) for node in nodes}
        return ledger_index.prune(self.client, checked)

    def reclaim_own(self) -> ReapReport | None:
        """At start: restore what a previous process with this node name left."""
        return self.reap(self.node)

    # -------------------------------------------------------------- restore

    def reap(self, node: str) -> ReapReport | None:
        """Restore (or fail) every still-unacked message of ``node``; None if another reaper holds it."""
        lock = self.client.lock(keys.reaper_lock(node), timeout=120)
        if not lock.acquire(blocking=False):
            return None
        try:
            report = ReapReport(node=node)
            ledger = keys.inflight_key(node)
            processing = keys.processing_key(node)
            with self.app.connection_for_write() as conn:
                channel = conn.default_channel
                for item in channel.client.lrange(processing, 0, -1):
                    self._isolated(report, self._restore_fetched, channel, processing, item)
                for raw_tag in sorted(self.client.smembers(ledger)):
                    self._isolated(report, self._restore_one, channel, ledger, _text(raw_tag))
                if node != self.node:  # its own queue: a restarted node serves it again itself
                    for queue in _own_queues(channel, node):
                        for _ in range(channel.client.llen(queue)):
                            self._isolated(report, self._reroute, channel, queue)
            if not report.errors:  # else the ledger still names what is left to restore
                self.client.delete(ledger)  # (an emptied processing list is gone by itself)
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                pass
        if report.restored or report.failed or report.dead_lettered or report.errors:
            log.warning(
                "reaper: node %s is gone; redelivered %d task(s) %s, failed %d after %d "
                "redeliveries %s, dead-lettered %d poison item(s) %s, left %d after errors",
                node, len(report.restored), report.restored, len(report.failed),
                self.max_redeliveries, report.failed, len(report.dead_lettered),
                report.dead_lettered, report.errors,
            )
        self.reports.append(report)
        return report

    @staticmethod
    def _isolated(report: ReapReport, restore: Any, *args: Any) -> None:
        """One item's restore; an unexpected error there leaves it for the next pass."""
        try:
            report.record(*restore(*args))
        except redis.RedisError:
            raise
        except Exception:  # one item never stops the others
            report.errors += 1
            log.exception("reaper: could not restore an item of %s; left in place", args[1])

    def check_own_fetches(self) -> int:
        """Restore messages stuck in this node's processing list; returns how many.

        A fetch moves a message there and the next step (``QoS.append``)
        takes it out milliseconds later; one still there after
        ``stale_fetch_s`` lost its reply to a dropped connection.
        """
        processing = keys.processing_key(self.node)
        if not self.client.exists(processing):  # the usual case: no connection opened
            self._fetch_seen = {}
            return 0
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            # Bytes, not this client's decoded text: an item need not be UTF-8.
            items = channel.client.lrange(processing, 0, -1)
            self._fetch_seen, stale = _aged(self._fetch_seen, items, self.stale_fetch_s)
            report = ReapReport(node=self.node)
            for item in stale:
                self._isolated(report, self._restore_fetched, channel, processing, item)
                self._fetch_seen.pop(item, None)
        if stale:
            log.warning("reaper: %d fetch(es) by this node never completed; redelivered %s, "
                        "dead-lettered %s, %d gone, %d left after errors", len(stale),
                        report.restored, report.dead_lettered, report.gone, report.errors)
        return len(stale)

    def check_orphans(self, listed: set[str]) -> int:
        """Restore messages of this node's in-flight set (``listed``: its tags,
        as :meth:`InflightLedger.prune` left it) that no task of this process
        has held for ``stale_fetch_s``; returns how many.

        The set names what the node fetched and has not acked. A live worker
        is never reaped, so a message it holds no task for would wait there
        for ``visibility_timeout`` (hours): one whose fetch wrote its record
        but lost its reply to a dropped connection, one Celery dropped unrun
        when it closed the channel after a lost connection, one whose ack did
        not reach Redis. Seen: one task of 24 never done after two Redis
        restarts. A restore here is not counted as a redelivery (the task did
        not kill anything); one whose result is stored comes back to be acked
        unrun (``workers.queue.dedup``).
        """
        if self.held is None:
            return 0
        orphans = listed - self.held() if listed else set()
        self._orphan_seen, stale = _aged(self._orphan_seen, orphans, self.stale_fetch_s)
        if not stale:
            return 0
        ledger = keys.inflight_key(self.node)
        report = ReapReport(node=self.node)
        with self.app.connection_for_write() as conn:
            for tag in sorted(stale):
                self._isolated(report, self._restore_one, conn.default_channel, ledger, tag, False)
                self._orphan_seen.pop(tag, None)
        log.warning("reaper: %d message(s) in this node's in-flight set held by no task for %.0f s; "
                    "redelivered %s, dead-lettered %s, %d gone, %d left after errors", len(stale),
                    self.stale_fetch_s, report.restored, report.dead_lettered, report.gone, report.errors)
        return len(stale)

    def hand_back(self, tags: set[str]) -> ReapReport:
        """Put back in their queues, at once and not counted as redeliveries, messages
        of this node's in-flight set that this live worker will not run: it is
        leaving on SIGTERM (tasks waiting in Celery's timer for their ETA or
        countdown, tasks it fetched and never started). A graceful exit is not
        a death: counted, three rolling restarts failed a task with an ETA for
        good (``RedeliveryLimitReached``)."""
        ledger = keys.inflight_key(self.node)
        report = ReapReport(node=self.node)
        if not tags:
            return report
        with self.app.connection_for_write() as conn:
            for tag in sorted(tags):
                self._isolated(report, self._restore_one, conn.default_channel, ledger, tag, False)
        log.warning("leaving: handed %d task(s) this worker will not run back to their queue %s "
                    "(%d already gone, %d left after errors)", len(report.restored), report.restored,
                    report.gone, report.errors)
        return report

    def _restore_fetched(self, channel: Any, processing: str, item: bytes) -> tuple[str, str]:
        """Move one message from a processing list back to its queue, atomically
        (a poison item to its dead-letter list)."""
        client = channel.client
        try:
            payload = check_envelope(item)
        except PoisonMessage as poison:
            # A processing list does not say which queue an item came from.
            moved = dead_letter_fetched(client, processing, item, queue=keys.UNKNOWN_QUEUE,
                                        node=keys.node_of_processing_key(processing), poison=poison)
            return ("dead-lettered" if moved else "gone"), poison.kind
        task_id = str((payload.get("headers") or {}).get("id") or "")
        delivery = (payload.get("properties") or {}).get("delivery_info") or {}
        exchange, routing_key = delivery.get("exchange", ""), delivery.get("routing_key", "")
        counter = keys.redeliveries(task_id)
        def attempt(pipe: Any) -> tuple[str, str]:
            pipe.watch(processing, counter)
            if pipe.lpos(processing, item) is None:  # restored by another reaper
                pipe.unwatch()
                return "gone", task_id
            count = int(pipe.get(counter) or 0)
            if count >= self.max_redeliveries:
                pipe.unwatch()
                self._fail(task_id, count)
                client.lrem(processing, 1, item)
                return "failed", task_id
            pipe.multi()
            pipe.lrem(processing, 1, item)
            self._push(channel, pipe, payload, exchange, routing_key)
            pipe.incr(counter)
            pipe.expire(counter, self.counter_ttl_s)
            pipe.execute()
            return "restored", task_id

        return _watched(client, attempt)

    def _restore_one(self, channel: Any, ledger: str, tag: str, count: bool = True) -> tuple[str, str]:
        """Move one message from ``unacked`` back to its queue, atomically.

        ``count``: a redelivery (its holder died): counted, and failed for good
        past ``max_redeliveries``."""
        client = channel.client
        def attempt(pipe: Any) -> tuple[str, str]:
            pipe.watch(keys.KOMBU_UNACKED)
            raw = pipe.hget(keys.KOMBU_UNACKED, tag)
            if raw is None:  # acked, or already restored by another reaper
                pipe.multi()
                pipe.srem(ledger, tag)
                pipe.execute()
                return "gone", ""
            try:
                payload, exchange, routing_key = _unacked_entry(raw)
            except PoisonMessage as poison:
                pipe.unwatch()
                moved = dead_letter_unacked(
                    client, tag, raw, ledger=ledger, queue=_queue_of_unacked(raw),
                    node=keys.node_of_inflight_key(ledger), poison=poison)
                return ("dead-lettered" if moved else "gone"), poison.kind
            task_id = str((payload.get("headers") or {}).get("id") or tag)
            counter = keys.redeliveries(task_id)
            pipe.watch(counter)
            delivered = int(pipe.get(counter) or 0)
            if count and delivered >= self.max_redeliveries:
                pipe.unwatch()
                self._fail(task_id, delivered)
                self._drop(client, ledger, tag)
                return "failed", task_id
            holder = keys.node_of_inflight_key(ledger)
            pipe.multi()
            pipe.zrem(keys.KOMBU_UNACKED_INDEX, tag)
            pipe.hdel(keys.KOMBU_UNACKED, tag)
            self._push(channel, pipe, payload, exchange, routing_key)
            pipe.srem(ledger, tag)
            if holder != self.node:  # it may still run it, cut off: tell it (workers.queue.handed_on)
                pipe.sadd(keys.handed_on(holder), tag)
                pipe.expire(keys.handed_on(holder), self.counter_ttl_s)
            if count:
                pipe.incr(counter)
                pipe.expire(counter, self.counter_ttl_s)
            pipe.execute()
            return "restored", task_id

        return _watched(client, attempt)

    @staticmethod
    def _reroute(channel: Any, queue: str) -> tuple[str, str]:
        """The oldest message of a dead worker's own queue → the shared queue it was routed
        past (its ``FALLBACK_QUEUE_HEADER``), atomically; not a redelivery: nobody ran it."""
        def attempt(pipe: Any) -> tuple[str, str]:
            pipe.watch(queue)
            item = pipe.lindex(queue, -1)  # consumers pop from the right: the oldest
            if item is None:
                return "gone", ""
            try:
                payload = loads(bytes_to_str(item))
                headers = payload.get("headers") or {}
                fallback = str(headers.get(keys.FALLBACK_QUEUE_HEADER) or keys.GENERATE_QUEUE)
                task_id = str(headers.get("id") or "")
                payload.setdefault("properties", {}).setdefault("delivery_info", {}).update(
                    exchange="", routing_key=fallback)
                target, moved = fallback, dumps(payload)
            except Exception:  # noqa: BLE001  unreadable: dead-lettered, not lost
                target, moved, task_id = keys.dead_letters(queue), item, "undecodable item"
            pipe.multi()
            pipe.rpop(queue)
            pipe.rpush(target, moved)  # the served end: it waited its turn already
            pipe.execute()
            return ("restored" if target != keys.dead_letters(queue) else "dead-lettered"), task_id

        return _watched(channel.client, attempt)

    @staticmethod
    def _push(channel: Any, pipe: Any, payload: dict[str, Any], exchange: str, routing_key: str) -> None:
        """What kombu's ``Channel._do_restore_message`` does, inside our transaction.

        The queue comes from kombu's binding table; if that is missing (a
        Redis restarted without persistence) the routing key is the queue
        name, as it is for every queue Celery declares for us.
        """
        if not isinstance(payload.get("headers"), dict):  # absent, or null
            payload["headers"] = {}
        payload["headers"]["redelivered"] = True
        payload.setdefault("properties", {}).setdefault("delivery_info", {})["redelivered"] = True
        queues = channel._lookup(exchange, routing_key) or [routing_key]
        priority = channel._get_message_priority(payload, reverse=False)
        for queue in queues:
            # RPUSH: consumers BRPOP from the right, so it is served next.
            pipe.rpush(channel._q_for_pri(queue, priority), dumps(payload))

    def _fail(self, task_id: str, count: int) -> None:
        error = RedeliveryLimitReached(
            f"task {task_id} was redelivered {count} times because the worker running it died "
            f"each time (max {self.max_redeliveries}, RQ_TASK_MAX_REDELIVERIES); it is not retried "
            "again. Check the workers' logs and memory (a request that crashes or OOM-kills its "
            "worker?)"
        )
        self.app.backend.mark_as_failure(task_id, error)

    @staticmethod
    def _drop(client: redis.Redis, ledger: str, tag: str) -> None:
        with client.pipeline() as pipe:
            pipe.zrem(keys.KOMBU_UNACKED_INDEX, tag)
            pipe.hdel(keys.KOMBU_UNACKED, tag)
            pipe.srem(ledger, tag)
            pipe.execute()


def _watched(client: redis.Redis, attempt: Callable[[Any], tuple[str, str]]) -> tuple[str, str]:
    """``attempt(pipe)``, once more each time a key it watched changed before its
    transaction ran (Redis's optimistic lock: WATCH, read, MULTI, write, EXEC);
    its answer."""
    with client.pipeline() as pipe:
        while True:
            try:
                return attempt(pipe)
            except redis.WatchError:
                continue


def _unacked_entry(raw: bytes | str) -> tuple[dict[str, Any], str, str]:
    """kombu's unacked record: ``[envelope, exchange, routing_key]``, checked."""
    try:
        entry = loads(bytes_to_str(raw))
    except Exception as exc:  # JSONDecodeError, or kombu's "__type__" hook
        raise PoisonMessage("not-json", f"unacked record is not JSON: {exc}") from exc
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[1], str)
            and isinstance(entry[2], str)):
        raise PoisonMessage("bad-envelope", "unacked record is not [envelope, exchange, routing_key]")
    return check_envelope(dumps(entry[0])), entry[1], entry[2]


def _queue_of_unacked(raw: bytes | str) -> str:
    """The routing key (for our queues, the queue name) of an unacked record, if readable."""
    try:
        routing_key = loads(bytes_to_str(raw))[2]
    except Exception:  # noqa: BLE001  unreadable: no queue to name
        return keys.UNKNOWN_QUEUE
    return routing_key if isinstance(routing_key, str) and routing_key else keys.UNKNOWN_QUEUE


def _own_queues(channel: Any, node: str) -> list[str]:
    """The lists of ``node``'s own queue (sticky sessions), one per priority."""
    return [channel._q_for_pri(keys.node_queue(node), p) for p in channel.priority_steps]


def _aged(first_seen: dict[Any, float], current: Any, after_s: float) -> tuple[dict[Any, float], list[Any]]:
    """When each of ``current`` was first seen (kept from ``first_seen``, now if
    new; items gone are forgotten), and those seen for ``after_s`` or longer."""
    now = time.monotonic()
    seen = {item: first_seen.get(item, now) for item in current}
    return seen, [item for item, first in seen.items() if now - first >= after_s]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
