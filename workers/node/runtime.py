"""``WorkerRuntime``: one worker node's parts, their state, and its heartbeat.

Owns the ``EngineHost``, the ``GenerationService`` that ``generate`` tasks run
through, the ``SyncParticipant``, the ``CommandVerifier`` of signed control
commands, the registry heartbeat (a thread writing ``WorkerInfo`` with a TTL)
and fencing: a worker whose weights are older than the fleet's stops
consuming the generate queue until a sync catches it up; one whose writes
Redis refuses for memory (a fetch, the registry) stops until its registry
write goes through again (:meth:`WorkerRuntime.redis_full`).
Its state (``workers.state.NodeState``, the engine host's) is written only
through its transitions; the runtime follows each change, consuming its queues
or not and publishing the registry entry (a change while a weight sync runs
from the registry writer thread: the sync does not wait for it).
It also owns the in-flight ledger and the reaper (``workers.queue.reaper``) that
redeliver a dead worker's tasks.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from rollout_queue.tasks import keys
from rollout_queue.tasks.app import app
from rollout_queue.tasks.auth import CommandVerifier
from rollout_queue.tasks.registry import connect, fleet_version, remove_entry, write_entry
from rollout_queue.tasks.schemas import WorkerInfo
from rollout_queue.weight_sync.locality import host_id
from rollout_queue.workers.engine.host import EngineHost, per_request_stream_interval
from rollout_queue.workers.engine.liveness import EngineWatch
from rollout_queue.workers.engine.progress import ProgressStore
from rollout_queue.workers.node.service import GenerationService
from rollout_queue.workers.node.sync import SyncParticipant
from rollout_queue.workers.queue import ledger_index
from rollout_queue.workers.queue.dedup import DuplicateGuard, quick_client
from rollout_queue.workers.queue.handed_on import HandedOn
from rollout_queue.workers.queue.intake import Intake
from rollout_queue.workers.queue.reaper import InflightLedger, Reaper
from rollout_queue.workers.settings import WorkerSettings
from rollout_queue.workers.state import CAUGHT_UP, FenceReason, NodeState

log = logging.getLogger(__name__)

# The exit code of a worker that left because its engine was lost (died or
# hung): non-zero, so that its supervisor (compose's restart policy,
# Kubernetes, systemd) starts a fresh one. 3 is "the engine did not load".
ENGINE_LOST_EXIT = 4
# How long a worker whose engine is lost waits for its tasks to go back to the
# queue before it stops (they go at once: their requests fail or are cancelled).
HAND_BACK_S = 30.0
# How long after a sync's start the registry writer says it: the sync's own steps in
# this process (its pause, claim and engine call: ~1 ms on a GPU host) run first, the
# write's Python (the entry's ~0.5 ms) not taking their interpreter lock; then the
# engine copies and this process waits.
SYNC_SAID_AFTER_S = 0.005
# KEYS[1]: the registry key; ARGV: the entry, its TTL (ms). Goes through when Redis is
# full (its first write, the DEL, frees what the SET takes again; a script that has
# written is not stopped midway): the registry says the worker is fenced meanwhile.
REPLACE_ENTRY_SCRIPT = """
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


