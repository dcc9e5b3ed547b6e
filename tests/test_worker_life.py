"""A worker process's life: its engine core dies with it, a starting worker
names the engines a dead one left, a SIGTERM hands its waiting tasks back
uncounted, and ``revoke(terminate=True)`` aborts a running generation.

One worker (``life@tests``, queue and pool ``life``) serves the module; the
SIGTERM test stops it, so it runs last of those that use it. The kill during
engine load needs only a half-started second worker. The tests signal the
worker's main process alone, not its process group (as a kill -9 of a worker,
or an orchestrator's SIGTERM to its main process, would): a group kill would
hide an engine core that outlives its worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis as redis_lib
from celery.result import AsyncResult

from rollout_queue.tasks import generate, keys
from rollout_queue.tasks.app import app
from rollout_queue.tasks.schemas import WorkerInfo
from tests.conftest import WorkerStarter, wait_for
from tests.procs import Proc, engine_cores

QUEUE = POOL = "life"
NODE = "life@tests"

# A stand-in for the engine core of a worker that died before this fix: a
# process titled as vLLM titles it, re-parented to PID 1 (its parent exits).
ORPHAN = """
import os, sys, time, setproctitle
if os.fork():
    sys.exit(0)
setproctitle.setproctitle("VLLM::EngineCore")
print(os.getpid(), flush=True)
sys.stdout.close()
time.sleep(900)
"""


@pytest.fixture(scope="module")
def orphan() -> Iterator[int]:
    """The pid of an orphaned ``VLLM::EngineCore`` (a fake: it only sleeps)."""
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    parent.wait(10)
    wait_for(lambda: psutil.Process(pid).ppid() == 1, 10, "the fake engine core to be re-parented to PID 1")
    yield pid
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def life_start(start_worker: WorkerStarter, model_a: Path, redis_client: redis_lib.Redis,
               orphan: int) -> tuple[Proc, str]:
    """The module's worker, and its log as it was when the registry first said it serves."""
    proc = start_worker(model_a, NODE, queue=QUEUE, pool=POOL, max_inflight=8, wait=False,
                        warm_up=True)
    seen: list[str] = []

    def serving() -> bool:
        entry = registry(redis_client, NODE)
        if entry is None or entry.state != "serving":
            return False
        seen.append(proc.log_path.read_text(errors="replace"))
        return True

    proc.wait_until(serving, 240, f"{NODE} to serve")
    return proc, seen[0]


@pytest.fixture(scope="module")
def life_worker(life_start: tuple[Proc, str]) -> Proc:
    return life_start[0]


def registry(client: redis_lib.Redis, node: str) -> WorkerInfo | None:
    raw = client.get(keys.worker_key(node))
    return None if raw is None else WorkerInfo.model_validate_json(raw)


def queued_task_ids(client: redis_lib.Redis, queue: str) -> list[str]:
    return [json.loads(item)["headers"]["id"] for item in client.lrange(queue, 0, -1)]


def held_task_ids(client: redis_lib.Redis, node: str) -> set[str]:
    """The tasks ``node`` holds: fetched, in its in-flight set, not acked."""
    held = set()
    for tag in client.smembers(keys.inflight_key(node)):
        record = client.hget(keys.KOMBU_UNACKED, tag)
        if record is not None:
            held.add(json.loads(record)[0]["headers"]["id"])
    return held


def test_a_starting_worker_names_an_orphaned_engine_core_in_its_log(life_worker: Proc, orphan: int) -> None:
    log = life_worker.log_path.read_text(errors="replace")  # the pid is this run's
    assert f"pid {orphan} (VLLM::EngineCore, orphaned" in log, life_worker.tail()


def test_the_registry_says_a_worker_serves_only_after_its_engine_warmed_up(life_start: tuple[Proc, str]) -> None:
    proc, log_when_serving = life_start
    assert "engine warmed up in" in log_when_serving, proc.tail()
    assert log_when_serving.index("warming up the engine") < log_when_serving.index("engine warmed up in")


