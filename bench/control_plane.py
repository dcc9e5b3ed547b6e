"""The control plane at scale, simulated: N engine-less workers on the real Redis.

    .venv/bin/python bench/control_plane.py --workers 16 64 256      # one JSON line per N

Each simulated worker node is what a worker is to Redis, without an engine:

* a real Celery broadcast consumer: a kombu pidbox ``Node`` under its own node
  name, on a channel (its own SUBSCRIBE connection) of its process's broker
  connection, answering the real ``rq_weight_sync`` / ``rq_engine`` handlers of
  ``workers.node.control`` (signature checks by ``tasks.auth`` included) and
  replying through Celery's reply path;
* a ``workers.node.sync.SyncParticipant`` behind ``rq_weight_sync``, on a fake
  engine host that pauses, loads and resumes at once: "accepted", "ready" and
  "done" acks go through the real Redis ack lists, and the trainer's decision
  is read from its real TCPStore (no process group is ever joined);
* a registry heartbeat (``WorkerInfo`` with a TTL, and the fleet-version check,
  as ``workers.node.runtime``) and the real ``workers.queue.reaper`` passes (in-flight
  ledger, own fetches, sweep), every ``heartbeat_s``;
* a consumer of a bench queue on a connection of its own (BRPOP, prefetch 1) that
  completes each ``generate`` task with a tiny fake result in the real result
  backend, then acks (kombu's plain Redis fetch, not ``workers.queue.reliable_redis``).

The nodes run in ``--processes`` processes: one thread drains every node's
broadcast channel (so the control handlers run one at a time per process, as
in a worker's consumer loop), and a thread per node drains its task connection.

The trainer side runs here: ``WeightSender`` (weight_sync/sender.py) hosts its
store and runs membership, trigger (manifest by digest, signed broadcast, wait
for every "accepted" ack), ``await_ready`` and ``await_commit``; only
``transfer`` (the process group and the bytes) is left out. Then
``control.engine_stats()``, the status module's ``read_fleet`` + ``render``,
and ``INFO commandstats`` deltas: idle (the fleet's background polling) and
while ``--tasks`` generate tasks are sent and their results read. Last, one
reaper sweep among ``--sweep-keys`` unrelated keys (``sweep_ms``): reading the
ledger index, and walking the keyspace as before it.

Prints one JSON line per N on stdout; logs go to stderr. Uses the Redis of
``--redis-url`` / ``REDIS_URL`` (never flushed: its keys are the sim's pool,
queue and node names, left to expire). Every process stops by itself.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import platform
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rollout_queue.tasks.app import app, configure
from rollout_queue.tasks.registry import remove_entry, write_entry
from rollout_queue.tasks.settings import ClientSettings, redis_url_env

# The fake checkpoint every simulated worker checks sync manifests against.
TENSORS = {"model.embed_tokens.weight": [64, 16], "model.norm.weight": [16]}
HEARTBEAT_S = 2.0
REGISTRY_TTL_S = 10.0
SIM_HOST = "ctlsim"


def log(message: str) -> None:
    print(f"[control_plane] {message}", file=sys.stderr, flush=True)


def write_checkpoint(folder: Path) -> None:
    """A safetensors file holding only a header (names, dtypes, shapes) and zeros."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in TENSORS.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))


# ---------------------------------------------------------------------------
# The simulated worker (runs in the child processes)
# ---------------------------------------------------------------------------


@dataclass
class SimServiceCounts:
    """What ``engine_op`` and the registry read of ``GenerationService``: its task counts."""

    inflight_tasks: int = 0
    completed_tasks: int = 0
    failed_tasks: int = 0


