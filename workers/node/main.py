"""Run one worker node: load the engine in this (main) process, then consume.

vLLM cannot live in a prefork child (daemonic processes cannot start
children; CUDA cannot be re-initialised after fork), so the engine is loaded
here, before Celery starts, and tasks run on the threads pool: concurrency =
tasks in flight, all feeding the one engine.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import Any

from celery import signals

from rollout_queue.tasks import keys
from rollout_queue.tasks.app import app, configure
from rollout_queue.tasks.errors import EngineError
from rollout_queue.tasks.generate import generate
from rollout_queue.tasks.logs import configure_logging
from rollout_queue.weight_sync import cpu_weights
from rollout_queue.workers.engine.host import EXTENSION_CLS, EngineHost
from rollout_queue.workers.engine.warm_up import warm_up
from rollout_queue.workers.node import control
from rollout_queue.workers.node.runtime import WorkerRuntime
from rollout_queue.workers.queue import delivery, reliable_redis, result_backend
from rollout_queue.workers.settings import WorkerSettings

log = logging.getLogger("rollout_queue.worker")


def cpu_environment(weights: str = "packed", *, async_engine: bool = True) -> None:
    """vLLM-on-CPU settings seen to work (docs/DEPLOYMENT.md, "vLLM on CPU"); explicit values win.
    ``weights``: the ``cpu_weights`` setting, passed on to the engine's processes.
    ``async_engine``: for an ``AsyncLLM`` (a worker's engine), not an offline ``LLM``."""
    os.environ[cpu_weights.ENV] = "1" if weights == "plain" else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if async_engine and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind":
        # An AsyncLLM runs its engine core in a process of its own; vLLM's CPU
        # platform then runs the model in a third one (the mp executor, there
        # to bind OpenMP threads, which nobind does not). Off, the model runs
        # in the engine-core process (the uni executor, as on a one-GPU
        # worker): one process and one vLLM import less, 29 s to serving
        # instead of 41 on this project's 2-core test machine. An offline LLM
        # would instead run its engine in the caller's process: not for it.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Transparent huge pages for torch's large CPU tensors: a weight sync's
    # layerwise reload allocates every layer afresh, and 2 MiB pages halve the
    # page-fault cost of that (measured: 0.36 s → 0.18 s to fill 1 GiB).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def use_reliable_fetch(node: str, hooks: reliable_redis.FetchHooks) -> None:
    """Fetch through workers.queue.reliable_redis: no message lost between queue and unacked,
    and a poison item dead-lettered wherever it is found (workers.queue.poison).
    ``hooks``: the node's side of the fetch (room to fetch, Redis full, handed-on tags)."""
    from kombu.transport import TRANSPORT_ALIASES

    # kombu builds the transport from a name; an alias may be a callable giving
    # the class, which is how the node's hooks reach it (no object is passed).
    TRANSPORT_ALIASES["rq-redis"] = lambda: reliable_redis.Transport.bound(hooks)  # type: ignore[assignment]
    app.conf.broker_transport = "rq-redis"  # logs show rq-redis://:**@host
    # Celery names its consumer class by import string; it needs nothing of the node.
    app.conf.worker_consumer = "rollout_queue.workers.queue.poison:DeadLetteringConsumer"
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "rq_processing_key": keys.processing_key(node),
        "rq_inflight_key": keys.inflight_key(node),
    }


def run_worker(settings: WorkerSettings, redis_note: str | None = None) -> int:
    """Load the engine, then consume until shut down. ``redis_note``: what the CLI's
    Redis check (``tasks.registry.preflight``, run before vLLM is imported) has to say.

    The one place the node is assembled: its parts are built once (the engine
    host, the runtime holding the rest) and handed to the Celery adapters
    (:func:`adapt_celery`)."""
    refusal = settings.insecure_start_refusal()
    if refusal is not None:  # before anything loads: the operator sees it at once
        print(refusal, file=sys.stderr)
        return 2
    configure_worker_app(settings, redis_note)
    fetch = reliable_redis.FetchHooks()
    use_reliable_fetch(settings.name, fetch)
    if settings.device == "cpu":
        cpu_environment(settings.cpu_weights)
    log.info("worker %s: loading %s on %s (broker %s)", settings.name, settings.model,
             settings.device, settings.redacted_url)
    host = EngineHost(settings)
    try:
        host.start()
    except EngineError as exc:
        print(f"rollout-queue worker: {exc}", file=sys.stderr)
        host.shutdown()
        return 3
    if not settings.skip_warm_up:  # before it consumes and the registry says it serves
        log.info("worker %s: warming up the engine (workers/engine/warm_up.py)", settings.name)
        log.info("worker %s: engine warmed up in %.1f s", settings.name, warm_up(host))
    # What is loaded now lives as long as the process: keep it out of the
    # collector's full passes (they stall the task threads, and the one at
    # interpreter exit took 15-25 s on a loaded 2-core machine).
    gc.collect()
    gc.freeze()
    runtime = WorkerRuntime(settings, host, fetch.forget_on_ack)
    adapt_celery(settings, runtime, fetch)
    return consume(settings, runtime)


