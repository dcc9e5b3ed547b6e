"""Local CPU workers forked from one interpreter that has already imported torch and vLLM.

A CPU worker's start on a 2-core machine is ~11 s to serving, and 7 s of it
is its process importing vLLM (torch, transformers, vLLM's configs) before
it does anything of its own. The test suite and the benchmarks' smoke runs
start dozens of workers. The zygote is a Python process (``python -m
rollout_queue.cli.zygote ADDRESS``) that imports those libraries and then
only forks: each child becomes one worker process (its own session, its log
file on stdout and stderr, its argv and environment) and runs ``python -m
rollout_queue.cli`` as the command line would, from ``rollout_queue``'s
first import on. So the worker's whole code path is the real one; what the
children share is the third-party imports, nothing of the project's (its
settings are read from the environment in ``main()``, after the fork). A
child may also run a script (``python bench/latency.py ...``: the suite's
bench smoke runs), as the interpreter would (its folder first on
``sys.path``), for the same imports saved.

The zygote forks before any torch op (its imports start no OpenMP pool:
``tests/test_fork_safety.py``), on its only thread. It reaps its children
and reports each exit status to whoever asked for it, who sees a child
through :class:`ForkedChild` (Popen's ``pid``, ``returncode``, ``poll`` and
``wait``), the way ``cli.localstack.LocalProcess`` sees a subprocess. It
serves CPU workers only: on CUDA vLLM forks the worker's engine itself.

Who asks: the process that started it (:class:`Zygote`, over the zygote's
stdin and stdout; the test suite), and any process that connects to the Unix
socket at ``ADDRESS`` (:meth:`ZygoteClient.connect`): a benchmark the suite
runs finds it in ``RQ_LOCAL_ZYGOTE`` and its ``LocalStack`` forks its CPU
workers there. A connection that closes (its process ended) takes the
children it started and has not stopped with it: nobody is left to stop them.

Protocol, one JSON object a line each way: ``{"argv", "env", "cwd", "log"}``
in, ``{"started": pid}`` back; ``{"exited": pid, "code": c}`` (Popen's
convention: ``-N`` for a signal) when a child ends. The zygote exits when
its stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

# What a worker imports before its engine starts, and takes longest (none of it the project's).
PRELOAD = [
    "torch", "transformers", "vllm.engine.arg_utils", "vllm.usage.usage_lib", "vllm.v1.engine.async_llm",
    "celery", "celery.worker", "kombu.transport.redis", "redis", "pydantic", "pydantic_settings", "psutil",
]
REAP_INTERVAL_S = 0.05
# Where a LocalStack finds a zygote to fork its CPU workers from (the socket's path).
ADDRESS_ENV = "RQ_LOCAL_ZYGOTE"


class ZygoteClient:
    """One connection to a zygote: fork workers from it, learn how they end."""

    def __init__(self, replies: IO[str], commands: IO[str], sock: socket.socket | None = None) -> None:
        self._replies, self._commands, self._socket = replies, commands, sock
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._given_up = 0  # forks whose caller stopped waiting: their children are killed as they come
        self._gone = False  # the zygote's replies ended: it exited, or closed this connection
        self._forking = threading.Lock()  # one command and its answer at a time: answers carry no request id
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, address: str) -> ZygoteClient:
        """A connection to the zygote listening at ``address``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        return cls(sock.makefile("r", encoding="utf-8"), sock.makefile("w", encoding="utf-8"), sock)

    def _read(self) -> None:
        try:
            for line in self._replies:
                message = json.loads(line)
                with self._changed:
                    if "started" in message and self._given_up:
                        # Nobody holds it (its fork timed out): it would run on unstopped,
                        # and the next fork would take it for its own.
                        self._given_up -= 1
                        _kill_session(int(message["started"]))
                    elif "started" in message:
                        self._started.append(int(message["started"]))
                    else:
                        self._exits[int(message["exited"])] = int(message["code"])
                    self._changed.notify_all()
        except (OSError, ValueError):  # closed under the reader (close()): the same as its end
            pass
        with self._changed:  # the zygote is gone: so is every answer still awaited
            self._gone = True
            self._changed.notify_all()

    def alive(self) -> bool:
        return not self._gone

    def fork(self, argv: list[str], env: dict[str, str], cwd: Path | None, log_path: Path,
             timeout: float = 60.0) -> ForkedChild:
        """A process running ``argv`` (``python -m rollout_queue.cli ...`` or ``python SCRIPT.py ...``)."""
        with self._forking, self._changed:
            seen = len(self._started)
            try:
                self._commands.write(json.dumps({"argv": argv, "env": env, "cwd": str(cwd or os.getcwd()),
                                                 "log": str(log_path)}) + "\n")
                self._commands.flush()
            except OSError as exc:
                raise RuntimeError(f"the zygote is gone: {exc}") from exc
            if not self._changed.wait_for(lambda: len(self._started) > seen or not self.alive(), timeout):
                self._given_up += 1
                raise RuntimeError(f"the zygote did not fork within {timeout:.0f}s")
            if len(self._started) == seen:
                raise RuntimeError("the zygote exited before it forked")
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
        """Close this connection (the zygote ends what it started and nobody stopped)."""
        if self._socket is not None:
            try:
                self._socket.shutdown(socket.SHUT_RDWR)  # wakes the reader
            except OSError:
                pass
            self._reader.join(5)
        for stream in (self._commands, self._replies):
            try:
                stream.close()
            except OSError:
                pass
        if self._socket is not None:
            self._socket.close()


