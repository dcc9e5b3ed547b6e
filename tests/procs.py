"""Subprocess helpers for tests: start, wait for, and always stop processes.

Every process logs to a file under ``.artifacts/logs``, runs in its own
session (so teardown kills its whole tree: vLLM engine cores and workers
included), and a process that dies while we wait for it fails the test with
the tail of its log.

A suite cut short (``timeout``, Ctrl-C, SIGTERM from CI) skips teardown, and
processes in sessions of their own would outlive it. :func:`install_guard`
(called by ``tests/conftest.py`` at start) kills, on SIGINT, SIGTERM and at
exit, every live ``Proc``'s process group and every process still below the
pytest process, before pytest goes on as the signal says.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from workers.localstack import free_port

__all__ = ["ARTIFACTS", "LOGS", "ROOT", "Proc", "free_port", "install_guard", "on_exit", "python"]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / ".artifacts"
LOGS = ARTIFACTS / "logs"

# Started and not yet stopped: what the guard kills.
_LIVE: set[Proc] = set()
# Run by the guard after the kill (e.g. deleting network namespaces); each once.
_AT_EXIT: list[Callable[[], None]] = []


def on_exit(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` when the guard fires (interrupted run, or exit); it must be
    idempotent: a fixture's finalizer usually runs it first."""
    _AT_EXIT.append(cleanup)


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.argv = argv
        self.log_path = LOGS / f"{name}.log"
        self._log = self.log_path.open("ab")
        self._log.write(f"\n=== {' '.join(argv)}\n".encode())
        self._log.flush()
        full_env = {**os.environ, **(env or {})}
        self.popen = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
            start_new_session=True, cwd=str(ROOT),
        )
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def wait_until(self, check: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(
                    f"{self.name} exited with {self.popen.returncode} while waiting for {what}:\n{self.tail()}"
                )
            try:
                if check():
                    return
            except Exception:  # noqa: BLE001, S110  a probe that fails means "not yet"
                pass
            time.sleep(0.25)
        raise AssertionError(f"{self.name}: {what} not within {timeout:.0f}s:\n{self.tail()}")

    def send_signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def kill_tree(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the tree, wait, then SIGKILL whatever is left."""
        if self.alive():
            self.kill_tree(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill_tree(signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        _LIVE.discard(self)
        self._log.close()


def python() -> str:
    return sys.executable


def kill_everything_started() -> int:
    """SIGKILL every live ``Proc``'s group and every descendant of this process
    (returns how many descendants)."""
    below = psutil.Process().children(recursive=True)  # before their parents die
    for proc in list(_LIVE):
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
    groups = len(_LIVE)
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
