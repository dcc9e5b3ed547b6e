"""Remote-control commands a worker answers (Celery broadcast, with replies).

They run in Celery's consumer loop, next to task intake: each answers
promptly. The weight sync only validates and hands its work to a thread;
engine operations (sleep, wake, cache reset) are short and answered inline.

Who may send what:

- ``rq_weight_sync`` and every ``rq_engine`` op outside ``READ_ONLY_OPS``
  change the worker's state: they must carry an ``auth`` signed with the
  worker's ``RQ_WEIGHT_SYNC_SECRET`` (``tasks.auth``); anything else is answered
  with a refusal and changes nothing.
- ``READ_ONLY_OPS`` (info, stats, world size) and Celery's inspect
  commands (ping, stats, active, registered... what Flower and
  ``rollout-queue status`` use) answer anyone.
- Celery's built-in state-changing commands (shutdown, pool_restart,
  add_consumer, rate_limit...) cannot be signed: :func:`restrict_celery_control`
  replaces them with a refusal unless ``--allow-celery-control``. ``revoke``
  stays: it is how producers cancel tasks, and it only drops tasks. With
  ``terminate=True`` a running task's prompts are aborted in the engine
  (:meth:`ControlPanel.revoke`): the threads pool cannot kill a task's thread.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery.utils.functional import maybe_list
from celery.worker import state as worker_state
from celery.worker.control import Panel, ok

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import ControlRefused
from rollout_queue.workers.node.runtime import WorkerRuntime

log = logging.getLogger(__name__)

# rq_engine ops that only read: answered unsigned.
READ_ONLY_OPS = {"info", "stats", "world_size"}  # and those registered read_only

# Celery built-ins of type "control" that stay on: revoke only drops tasks (how
# producers cancel them), enable_events and heartbeat only make the worker send
# events (Flower calls enable_events). (The inspect command "hello" can also add
# revoked ids: the same power as revoke.) Every other built-in control command
# (shutdown, pool_restart, pool_grow/shrink, autoscale, add/cancel_consumer,
# rate_limit, time_limit, terminate, election, disable_events...) is refused
# unless the worker runs with --allow-celery-control.
CELERY_CONTROL_KEPT = frozenset({"revoke", "revoke_by_stamped_headers", "enable_events", "heartbeat"})

# Celery's own revoke (the built-in the panel's revoke calls first).
CELERY_REVOKE: Callable[..., dict[str, Any]] = Panel.data["revoke"]

EngineOp = Callable[[WorkerRuntime, dict[str, Any]], Any]


def _stats(runtime: WorkerRuntime, args: dict[str, Any]) -> dict[str, Any]:
    info, engine = runtime.info(), runtime.host.stats.snapshot()
    return {
        "weight_version": info.weight_version,
        "state": info.state,
        "inflight_requests": info.inflight_requests,
        "inflight_tasks": info.inflight_tasks,
        "generated_tokens": info.generated_tokens,
        "tokens_per_s": info.tokens_per_s,
        "kv_cache_usage": info.kv_cache_usage,
        "waiting_requests": info.waiting_requests,
        "running_requests": engine.running_requests,
        "prefix_cache_queries": engine.prefix_cache_queries,
        "prefix_cache_hits": engine.prefix_cache_hits,
        "unfinished_sequences": runtime.host.unfinished_sequences(),
        "intake_sequences": runtime.intake.budget,
        "intake_peak_sequences": runtime.intake.peak_sequences,
        "completed_tasks": runtime.service.completed_tasks,
        "failed_tasks": runtime.service.failed_tasks,
        "last_sync_error": runtime.sync.last_error,
    }


def _pause(runtime: WorkerRuntime, args: dict[str, Any]) -> str:
    runtime.state.pause()
    return runtime.state.current


def _resume(runtime: WorkerRuntime, args: dict[str, Any]) -> str:
    # Lifts only the operator's pause: a worker fenced for stale weights
    # or asleep stays out until a sync or a wake-up brings it back.
    runtime.state.resume()
    return runtime.state.current


def _sleep(runtime: WorkerRuntime, args: dict[str, Any]) -> bool:
    runtime.host.sleep(int(args.get("level", 1)))  # the host's state is asleep from before the engine sleeps
    return True


def _wake_up(runtime: WorkerRuntime, args: dict[str, Any]) -> bool:
    runtime.host.wake_up(args.get("tags"))  # awake again once the KV cache is
    return True


def _transfer_join(runtime: WorkerRuntime, args: dict[str, Any]) -> list[int]:
    """Join the trainer's own group (vLLM's weight transfer, ``weight_sync.vllm_transfer``):
    ``args["offsets"]`` hands each node its first rank. Answers the ranks joined."""
    offsets = args.get("offsets", {})
    if runtime.node not in offsets:
        raise ValueError(f"{runtime.node} was handed no rank in the trainer's group")
    init = {key: value for key, value in args.items() if key != "offsets"}
    init["rank_offset"] = int(offsets[runtime.node])
    timeout = float(args.get("timeout_s", 120.0)) + 10.0  # the join's own deadline comes first
    return [int(rank) for rank in runtime.host.collective_rpc("rq_transfer_join", timeout, init)]


# The rq_engine ops: name -> what it does on the worker's runtime.
ENGINE_OPS: dict[str, EngineOp] = {
    "info": lambda runtime, args: runtime.info().model_dump(mode="json"),
    "stats": _stats,
    # The most sequences held after taking a task, since the last call.
    "intake_peak": lambda runtime, args: runtime.intake.reset_peak(),
    # From the next task on; answers the previous interval.
    "checkpoint_tokens": lambda runtime, args: runtime.set_checkpoint_tokens(int(args["tokens"])),
    "world_size": lambda runtime, args: runtime.settings.tensor_parallel_size,
    "reset_prefix_cache": lambda runtime, args: runtime.host.reset_prefix_cache(),
    "pause": _pause,
    "resume": _resume,
    "sleep": _sleep,
    "wake_up": _wake_up,
    "transfer_join": _transfer_join,
    "transfer_leave": lambda runtime, args: any(runtime.host.collective_rpc("rq_transfer_leave", 30.0)),
}


def register_engine_op(name: str, op: EngineOp, *, read_only: bool = False) -> None:
    """Answer ``rq_engine`` op ``name`` with ``op``: signed, unless ``read_only``
    (it changes nothing on the worker).

    The seam for ops only benchmarks send: they belong with the benchmark
    that sends them, registered from there (:func:`register_extension_ops`)."""
    ENGINE_OPS[name] = op
    if read_only:
        READ_ONLY_OPS.add(name)


def register_extension_ops(extension_cls: str) -> list[str]:
    """Answer the ``rq_engine`` ops the engine's worker extension brings.

    ``extension_cls``: the import path of vLLM's ``worker_extension_cls``. A
    module that holds one with engine calls of its own (a benchmark's
    receiver) names their ops in ``register_engine_ops(register)``, called
    here with :func:`register_engine_op`; the production receiver has none.
    Returns the ops added."""
    module = importlib.import_module(extension_cls.rpartition(".")[0])
    hook = getattr(module, "register_engine_ops", None)
    if hook is None:
        return []
    before = set(ENGINE_OPS)
    hook(register_engine_op)
    return sorted(set(ENGINE_OPS) - before)


def engine_op(runtime: WorkerRuntime, op: str, args: dict[str, Any]) -> Any:
    known = ENGINE_OPS.get(op)
    if known is None:
        raise ValueError(f"unknown engine operation {op!r}")
    return known(runtime, args)


class ControlPanel:
    """The worker's remote-control commands, bound to its runtime.

    Celery finds control commands in one process-wide registry
    (``Panel.data``, read by the consumer when it starts): :func:`install`
    puts these there; a process of many simulated nodes gives each node's
    mailbox its own :meth:`handlers` instead.
    """

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    def handlers(self) -> dict[str, Callable[..., dict[str, Any]]]:
        return {keys.CONTROL_SYNC: self.weight_sync, keys.CONTROL_ENGINE: self.engine, "revoke": self.revoke}

    def weight_sync(self, state: Any, plan: dict[str, Any], auth: dict[str, Any] | None = None) -> dict[str, Any]:
        """Accept a signed weight-sync plan (its work runs on the sync's thread)."""
        return self.runtime.sync.accept_signed(plan, auth)

    def engine(
        self, state: Any, op: str, args: dict[str, Any] | None = None, auth: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """An engine operation (signed unless it only reads), answered inline."""
        runtime = self.runtime
        try:
            if op not in READ_ONLY_OPS:
                runtime.verifier.verify(keys.CONTROL_ENGINE, {"op": op, "args": args}, auth, what=op)
            return {"ok": True, "node": runtime.node, "result": engine_op(runtime, op, args or {})}
        except ControlRefused as exc:
            log.warning("engine op %s refused: %s", op, exc)
            return {"ok": False, "node": runtime.node, "error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001  answered to the caller, who raises naming this node
            log.warning("engine op %s failed: %s", op, exc)
            return {"ok": False, "node": runtime.node, "error": f"{type(exc).__name__}: {exc}"}

    def revoke(self, state: Any, task_id: Any, terminate: bool = False, signal: str | None = None,
               **kwargs: Any) -> dict[str, Any]:
        """Celery's ``revoke`` (queued and reserved tasks are dropped, their results
        REVOKED); with ``terminate``, the tasks this worker runs have their prompts
        aborted in the engine and end REVOKED. Celery's own terminate kills a pool
        process; on the threads pool it answered ``NotImplementedError`` and the
        generation ran on."""
        reply = CELERY_REVOKE(state, task_id, terminate=False, signal=signal, **kwargs)
        if not terminate:
            return reply
        ids = set(maybe_list(task_id) or [])
        running = {request.id for request in tuple(worker_state.active_requests)} & ids
        if not running:
            return ok("terminate: tasks unknown")
        generating = self.runtime.service.terminate(running)
        return ok(f"terminate: {', '.join(sorted(running))} (prompts aborted in the engine: "
                  f"{', '.join(generating) or 'none yet'})")


def install(runtime: WorkerRuntime) -> ControlPanel:
    """Register the worker's commands, bound to ``runtime``, in Celery's registry
    (before the consumer starts, which reads it then)."""
    panel = ControlPanel(runtime)
    Panel.register(name=keys.CONTROL_SYNC, args=[("plan", dict), ("auth", dict)],
                   signature="<plan> <auth>")(panel.weight_sync)
    Panel.register(name=keys.CONTROL_ENGINE, args=[("op", str), ("args", dict), ("auth", dict)],
                   signature="<op> <args> <auth>")(panel.engine)
    Panel.data["revoke"] = panel.revoke  # its meta (arguments, help) stays Celery's
    return panel


def disabled_celery_commands(meta: Mapping[str, Any], data: Mapping[str, Callable[..., Any]]) -> list[str]:
    """Names (aliases included) of Celery's state-changing built-ins to refuse.

    ``meta``/``data``: Celery's ``Panel.meta`` and ``Panel.data``. Ours
    (``rq_*``) check signatures themselves; inspect commands only read.
    """
    ours = {keys.CONTROL_SYNC, keys.CONTROL_ENGINE}
    names = {name for name, info in meta.items()
             if info.type == "control" and name not in ours and name not in CELERY_CONTROL_KEPT}
    handlers = {data[name] for name in names if name in data}
    aliases = {name for name, fun in data.items() if fun in handlers}
    return sorted(names | aliases)


def _refusal(name: str) -> Callable[..., dict[str, str]]:
    def refuse(state: Any, **_: Any) -> dict[str, str]:
        log.warning("refused Celery control command %r (disabled; --allow-celery-control enables it)", name)
        return {"error": f"{name} is disabled on this worker: Celery's control commands cannot be "
                         "signed; start the worker with --allow-celery-control to accept them"}

    refuse.__name__ = name
    return refuse


def restrict_celery_control(allow: bool) -> list[str]:
    """Unless ``allow``, answer Celery's state-changing built-ins with a refusal.

    Celery's only switch (``worker_enable_remote_control``) turns off inspect
    too, which Flower and ``status`` need; so the worker's command registry
    (``Panel.data``, read when the consumer starts) is edited here, before
    ``worker.start()``. Returns the refused names.
    """
    if allow:
        return []
    names = disabled_celery_commands(Panel.meta, Panel.data)
    for name in names:
        Panel.data[name] = _refusal(name)
    return names
