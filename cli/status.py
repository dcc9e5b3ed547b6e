"""``rollout-queue status``: the fleet at a glance, from the Redis registry.

A rich table of live workers (node, pool, model, device, TP, weight_version,
state, in-flight, waiting, tokens/s, KV-cache usage, heartbeat age), the
fleet version of each pool and the depth of each queue. ``--watch``
redraws every ``interval`` seconds until Ctrl-C; ``--node NAME`` shows one
worker and exits 1 when it is not live (a container healthcheck).

Liveness is judged from each worker's ``heartbeat_at``, not from its registry
key: a worker is dead once it has missed ``MISSED_HEARTBEATS`` heartbeats
(``WorkerInfo.live_at``: 6 s with the default 2 s interval), while its key
lingers until its TTL (10 s). Imports no vLLM: it runs anywhere that reaches
Redis.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import redis
from pydantic import SecretStr
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import BrokerUnavailable
from rollout_queue.tasks.registry import connect, fleet_version, live_workers, queue_depths
from rollout_queue.tasks.schemas import MISSED_HEARTBEATS, WorkerInfo
from rollout_queue.tasks.settings import ClientSettings

STATE_STYLE = {
    "serving": "green",
    "paused": "yellow",
    "syncing": "cyan",
    "fenced": "red",
    "sleeping": "blue",
    "starting": "dim",
    "stopping": "dim",
}
DEAD = "dead"  # shown as the state of a worker whose heartbeats stopped
# kombu's Redis transport keeps delivered-but-unacknowledged messages here.
UNACKED_KEY = "unacked"


@dataclass
class FleetView:
    workers: list[WorkerInfo]
    fleet_versions: dict[str, int]  # pool → version the trainer last committed
    queue_depths: dict[str, int]
    unacked: int
    taken_at: float


def read_fleet(client: redis.Redis) -> FleetView:
    workers = live_workers(client)
    queues = sorted({q for w in workers for q in w.queues} | {keys.GENERATE_QUEUE})
    pools = sorted({w.pool for w in workers} | {keys.DEFAULT_POOL})
    try:
        depths = queue_depths(client, queues)
        unacked = int(client.hlen(UNACKED_KEY))
    except redis.RedisError as exc:
        raise BrokerUnavailable(f"could not read queue depths: {exc}") from exc
    return FleetView(
        workers=workers,
        fleet_versions={pool: fleet_version(client, pool) for pool in pools},
        queue_depths=depths,
        unacked=unacked,
        taken_at=time.time(),
    )


def render(view: FleetView) -> Group:
    """The workers table and the queues table, as one renderable."""
    dead = sum(not w.live_at(view.taken_at) for w in view.workers)
    title = f"workers ({len(view.workers) - dead} live{f', {dead} dead' if dead else ''})"
    workers = Table(title=title, title_justify="left")
    for name, justify in [
        ("node", "left"), ("pool", "left"), ("model", "left"), ("device", "left"),
        ("TP", "right"), ("weight_version", "right"), ("state", "left"), ("in-flight", "right"),
        ("waiting", "right"), ("tok/s", "right"), ("KV%", "right"), ("heartbeat", "right"),
    ]:
        workers.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for w in sorted(view.workers, key=lambda w: (w.pool, w.node)):
        behind = w.weight_version < view.fleet_versions.get(w.pool, 0)
        live = w.live_at(view.taken_at)
        workers.add_row(
            w.node,
            w.pool,
            _short_model(w.model),
            w.device,
            str(w.tensor_parallel_size),
            Text(str(w.weight_version), style="red" if behind else ""),
            Text(w.state, style=STATE_STYLE.get(w.state, "")) if live else Text(DEAD, style="bold red"),
            f"{w.inflight_requests} ({w.inflight_tasks} tasks)",
            str(w.waiting_requests),
            f"{w.tokens_per_s:.1f}",
            f"{100 * w.kv_cache_usage:.1f}",
            f"{max(0.0, view.taken_at - w.heartbeat_at):.1f}s",
        )
    queues = Table(title="queues", title_justify="left")
    queues.add_column("queue")
    queues.add_column("waiting", justify="right")
    for queue, depth in view.queue_depths.items():
        queues.add_row(queue, str(depth))
    queues.add_row(Text("(delivered, not yet acked)", style="dim"), str(view.unacked))
    versions = ", ".join(f"{pool}={version}" for pool, version in view.fleet_versions.items())
    return Group(workers, queues, Text(f"fleet weight_version: {versions}", style="dim"))


def _short_model(model: str) -> str:
    """Last two path parts: enough to tell models apart, short enough for a column."""
    parts = [p for p in model.replace("\\", "/").split("/") if p]
    return "/".join(parts[-2:]) if parts else model


def run_status(
    watch: bool = False, interval: float = 2.0, redis_url: str | None = None, node: str | None = None
) -> int:
    """Print the fleet once (or redraw it every ``interval`` s with ``watch``).

    With ``node``: only that worker; returns 1 if it is not in the registry
    or its heartbeats stopped (``WorkerInfo.live_at``).
    """
    settings = ClientSettings(redis_url=SecretStr(redis_url)) if redis_url else ClientSettings()
    # Piped into a file or a test: wide enough that the table does not wrap.
    console = Console(width=None if sys.stdout.isatty() else 200)
    client = connect(settings)
    try:
        if node is not None:
            view = read_fleet(client)
            view.workers = [w for w in view.workers if w.node == node]
            console.print(render(view))
            if not view.workers:
                console.print(f"[red]{node} is not live (no heartbeat in the registry)[/]")
                return 1
            (info,) = view.workers
            if not info.live_at(view.taken_at):
                console.print(
                    f"[red]{node} is not live: its last heartbeat is "
                    f"{view.taken_at - info.heartbeat_at:.1f}s old (dead after {info.dead_after_s:g}s: "
                    f"{MISSED_HEARTBEATS} missed heartbeats of {info.heartbeat_s:g}s)[/]"
                )
                return 1
            return 0
        if not watch:
            console.print(render(read_fleet(client)))
            return 0
        from rich.live import Live

        with Live(render(read_fleet(client)), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                live.update(render(read_fleet(client)))
    except BrokerUnavailable as exc:
        console.print(f"[red]rollout-queue status: {exc}[/] (Redis at {settings.redacted_url})")
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()