class WorkerRuntime:
    def __init__(
        self, settings: WorkerSettings, host: EngineHost, forget_on_ack: Callable[[str], None],
    ) -> None:
        """``forget_on_ack``: the transport's (``FetchHooks``), for tasks the
        fleet handed on while this worker was cut off."""
        self.settings = settings
        self.host = host
        self.node = settings.name
        self.client: redis.Redis = connect(settings)
        self.state = host.state
        self.started_at = time.time()
        handed_on = HandedOn(self.client, self.node, forget_on_ack)
        self.service = GenerationService(
            host, self.node, settings.task_soft_time_limit, settings.task_time_limit, self.client, handed_on
        )
        self.duplicates = DuplicateGuard(app.backend, quick_client(settings))
        budget = settings.intake_sequences or host.max_num_seqs
        self.intake = Intake(host, budget)
        self.service.on_submitted = self.intake.entered
        self.set_checkpoint_tokens(settings.checkpoint_tokens)
        self.ledger = InflightLedger(self.client, self.node, ttl_s=settings.visibility_timeout)
        self.reaper = Reaper(
            app, self.client, self.node,
            max_redeliveries=settings.task_max_redeliveries,
            grace_s=settings.reap_grace_s,
            interval_s=settings.heartbeat_s,
            counter_ttl_s=settings.result_expires,
            ledger=self.ledger,
            held=held_delivery_tags,
        )
        # Checks the signature of every state-changing control command (workers/node/control.py).
        self.verifier = CommandVerifier(self.node, settings.control_secret(), settings.control_max_age_s,
                                        client=self.client)
        self.sync = SyncParticipant(host, self.node, self.client, self.state, self.verifier)
        # Where a colocated trainer finds this worker: its host, its GPU (weight_sync/transports).
        self.host_id = host_id()
        self.device_uuids = host.device_uuids() if settings.colocated and settings.device == "cuda" else []
        self.watch = EngineWatch(host, settings.engine_answer_s)
        host.on_lost.append(self._engine_lost)
        self.exit_code: int | None = None  # set when the worker must exit non-zero
        self.consumer: Any = None
        self._consuming = True
        self.state.on_change(self._follow)
        self._stop = threading.Event()
        # One registry write at a time, each of the state as it is when written: whatever
        # order they run in, the last one says the latest state (reentrant: a write that
        # fences or lifts a fence writes again inside). ``_removed``: the entry is gone
        # for good (stop), nothing writes it again.
        self._publishing = threading.RLock()
        self._removed = False
        # A change for the writer thread to say (set by _follow while a sync runs).
        self._changed = threading.Event()
        self._writer = threading.Thread(target=self._write_changes, name="registry-writer", daemon=True)
        self._hand_back: threading.Thread | None = None  # hand_back_waiting()'s, if any
        self._heartbeat = threading.Thread(target=self._beat, name="registry-heartbeat", daemon=True)
        self._last_tokens = (time.monotonic(), 0)
        self.tokens_per_s = 0.0

    # ----------------------------------------------------------------- state

    def _follow(self, state: NodeState) -> None:
        """After each change of the state: consume the queues or not, and say so in the registry.

        While a weight sync runs, the writer thread says it: a sync's start is on the
        path to the engine's first copy, and nobody waits for the registry to say
        "syncing" (the sync's end writes the entry itself, on its own thread)."""
        self._set_consuming(state.consuming)
        if state.current == "syncing":  # written SYNC_SAID_AFTER_S later
            self._changed.set()
        else:
            self.publish()

    def _write_changes(self) -> None:
        """The registry writer thread: each change ``_follow`` hands it, written
        ``SYNC_SAID_AFTER_S`` later (the sync's own steps in this process go first)."""
        while True:
            self._changed.wait()
            if self._stop.wait(SYNC_SAID_AFTER_S):
                return
            self._changed.clear()
            self.publish()

    def _set_consuming(self, on: bool) -> None:
        if on == self._consuming or self.consumer is None:
            self._consuming = on
            return
        self._consuming = on
        switch_queues(self.consumer, self.settings.consumed_queues, lambda: self._consuming)

    def set_checkpoint_tokens(self, tokens: int) -> int:
        """Checkpoint partial generations every ``tokens`` tokens (0: off), from the
        next task on; the previous interval. (``--checkpoint-tokens`` at start;
        the ``checkpoint_tokens`` engine op later: a benchmark's A/B legs on one engine.)"""
        if tokens < 0:
            raise ValueError(f"checkpoint_tokens must be >= 0, not {tokens}")
        previous = self.service.checkpoint_tokens
        if tokens > 0 and previous <= 0 and not per_request_stream_interval():
            engine_every = getattr(self.host.engine.vllm_config.scheduler_config, "stream_interval", 1)
            if engine_every < tokens:
                # Measured on an H200 (1,024 x 256 tokens, vLLM 0.24): 0.67x the
                # throughput without checkpoints (docs/BENCHMARKS.md).
                log.warning(
                    "checkpoints every %d tokens on a vLLM without per-request stream_interval: every "
                    "request sends an output every %d step(s), which costs throughput (0.67x measured "
                    "on an H200); start the worker with --stream-interval %d to send one per checkpoint "
                    "(streamed tasks then get their deltas that often too)", tokens, engine_every, tokens)
        if tokens > 0 and self.service.progress is None:
            # A checkpoint outlives its task's longest possible redelivery wait.
            self.service.progress = ProgressStore(self.client, self.settings.visibility_timeout)
        self.service.checkpoint_tokens = tokens
        return previous

    def info(self) -> WorkerInfo:
        inflight = self.host.inflight_requests()
        engine = self.host.stats.snapshot()
        # The engine reports only while it steps: once idle, its last figures
        # are stale (they still count the requests that just finished).
        busy = inflight > 0
        return WorkerInfo(
            node=self.node,
            pool=self.settings.pool,
            queues=self.settings.consumed_queues,
            model=self.settings.model,
            device=self.settings.device,
            dtype=self.host.dtype,
            tensor_parallel_size=self.settings.tensor_parallel_size,
            weight_version=self.host.weight_version,
            state=self.state.current,
            inflight_requests=inflight,
            waiting_requests=engine.waiting_requests if busy else 0,
            inflight_tasks=self.service.inflight_tasks,
            tokens_per_s=round(self.tokens_per_s, 1),
            generated_tokens=self.host.generated_tokens,
            kv_cache_usage=round(engine.kv_cache_usage, 4) if busy else 0.0,
            max_model_len=self.host.max_model_len,
            vocab_size=self.host.vocab_size,
            **_logprob_settings(self.host.engine),
            metrics_port=self.settings.metrics_port,
            started_at=self.started_at,
            heartbeat_at=time.time(),
            heartbeat_s=self.settings.heartbeat_s,
            engine_answered_at=self.watch.answered_at,
            colocated=self.settings.colocated,
            host_id=self.host_id,
            device_uuids=self.device_uuids,
        )

    def publish(self) -> None:
        with self._publishing:
            if not self._removed:
                self._publish()

    def _publish(self) -> None:
        ttl_ms = int(self.settings.registry_ttl_s * 1000)
        try:
            write_entry(self.client, self.node, self.info().model_dump_json(), ttl_ms)
        except redis.exceptions.OutOfMemoryError as exc:
            self.redis_full(str(exc))
            key = keys.worker_key(self.node)
            try:  # the entry says fenced, and lives on (other workers' reapers spare us)
                self.client.eval(REPLACE_ENTRY_SCRIPT, 1, key, self.info().model_dump_json(), ttl_ms)
            except redis.RedisError:
                try:  # EXPIRE is allowed when full: the last entry at least
                    self.client.pexpire(key, ttl_ms)
                except redis.RedisError:
                    pass
        except redis.RedisError as exc:
            log.warning("registry heartbeat failed: %s", exc)
        else:
            if self.state.fence_reason is FenceReason.REDIS_FULL:
                log.warning("Redis has room again: %s takes tasks again", self.node)
                self.state.lift(FenceReason.REDIS_FULL)

    # ------------------------------------------------------------ Redis full

    def redis_full(self, detail: str) -> None:
        """Redis refused a write for memory (a fetch, the registry): fence until the
        heartbeat's registry write goes through again. Tasks held run on."""
        if self.state.fence_reason is None and self.state.current != "stopping":
            self.state.fence(
                FenceReason.REDIS_FULL,
                f"Redis is full ({detail.strip()}); taking no task until it has room: free memory "
                "or raise its maxmemory",
            )
            log.warning("fenced: Redis is full (%s); %s takes no task until it has room", detail, self.node)

    # ------------------------------------------------------------- heartbeat

    def start(self) -> None:
        """Before consuming: name this node in the reapers' ledger index (its fetch
        does too), reclaim a previous incarnation's tasks, then beat and reap."""
        try:
            ledger_index.enlist(self.client, self.node)
            self.reaper.reclaim_own()
        except redis.RedisError as exc:
            log.warning("could not reclaim this node's previous tasks: %s", exc)
        self._heartbeat.start()
        self._writer.start()
        self.reaper.start()

    def drain(self, timeout_s: float) -> None:
        """SIGTERM: tasks still running ``timeout_s`` from now are handed off (the
        engine aborts them, their progress is checkpointed, they go back to the
        queue at once) so that the worker can exit well within its notice."""
        def hand_off() -> None:
            count = self.host.hand_off()
            log.warning("drain deadline (%.1f s) passed: handed %d unfinished requests back to "
                        "the queue", timeout_s, count)

        timer = threading.Timer(timeout_s, hand_off)
        timer.name, timer.daemon = "drain-deadline", True
        timer.start()

    def hand_back_waiting(self) -> None:
        """SIGTERM: the tasks waiting in Celery's timer for their ETA or countdown
        will not run here; their timer entries are cancelled and their messages
        go back to the queue now, uncounted (on a thread: this runs in the
        signal handler, which must not wait on Redis)."""
        waiting = waiting_for_eta(self.consumer)
        for entry in waiting:
            entry.cancel()
        tags = {entry.args[0].message.delivery_tag for entry in waiting}
        if tags:
            self._hand_back = threading.Thread(
                target=self._hand_back_quietly, args=(tags,), name="hand-back", daemon=True)
            self._hand_back.start()

    def _hand_back_quietly(self, tags: set[str]) -> None:
        try:
            self.reaper.hand_back(tags)
        except Exception as exc:  # noqa: BLE001  Redis away: stop() tries again with what is left
            log.warning("could not hand back this worker's waiting tasks: %s", exc)

    def stop(self) -> None:
        """After Celery stopped (in-flight tasks finished or requeued): what this
        worker still holds and runs no task for goes back to the queue uncounted
        (``Reaper.hand_back``), so a graceful exit is never taken for a death."""
        self._stop.set()
        self.reaper.stop()
        self.sync.close()  # no trigger through the trainer's store from here on
        if self._hand_back is not None:
            self._hand_back.join(timeout=30)
        try:
            held = self.ledger.prune()
            if held:
                self.reaper.hand_back(held - running_delivery_tags())
        except Exception as exc:  # noqa: BLE001  Redis away: the engine must still shut down (the
            # reaper restores them later, counted: this process cannot tell it otherwise).
            log.warning("could not hand back the tasks this worker still holds: %s", exc)
        self.state.stopping()
        self._changed.set()  # the writer thread ends (_stop is set)
        self.ledger.close()
        with self._publishing:
            self._removed = True
            try:
                remove_entry(self.client, self.node)
            except redis.RedisError:
                pass

    def _beat(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            now, tokens = time.monotonic(), self.host.generated_tokens
            last_t, last_tokens = self._last_tokens
            self.tokens_per_s = (tokens - last_tokens) / max(now - last_t, 1e-6)
            self._last_tokens = (now, tokens)
            lost = self.watch.check(busy=self.sync.busy()) if self.host.lost is None else None
            if lost is not None:
                self.host.lose(lost)
            try:
                self._check_fleet_version()
                if self.service.handed_on is not None:
                    self.service.handed_on.notice()
            except Exception as exc:  # noqa: BLE001  Redis away: keep beating, reconnect later
                log.warning("fleet version check failed: %s", exc)
            self.publish()

    def _engine_lost(self, reason: str) -> None:
        """The engine died or hung (``EngineHost.lose``): take no more tasks, hand
        back those held (each raises ``EngineLost`` or is refused: back to the
        queue, not failed), and exit non-zero for a supervisor to start a fresh
        worker. Restarting the engine in place would come back on the model's
        original weights, behind the fleet: a fresh worker catches up the
        usual way."""
        log.error("worker %s: %s; fenced, handing its tasks back to the queue and exiting "
                  "(code %d) for its supervisor to restart it", self.node, reason, ENGINE_LOST_EXIT)
        self.exit_code = ENGINE_LOST_EXIT
        self.state.fence(FenceReason.ENGINE_LOST, f"{self.node}'s engine is lost ({reason})")
        leave = threading.Thread(target=self._leave, name="engine-lost", daemon=True)
        leave.start()

    def _leave(self) -> None:
        deadline = time.monotonic() + HAND_BACK_S
        while self.service.inflight_tasks and time.monotonic() < deadline:
            time.sleep(0.1)
        # Celery's warm shutdown: tasks still reserved run, are refused (fenced) and requeued.
        os.kill(os.getpid(), signal.SIGTERM)

    def _check_fleet_version(self) -> None:
        if self.sync.busy() or self.state.current in ("sleeping", "stopping", "starting"):
            return
        fleet = fleet_version(self.client, self.settings.pool)
        if fleet > self.host.weight_version:
            if self.state.fence_reason is None:
                self.state.fence(
                    FenceReason.FLEET_AHEAD,
                    f"fleet is at weight_version {fleet}, this worker at {self.host.weight_version}; "
                    "waiting for the next sync",
                )
        else:
            held = self.state.held_for  # a missed round's: lifted once it is over
            over = held is not None and bool(self.client.exists(keys.sync_over(held)))
            self.state.lift(*CAUGHT_UP, round_over=over)


def switch_queues(consumer: Any, queues: list[str], wanted: Callable[[], bool]) -> None:
    """Consume ``queues`` (in their order) or cancel them, as ``wanted()`` says
    when the consumer's event loop gets to it: one callback there.

    Order matters: the fetch blocks on the first queue a worker consumes and
    only sweeps the others (``workers.queue.reliable_redis``). kombu's hub
    keeps its pending callbacks in a set, so one callback per queue re-added
    them in any order: a worker unfenced after a missed sync could block on
    its own sticky queue and sweep the shared one every 50 ms, while a peer
    blocked on the shared queue took every message (seen in CI: six tasks
    sent to two workers, all six to one). For the same reason a cancel and
    an add pending together could run add first: each callback applies the
    state wanted when it runs (both of Celery's calls are idempotent).
    """
    def switch() -> None:
        on = wanted()
        for queue in queues:
            if on:
                consumer.add_task_queue(queue)
            else:
                consumer.cancel_task_queue(queue)

    consumer.call_soon(switch)


def held_delivery_tags() -> set[str]:
    """The delivery tags of the tasks this worker process holds (received, not
    finished): Celery's worker state, read from the reaper's thread."""
    from celery.worker import state

    while True:
        try:
            requests = tuple(state.requests.values())
        except RuntimeError:  # changed size while copied (the consumer's thread): again
            continue
        return {request.message.delivery_tag for request in requests}


def running_delivery_tags() -> set[str]:
    """The delivery tags of the tasks this worker process runs now (started, not finished)."""
    from celery.worker import state

    return {request.message.delivery_tag for request in tuple(state.active_requests)}


def waiting_for_eta(consumer: Any) -> list[Any]:
    """The timer entries of Celery's ``consumer`` that will start a task at its ETA
    (``Consumer.apply_eta_task``; their first argument is the task's request),
    not cancelled; none without a consumer."""
    timer = getattr(consumer, "timer", None)
    if timer is None:
        return []
    entries = [scheduled[-1] for scheduled in timer.queue]  # (eta, priority, entry), a snapshot
    return [entry for entry in entries
            if getattr(entry.fun, "__name__", "") == "apply_eta_task" and entry.args and not entry.cancelled]


def _logprob_settings(engine: Any) -> dict[str, Any]:
    """The engine's max_logprobs and logprobs_mode, for the registry (the gateway's
    limits and ``/server_info``); nothing while no engine is up."""
    model_config = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    if model_config is None:
        return {}
    return {"max_logprobs": int(model_config.max_logprobs), "logprobs_mode": str(model_config.logprobs_mode)}