class Zygote(ZygoteClient):
    """The zygote, started as a subprocess; a connection to it over its stdin and stdout,
    and a socket (``address``) where other processes may connect."""

    def __init__(self, log_path: Path, cwd: Path) -> None:
        self._folder = tempfile.mkdtemp(prefix="rq-zygote-")  # short: a Unix socket path has ~100 bytes
        self.address = os.path.join(self._folder, "socket")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "rollout_queue.cli.zygote", self.address], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, cwd=cwd, text=True, bufsize=1,
            )
        assert self._proc.stdout is not None and self._proc.stdin is not None
        super().__init__(self._proc.stdout, self._proc.stdin)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.address):  # it listens before its imports: a moment
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the zygote did not listen at {self.address}; see its log {log_path}")
            time.sleep(0.02)

    def alive(self) -> bool:
        return super().alive() and self._proc.poll() is None

    def close(self) -> None:
        try:
            self._commands.close()  # the zygote exits; its children live on in their own sessions
        except OSError:
            pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        shutil.rmtree(self._folder, ignore_errors=True)


class ForkedChild:
    """A child of the zygote, seen as ``subprocess.Popen`` sees its child."""

    def __init__(self, zygote: ZygoteClient, pid: int) -> None:
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


# ---------------------------------------------------------------- the zygote


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
    try:
        if argv[1:3] == ["-m", "rollout_queue.cli"]:
            sys.argv = ["rollout_queue.cli", *argv[3:]]  # runpy sets argv[0] to the module's file
            runpy.run_module("rollout_queue.cli", run_name="__main__", alter_sys=True)
        elif len(argv) > 1 and argv[1].endswith(".py") and os.path.isfile(argv[1]):
            script = os.path.abspath(argv[1])  # a script, as `python script.py ...` runs it
            sys.argv = [script, *argv[2:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
        else:
            print(f"the zygote runs `python -m rollout_queue.cli ...` or `python SCRIPT.py ...`, not {argv}",
                  file=sys.stderr)
            return 2
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def fork_child(command: dict[str, Any], zygote_fds: list[int]) -> int:
    """Fork one child that runs ``command`` and exits with its code; its pid.
    ``zygote_fds``: the zygote's sockets, closed in the child."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for fd in zygote_fds:
            os.close(fd)
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


class Peer:
    """In the zygote: one connection that asks for forks (stdin and stdout, or a socket)."""

    def __init__(self, read_fd: int, write_fd: int, sock: socket.socket | None = None) -> None:
        self.read_fd, self.write_fd, self.socket = read_fd, write_fd, sock
        self.pending = b""  # read from the descriptor, not a buffered reader, so select sees every line
        self.children: set[int] = set()

    def send(self, message: dict[str, int]) -> None:
        data = (json.dumps(message) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.write_fd, data):]
        except OSError:
            pass  # it went away: its end is read (EOF) at the next select


def serve(address: str | None) -> None:
    """The zygote: preload, then fork a child per command until stdin closes."""
    import importlib

    import setproctitle

    # Sets its title-writing up now, while the C environment still follows argv
    # in memory: a child replaces its environment, and setproctitle would then
    # leave every title (the worker's, its engine core's) unwritten.
    setproctitle.setproctitle("rq-zygote")
    listener: socket.socket | None = None
    if address is not None:  # listening from the start: a connection waits out the imports
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen()
    for module in PRELOAD:
        importlib.import_module(module)
    suite = Peer(0, 1)
    peers = {suite.read_fd: suite}
    owner: dict[int, Peer | None] = {}  # running child -> who asked for it (None: nobody left to tell)
    while suite.read_fd in peers or owner:
        watched = [*peers, *([listener.fileno()] if listener is not None and suite.read_fd in peers else [])]
        ready, _, _ = select.select(watched, [], [], REAP_INTERVAL_S)
        for fd in ready:
            if listener is not None and fd == listener.fileno():
                sock, _ = listener.accept()
                peers[sock.fileno()] = Peer(sock.fileno(), sock.fileno(), sock)
                continue
            peer = peers[fd]
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # a connection reset: the same as its end
                chunk = b""
            if not chunk:
                del peers[fd]
                end_peer(peer, owner)
                continue
            peer.pending += chunk
            while b"\n" in peer.pending:
                line, peer.pending = peer.pending.split(b"\n", 1)
                zygote_fds = [p.socket.fileno() for p in peers.values() if p.socket is not None]
                pid = fork_child(json.loads(line), zygote_fds + ([listener.fileno()] if listener else []))
                owner[pid] = peer
                peer.children.add(pid)
                peer.send({"started": pid})
        for pid in list(owner):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                asker = owner.pop(pid)
                if asker is not None:
                    asker.children.discard(pid)
                    asker.send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
    if listener is not None and address is not None:
        listener.close()
        os.unlink(address)


def _kill_session(pid: int) -> None:
    """Kill a child of the zygote and what it started (its session, its engine core)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # not yet a session of its own
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    except PermissionError:
        pass


def end_peer(peer: Peer, owner: dict[int, Peer | None]) -> None:
    """``peer`` closed its end. The suite's (stdin): its children are its to end (they run
    in sessions of their own), and the zygote exits once the others' are reaped. A
    socket's: the children it started and left running are killed, then reaped."""
    for pid in peer.children:
        if peer.socket is None:
            owner.pop(pid, None)
        else:
            owner[pid] = None
            _kill_session(pid)
    if peer.socket is not None:
        peer.socket.close()


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else None)
