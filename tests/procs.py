"""Subprocess helpers for tests: where they log, and the guard that always stops them.

A test's process is a ``cli.localstack.LocalProcess`` (``Proc`` only picks
its log file, ``.artifacts/logs/<name>.log``, and runs it from the
repository root): its own session (so teardown kills its whole tree: vLLM
engine cores and workers included), and a process that dies while we wait
for it fails the test with the tail of its log.

A suite cut short (``timeout``, Ctrl-C, SIGTERM from CI) skips teardown, and
processes in sessions of their own would outlive it. :func:`install_guard`
(called by ``tests/conftest.py`` at start) kills, on SIGINT, SIGTERM and at
exit, every live ``LocalProcess``'s process group and every process still
below the pytest process, before pytest goes on as the signal says.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from rollout_queue.cli.localstack import LocalProcess, free_port
from rollout_queue.cli.zygote import ZygoteClient

__all__ = ["ARTIFACTS", "LOGS", "ROOT", "Proc", "engine_cores", "free_port", "install_guard", "on_exit", "python"]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / ".artifacts"
LOGS = ARTIFACTS / "logs"

# Run by the guard after the kill (e.g. deleting network namespaces); each once.
_AT_EXIT: list[Callable[[], None]] = []


def on_exit(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` when the guard fires (interrupted run, or exit); it must be
    idempotent: a fixture's finalizer usually runs it first."""
    _AT_EXIT.append(cleanup)


class Proc(LocalProcess):
    """A ``LocalProcess`` logging to ``LOGS/<name>.log``, run from the repository root;
    forked from ``zygote`` (``cli.zygote``: a worker's command line) when given."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                 zygote: ZygoteClient | None = None) -> None:
        super().__init__(name, argv, LOGS / f"{name}.log", env, cwd=ROOT, zygote=zygote)


def python() -> str:
    return sys.executable


def kill_everything_started() -> int:
    """SIGKILL every live ``LocalProcess``'s group and every descendant of this
    process (returns how many descendants)."""
    below = psutil.Process().children(recursive=True)  # before their parents die
    for proc in LocalProcess.running():
        proc.kill_tree(signal.SIGKILL)
    for child in below:
        try:
            child.kill()
        except psutil.Error:
            pass
    while _AT_EXIT:
        try:
            _AT_EXIT.pop()()
        except Exception:  # noqa: BLE001, S110  one failed cleanup must not stop the others
            pass
    return len(below)


def _on_signal(signum: int, frame: Any) -> None:
    groups = len(LocalProcess.running())
    killed = kill_everything_started()
    # fd 2 itself: pytest captures sys.stderr during a test.
    os.write(2, f"\ntests: signal {signum}: killed {groups} process group(s) and {killed} "
                f"process(es) the suite started\n".encode())
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_guard() -> None:
    """Kill what the suite started when it is interrupted or exits (call once, main thread)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    atexit.register(kill_everything_started)


@contextlib.contextmanager
def engine_stopped(proc: LocalProcess) -> Iterator[None]:
    """``proc``'s engine core stopped (SIGSTOP) for the block, then resumed: a
    test's tasks are still generating when the fault it sets up lands, however
    fast the machine (keep it to seconds: the worker's engine watch allows 30)."""
    (core,) = engine_cores(proc)
    core.suspend()
    try:
        yield
    finally:
        core.resume()


def engine_cores(proc: LocalProcess) -> list[psutil.Process]:
    """The vLLM engine-core processes (titled ``VLLM::EngineCore``) below ``proc``'s main process."""
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in below:
        try:
            if "EngineCore" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found
