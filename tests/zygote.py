"""Workers forked from one interpreter that has already imported torch and vLLM.

A CPU worker's start on the 2-core test machine is ~11 s to serving, and 7 s
of it is its process importing vLLM (torch, transformers, vLLM's configs)
before it does anything of its own. The suite starts dozens of workers. The
zygote is a Python process, started once a session (``python -m
tests.zygote``), that imports those libraries and then only forks: each
child becomes one worker process (its own session, its log file on stdout and
stderr, its argv and environment) and runs ``python -m rollout_queue.cli``
as the command line would, from ``rollout_queue``'s first import on. So the
worker's whole code path is the real one; what the children share is the
third-party imports, nothing of the project's (its settings are read from the
environment in ``main()``, after the fork).

The zygote forks before any torch op (its imports start no OpenMP pool:
``tests/test_fork_safety.py``), on its only thread. It reaps its children
and reports each exit status to the suite, which sees a child through
:class:`ForkedChild` (Popen's ``pid``, ``returncode``, ``poll`` and
``wait``), the way ``tests.procs.Proc`` sees a subprocess. It serves CPU
workers only: on CUDA vLLM forks the worker's engine itself.

Protocol, one JSON object a line: the suite writes ``{"argv", "env", "cwd",
"log"}`` to the zygote's stdin and reads ``{"started": pid}`` back; the
zygote writes ``{"exited": pid, "code": c}`` (Popen's convention: ``-N``
for a signal) when a child ends. It exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

# What a worker imports before its engine starts, and takes longest (none of it the project's).
PRELOAD = [
    "torch", "transformers", "vllm.engine.arg_utils", "vllm.usage.usage_lib", "vllm.v1.engine.async_llm",
    "celery", "celery.worker", "kombu.transport.redis", "redis", "pydantic", "pydantic_settings", "psutil",
]
REAP_INTERVAL_S = 0.05


class Zygote:
    """The suite's side: start the zygote, fork workers from it, learn how they end."""

    def __init__(self, log_path: Path, cwd: Path) -> None:
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._forking = threading.Lock()  # one command and its answer at a time: answers carry no request id
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, cwd=cwd, text=True, bufsize=1,
            )
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "started" in message:
                    self._started.append(int(message["started"]))
                else:
                    self._exits[int(message["exited"])] = int(message["code"])
                self._changed.notify_all()
        with self._changed:  # the zygote is gone: so is every answer still awaited
            self._changed.notify_all()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def fork(self, argv: list[str], env: dict[str, str], cwd: Path | None, log_path: Path,
             timeout: float = 60.0) -> ForkedChild:
        """A worker process running ``argv`` (``python -m rollout_queue.cli ...``)."""
        assert self._proc.stdin is not None
        with self._forking, self._changed:
            seen = len(self._started)
            self._proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(cwd or os.getcwd()),
                                               "log": str(log_path)}) + "\n")
            self._proc.stdin.flush()
            if not self._changed.wait_for(lambda: len(self._started) > seen or not self.alive(), timeout):
                raise RuntimeError(f"the zygote did not fork within {timeout:.0f}s")
            if len(self._started) == seen:
                raise RuntimeError(f"the zygote exited with code {self._proc.poll()}")
            return ForkedChild(self, self._started[seen])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit code once it ended (within ``timeout``), else None.
        A zygote that died before its child reports none: a child gone by
        then (init reaped it) is given -1."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self.alive(), timeout)
            if pid in self._exits:
                return self._exits[pid]
        if not self.alive():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -1
        return None

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the zygote exits; its children live on in their own sessions
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


class ForkedChild:
    """A child of the zygote, seen as ``subprocess.Popen`` sees its child."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(0.0, raise_on_timeout=False)

    def wait(self, timeout: float | None = None, *, raise_on_timeout: bool = True) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, timeout)
        if self.returncode is None and raise_on_timeout:
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0.0)
        return self.returncode


def run_child(command: dict[str, Any]) -> int:
    """In the forked child: become the command line's process, run it, return its exit code."""
    import runpy

    os.setsid()
    log = os.open(command["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.chdir(command["cwd"])
    os.environ.clear()
    os.environ.update(command["env"])
    argv: list[str] = command["argv"]
    if argv[1:3] != ["-m", "rollout_queue.cli"]:
        print(f"the zygote runs `python -m rollout_queue.cli ...` only, not {argv}", file=sys.stderr)
        return 2
    sys.argv = ["rollout_queue.cli", *argv[3:]]  # runpy sets argv[0] to the module's file
    try:
        runpy.run_module("rollout_queue.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def fork_child(command: dict[str, Any]) -> int:
    """Fork one child that runs ``command`` and exits with its code; its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = run_child(command)
    except BaseException:  # noqa: BLE001  the child's end, whatever it was
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # as the interpreter would at exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The zygote: preload, then fork a child per command until stdin closes."""
    import importlib

    import setproctitle

    # Sets its title-writing up now, while the C environment still follows argv
    # in memory: a child replaces its environment, and setproctitle would then
    # leave every title (the worker's, its engine core's) unwritten.
    setproctitle.setproctitle("rq-test-zygote")
    for module in PRELOAD:
        importlib.import_module(module)
    replies = sys.stdout
    children: set[int] = set()
    pending = b""  # read from stdin's descriptor, not its buffered reader, so select sees every line
    open_input = True
    while open_input or children:
        ready, _, _ = select.select([0] if open_input else [], [], [], REAP_INTERVAL_S)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                open_input = False
                children.clear()  # theirs to end: they run in sessions of their own
            pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = fork_child(json.loads(line))
            children.add(pid)
            replies.write(json.dumps({"started": pid}) + "\n")
            replies.flush()
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                replies.write(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
                replies.flush()


if __name__ == "__main__":
    serve()
