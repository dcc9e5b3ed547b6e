"""Not collected by the suite: ``tests/test_interrupted_suite.py`` runs it in a
pytest of its own and interrupts it once it has started its processes.

It starts what the real suite starts (a private Redis server, a worker
loading its engine, a plain child process), then waits to be interrupted.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.conftest import CONTROL_SECRET, MAX_MODEL_LEN, private_redis_server, tiny_model
from tests.procs import Proc, python


def test_starts_processes_then_waits_to_be_interrupted() -> None:
    server = private_redis_server("guard-valkey")
    Proc("guard-worker", [
        python(), "-m", "rollout_queue.cli", "worker", "--model", str(tiny_model(1)), "--device", "cpu",
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--gpu-memory-utilization", "0.1", "--name", "guard@tests", "--queues", "guard",
        "--pool", "guard",
    ], env={"REDIS_URL": server.url, "RQ_WEIGHT_SYNC_SECRET": CONTROL_SECRET})
    sleeper = subprocess.Popen(["sleep", "600"])  # in pytest's own process group
    Path(os.environ["RQ_GUARD_READY"]).write_text(json.dumps({"sleeper": sleeper.pid, "port": str(server.port)}))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # the outer test interrupts this
        time.sleep(0.5)
    raise AssertionError("never interrupted")
