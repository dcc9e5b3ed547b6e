"""The asyncio client (``tasks.aio``, ``generate.async_``), typed results, and ``py.typed``.

The client's calls go through the shared ``gen_worker`` (default queue) and a
real Redis; each test runs its own event loop (``asyncio.run``).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

from rollout_queue.tasks import aio, generate
from rollout_queue.tasks.app import app as celery_app
from rollout_queue.tasks.errors import BrokerUnavailable, InvalidRequest, PromptTooLong, ResultTimeout
from rollout_queue.tasks.results import ResultWatcher
from rollout_queue.tasks.schemas import GenerationResult
from tests.conftest import MAX_MODEL_LEN, wait_for
from tests.procs import ARTIFACTS, ROOT, Proc

TIMEOUT = 180.0
GREEDY = {"temperature": 0, "max_tokens": 8}
TOO_LONG = [7] * 600  # past the worker's max_model_len (512)
PACKAGES = ["tasks", "workers", "weight_sync", "api", "cli"]


def token_ids(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[s["token_ids"] for s in out["samples"]] for out in result["outputs"]]


# ------------------------------------------------------------- no engine


def test_tasks_imports_without_fastapi_with_the_async_client_and_its_watcher() -> None:
    blocked = "import sys; sys.modules['fastapi'] = sys.modules['starlette'] = None; "
    done = subprocess.run(
        [sys.executable, "-c", blocked + "import tasks, tasks.aio, tasks.results; print(tasks.aio.__all__)"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "as_completed" in done.stdout


def test_a_watcher_that_cannot_reach_redis_raises_broker_unavailable_naming_the_url(redis_url: str) -> None:
    # redis_url: the session's Redis is configured before the app's result backend is
    # first built here (Celery caches it: built earlier, it would read another database).
    async def start() -> None:
        await ResultWatcher("redis://127.0.0.1:1/0", celery_app.backend, namespace="aio").start()

    with pytest.raises(BrokerUnavailable, match=r"127\.0\.0\.1:1.*check REDIS_URL"):
        asyncio.run(start())


def test_a_call_whose_task_expired_with_its_timeout_says_so_as_a_timeout_does(redis_url: str) -> None:
    """A call's task expires when its timeout does: a worker that fetched it later
    stores REVOKED, which can come back before the call's own wait ends (seen in
    CI with a 0.05 s timeout). The error names the timeout either way."""
    from rollout_queue.tasks.app import settings

    async def scenario() -> None:
        watcher = ResultWatcher(settings().redis_url.get_secret_value(), celery_app.backend, namespace="aio")
        await watcher.start()
        try:
            task_id = watcher.new_task_id()
            watcher.expect(task_id)
            # What Celery's worker stores for a message fetched past its expiry.
            await asyncio.to_thread(celery_app.backend.mark_as_revoked, task_id, "expired")
            with pytest.raises(ResultTimeout, match=r"within 30s: .*revoked or expired"):
                await watcher.result(task_id, 30.0)
        finally:
            await watcher.close()

    asyncio.run(scenario())


def test_as_completed_refuses_a_params_list_of_another_length_before_sending_anything(redis_url: str) -> None:
    async def scenario() -> None:
        with pytest.raises(InvalidRequest, match="2 params for 3 calls"):
            aio.as_completed([["a"], ["b"], ["c"]], [GREEDY, GREEDY])
        await aio.close()

    asyncio.run(scenario())


def test_py_typed_ships_in_the_built_wheel_of_every_installed_package(tmp_path: Path) -> None:
    # Declared, not left to setuptools' default (py.typed is included by
    # default only since setuptools 69; pyproject allows 68).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["*"]
    # A copy without git: only pyproject's package data can bring the markers in.
    source = tmp_path / "src"
    source.mkdir()
    for name in ["pyproject.toml", "README.md"]:
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    # The one installed package, which links the folders above.
    shutil.copytree(ROOT / "rollout_queue", source / "rollout_queue", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = tmp_path.glob("rollout_queue-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"rollout_queue/{package}/py.typed" for package in PACKAGES} | {"rollout_queue/py.typed"} <= names
    assert "rollout_queue/tasks/aio.py" in names and "rollout_queue/tasks/results.py" in names


TRAINER = """
from rollout_queue.tasks import aio, generate


