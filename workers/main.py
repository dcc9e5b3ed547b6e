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

from tasks.app import app, configure
from tasks.errors import EngineError
from tasks.generate import generate
from workers import control
from workers.engine import EngineHost
from workers.runtime import WorkerRuntime
from workers.settings import WorkerSettings

log = logging.getLogger("rollout_queue.worker")


def cpu_environment() -> None:
    """vLLM-on-CPU settings seen to work (DESIGN.md); explicit values win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def run_worker(settings: WorkerSettings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [%(processName)s] %(message)s",
    )
    configure(settings, worker=True)
    if settings.device == "cpu":
        cpu_environment()
    log.info("worker %s: loading %s on %s (broker %s)", settings.name, settings.model,
             settings.device, settings.redacted_url)
    host = EngineHost(settings)
    try:
        host.start()
    except EngineError as exc:
        print(f"rollout-queue worker: {exc}", file=sys.stderr)
        host.shutdown()
        return 3
    # What is loaded now lives as long as the process: keep it out of the
    # collector's full passes (they stall the task threads, and the one at
    # interpreter exit took 15-25 s on a loaded 2-core machine).
    gc.collect()
    gc.freeze()
    runtime = WorkerRuntime(settings, host)
    control.install(runtime)
    generate.executor = runtime.service
    if settings.metrics_port is not None:
        from workers.metrics import start_metrics

        start_metrics(runtime, settings.metrics_port)

    def on_ready(sender: Any = None, **_: Any) -> None:
        runtime.consumer = sender
        runtime.set_state("serving")

    def on_shutdown(**_: Any) -> None:
        runtime.set_state("stopping")

    def on_received(request: Any = None, **_: Any) -> None:
        # Consumer thread, before the task runs: kombu already holds the
        # message in its unacked hash under this tag.
        tag = getattr(getattr(request, "message", None), "delivery_tag", None)
        if tag:
            runtime.ledger.record(str(tag))

    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutting_down.connect(on_shutdown, weak=False)
    signals.task_received.connect(on_received, weak=False)
    runtime.start()
    worker = app.Worker(
        hostname=settings.name,
        pool="threads",
        concurrency=settings.max_inflight,
        queues=settings.queues,
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
        host.shutdown()
    return int(worker.exitcode or 0)