class FakeEngineHost:
    """What ``SyncParticipant`` and ``engine_op`` use of ``EngineHost``; no engine.

    Its settings, state and stats are the real classes (``EngineSettings``,
    ``NodeState``, ``EngineStats``, never stepped): a field the control plane
    starts reading is there, zero, rather than missing from a stand-in. The
    bench's smoke run in the suite (tests/test_bench_smoke.py) runs every
    ``rq_engine`` op the bench sends."""

    def __init__(self, model: str) -> None:
        from rollout_queue.workers.engine.stats import EngineStats
        from rollout_queue.workers.settings import EngineSettings
        from rollout_queue.workers.state import NodeState

        self.settings = EngineSettings(model=model, device="cpu")
        self.state = NodeState()
        self.dtype = "float32"
        self.weight_version = 0
        self.max_model_len = 512
        self.max_num_seqs = 256
        self.generated_tokens = 0
        self.stats = EngineStats()

    def weights_asleep(self) -> bool:
        return False

    def weights_dropped(self) -> bool:
        return False

    def weights_restored(self) -> None:
        pass

    def weights_loading(self) -> None:
        pass

    def inflight_requests(self) -> int:
        return 0

    def unfinished_sequences(self) -> int:
        return 0

    def pause(self, mode: str, timeout: float) -> None:
        self.state.hold_intake()

    def resume(self, new_version: int | None, timeout: float) -> None:
        if new_version is not None:
            self.weight_version = new_version
        self.state.release_intake()

    def collective_rpc(self, method: str, timeout: float, *args: Any) -> list[Any]:
        if method == "rq_update":  # the bytes are the data plane: not simulated
            return [{"seconds": {"join_s": 0.0, "receive_s": 0.0, "wire_s": 0.0, "load_s": 0.0, "finish_s": 0.0}}]
        if method == "rq_abort_update":
            return [False]
        raise ValueError(f"the simulated engine has no {method}")

    def update_engine(self, request: dict[str, Any], timeout: float) -> tuple[list[Any], str]:
        return self.collective_rpc("rq_update", timeout, request), "call"

    def reset_prefix_cache(self) -> bool:
        return True

    def sleep(self, level: int) -> None:
        self.state.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is None or "kv_cache" in tags:
            self.state.wake()


