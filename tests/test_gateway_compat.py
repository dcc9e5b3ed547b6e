"""What OpenAI and vLLM clients expect of the gateway besides generation.

Unknown request fields are ignored with a warning header (as vLLM does),
``/v1/models`` carries ``max_model_len`` from the worker registry, and
``/tokenize``, ``/detokenize`` and ``/version`` answer. One gateway with
``RQ_API_TOKENIZER`` (the tiny model's) in front of the shared worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_queue.api.tokenize import TokenizeRequest, tokenize
from rollout_queue.tasks import generate
from rollout_queue.tasks.errors import BadRequest
from tests.conftest import MAX_MODEL_LEN
from tests.procs import Proc
from tests.test_api import MODEL, RESULT_TIMEOUT, Gateway, start_gateway


@pytest.fixture(scope="module")
def compat_gateway(redis_url: str, gen_worker: Proc, model_a: Path) -> Iterator[Gateway]:
    gw = start_gateway("api-compat-gateway", redis_url, {"RQ_API_TOKENIZER": str(model_a)})
    yield gw
    gw.proc.stop()


def test_unknown_fields_are_ignored_and_named_in_a_header(compat_gateway: Gateway) -> None:
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 3, "ignore_eos": True, "store": False,
            "metadata": {"run": "7"}, "parallel_tool_calls": True}
    response = httpx.post(f"{compat_gateway.base}/v1/completions", json=body, timeout=RESULT_TIMEOUT)
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"] == "metadata, parallel_tool_calls, store"
    assert response.json()["usage"]["completion_tokens"] == 3
    known = httpx.post(f"{compat_gateway.base}/v1/completions", timeout=RESULT_TIMEOUT,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert known.status_code == 200 and "x-ignored-fields" not in known.headers


def test_an_unknown_field_inside_a_message_is_still_refused(compat_gateway: Gateway) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi", "mood": "x"}]}
    response = httpx.post(f"{compat_gateway.base}/v1/chat/completions", json=body, timeout=RESULT_TIMEOUT)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.mood"


def test_models_carry_max_model_len_from_the_worker_registry(compat_gateway: Gateway) -> None:
    models = httpx.get(f"{compat_gateway.base}/v1/models", timeout=30).json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, MAX_MODEL_LEN)]


def test_tokenize_counts_what_the_worker_counts_and_detokenize_inverts_it(compat_gateway: Gateway) -> None:
    base = compat_gateway.base
    text = "Once upon a time"
    served = httpx.post(f"{base}/v1/completions", timeout=RESULT_TIMEOUT, json={
        "model": MODEL, "prompt": text, "max_tokens": 1, "return_token_ids": True}).json()
    tokens = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()
    assert tokens["tokens"] == served["choices"][0]["prompt_token_ids"]
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=RESULT_TIMEOUT, json={
        "model": MODEL, "messages": messages, "max_tokens": 1}).json()
    rendered = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=30).json()
    assert rendered["count"] == chat["usage"]["prompt_tokens"]
    plain = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()
    back = httpx.post(f"{base}/detokenize", json={"tokens": plain["tokens"]}, timeout=30).json()
    assert back["prompt"] == text
    outside = httpx.post(f"{base}/detokenize", json={"tokens": [10**6]}, timeout=30)
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"


def test_tokenize_without_a_tokenizer_says_how_to_get_one() -> None:
    with pytest.raises(BadRequest, match="RQ_API_TOKENIZER"):
        tokenize(None, TokenizeRequest(prompt="hi"), None)


def test_version_answers(compat_gateway: Gateway) -> None:
    version = httpx.get(f"{compat_gateway.base}/version", timeout=30)
    assert version.status_code == 200 and version.json()["version"]


# --------------------------------------------------------------------------
# Scoring: echo, prompt_logprobs, max_tokens 0
# --------------------------------------------------------------------------


def _complete(gw: Gateway, **body: Any) -> httpx.Response:
    return httpx.post(f"{gw.base}/v1/completions", json={"model": MODEL, **body}, timeout=RESULT_TIMEOUT)


def test_echo_with_max_tokens_0_scores_the_prompt_as_a_direct_task_does(compat_gateway: Gateway) -> None:
    text = "Once upon a time there was a"
    response = _complete(compat_gateway, prompt=text, max_tokens=0, echo=True, logprobs=1, return_token_ids=True)
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    direct = generate.delay([text], {"max_tokens": 1, "prompt_logprobs": 1}).get(timeout=RESULT_TIMEOUT)
    expected = direct["outputs"][0]
    assert choice["text"] == text and body["usage"]["completion_tokens"] == 0
    assert choice["prompt_token_ids"] == expected["prompt_token_ids"] and choice["token_ids"] == []
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(expected["prompt_token_ids"])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected["prompt_logprobs"][1:], abs=1e-5)
    for token, logprob, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:],
                                   logprobs["top_logprobs"][1:]):
        assert top[token] == logprob and 1 <= len(top) <= 2  # the token itself and the top-1
    # The loglikelihood an eval harness computes from it, against the direct task's.
    assert sum(logprobs["token_logprobs"][1:]) == pytest.approx(sum(expected["prompt_logprobs"][1:]), abs=1e-4)


def test_echo_with_generation_returns_the_prompt_then_the_generated_tokens(compat_gateway: Gateway) -> None:
    text = "Once upon a time"
    body = _complete(compat_gateway, prompt=text, max_tokens=3, echo=True, logprobs=0, temperature=0,
                     ignore_eos=True).json()
    plain = _complete(compat_gateway, prompt=text, max_tokens=3, temperature=0, ignore_eos=True,
                      return_token_ids=True).json()
    choice = body["choices"][0]
    assert choice["text"] == text + plain["choices"][0]["text"]
    prompt_len = len(plain["choices"][0]["prompt_token_ids"])
    assert len(choice["logprobs"]["tokens"]) == prompt_len + 3
    assert body["usage"]["completion_tokens"] == 3


def test_prompt_logprobs_come_in_vllm_shape(compat_gateway: Gateway) -> None:
    body = _complete(compat_gateway, prompt="Once upon a time", max_tokens=1, prompt_logprobs=2,
                     return_token_ids=True).json()
    choice = body["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(choice["prompt_token_ids"])
    for token, entry in zip(choice["prompt_token_ids"][1:], entries[1:]):
        # The top 2 ranked 1 and 2, and the prompt's own token with its engine rank, as vLLM.
        ranks = [e["rank"] for e in entry.values()]
        assert ranks[:2] == [1, 2] and len(ranks) in (2, 3)
        own = entry[str(token)]["rank"]
        assert own in (1, 2) if len(ranks) == 2 else own > 2


def test_max_tokens_0_without_echo_is_refused_naming_the_field(compat_gateway: Gateway) -> None:
    response = _complete(compat_gateway, prompt="hi", max_tokens=0)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    streamed = _complete(compat_gateway, prompt="hi", max_tokens=1, echo=True, stream=True)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "echo"
