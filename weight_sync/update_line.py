"""The update line: a sync's engine call straight from the worker host to its engine.

vLLM's ``collective_rpc`` takes the call through five threads on its way in (the
host's asyncio loop, ZMQ's I/O threads on both sides, the engine core's input
thread, then its busy loop) and as many on its way out: 0.8-1.0 ms each way on
an H100 host, before the engine's first copy of a colocated handoff. A
single-rank engine's receiver (``WeightReceiver.rq_attach``) also listens on a
Unix socket the host names, from a thread of its own (:class:`LineListener`);
the host (:class:`UpdateLine`) sends ``rq_update`` over it when no request is in
the engine: the core's busy loop then waits for input and runs nothing that
touches the weights. One wake-up each way.

On CUDA the line's thread issues the update on the stream the engine core's
thread runs on (vLLM gives each thread a stream of its own,
``vllm.utils.torch_utils.current_stream``), captured at attach: the engine's
next forward pass is ordered after the copies, as when the core thread issued
them. The receiver takes one call at a time, whichever way it came
(``EngineReceiver.serial``).

Frames, both ways: a 4-byte big-endian length, then JSON (the
``UpdateRequest``, the ``UpdateResult``). One call at a time on one connection;
a call the host gave up on (its deadline) closes the connection, and the next
call connects anew once the engine has finished the old one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
# A Unix socket's path must fit in sockaddr_un.sun_path (108 bytes with its NUL on Linux).
MAX_PATH_BYTES = 107


# A worker's line directory: ``rq-line-<pid>-<random>`` in the temporary directory.
LINE_DIR_PREFIX = "rq-line-"


def line_directory(parent: str | None = None) -> str:
    """A private directory (mode 0700) for this process's update line socket, named
    for the process; first, the line directories of worker processes that are gone
    (killed with SIGKILL: no shutdown removed them) are removed. ``parent``: the
    temporary directory by default."""
    parent = parent or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            pid = _owner_pid(entry.name)
            if pid is not None and pid != os.getpid() and not _alive(pid) and entry.is_dir(follow_symlinks=False) \
                    and entry.stat(follow_symlinks=False).st_uid == os.getuid():
                shutil.rmtree(entry.path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{LINE_DIR_PREFIX}{os.getpid()}-", dir=parent)


def _owner_pid(name: str) -> int | None:
    """The process a line directory's name says made it (None: not such a name)."""
    if not name.startswith(LINE_DIR_PREFIX):
        return None
    pid, _, rest = name[len(LINE_DIR_PREFIX):].partition("-")
    return int(pid) if pid.isdigit() and rest else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class LineClosed(ConnectionError):
    """The other end closed the line (between frames: ``None`` is read instead)."""


def write_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(body)) + body)


def read_frame(sock: socket.socket, deadline: float | None = None) -> dict[str, Any] | None:
    """The next frame's message; None when the other end closed the line between frames.
    ``deadline`` (monotonic): ``TimeoutError`` past it."""
    head = _read_exactly(sock, _LENGTH.size, deadline, between_frames=True)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    body = _read_exactly(sock, length, deadline, between_frames=False)
    assert body is not None
    message = json.loads(body)
    if not isinstance(message, dict):
        raise TypeError(f"an update line frame holds a {type(message).__name__}, not an object")
    return message


def _read_exactly(sock: socket.socket, size: int, deadline: float | None, between_frames: bool) -> bytes | None:
    chunks: list[bytes] = []
    left = size
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no answer on the update line before the call's deadline")
            sock.settimeout(remaining)
        chunk = sock.recv(left)
        if not chunk:
            if between_frames and left == size:
                return None
            raise LineClosed(f"the update line closed {size - left} bytes into a {size}-byte read")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class LineListener:
    """The engine's end: answers each request on ``path`` with ``serve(request)``, run
    in ``context()`` (the engine core thread's stream, no autograd), from a daemon
    thread of its own. ``serve`` answers failures itself (an ``UpdateResult``);
    one that raises is answered with ``failed(exc)``."""

    def __init__(self, path: str, serve: Callable[[dict[str, Any]], dict[str, Any]],
                 failed: Callable[[BaseException], dict[str, Any]],
                 context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.path = path
        self._serve = serve
        self._failed = failed
        self._context = context
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by an engine of this host that died
        self._socket.bind(path)
        os.chmod(path, 0o600)
        self._socket.listen(1)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rq-update-line", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                if not self._closed:
                    log.exception("the update line stopped listening: syncs take collective_rpc")
                return
            try:
                with conn:
                    self._answer(conn)
            except Exception:  # one connection's failure ends that connection, not the line
                log.exception("update line connection failed")

    def _answer(self, conn: socket.socket) -> None:
        while True:
            try:
                request = read_frame(conn)
            except (OSError, ValueError, TypeError):  # the host gave the call up, or sent garbage
                return
            if request is None:
                return
            try:
                with self._context():
                    answer = self._serve(request)
            except Exception as exc:  # noqa: BLE001  every request is answered
                answer = self._failed(exc)
            try:
                write_frame(conn, answer)
            except OSError:  # the host gave the call up meanwhile: its next call connects anew
                return

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class LineUnavailable(ConnectionError):
    """The line could not be reached; nothing was sent (the caller may take another way)."""


class UpdateLine:
    """The worker host's end: one connection to the engine's :class:`LineListener`,
    made at the first call and again after a call that failed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """``request``'s answer. ``LineUnavailable`` when the engine's end could not
        be reached (nothing sent); ``TimeoutError`` past ``timeout``, ``LineClosed``
        when the engine closed the line mid-call (the call may have run: roll back)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            sock = self._connected(timeout)
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                write_frame(sock, request)
                answer = read_frame(sock, deadline)
                if answer is None:
                    raise LineClosed("the engine closed the update line before it answered")
                return answer
            except BaseException:
                self._drop()  # a late answer would be read as the next call's
                raise

    def _connected(self, timeout: float) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(min(timeout, 5.0))
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise LineUnavailable(f"cannot reach the engine's update line at {self.path}: {exc}") from exc
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """The update's context in the line's thread: the engine core thread's CUDA
    ``stream`` (None on CPU), and no autograd."""
    import torch

    with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        yield


def core_stream(device: Any) -> Any:
    """The stream the calling thread (the engine core's, at attach) runs its CUDA work
    on: vLLM's per-thread stream (None on CPU)."""
    if device.type != "cuda":
        return None
    from vllm.utils.torch_utils import current_stream

    return current_stream()


__all__ = ["LineClosed", "LineListener", "LineUnavailable", "UpdateLine", "core_stream", "on_stream"]