class SimNode:
    """One simulated worker node: the parts of ``WorkerRuntime`` the control plane sees."""

    def __init__(self, node: str, pool: str, queue: str, model: str, secret: str, conn: Any) -> None:
        import redis as redis_lib
        from celery.utils.collections import AttributeDict

        from rollout_queue.tasks.auth import CommandVerifier
        from rollout_queue.tasks.registry import connect
        from rollout_queue.workers.node.sync import SyncParticipant
        from rollout_queue.workers.queue.reaper import InflightLedger, Reaper

        self.node = node
        from rollout_queue.workers.queue.intake import Intake
        from rollout_queue.workers.settings import WorkerSettings

        self.settings = WorkerSettings(name=node, pool=pool, queues=[queue], model=model, device="cpu")
        self.host = FakeEngineHost(model)
        self.client: redis_lib.Redis = connect(ClientSettings())
        self.state = self.host.state
        self.state.on_change(lambda state: self.publish())
        self.started_at = time.time()
        self.service = SimServiceCounts()
        self.intake = Intake(self.host, self.host.max_num_seqs)
        self.verifier = CommandVerifier(node, secret, 30.0)
        self.sync = SyncParticipant(self.host, node, self.client, self.state, self.verifier)
        self.ledger = InflightLedger(self.client, node, ttl_s=3600)
        self.reaper = Reaper(app, self.client, node, max_redeliveries=3, grace_s=10.0, interval_s=HEARTBEAT_S,
                             counter_ttl_s=3600, ledger=self.ledger)
        # Remote control: the node's own channel (a SUBSCRIBE connection), Celery's Node.
        self.mailbox = app.control.mailbox.Node(
            node, handlers=handlers_for(self),
            state=AttributeDict(app=app, hostname=node, consumer=None, tset=set))
        self.mailbox.channel = conn.channel()
        self.mailbox.listen(callback=self._on_control)
        # Tasks: a connection of its own (kombu's virtual transports deliver a queue's
        # messages to one consumer per connection), drained by a thread of its own.
        from kombu import Consumer, Queue

        self.task_connection = app.connection_for_read()
        self.task_connection.ensure_connection(max_retries=3)
        self.task_channel = self.task_connection.channel()
        self.task_channel.basic_qos(prefetch_count=1)
        self.tasks = Consumer(self.task_channel, queues=[Queue(queue)], callbacks=[self._on_task],
                              accept=["json"])
        self.tasks.consume()

    def drain_tasks(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.task_connection.drain_events(timeout=1.0)
            except TimeoutError:
                pass

    def _on_control(self, body: Any, message: Any) -> None:
        try:
            self.mailbox.handle_message(body, message)
        except Exception as exc:  # noqa: BLE001  as Celery's Pidbox.on_message: log, go on
            log(f"{self.node}: control command error: {exc!r}")

    def _on_task(self, body: Any, message: Any) -> None:
        task_id = message.headers["id"]
        result = {"worker": self.node, "weight_version": self.host.weight_version, "outputs": [],
                  "usage": {"prompt_tokens": 0, "completion_tokens": 0}}
        app.backend.store_result(task_id, result, "SUCCESS")
        message.ack()
        self.service.completed_tasks += 1

    # What workers.node.control's handlers call on a runtime.
    def info(self) -> Any:
        from rollout_queue.tasks.schemas import WorkerInfo

        return WorkerInfo(
            node=self.node, pool=self.settings.pool, queues=self.settings.queues, model=self.settings.model,
            device="cpu", dtype=self.host.dtype, weight_version=self.host.weight_version, state=self.state.current,
            inflight_tasks=self.service.inflight_tasks, max_model_len=self.host.max_model_len,
            started_at=self.started_at, heartbeat_at=time.time(), heartbeat_s=HEARTBEAT_S,
        )

    def publish(self) -> None:
        write_entry(self.client, self.node, self.info().model_dump_json(), int(REGISTRY_TTL_S * 1000))

    def beat(self) -> None:
        """One heartbeat of ``WorkerRuntime._beat``: the fleet-version check, then the registry."""
        from rollout_queue.tasks.registry import fleet_version
        from rollout_queue.workers.state import CAUGHT_UP, FenceReason

        if not self.sync.busy() and self.state.current not in ("sleeping", "stopping", "starting"):
            fleet = fleet_version(self.client, self.settings.pool)
            if fleet > self.host.weight_version and self.state.fence_reason is None:
                self.state.fence(FenceReason.FLEET_AHEAD, f"fleet is at weight_version {fleet}")
            elif fleet <= self.host.weight_version:
                self.state.lift(*CAUGHT_UP)
        self.publish()

    def reap(self) -> None:
        """One pass of ``Reaper._loop``."""
        self.ledger.prune()
        self.reaper.check_own_fetches()
        self.reaper.sweep()

    def stop(self) -> None:
        remove_entry(self.client, self.node)


def handlers_for(node: SimNode) -> dict[str, Any]:
    """Celery's command registry with the real ``rq_*`` handlers bound to ``node``
    (``workers.node.control.ControlPanel``: one per node, as in a worker process)."""
    from celery.worker.control import Panel

    from rollout_queue.workers.node.control import ControlPanel

    return {**Panel.data, **ControlPanel(node).handlers()}  # type: ignore[arg-type]


def run_sim_process(args: argparse.Namespace) -> int:
    """A child: ``--count`` nodes, until stdin closes or ``--lifetime`` runs out."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import torch.distributed  # noqa: F401  the sync threads' TCPStore client, imported once here

    from rollout_queue.workers.node import control

    configure(ClientSettings(), worker=True)
    control.restrict_celery_control(False)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    conn = app.connection_for_read()
    conn.ensure_connection(max_retries=3)
    nodes = [SimNode(f"sim{i}@{SIM_HOST}", args.pool, args.queue, args.model, os.environ["RQ_WEIGHT_SYNC_SECRET"], conn)
             for i in range(args.first, args.first + args.count)]

    def beat() -> None:  # every node's heartbeat and reaper pass, spread over the interval
        while not stop.is_set():
            began = time.monotonic()
            for index, node in enumerate(nodes):
                try:
                    node.beat()
                    node.reap()
                except Exception as exc:  # noqa: BLE001  keep beating, as the runtime does
                    log(f"{node.node}: heartbeat failed: {exc!r}")
                stop.wait(max(0.0, began + HEARTBEAT_S * (index + 1) / len(nodes) - time.monotonic()))

    for node in nodes:
        node.state.ready()
    threading.Thread(target=beat, daemon=True, name="heartbeats").start()
    for node in nodes:
        threading.Thread(target=node.drain_tasks, args=(stop,), daemon=True, name=f"tasks-{node.node}").start()
    deadline = time.monotonic() + args.lifetime
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.5)
        except TimeoutError:
            pass
    stop.set()
    for node in nodes:
        node.stop()
    return 0


# ---------------------------------------------------------------------------
# The trainer / operator side (this process)
# ---------------------------------------------------------------------------


def commandstats(client: Any) -> dict[str, tuple[int, int]]:
    """``INFO commandstats``: command → (calls, usec)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in stats.items()}