async def main() -> None:
    reveal_type(await aio.generate(["x"], {"max_tokens": 2}, typed=True))
    reveal_type(await aio.generate(["x"]))
    async for index, result in aio.as_completed([["a"]], typed=True):
        reveal_type(result)
    reveal_type(generate.delay(["x"]).result_model(timeout=1))
    reveal_type(await generate.async_(["x"], typed=True))
"""


def test_a_trainers_mypy_sees_the_typed_and_the_plain_results(tmp_path: Path) -> None:
    (tmp_path / "trainer.py").write_text(TRAINER)
    # Checking celery and pydantic takes a minute cold: the cache outlives the run.
    ARTIFACTS.mkdir(exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--cache-dir", str(ARTIFACTS / "mypy-trainer"),
         "trainer.py"],
        cwd=tmp_path, env={**os.environ, "MYPYPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300, check=False,
    )
    revealed = re.findall(r'Revealed type is "([^"]+)"', done.stdout)
    assert revealed == ["rollout_queue.tasks.schemas.GenerationResult", "dict[str, Any]",
                        "rollout_queue.tasks.schemas.GenerationResult", "rollout_queue.tasks.schemas.GenerationResult",
                        "rollout_queue.tasks.schemas.GenerationResult"], done.stdout


# ------------------------------------------------------------- on a worker


def test_an_awaited_call_returns_the_result_dict_the_sync_get_returns(gen_worker: Proc) -> None:
    prompts = ["2+2=", "The capital of France is"]

    async def scenario() -> dict[str, Any]:
        try:
            return await generate.async_(prompts, GREEDY, timeout=TIMEOUT)
        finally:
            await aio.close()

    result = asyncio.run(scenario())
    reference = generate.delay(prompts, GREEDY).get(timeout=TIMEOUT)
    assert isinstance(result, dict)
    assert token_ids(result) == token_ids(reference) and all(token_ids(result)[0])
    assert result["worker"] == "gen@tests" and result["signature"] == reference["signature"]


def test_as_completed_yields_every_call_once_with_its_index_in_completion_order(gen_worker: Proc) -> None:
    calls = [["2+2="], ["a"], [[42]], ["Once upon a time"]]
    short = {"temperature": 0, "max_tokens": 1}
    long = {"temperature": 0, "max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True}
    # The last call sent generates hundreds of tokens, the others one each.
    params = [short, short, short, long]

    async def scenario() -> list[tuple[int, dict[str, Any]]]:
        async with aio.AsyncClient() as client:
            return [item async for item in client.as_completed(calls, params, timeout=TIMEOUT)]

    seen = asyncio.run(scenario())
    assert sorted(index for index, _ in seen) == [0, 1, 2, 3]
    assert seen[-1][0] == 3, [index for index, _ in seen]  # it finished last
    by_index = dict(seen)
    assert [len(by_index[i]["outputs"][0]["samples"][0]["token_ids"]) for i in range(3)] == [1, 1, 1]
    assert len(by_index[3]["outputs"][0]["samples"][0]["token_ids"]) == MAX_MODEL_LEN - 32
    assert by_index[2]["outputs"][0]["prompt_token_ids"] == [42]


def test_a_failed_call_raises_its_own_error_class_and_a_too_short_timeout_a_timeout_error(
    gen_worker: Proc,
) -> None:
    async def scenario() -> dict[str, Any]:
        async with aio.AsyncClient() as client:
            with pytest.raises(PromptTooLong, match=rf"600 tokens.*max_model_len is {MAX_MODEL_LEN}"):
                await client.generate([TOO_LONG], GREEDY, timeout=TIMEOUT)
            with pytest.raises(ResultTimeout, match=r"within 0\.05s") as caught:
                # Seconds of work. (It once came back: the timeout started after a held-up
                # send; see the next test.)
                await client.generate(["2+2="], {"max_tokens": 480, "ignore_eos": True, "n": 8}, timeout=0.05)
            assert isinstance(caught.value, TimeoutError)
            # The client goes on serving after both.
            return await client.generate(["2+2="], GREEDY, timeout=TIMEOUT)

    assert token_ids(asyncio.run(scenario()))[0][0]


def test_a_calls_timeout_counts_its_send_which_a_loaded_host_can_hold_up_past_the_result(
    gen_worker: Proc, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded host holds sends up (short calls' results were seen in before
    their send returned); the wait's clock used to start after the send. Here
    every send is held once its publish is done, until the test lets it return."""
    real_send = generate.send
    published: list[str] = []
    release, returned = threading.Event(), threading.Event()

    def held_send(request: Any, headers: dict[str, Any], options: dict[str, Any]) -> Any:
        try:
            return real_send(request, headers, options)
        finally:
            published.append(options["task_id"])
            release.wait(120)
            returned.set()

    monkeypatch.setattr(generate, "send", held_send)
    long = {"max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True, "n": 8}  # seconds of work

    async def scenario() -> None:
        async with aio.AsyncClient() as client:
            try:
                # No result at the timeout: it raises while the send is still held.
                with pytest.raises(ResultTimeout, match=r"within 0\.5s"):
                    await client.generate(["2+2="], long, timeout=0.5)
                assert not returned.is_set()
                # Its worker aborts it (or drops it, expired); its result is deleted as it comes.
                deadline = asyncio.get_running_loop().time() + 120
                while not published or client.abandoned:
                    assert asyncio.get_running_loop().time() < deadline, "the abandoned result never came"
                    await asyncio.sleep(0.1)
                # A result in by the timeout is returned then, the send still held.
                result = await client.generate(["2+2="], GREEDY, timeout=8.0)
                assert len(published) == 2 and not returned.is_set()
                assert token_ids(result)[0][0]
            finally:
                release.set()

    asyncio.run(scenario())
    for task_id in published:  # read or abandoned: deleted either way
        wait_for(lambda task_id=task_id: not redis_client.exists(celery_app.backend.get_key_for_task(task_id)),
                 30, f"the result of {task_id} to be deleted")


def test_a_call_whose_event_loop_was_held_past_its_timeout_raises_a_timeout_though_its_result_came(
    gen_worker: Proc, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen with four busy loops beside the suite: the client's loop was held
    1.7 s after a send of 4 ms. A result that landed meanwhile used to beat the
    timer in the turns after (CI: a call of 0.05 s returned its 8 x 480 tokens).
    Here the send publishes from a turn of the loop, which then holds it 5 s."""
    real_send = generate.send
    published: list[str] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        def send_then_hold_the_loop(request: Any, headers: dict[str, Any], options: dict[str, Any]) -> Any:
            def on_the_loop() -> None:
                try:
                    sent.append(real_send(request, headers, options))
                    published.append(options["task_id"])
                    time.sleep(5.0)  # the worker answers meanwhile (8 tokens)
                finally:
                    done.set()

            sent: list[Any] = []
            done = threading.Event()
            loop.call_soon_threadsafe(on_the_loop)
            assert done.wait(120)
            return sent[0]

        monkeypatch.setattr(generate, "send", send_then_hold_the_loop)
        async with aio.AsyncClient() as client:
            with pytest.raises(ResultTimeout, match=r"within 0\.5s"):
                await client.generate(["2+2="], GREEDY, timeout=0.5)
            deadline = loop.time() + 60
            while client.abandoned:  # it comes, and is deleted
                assert loop.time() < deadline, "the abandoned result was not deleted"
                await asyncio.sleep(0.1)

    asyncio.run(scenario())
    [task_id] = published
    assert not redis_client.exists(celery_app.backend.get_key_for_task(task_id))


def test_as_completed_raises_a_failed_calls_error_or_yields_it_at_its_index_when_asked(gen_worker: Proc) -> None:
    calls = [["2+2="], [TOO_LONG], ["a"]]

    async def scenario() -> list[tuple[int, Any]]:
        async with aio.AsyncClient() as client:
            with pytest.raises(PromptTooLong):
                async for _ in client.as_completed(calls, GREEDY, timeout=TIMEOUT):
                    pass
            return [item async for item in client.as_completed(calls, GREEDY, timeout=TIMEOUT,
                                                               return_exceptions=True)]

    by_index = dict(asyncio.run(scenario()))
    assert sorted(by_index) == [0, 1, 2]
    assert isinstance(by_index[1], PromptTooLong) and "600 tokens" in str(by_index[1])
    assert token_ids(by_index[0])[0][0] and token_ids(by_index[2])[0][0]


def test_results_are_typed_on_request_and_dicts_by_default(gen_worker: Proc) -> None:
    async def scenario() -> tuple[GenerationResult, list[tuple[int, GenerationResult]]]:
        try:
            one = await aio.generate(["2+2="], GREEDY, typed=True, timeout=TIMEOUT)
            many = [item async for item in aio.as_completed([["a"], ["b"]], GREEDY, typed=True, timeout=TIMEOUT)]
            return one, many
        finally:
            await aio.close()

    one, many = asyncio.run(scenario())
    assert isinstance(one, GenerationResult) and one.outputs[0].samples[0].token_ids
    assert all(isinstance(result, GenerationResult) for _, result in many)
    handle = generate.delay(["2+2="], GREEDY)
    typed = handle.result_model(timeout=TIMEOUT)
    assert isinstance(typed, GenerationResult)
    assert typed.outputs[0].samples[0].token_ids == one.outputs[0].samples[0].token_ids
    assert isinstance(generate.delay(["2+2="], GREEDY).get(timeout=TIMEOUT), dict)


# The split case: test_split's call, under conftest's max_prompts (RQ_TASK_MAX_PROMPTS = 4).
from tests.test_split import PROMPTS


def test_a_big_awaited_call_is_split_and_joined_as_the_sync_call_is(gen_worker: Proc, max_prompts: int) -> None:
    failing = list(PROMPTS)
    failing[9] = TOO_LONG  # in the third part (prompts 7-9)

    async def scenario() -> GenerationResult:
        async with aio.AsyncClient() as client:
            with pytest.raises(PromptTooLong, match=r"^prompt 9 has 600 tokens"):
                await client.generate(failing, GREEDY, timeout=TIMEOUT)
            return await client.generate(PROMPTS, GREEDY, typed=True, timeout=TIMEOUT)

    result = asyncio.run(scenario())
    reference = generate.delay(PROMPTS, GREEDY).result_model(timeout=TIMEOUT)
    assert [output.prompt_token_ids for output in result.outputs] == PROMPTS
    assert [o.samples[0].token_ids for o in result.outputs] == [o.samples[0].token_ids for o in reference.outputs]
    assert result.usage == reference.usage


def _engine_stats() -> dict[str, Any]:
    from rollout_queue.tasks import control

    return control.engine_stats(["gen@tests"], timeout=10)["gen@tests"]


def test_a_cancelled_call_has_its_prompts_aborted_in_the_engine_and_its_result_deleted(gen_worker: Proc) -> None:
    # As the gateway's dropped request (tests/test_api.py): 64 x 480 tokens make
    # each engine step slow enough that the abort lands well before the end.
    max_tokens, prompts = MAX_MODEL_LEN - 32, 64
    params = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    before = _engine_stats()
    assert before["inflight_requests"] == 0, before

    async def scenario() -> None:
        async with aio.AsyncClient() as client:
            call = asyncio.ensure_future(client.generate([f"story {i}" for i in range(prompts)], params))
            deadline = asyncio.get_running_loop().time() + 120
            while min((stats := await asyncio.to_thread(_engine_stats))["inflight_requests"],
                      stats["running_requests"]) < prompts:
                assert asyncio.get_running_loop().time() < deadline and not call.done(), "the call never ran"
                await asyncio.sleep(0.1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert client.abandoned == 1
            while client.abandoned:  # its result comes, and is deleted with the abort set
                assert asyncio.get_running_loop().time() < deadline + 60, "the aborted task never ended"
                await asyncio.sleep(0.1)

    asyncio.run(scenario())
    stats = _engine_stats()
    assert stats["inflight_requests"] == 0, stats
    generated = stats["generated_tokens"] - before["generated_tokens"]
    print(f"\ncancelled call: {generated} of {prompts * max_tokens} tokens generated")
    assert 0 < generated < prompts * max_tokens * 0.9, generated
