"""Request limits and Redis hygiene at the gateway (the hardening findings).

One gateway (``limits_gateway``) in front of the shared worker, with small
caps so the limits are reached with small requests: at most 64 sequences a
request (``RQ_API_MAX_REQUEST_SEQUENCES``) and 4 a task
(``RQ_TASK_MAX_SEQUENCES``: a bigger request is split over several tasks).
Besides: what a client that goes away leaves in Redis, and session keys
without sticky workers. The watcher and session logic are also tested alone,
on the real Redis.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis as redis_lib

from rollout_queue.tasks import keys
from rollout_queue.tasks.schemas import MAX_JSON_DEPTH, MAX_STOP_STRINGS, WorkerInfo
from tests.conftest import MAX_MODEL_LEN
from tests.procs import Proc
from tests.test_api import MODEL, RESULT_TIMEOUT, Gateway, start_gateway

MAX_REQUEST_SEQUENCES = 64
MAX_TASK_SEQUENCES = 4
RESULT_PREFIX = "celery-task-meta-"
ABORTED_LINE = "their client went away"  # the worker logs it when it aborts prompts


@pytest.fixture(scope="module")
def limits_gateway(redis_url: str, gen_worker: Proc) -> Iterator[Gateway]:
    gw = start_gateway("api-limits-gateway", redis_url, {
        "RQ_API_MAX_REQUEST_SEQUENCES": str(MAX_REQUEST_SEQUENCES),
        "RQ_TASK_MAX_SEQUENCES": str(MAX_TASK_SEQUENCES),
    })
    yield gw
    gw.proc.stop()


def _complete(gw: Gateway, **body: Any) -> httpx.Response:
    return httpx.post(f"{gw.base}/v1/completions", json={"model": MODEL, **body}, timeout=RESULT_TIMEOUT)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return dict(response.json()["error"])


def _nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        value = {"items": value}
    return value


# --------------------------------------------------------------------------
# Sequences per request
# --------------------------------------------------------------------------


def test_a_request_for_more_sequences_than_the_cap_gets_413_naming_the_setting(limits_gateway: Gateway) -> None:
    # The report's request: 16 KB of JSON asking for 2000 x 64 = 128,000 sequences.
    error = _error(_complete(limits_gateway, prompt=[[5, 6]] * 2000, n=64, max_tokens=1, temperature=1.0), 413)
    assert "128000 sequences" in error["message"] and "RQ_API_MAX_REQUEST_SEQUENCES" in error["message"]
    assert f"at most {MAX_REQUEST_SEQUENCES}" in error["message"]
    assert error["code"] == "request_too_large" and error["param"] == "prompt"
    one_prompt = _error(_complete(limits_gateway, prompt="hi", n=MAX_REQUEST_SEQUENCES + 1, max_tokens=1), 413)
    assert one_prompt["param"] == "n"


def test_a_request_bigger_than_a_task_is_split_over_tasks_and_answered_in_prompt_order(
    limits_gateway: Gateway,
) -> None:
    # 6 prompts x n=2 = 12 sequences, 4 a task: 3 tasks of 2 prompts.
    prompts = [[11 + p, 200 + 3 * p, 7] for p in range(6)]
    # ignore_eos: the tiny model samples its EOS now and then at temperature 1,
    # which would end a sequence after one token.
    response = _complete(limits_gateway, prompt=prompts, n=2, max_tokens=2, temperature=1.0,
                         ignore_eos=True, return_token_ids=True)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == list(range(12))
    assert [c["prompt_token_ids"] for c in body["choices"]] == [p for p in prompts for _ in range(2)]
    tasks = body["rollout"]["task_id"].split(",")
    assert len(tasks) == len(set(tasks)) == 3, body["rollout"]
    assert body["rollout"]["batch_prompts"] == 6
    assert body["usage"]["completion_tokens"] == 12 * 2


def test_a_bad_prompt_in_a_later_part_of_a_split_request_is_named_by_its_index_in_the_request(
    limits_gateway: Gateway,
) -> None:
    # n=2: 2 prompts a task. Prompt 3 (the second of the second part) is too long
    # for the worker's max_model_len, which only the worker can count.
    prompts = ["hi", "hello", "hey", "ab " * MAX_MODEL_LEN]
    error = _error(_complete(limits_gateway, prompt=prompts, n=2, max_tokens=1, temperature=1.0), 400)
    assert error["message"].startswith("prompt 3 "), error


# --------------------------------------------------------------------------
# Stop strings and nesting
# --------------------------------------------------------------------------


def test_a_long_stop_list_is_a_400_naming_stop_and_the_cap(limits_gateway: Gateway) -> None:
    stops = [f"stop-{i}" for i in range(MAX_STOP_STRINGS + 1)]
    error = _error(_complete(limits_gateway, prompt="hi", max_tokens=1, stop=stops), 400)
    assert error["param"] == "stop" and f"at most {MAX_STOP_STRINGS}" in error["message"], error
    assert error["type"] == "invalid_request_error"
    chat = httpx.post(f"{limits_gateway.base}/v1/chat/completions", timeout=RESULT_TIMEOUT, json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "stop": stops})
    assert _error(chat, 400)["param"] == "stop"


def test_tools_and_guided_json_nested_300_levels_get_a_400_not_a_500(limits_gateway: Gateway) -> None:
    def chat(**extra: Any) -> httpx.Response:
        return httpx.post(f"{limits_gateway.base}/v1/chat/completions", timeout=RESULT_TIMEOUT, json={
            "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **extra})

    tool = {"type": "function", "function": {"name": "deep", "parameters": _nested(300)}}
    for extra, param in (({"tools": [tool]}, "tools"), ({"guided_json": _nested(300)}, "json_schema")):
        error = _error(chat(**extra), 400)
        assert error["param"] == param and f"more than {MAX_JSON_DEPTH} levels" in error["message"], error


# --------------------------------------------------------------------------
# What a client that goes away leaves in Redis
# --------------------------------------------------------------------------


def _new_keys(client: redis_lib.Redis, pattern: str, before: set[str]) -> set[str]:
    return {k for k in client.scan_iter(pattern) if k not in before}


def _aborted_lines(worker: Proc) -> int:
    return worker.log_path.read_text(errors="replace").count(ABORTED_LINE)


def _leaves_nothing_once_its_task_ends(
    gw: Gateway, worker: Proc, client: redis_lib.Redis, body: dict[str, Any]
) -> None:
    """Send ``body`` (a long generation), drop the connection once its task runs, see the
    worker abort it, then neither its result nor its abort set left in Redis."""
    result_pattern = f"{RESULT_PREFIX}api-*"
    results_before = set(client.scan_iter(result_pattern))
    aborted_before = _aborted_lines(worker)
    data = json.dumps({"model": MODEL, **body}).encode()
    host, port = gw.base.removeprefix("http://").split(":")

    async def drop_once_started() -> str:
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        # Its task has started once the worker stored STARTED under its result key.
        deadline = time.monotonic() + RESULT_TIMEOUT
        while not (started := _new_keys(client, result_pattern, results_before)):
            assert time.monotonic() < deadline, "the task never started"
            await asyncio.sleep(0.1)
        writer.close()
        (key,) = started
        return str(key).removeprefix(RESULT_PREFIX)

    task_id = asyncio.run(drop_once_started())
    worker.wait_until(lambda: _aborted_lines(worker) > aborted_before, RESULT_TIMEOUT, "the worker to abort it")
    gw.proc.wait_until(lambda: not client.exists(f"{RESULT_PREFIX}{task_id}"), RESULT_TIMEOUT,
                       "the abandoned task's result to be deleted")
    assert not client.exists(keys.abort_key(task_id))


def test_an_abandoned_stream_leaves_no_result_or_abort_set_in_redis(
    limits_gateway: Gateway, gen_worker: Proc, redis_client: redis_lib.Redis
) -> None:
    _leaves_nothing_once_its_task_ends(limits_gateway, gen_worker, redis_client, {
        "prompt": "Tell me a story", "n": 4, "max_tokens": MAX_MODEL_LEN - 32, "temperature": 1.0,
        "ignore_eos": True, "stream": True})


def test_an_abandoned_request_leaves_no_abort_set_in_redis(
    limits_gateway: Gateway, gen_worker: Proc, redis_client: redis_lib.Redis
) -> None:
    _leaves_nothing_once_its_task_ends(limits_gateway, gen_worker, redis_client, {
        "prompt": ["Tell me a story", "Once upon"], "n": 2, "max_tokens": MAX_MODEL_LEN - 32,
        "temperature": 1.0, "ignore_eos": True})


def test_a_result_whose_reader_went_away_is_deleted_when_it_arrives(
    redis_url: str, redis_client: redis_lib.Redis
) -> None:
    from celery import states

    from rollout_queue.api.results import ResultWatcher
    from rollout_queue.tasks.app import app as celery_app

    async def scenario() -> tuple[str, int]:
        watcher = ResultWatcher(redis_url, celery_app.backend, poll_s=0.2)
        await watcher.start()
        try:
            task_id = watcher.new_task_id()
            watcher.expect(task_id)
            waiting = asyncio.ensure_future(watcher.wait(task_id, 60))
            await asyncio.sleep(0)  # the wait begins
            waiting.cancel()  # its reader went away
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert watcher.abandoned == 1
            redis_client.sadd(keys.abort_key(task_id), 0)
            await asyncio.to_thread(celery_app.backend.store_result, task_id, None, states.STARTED)
            await asyncio.to_thread(celery_app.backend.store_result, task_id, {"partial": True}, states.SUCCESS)
            deadline = time.monotonic() + 30
            while redis_client.exists(f"{RESULT_PREFIX}{task_id}", keys.abort_key(task_id)):
                assert time.monotonic() < deadline, "the abandoned result was not deleted"
                await asyncio.sleep(0.05)
            return task_id, watcher.abandoned
        finally:
            await watcher.close()

    _, still_watched = asyncio.run(scenario())
    assert still_watched == 0


# --------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------


def test_sessions_write_no_key_unless_the_serving_worker_runs_sticky_sessions(
    redis_url: str, redis_client: redis_lib.Redis
) -> None:
    from rollout_queue.api.sessions import Sessions

    def register(node: str, sticky: bool) -> None:
        queues = [keys.GENERATE_QUEUE, *([keys.node_queue(node)] if sticky else [])]
        info = WorkerInfo(node=node, queues=queues, model="m", device="cpu", dtype="float32",
                          state="serving", heartbeat_at=time.time())
        redis_client.set(keys.worker_key(node), info.model_dump_json(), ex=60)
        redis_client.sadd(keys.WORKERS, node)

    register("plain@limits", sticky=False)
    register("sticky@limits", sticky=True)

    async def scenario() -> None:
        sessions = Sessions(redis_url, keys.GENERATE_QUEUE)
        try:
            await sessions.served("s-plain", "plain@limits")
            await sessions.served("s-gone", "gone@limits")  # not in the registry
            await sessions.served("s-sticky", "sticky@limits,plain@limits")  # a split request
            assert await sessions.queue_for("s-sticky") == (keys.node_queue("sticky@limits"), "sticky")
            assert await sessions.queue_for("s-plain") == (keys.GENERATE_QUEUE, "new")
        finally:
            await sessions.close()

    try:
        asyncio.run(scenario())
        assert not redis_client.exists(keys.session_key("s-plain"), keys.session_key("s-gone"))
        assert redis_client.get(keys.session_key("s-sticky")) == "sticky@limits"
    finally:
        redis_client.delete(*(keys.worker_key(n) for n in ("plain@limits", "sticky@limits")),
                            keys.session_key("s-sticky"))
        redis_client.srem(keys.WORKERS, "plain@limits", "sticky@limits")


def test_many_session_ids_without_sticky_workers_create_no_session_keys(
    limits_gateway: Gateway, redis_client: redis_lib.Redis
) -> None:
    pattern = f"{keys.PREFIX}:session:*"
    before = set(redis_client.scan_iter(pattern))

    async def turns() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=RESULT_TIMEOUT) as client:
            return await asyncio.gather(*(
                client.post(f"{limits_gateway.base}/v1/completions", headers={"X-Session-ID": f"limits-{i}"},
                            json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
                for i in range(20)
            ))

    assert all(r.status_code == 200 for r in asyncio.run(turns()))
    assert _new_keys(redis_client, pattern, before) == set()