def delta(after: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {name: (calls - before.get(name, (0, 0))[0], usec - before.get(name, (0, 0))[1])
            for name, (calls, usec) in after.items()}


def wait_for_fleet(client: Any, pool: str, count: int, timeout: float) -> None:
    from rollout_queue.tasks.registry import live_workers

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = [w for w in live_workers(client, pool) if w.state == "serving"]
        if len(live) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError(f"only {len(live)} of {count} simulated workers serving after {timeout:.0f}s")


def measure_sweeps(client: Any, counts: list[int], rounds: int, run_id: str) -> dict[str, dict[str, float]]:
    """One reaper sweep (``Reaper.sweep``), in ms (median of ``rounds``), with each of
    ``counts`` unrelated keys added (task-result-like, deleted after): ``index`` as it
    sweeps (the ledger index), ``scan`` as every sweep did before it and as the safety
    net does every ``ledger_index.SAFETY_SCAN_EVERY`` sweeps (a walk of the keyspace)."""
    from rollout_queue.workers.queue.reaper import InflightLedger, Reaper

    node = f"ctlsim-sweeper-{run_id}@{SIM_HOST}"
    reapers = {how: Reaper(app, client, node, max_redeliveries=3, grace_s=10.0, interval_s=HEARTBEAT_S,
                           counter_ttl_s=3600, ledger=InflightLedger(client, node, ttl_s=3600),
                           scan_every=every) for how, every in (("index", 10**9), ("scan", 1))}
    prefix, written = f"celery-task-meta-ctlsim-{run_id}-", 0
    figures: dict[str, dict[str, float]] = {}
    try:
        for count in sorted(counts):
            pipe = client.pipeline(transaction=False)
            for i in range(written, count):
                pipe.set(f"{prefix}{i}", "{}", ex=600)  # gone by themselves if this run dies
            pipe.execute()
            written = max(written, count)
            timings: dict[str, float] = {}
            for how, reaper in reapers.items():
                took = []
                for _ in range(rounds):
                    t = time.perf_counter()
                    reaper.sweep()
                    took.append(time.perf_counter() - t)
                timings[how] = round(1000 * statistics.median(took), 2)
            figures[str(count)] = timings
    finally:
        for start in range(0, written, 5_000):
            client.delete(*(f"{prefix}{i}" for i in range(start, min(written, start + 5_000))))
    return figures


def measure(args: argparse.Namespace, workers: int, secret: str, model: str) -> dict[str, Any]:
    import torch
    from rich.console import Console

    from rollout_queue.cli.status import read_fleet, render
    from rollout_queue.tasks import control
    from rollout_queue.tasks.generate import generate
    from rollout_queue.tasks.registry import connect
    from rollout_queue.tasks.schemas import SamplingParams
    from rollout_queue.weight_sync.sender import WeightSender, named_tensors
    from rollout_queue.weight_sync.settings import SyncSettings

    run_id = secrets.token_hex(3)
    pool, queue = f"ctlsim-{run_id}", f"ctlsim-{run_id}"
    client = connect(ClientSettings())
    per = -(-workers // args.processes)
    children = []
    began = time.monotonic()
    for index, first in enumerate(range(0, workers, per)):
        command = [sys.executable, __file__, "--sim-process", "--first", str(first),
                   "--count", str(min(per, workers - first)), "--pool", pool, "--queue", queue,
                   "--model", model, "--lifetime", str(args.lifetime)]
        children.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=sys.stderr,
                                         env={**os.environ, "RQ_WEIGHT_SYNC_SECRET": secret}))
    try:
        wait_for_fleet(client, pool, workers, timeout=120)
        started_s = time.monotonic() - began
        log(f"{workers} simulated workers serving after {started_s:.1f}s in {len(children)} processes")
        time.sleep(2 * HEARTBEAT_S)  # a few heartbeats and reaper passes: the steady state

        # 1. Weight-sync trigger → acks, the real sender without the transfer.
        sender = WeightSender(SyncSettings(weight_sync_secret=SecretStr(secret)), pool=pool)
        sender.rendezvous()
        tensors = named_tensors({name: torch.zeros(shape) for name, shape in TENSORS.items()})
        rounds: list[dict[str, float]] = []
        for _ in range(args.rounds):
            t0 = time.monotonic()
            members = sender.membership()
            t_members = time.monotonic()
            manifest, _ = sender.manifest(tensors, members, "gloo")
            deadline = time.monotonic() + 60
            plan = sender.plan_round(members, manifest, sender.next_version(), "wait", "gloo", deadline)
            silent = sender.trigger(plan, deadline)
            t_accepted = time.monotonic()
            decision, not_ready = sender.await_ready(plan, set(plan.members) - set(silent), deadline)
            t_ready = time.monotonic()
            committed, failed, _ = sender.await_commit(plan, decision, deadline)
            t_done = time.monotonic()
            if silent or not_ready or failed or len(committed) != workers:
                raise RuntimeError(f"sync incomplete: {len(committed)} committed; silent {silent}; "
                                   f"not ready {not_ready}; failed {failed}")
            # Each "ready" ack carries the node's trigger timing: publish → handler, and the handler.
            timing = [ack.seconds for ack in sender._acks.get("ready", {}).values()]
            rounds.append({"membership": t_members - t0, "accepted": t_accepted - t_members,
                           "ready": t_ready - t_members, "done": t_done - t_members,
                           "delivery_max": max(t["delivery"] for t in timing),
                           "delivery_median": statistics.median(t["delivery"] for t in timing),
                           "accept_median": statistics.median(t["accept"] for t in timing)})
            time.sleep(0.5)
        sender.close()

        def median(key: str) -> float:
            return round(statistics.median(r[key] for r in rounds), 4)

        # 2. engine_stats across the fleet (rq_engine "stats", replies from every node).
        stats_s = []
        for _ in range(args.rounds):
            t = time.monotonic()
            replies = control.engine_stats(pool=pool, timeout=10)
            stats_s.append(time.monotonic() - t)
            assert len(replies) == workers, f"{len(replies)} stats replies of {workers}"

        # 3. rollout-queue status: the data (read_fleet) and the table (render).
        read_s, render_s = [], []
        for _ in range(args.rounds):
            t = time.monotonic()
            view = read_fleet(client)
            read_s.append(time.monotonic() - t)
            t = time.monotonic()
            Console(file=io.StringIO(), width=200).print(render(view))
            render_s.append(time.monotonic() - t)

        # 4. Redis commands: the idle fleet per second, then per generate task.
        redis = connect(ClientSettings())
        before = commandstats(redis)
        t = time.monotonic()
        time.sleep(args.idle_s)
        idle_window = time.monotonic() - t
        idle = delta(commandstats(redis), before)
        idle_calls_s = sum(c for c, _ in idle.values()) / idle_window
        idle_usec_s = sum(u for _, u in idle.values()) / idle_window
        params = SamplingParams(max_tokens=1)
        before = commandstats(redis)
        t = time.monotonic()
        handles = [generate.apply_async(([[1, 2, 3]], params), queue=queue) for _ in range(args.tasks)]
        served = {h.get(timeout=60)["worker"] for h in handles}
        task_window = time.monotonic() - t
        busy = delta(commandstats(redis), before)
        busy_calls = sum(c for c, _ in busy.values())
        net_per_task = (busy_calls - idle_calls_s * task_window) / args.tasks
        per_command = {
            name: round((calls - idle.get(name, (0, 0))[0] / idle_window * task_window) / args.tasks, 2)
            for name, (calls, _) in busy.items() if calls}
        top_task = dict(sorted(per_command.items(), key=lambda kv: -kv[1])[:8])
        top_idle = dict(sorted(((n, round(c / idle_window, 1)) for n, (c, _) in idle.items() if c),
                               key=lambda kv: -kv[1])[:6])
        idle_cpu = dict(sorted(((n, round(u / idle_window / 1e6, 4)) for n, (_, u) in idle.items() if u),
                               key=lambda kv: -kv[1])[:4])
        keyspace = int(redis.dbsize())
        sweep_ms = measure_sweeps(redis, args.sweep_keys, args.rounds, run_id)
        return {
            "bench": "control_plane",
            "workers": workers,
            "processes": len(children),
            "trigger_to_all_acks_s": median("accepted"),
            "trigger_to_all_ready_s": median("ready"),
            "trigger_to_all_done_s": median("done"),
            "trigger_to_all_acks_max_s": round(max(r["accepted"] for r in rounds), 4),
            "membership_s": median("membership"),
            "trigger_delivery_max_s": median("delivery_max"),
            "trigger_delivery_median_s": median("delivery_median"),
            "accept_handler_median_ms": round(1000 * median("accept_median"), 2),
            "engine_stats_s": round(statistics.median(stats_s), 4),
            "status_s": round(statistics.median(a + b for a, b in zip(read_s, render_s)), 4),
            "status_read_fleet_s": round(statistics.median(read_s), 4),
            "status_render_s": round(statistics.median(render_s), 4),
            "tasks": args.tasks,
            "tasks_s": round(task_window, 3),
            "workers_served": len(served),
            "redis_commands_per_task": round(net_per_task, 1),
            "redis_commands_per_task_by_command": top_task,
            "idle_redis_commands_per_s": round(idle_calls_s, 1),
            "idle_redis_commands_per_worker_s": round(idle_calls_s / workers, 2),
            "idle_redis_cpu_share": round(idle_usec_s / 1e6, 4),
            "idle_redis_commands_per_s_by_command": top_idle,
            "idle_redis_cpu_share_by_command": idle_cpu,
            "redis_keys": keyspace,
            "sweep_ms": sweep_ms,
            "rounds": args.rounds,
            "fleet_start_s": round(started_s, 1),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({socket.gethostname()})",
            "redis": redis.info("server")["redis_version"],
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_1m": round(os.getloadavg()[0], 1),
        }
    finally:
        for child in children:
            if child.stdin:
                child.stdin.close()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--processes", type=int, default=4, help="processes the simulated nodes are spread over")
    p.add_argument("--rounds", type=int, default=5, help="syncs / stats calls / status reads per N (medians)")
    p.add_argument("--tasks", type=int, default=200)
    p.add_argument("--idle-s", type=float, default=4.0, help="window of the idle fleet's command count")
    p.add_argument("--lifetime", type=float, default=240.0, help="a simulated node process stops after this")
    p.add_argument("--sweep-keys", type=int, nargs="+", default=[0, 10_000, 50_000],
                   help="unrelated keys to time one reaper sweep among (sweep_ms)")
    p.add_argument("--redis-url")
    # The child processes' own flags.
    p.add_argument("--sim-process", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--pool", help=argparse.SUPPRESS)
    p.add_argument("--queue", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.redis_url:
        os.environ.update(redis_url_env(args.redis_url))  # both names: RQ_REDIS_URL would win
    if args.sim_process:
        sys.exit(run_sim_process(args))
    secret = secrets.token_hex(32)
    os.environ["RQ_WEIGHT_SYNC_SECRET"] = secret
    configure(ClientSettings())
    with tempfile.TemporaryDirectory(prefix="ctlsim-model-") as folder:
        write_checkpoint(Path(folder))
        for workers in args.workers:
            print(json.dumps(measure(args, workers, secret, folder)), flush=True)


if __name__ == "__main__":
    main()