def test_revoke_with_terminate_aborts_a_running_generation_and_the_task_ends_revoked(
    life_worker: Proc, redis_client: redis_lib.Redis,
) -> None:
    log_start = life_worker.log_path.stat().st_size  # the log is appended to across runs
    # 256 sequences of 480 tokens: minutes on this CPU unless aborted.
    params = {"max_tokens": 480, "ignore_eos": True, "n": 8}
    result = generate.apply_async(([f"long {i}" for i in range(32)], params), queue=QUEUE)
    life_worker.wait_until(
        lambda: (info := registry(redis_client, NODE)) is not None and info.inflight_requests > 0, 120,
        "the long task to be generating")
    replies = app.control.revoke(result.id, terminate=True, reply=True, destination=[NODE], timeout=10)
    assert replies, "no reply from the worker"
    reply = replies[0][NODE]
    assert "ok" in reply and "prompts aborted in the engine" in reply["ok"], reply
    wait_for(lambda: AsyncResult(result.id, app=app).state == "REVOKED", 60, "the task to end REVOKED")
    wait_for(lambda: (info := registry(redis_client, NODE)) is not None and info.inflight_requests == 0, 30,
             "its engine requests to be aborted")
    with life_worker.log_path.open("rb") as log:
        log.seek(log_start)
        assert b"NotImplementedError" not in log.read()


def test_revoke_without_terminate_drops_a_waiting_task_as_celery_does(
    life_worker: Proc, redis_client: redis_lib.Redis,
) -> None:
    result = generate.apply_async((["later"], {"max_tokens": 4}), queue=QUEUE, countdown=3)
    wait_for(lambda: result.id in held_task_ids(redis_client, NODE), 30, "the worker to hold the task")
    app.control.revoke(result.id, reply=True, destination=[NODE], timeout=10)
    # Past its countdown Celery drops it (acked, never run) instead of running it.
    wait_for(lambda: result.id not in held_task_ids(redis_client, NODE), 30, "the revoked task to be dropped")
    assert AsyncResult(result.id, app=app).state == "REVOKED"


def test_sigterm_hands_a_countdown_task_back_to_the_queue_at_once_without_counting_a_redelivery(
    life_worker: Proc, redis_client: redis_lib.Redis,
) -> None:
    result = generate.apply_async((["in five minutes"], {"max_tokens": 4}), queue=QUEUE, countdown=300)
    wait_for(lambda: result.id in held_task_ids(redis_client, NODE), 30, "the worker to hold the task")
    cores = engine_cores(life_worker)
    life_worker.send_signal(signal.SIGTERM)  # its main process only
    wait_for(lambda: result.id in queued_task_ids(redis_client, QUEUE), 20, "the task to be back in its queue")
    assert life_worker.popen.wait(120) == 0
    assert not redis_client.exists(keys.redeliveries(result.id)), "a graceful exit was counted as a death"
    assert not redis_client.exists(keys.inflight_key(NODE))
    assert result.id in queued_task_ids(redis_client, QUEUE)  # not taken again by the leaving worker
    _, alive = psutil.wait_procs(cores, timeout=30)
    assert not alive, f"engine cores outlived their worker: {alive}"
    redis_client.delete(QUEUE)
    AsyncResult(result.id, app=app).forget()


def test_an_engine_core_dies_with_its_worker_killed_or_terminated_during_engine_load(
    start_worker: WorkerStarter, model_a: Path,
) -> None:
    # Two workers load side by side; the main process of one gets SIGKILL (the
    # OOM killer's way), the other's SIGTERM (before Celery's handlers exist).
    loading = {sig: start_worker(model_a, f"life-{sig.name.lower()}@tests", queue=f"life-{sig.name.lower()}",
                                 pool=POOL, wait=False)
               for sig in (signal.SIGKILL, signal.SIGTERM)}
    for sig, proc in loading.items():
        proc.wait_until(lambda proc=proc: bool(engine_cores(proc)), 240, "its engine core to start")
        cores = engine_cores(proc)
        os.kill(proc.pid, sig)  # the worker's main process only
        _, alive = psutil.wait_procs(cores, timeout=30)
        assert not alive, (f"engine core(s) {[p.pid for p in alive]} outlived their worker ({sig.name}): "
                           "re-parented, still running")
