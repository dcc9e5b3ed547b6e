"""Split calls: more than RQ_TASK_MAX_PROMPTS prompts go out as several generate tasks
and come back as one result (tasks/split.py).

The split threshold is set to 4 for these tests (``configure``); the calls go
through the shared ``gen_worker`` (model A, default queue) and a real Redis.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis as redis_lib
from celery import states
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult

from rollout_queue.tasks import generate
from rollout_queue.tasks.errors import InvalidRequest, PromptTooLong
from rollout_queue.tasks.schemas import GenerationResult, PromptOutput, Sample, Timing, Usage
from rollout_queue.tasks.signature import signature
from rollout_queue.tasks.split import SplitResult, join_results, plan_parts, prompts_per_task
from tests.conftest import MAX_MODEL_LEN, MAX_PROMPTS, wait_for
from tests.procs import Proc

TIMEOUT = 180.0
# 3 x MAX_PROMPTS + 1 distinct token-id prompts: four parts of 4, 3, 3, 3.
PROMPTS = [[11 + p, 200 + 3 * p, 7, 5 + p] for p in range(3 * MAX_PROMPTS + 1)]
GREEDY = {"temperature": 0, "max_tokens": 8}


def unsplit(prompts: list[Any], params: dict[str, Any]) -> dict[str, Any]:
    """The same call as one task (RQ_TASK_MAX_PROMPTS above its size)."""
    from rollout_queue.tasks.app import configure, settings

    before = settings()
    configure(before.model_copy(update={"task_max_prompts": len(prompts)}))
    try:
        handle = generate.delay(prompts, params)
    finally:
        configure(before)
    assert isinstance(handle, AsyncResult)
    return handle.get(timeout=TIMEOUT)


def token_ids(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[s["token_ids"] for s in out["samples"]] for out in result["outputs"]]


# ------------------------------------------------------------- pure logic


def test_plan_parts_covers_every_prompt_once_in_parts_within_one_of_each_other() -> None:
    assert plan_parts(13, 4) == [range(4), range(4, 7), range(7, 10), range(10, 13)]
    assert plan_parts(4, 4) == [range(4)]
    for prompts in (1, 5, 128, 129, 1000, 1024):
        for limit in (1, 3, 64, 128):
            parts = plan_parts(prompts, limit)
            assert [i for part in parts for i in part] == list(range(prompts))
            sizes = [len(part) for part in parts]
            assert max(sizes) <= limit and max(sizes) - min(sizes) <= 1
            assert len(parts) == -(-prompts // limit)


def _part(worker: str, version: int, first_token: int, queued: float, generate_s: float) -> GenerationResult:
    sample = Sample(text="x", token_ids=[first_token, 2], finish_reason="length",
                    weight_versions=[(0, version)])
    return GenerationResult(
        signature="sig", weight_version=version, worker=worker,
        outputs=[PromptOutput(prompt_token_ids=[first_token], samples=[sample])],
        usage=Usage(prompt_tokens=1, completion_tokens=2),
        timing=Timing(queued_s=queued, generate_s=generate_s),
    )


def test_join_results_keeps_part_order_sums_usage_and_takes_the_lowest_weight_version() -> None:
    joined = join_results([
        _part("w@a", 3, 10, queued=0.5, generate_s=2.0),   # ends at 2.5
        _part("w@b", 2, 20, queued=0.1, generate_s=1.0),   # starts first
        _part("w@a", 3, 30, queued=1.0, generate_s=3.0),   # ends last, at 4.0
    ])
    assert [o.prompt_token_ids for o in joined.outputs] == [[10], [20], [30]]
    assert joined.worker == "w@a,w@b"
    assert joined.weight_version == 2
    assert [o.samples[0].weight_versions for o in joined.outputs] == [[(0, 3)], [(0, 2)], [(0, 3)]]
    assert joined.usage == Usage(prompt_tokens=3, completion_tokens=6)
    assert joined.timing.queued_s == pytest.approx(0.1)
    assert joined.timing.generate_s == pytest.approx(3.9)


# --------------------------------------------------------- what is enqueued


def test_a_small_call_is_one_task_and_a_big_one_parts_carrying_params_limits_and_offsets(
    redis_client: redis_lib.Redis, max_prompts: int
) -> None:
    queue = f"unconsumed-{uuid.uuid4().hex[:8]}"  # no worker reads it: what lands stays
    params = {**GREEDY, "min_weight_version": 7}
    try:
        small = generate.apply_async((PROMPTS[:max_prompts], params), queue=queue)
        assert isinstance(small, AsyncResult)  # not a SplitResult
        assert redis_client.llen(queue) == 1
        redis_client.delete(queue)

        big = generate.apply_async((PROMPTS, params), queue=queue, soft_time_limit=30, time_limit=40)
        assert isinstance(big, SplitResult)
        messages = [json.loads(raw) for raw in reversed(redis_client.lrange(queue, 0, -1))]
        assert len(messages) == len(big.results) == 4
        headers = [m["headers"] for m in messages]
        assert [h["id"] for h in headers] == [part.id for part in big.results]
        assert [h["rq_first_prompt"] for h in headers] == [0, 4, 7, 10]
        assert [h["rq_sequences"] for h in headers] == [4, 3, 3, 3]
        assert {h["rq_signature"] for h in headers} == {signature(params)}
        assert {h["rq_min_weight_version"] for h in headers} == {7}
        assert all(h["timelimit"] == [40, 30] for h in headers)  # per part
        assert {h["group"] for h in headers} == {big.id}
        assert len({h["rq_sent_at"] for h in headers}) == 1
        # The group is stored: another process finds the call by its id.
        restored = SplitResult.restore(big.id)
        assert restored is not None and [p.id for p in restored.results] == [p.id for p in big.results]
        assert big.state == states.PENDING and not big.ready()
    finally:
        redis_client.delete(queue)


def test_a_task_holds_at_most_the_sequence_cap_and_always_one_prompt() -> None:
    assert prompts_per_task(n=1, max_prompts=128, max_sequences=1024) == 128
    assert prompts_per_task(n=64, max_prompts=128, max_sequences=1024) == 16
    assert prompts_per_task(n=256, max_prompts=128, max_sequences=16) == 1


def test_a_call_with_many_samples_is_split_by_sequences(redis_client: redis_lib.Redis) -> None:
    from rollout_queue.tasks.app import configure, settings

    queue = f"unconsumed-{uuid.uuid4().hex[:8]}"
    before = settings()
    configure(before.model_copy(update={"task_max_sequences": 8}))
    try:
        # 6 prompts x n=4: 2 prompts (8 sequences) a task, although 6 < RQ_TASK_MAX_PROMPTS.
        handle = generate.apply_async((PROMPTS[:6], {"n": 4, "max_tokens": 2}), queue=queue)
        assert isinstance(handle, SplitResult) and len(handle.results) == 3
        headers = [json.loads(raw)["headers"] for raw in reversed(redis_client.lrange(queue, 0, -1))]
        assert [(h["rq_first_prompt"], h["rq_sequences"]) for h in headers] == [(0, 8), (2, 8), (4, 8)]
    finally:
        configure(before)
        redis_client.delete(queue)


def test_a_call_past_the_sequence_cap_is_refused_before_anything_is_enqueued(
    redis_client: redis_lib.Redis,
) -> None:
    from rollout_queue.tasks.app import settings

    queue = f"unconsumed-{uuid.uuid4().hex[:8]}"
    # The hardening report's request: 16 KB of JSON asking for 128,000 sequences.
    try:
        with pytest.raises(InvalidRequest, match="RQ_CALL_MAX_SEQUENCES") as refused:
            generate.apply_async(([[5, 6]] * 2000, {"n": 64, "max_tokens": 1, "temperature": 1.0}), queue=queue)
        assert f"at most {settings().call_max_sequences}" in str(refused.value)
        assert "128000 sequences (2000 prompts x n=64)" in str(refused.value)
        assert redis_client.llen(queue) == 0
    finally:
        redis_client.delete(queue)


# ------------------------------------------------------------- end to end


def test_split_call_returns_one_result_equal_to_the_unsplit_call_in_prompt_order(
    gen_worker: Proc, max_prompts: int
) -> None:
    handle = generate.delay(PROMPTS, GREEDY)
    assert isinstance(handle, SplitResult) and len(handle.results) == 4
    result = handle.get(timeout=TIMEOUT)
    parsed = GenerationResult.model_validate(result)
    reference = unsplit(PROMPTS, GREEDY)
    assert [o["prompt_token_ids"] for o in result["outputs"]] == PROMPTS
    assert token_ids(result) == token_ids(reference)
    assert all(per_prompt[0] for per_prompt in token_ids(result))
    assert parsed.usage == Usage.model_validate(reference["usage"])
    assert parsed.signature == reference["signature"] == signature(GREEDY)
    assert parsed.worker == "gen@tests" and parsed.weight_version == 0
    assert parsed.timing.generate_s > 0
    assert handle.state == states.SUCCESS and handle.ready() and handle.successful()


def test_split_call_keeps_each_prompts_n_samples_together(gen_worker: Proc, max_prompts: int) -> None:
    params = {"temperature": 1.0, "max_tokens": 6, "n": 2, "seed": 99}
    prompts = PROMPTS[: 2 * max_prompts + 1]  # parts of 3, 3, 3 prompts x 2 samples
    handle = generate.delay(prompts, params)
    assert isinstance(handle, SplitResult) and len(handle.results) == 3
    result = handle.get(timeout=TIMEOUT)
    assert [o["prompt_token_ids"] for o in result["outputs"]] == prompts
    assert [len(o["samples"]) for o in result["outputs"]] == [2] * len(prompts)
    # A seeded request samples the same tokens wherever it runs.
    assert token_ids(result) == token_ids(unsplit(prompts, params))


def test_a_failing_part_fails_the_call_naming_the_prompt_by_its_index_in_the_whole_call(
    gen_worker: Proc, max_prompts: int
) -> None:
    prompts = list(PROMPTS)
    prompts[9] = [7] * 600  # in the third part (prompts 7-9)
    handle = generate.delay(prompts, GREEDY)
    assert isinstance(handle, SplitResult)
    too_long = rf"^prompt 9 has 600 tokens; this worker's max_model_len is {MAX_MODEL_LEN}"
    with pytest.raises(PromptTooLong, match=too_long):
        handle.get(timeout=TIMEOUT)
    wait_for(lambda: handle.state == states.FAILURE, 30, "the call's state to be FAILURE")
    assert isinstance(handle.get(timeout=TIMEOUT, propagate=False), PromptTooLong)


def test_revoking_a_split_call_revokes_every_part(gen_worker: Proc, max_prompts: int) -> None:
    # A countdown holds the parts in the worker's timer, so the revoke
    # reaches it before any part could start: 15 s for a control message that
    # a loaded machine may take seconds to deliver (the test waits it out;
    # 8 s was too short once, with two suites running side by side).
    handle = generate.apply_async((PROMPTS, GREEDY), countdown=15)
    assert isinstance(handle, SplitResult)
    handle.revoke()
    with pytest.raises(TaskRevokedError):
        handle.get(timeout=TIMEOUT)
    wait_for(lambda: all(part.state == states.REVOKED for part in handle.results), 60,
             "every part to be REVOKED")
    assert handle.state == states.REVOKED