def configure_worker_app(settings: WorkerSettings, redis_note: str | None) -> None:
    """Logging, the Celery app's worker config, and which control commands it answers."""
    configure_logging(settings.log_level, settings.log_format, settings.name,
                      "%(asctime)s %(levelname)s %(name)s [%(processName)s] %(message)s")
    if redis_note is not None:
        log.warning("%s", redis_note)
    configure(settings, worker=True)
    # Results refused by a full Redis are retried, not lost (workers.queue.result_backend).
    app.conf.result_backend = result_backend.backend_url(settings.redis_url.get_secret_value())
    if settings.control_secret() is None:
        log.warning("worker %s: --insecure-control: control commands are NOT signed; any client of "
                    "this Redis can pause, sleep or sync weights into this worker", settings.name)
    refused = control.restrict_celery_control(settings.allow_celery_control)
    if refused:
        log.info("Celery control commands disabled (--allow-celery-control enables them): %s",
                 ", ".join(refused))


def adapt_celery(settings: WorkerSettings, runtime: WorkerRuntime, fetch: reliable_redis.FetchHooks) -> None:
    """Hand the node's parts to Celery's extension points, before the worker starts.

    Celery keeps control commands in a process-wide registry and tasks as
    registry singletons: the control panel is bound to the runtime there, and
    the task is given its executor; the strategy and the fetch hooks are
    built from the node's parts."""
    control.install(runtime)
    extension = settings.engine_args.get("worker_extension_cls", EXTENSION_CLS)
    added = control.register_extension_ops(extension)
    if added:
        log.info("engine ops of %s: %s", extension, ", ".join(added))
    generate.executor = runtime.service
    delivery.install(generate, runtime.duplicates, runtime.intake, die_before_ack=settings.fault_die_before_ack)
    fetch.on_full = runtime.redis_full
    # The duplicate check's read rides in the fetch's ledger MULTI (workers.queue.dedup).
    fetch.result_head = runtime.duplicates.result_head
    # Fetch only while the engine has room (workers.queue.intake; budget: --intake-sequences).
    fetch.has_room = runtime.intake.has_room
    if settings.metrics_port is not None:
        from rollout_queue.workers.node.metrics import start_metrics

        start_metrics(runtime, settings.metrics_port, settings.metrics_host)

    def on_ready(sender: Any = None, **_: Any) -> None:
        runtime.consumer = sender
        runtime.state.ready()

    def on_shutdown(**_: Any) -> None:
        runtime.state.stopping()
        runtime.hand_back_waiting()  # ETA/countdown tasks: back to the queue now, uncounted
        if settings.drain_timeout is not None:
            runtime.drain(settings.drain_timeout)

    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutting_down.connect(on_shutdown, weak=False)


def consume(settings: WorkerSettings, runtime: WorkerRuntime) -> int:
    """Run Celery's worker on the threads pool until it stops; the exit code."""
    runtime.start()
    worker = app.Worker(
        hostname=settings.name,
        pool="threads",
        concurrency=settings.max_inflight,
        queues=settings.consumed_queues,
        loglevel=settings.log_level.upper(),
        without_gossip=True,
        without_mingle=True,
        task_events=True,
        prefetch_multiplier=1,
    )
    try:
        worker.start()
    finally:
        runtime.stop()
        # A worker given a drain deadline is racing a notice: its requests are
        # all finished or handed off, so the engine's processes get 1 s.
        # A lost engine's core may be stopped or hung: it is not waited for.
        leaving = settings.drain_timeout is not None or runtime.host.lost is not None
        runtime.host.shutdown(timeout=1.0 if leaving else None)
    if runtime.exit_code is not None:
        return runtime.exit_code
    return int(worker.exitcode or 0)
