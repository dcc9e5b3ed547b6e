"""A suite cut short leaves no process behind (``tests/procs.install_guard``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import wait_for
from tests.procs import ROOT, python


def marked(mark: str, port: str = "") -> list[psutil.Process]:
    """Live processes whose environment carries ``RQ_GUARD_MARK=mark``, and the
    Redis server on ``port`` (valkey writes its title over its environment)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            ours = proc.environ().get("RQ_GUARD_MARK") == mark
            if ours or (port and "valkey-server" in proc.name() and f":{port}" in " ".join(proc.cmdline())):
                found.append(proc)
        except psutil.Error:
            pass  # gone, or not ours to read
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_suite_leaves_no_worker_redis_or_child_process(
    sig: signal.Signals, tmp_path: Path, model_a: Path
) -> None:
    mark, ready = uuid.uuid4().hex, tmp_path / "ready"
    env = {**os.environ, "RQ_GUARD_MARK": mark, "RQ_GUARD_READY": str(ready)}
    inner = subprocess.Popen(
        [python(), "-m", "pytest", "tests/interrupted_run.py", "-q", "-p", "no:cacheprovider"],
        cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # as `timeout` runs it: the signal reaches pytest alone
    )
    try:
        wait_for(lambda: ready.exists() or inner.poll() is not None, 120,
                 "the inner suite to start its processes")
        assert inner.poll() is None, inner.communicate()[0]
        port = json.loads(ready.read_text())["port"]
        started = marked(mark, port)
        # pytest itself, the sleep child, valkey, the worker (and whatever it started by now).
        assert len(started) >= 4, [p.cmdline() for p in started]
        os.kill(inner.pid, sig)
        out, _ = inner.communicate(timeout=60)
        # pytest's own ends: "interrupted" (exit 2) on SIGINT, killed by SIGTERM.
        assert inner.returncode == (2 if sig == signal.SIGINT else -sig), out
        # Everything it started goes, not only pytest.
        wait_for(lambda: not marked(mark, port), 30, "every process of the interrupted suite to exit")
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
        for proc in marked(mark):
            proc.kill()
