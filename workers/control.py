"""Remote-control commands a worker answers (Celery broadcast, with replies).

They run in Celery's consumer loop, next to task intake: each answers
promptly. The weight sync only validates and hands its work to a thread;
engine operations (sleep, wake, cache reset) are short and answered inline.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.control import control_command

from tasks import keys
from workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)

OPERATOR_PAUSE = "paused by an operator"

_runtime: WorkerRuntime | None = None


def install(runtime: WorkerRuntime) -> None:
    global _runtime
    _runtime = runtime


def _rt() -> WorkerRuntime:
    if _runtime is None:
        raise RuntimeError("worker runtime not installed")
    return _runtime


@control_command(name=keys.CONTROL_SYNC, args=[("plan", dict)], signature="<plan>")  # type: ignore[misc]
def rq_weight_sync(state: Any, plan: dict[str, Any]) -> dict[str, Any]:
    return _rt().sync.accept(plan)


def engine_op(runtime: WorkerRuntime, op: str, args: dict[str, Any]) -> Any:
    host = runtime.host
    if op == "info":
        return runtime.info().model_dump(mode="json")
    if op == "stats":
        info = runtime.info()
        return {
            "weight_version": info.weight_version,
            "state": info.state,
            "inflight_requests": info.inflight_requests,
            "inflight_tasks": info.inflight_tasks,
            "generated_tokens": info.generated_tokens,
            "tokens_per_s": info.tokens_per_s,
            "kv_cache_usage": info.kv_cache_usage,
            "waiting_requests": info.waiting_requests,
            "running_requests": host.stats.snapshot().running_requests,
            "unfinished_sequences": host.unfinished_sequences(),
            "intake_sequences": runtime.intake.budget,
            "completed_tasks": runtime.service.completed_tasks,
            "failed_tasks": runtime.service.failed_tasks,
            "last_sync_error": runtime.sync.last_error,
        }
    if op == "world_size":
        return runtime.settings.tensor_parallel_size
    if op == "reset_prefix_cache":
        return host.reset_prefix_cache()
    if op == "pause":
        runtime.set_fenced(OPERATOR_PAUSE)
        runtime.set_state("paused")
        return runtime.state
    if op == "resume":
        # Lift only the operator's pause: a worker fenced for stale weights
        # or asleep stays out until a sync or a wake-up brings it back.
        if runtime.service.fenced_reason in (OPERATOR_PAUSE, None):
            runtime.set_fenced(None)
            runtime.set_state("serving")
        return runtime.state
    if op == "sleep":
        host.sleep(int(args.get("level", 1)))
        runtime.set_fenced("sleeping")
        runtime.set_state("sleeping")
        return True
    if op == "wake_up":
        tags = args.get("tags")
        host.wake_up(tags)
        if tags is None or "kv_cache" in tags:
            runtime.set_fenced(None)
            runtime.set_state("serving")
        return True
    if op == "receive_one":  # the per-tensor baseline of bench/weight_sync.py
        return host.collective_rpc(
            "rq_receive_one", 120.0, args["name"], args["dtype"], args["shape"], 60.0
        )
    if op == "receive_raw":  # bench/weight_sync.py: raw broadcast into the engine's process
        return host.collective_rpc("rq_receive_raw", 300.0, args["sizes"], 120.0)
    if op == "weight_checksum":
        return host.collective_rpc("rq_weight_checksum", 120.0)
    if op == "last_receive":
        return host.collective_rpc("rq_last_receive", 60.0)
    raise ValueError(f"unknown engine operation {op!r}")


@control_command(name=keys.CONTROL_ENGINE, args=[("op", str), ("args", dict)], signature="<op> <args>")  # type: ignore[misc]
def rq_engine(state: Any, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    runtime = _rt()
    try:
        return {"ok": True, "node": runtime.node, "result": engine_op(runtime, op, args or {})}
    except Exception as exc:  # noqa: BLE001  answered to the caller, who raises naming this node
        log.warning("engine op %s failed: %s", op, exc)
        return {"ok": False, "node": runtime.node, "error": f"{type(exc).__name__}: {exc}"}
