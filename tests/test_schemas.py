"""Pure unit tests of the contract: ``SamplingParams`` ranges, request validation,
signatures, and the error tree through Celery's JSON result encoding.

No Redis, no engine: these run in milliseconds, except one that imports vLLM
(a few seconds, paid once per session) to encode params at our bounds with
the engine core's own encoder.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_queue.tasks import errors
from rollout_queue.tasks.errors import RolloutError
from rollout_queue.tasks.generate import build_request
from rollout_queue.tasks.schemas import GenerateRequest, SamplingParams, validation_summary
from rollout_queue.tasks.signature import signature

VALID = [
    {"temperature": 0},
    {"temperature": 2.5, "top_p": 1.0},
    {"top_p": 0.01},
    {"top_k": 50},
    {"top_k": -1},
    {"min_p": 1.0},
    {"max_tokens": 1},
    {"max_tokens": 8, "min_tokens": 8},
    {"n": 256},
    {"stop": "###"},
    {"stop": ["a", "b"], "stop_token_ids": [0, 3]},
    {"seed": -5},
    {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1.2},
    {"logprobs": 0},
    {"logprobs": 20, "prompt_logprobs": 5},
    {"ignore_eos": True},
    {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    {"json_object": True},
    {"regex": "[0-9]+"},
    {"choice": ["yes", "no"]},
    {"min_weight_version": 3},
    # The largest values the engine carries (int32 counts and ids, int64 seeds).
    {"max_tokens": 2**31 - 1, "min_tokens": 2**31 - 1, "top_k": 2**31 - 1},
    {"stop_token_ids": [2**31 - 1], "seed": 2**63 - 1},
    {"seed": -(2**63), "min_weight_version": 2**63 - 1},
]

INVALID = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"n": 0}, "n"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"logprobs": 2**31}, "logprobs"),  # past it the engine's max_logprobs decides (api.checks)
    ({"regex": "a", "grammar": "root ::= \"a\""}, "structured output"),
    ({"choice": []}, "choice"),
    ({"regex": "a", "choice": ["a"]}, "structured output"),
    ({"json_schema": {"x": object()}}, "json_schema"),
    ({"json_schema": {"x": float("nan")}}, "json_schema"),
    ({"min_weight_version": -1}, "min_weight_version"),
    # Beyond what vLLM carries: they used to pass and fail in the engine
    # ("OverflowError: can't serialize ints") after the task's retries.
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"min_tokens": 2**31}, "min_tokens"),
    ({"top_k": 2**70}, "top_k"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"min_weight_version": 2**63}, "min_weight_version"),
    ({"temprature": 0.5}, "temprature"),
    ({"max_new_tokens": 5}, "max_new_tokens"),
]


@pytest.mark.parametrize("params", VALID, ids=[",".join(p) for p in VALID])
def test_sampling_params_accept_values_in_range(params: dict[str, Any]) -> None:
    parsed = SamplingParams.model_validate(params)
    assert parsed.canonical()["max_tokens"] >= 1


@pytest.mark.parametrize(("params", "field"), INVALID, ids=[f for _, f in INVALID])
def test_sampling_params_refuse_out_of_range_values_naming_the_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        SamplingParams.model_validate(params)
    assert field in str(caught.value)


def test_a_single_stop_string_becomes_a_list_and_disabled_top_k_becomes_none() -> None:
    parsed = SamplingParams(stop="###", top_k=0)  # type: ignore[arg-type]
    assert parsed.stop == ["###"]
    assert parsed.top_k is None
    assert signature({"top_k": 0}) == signature({"top_k": -1}) == signature({})


@pytest.mark.parametrize(
    "prompts",
    [["a", "b"], [[1, 2], [3]], [[{"role": "user", "content": "hi"}]], ("tuple of", "strings")],
    ids=["text", "tokens", "chat", "tuple"],
)
def test_requests_accept_one_prompt_kind_per_task(prompts: Any) -> None:
    request = build_request(prompts, {})
    assert len(request.prompts) == len(prompts)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([], "must not be empty"),
        ("just a string", "must be a list"),
        (["a", [1, 2]], "mix kinds"),
        ([""], "at least 1 character"),
        ([[]], "at least 1 item"),
        ([[1, -2]], "greater than or equal to 0"),
        ([[{"role": "wizard", "content": "x"}]], "role"),
        ([[{"role": "user", "content": "x", "mood": "n"}]], "mood"),
        ([{"messages": []}], "at least 1 item"),
        ([[{"role": "assistant", "content": None}]], "'assistant' message without content"),
        ([3.5], "prompt 0 is float"),
    ],
    ids=["empty", "bare-string", "mixed", "empty-text", "empty-tokens", "negative-id", "bad-role",
         "extra-key", "empty-conversation", "no-content", "float"],
)
def test_requests_refuse_bad_prompts_with_a_clear_message(prompts: Any, message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message) as caught:
        build_request(prompts, {})
    # Only the prompts' own kind is checked: a negative token id is one error,
    # not one from each kind of prompt it is not (a string, a chat).
    assert caught.value.error_count() == 1, str(caught.value)


def test_token_prompts_refuse_ids_beyond_int32_and_accept_the_largest() -> None:
    assert build_request([[2**31 - 1]], {}).prompts == [[2**31 - 1]]
    with pytest.raises(pydantic.ValidationError, match="less than or equal to 2147483647"):
        build_request([[5, 2**31]], {})


@pytest.mark.parametrize("params", ["temperature=0", 5, [("max_tokens", 3)], ""], ids=repr)
def test_params_that_are_not_a_mapping_are_a_validation_error_naming_params(params: Any) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        build_request(["hi"], params)
    (error,) = caught.value.errors()
    assert error["loc"] == ("params",) and "valid dictionary" in error["msg"]


def test_validation_summary_names_each_refused_field_and_the_value_on_one_line() -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        GenerateRequest.model_validate({"prompts": ["a"], "params": {"max_tokens": 2**70, "top_p": 0}})
    text = validation_summary(caught.value)
    assert "\n" not in text and "errors.pydantic.dev" not in text
    assert f"params.max_tokens: Input should be less than or equal to 2147483647 (got {2**70})" in text
    assert "params.top_p: Input should be greater than 0 (got 0)" in text


def test_the_largest_accepted_values_cross_vllms_engine_core_encoder() -> None:
    """Our bounds are what the engine carries: the params a task at the limits
    becomes (``to_vllm_params``) encode with vLLM's own msgspec encoder, which
    refused the values that used to pass."""
    from vllm.v1.serial_utils import MsgpackEncoder

    from rollout_queue.workers.engine.host import to_vllm_params

    largest = SamplingParams(max_tokens=2**31 - 1, top_k=2**31 - 1, seed=2**63 - 1,
                             stop_token_ids=[2**31 - 1])
    encoder = MsgpackEncoder()
    assert encoder.encode(to_vllm_params(largest))
    too_large = to_vllm_params(SamplingParams())
    too_large.max_tokens = 2**70  # what validation used to let through
    with pytest.raises(OverflowError, match="can't serialize ints"):
        encoder.encode(too_large)


# --------------------------------------------------------------- errors


def _error_classes(base: type[BaseException] = RolloutError) -> list[type[BaseException]]:
    found = [base]
    for sub in base.__subclasses__():
        found += _error_classes(sub)
    return found


# One instance of every class of the tree, built the way the code raises it:
# those whose constructor takes fields, then every other one from a message.
ERROR_EXAMPLES: dict[type[BaseException], BaseException] = {
    errors.Requeue: errors.Requeue("task needs weight_version >= 3; w has 2", countdown=1.0),
    errors.ControlTimeout: errors.ControlTimeout("engine_stats", ["ghost@tests", "b@h"]),
    errors.ControlFailed: errors.ControlFailed("sleep", {"a@h": "no sleep mode"}, {"b@h": True}),
    errors.BatchIncomplete: errors.BatchIncomplete({"t1": "PromptTooLong('x')"}, ["t2"], [3, 1]),
    errors.BadRequest: errors.BadRequest("temperature must be at most 100", param="temperature"),
    errors.WorkerLost: errors.WorkerLost("w@h stopped answering", phase="receive", workers=["w@h"]),
    errors.SyncRefused: errors.SyncRefused("bad signature", phase="trigger", workers=["b", "a"]),
    errors.PoisonMessage: errors.PoisonMessage("not-json", "item is not JSON: b'[1,'"),
}
for _cls in _error_classes():
    if _cls.__module__ == "rollout_queue.tasks.errors" and _cls not in ERROR_EXAMPLES:
        ERROR_EXAMPLES[_cls] = _cls("prompt has 9123 tokens; this worker's max_model_len is 4096")


@pytest.mark.parametrize("error", list(ERROR_EXAMPLES.values()), ids=lambda e: type(e).__name__)
def test_every_error_class_comes_back_from_celerys_json_result_backend_whole(error: BaseException) -> None:
    from rollout_queue.tasks.app import app

    stored = app.backend.prepare_exception(error, "json")
    assert stored["exc_type"] == type(error).__name__
    wire = json.loads(json.dumps(stored))  # what the result backend keeps in Redis
    rebuilt = app.backend.exception_to_python(wire)
    assert type(rebuilt) is type(error)
    assert str(rebuilt) == str(error) and str(error)
    assert vars(rebuilt) == vars(error)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_the_error_examples_cover_the_whole_tree() -> None:
    assert set(ERROR_EXAMPLES) == {c for c in _error_classes() if c.__module__ == "rollout_queue.tasks.errors"}
    assert len(ERROR_EXAMPLES) >= 25


# --------------------------------------------------------------- signature

FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0.05, 5, allow_nan=False),  # 0 with n > 1 is refused
    "top_p": st.floats(0.01, 1.0, allow_nan=False),
    "top_k": st.integers(1, 100),
    "max_tokens": st.integers(16, 512),
    "n": st.integers(1, 8),
    "seed": st.integers(0, 2**31),
    "stop": st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3),
    "logprobs": st.integers(0, 5),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2, allow_nan=False),
    "min_weight_version": st.integers(0, 10),
}

params_dicts = st.fixed_dictionaries({}, optional=FIELD_VALUES)


@settings(max_examples=200, deadline=None)
@given(params=params_dicts, order=st.randoms(use_true_random=False))
def test_signature_ignores_key_order_and_spelled_out_defaults(params: dict[str, Any], order: Any) -> None:
    shuffled = list(params.items())
    order.shuffle(shuffled)
    same = dict(shuffled)
    assert signature(same) == signature(params)
    assert signature(SamplingParams.model_validate(params)) == signature(params)
    spelled_out = SamplingParams.model_validate(params).canonical()
    assert signature(spelled_out) == signature(params)


@settings(max_examples=200, deadline=None)
@given(params=params_dicts, data=st.data())
def test_signature_changes_when_any_sampling_field_changes(params: dict[str, Any], data: Any) -> None:
    field = data.draw(st.sampled_from(sorted(FIELD_VALUES)))
    value = data.draw(FIELD_VALUES[field])
    base = SamplingParams.model_validate(params).canonical()
    changed = {**params, field: value}
    if SamplingParams.model_validate(changed).canonical() == base:
        assert signature(changed) == signature(params)
    else:
        assert signature(changed) != signature(params)


def test_signature_is_a_short_stable_hex_string() -> None:
    sig = signature({"temperature": 0.7, "max_tokens": 64})
    assert len(sig) == 16 and int(sig, 16) >= 0
    # Pinned: a change of the canonical form must be deliberate (results carry it).
    assert sig == "73ab57268078e485"


def test_several_greedy_samples_are_refused_before_enqueueing() -> None:
    from pydantic import ValidationError

    from rollout_queue.tasks.schemas import SamplingParams

    with pytest.raises(ValidationError, match="identical greedy samples"):
        SamplingParams(n=2, temperature=0.0)
    assert SamplingParams(n=2, temperature=0.5).n == 2


# --------------------------------------------------------------------------
# Request limits: stop strings, JSON nesting
# --------------------------------------------------------------------------


def _nested(levels: int) -> dict[str, Any]:
    """A JSON-schema-like object nesting dicts exactly ``levels`` deep."""
    value: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        value = {"items": value}
    return value


def test_stop_lists_past_the_count_or_size_caps_are_refused_naming_stop_everywhere_params_are_parsed() -> None:
    from rollout_queue.tasks.schemas import MAX_STOP_CHARS, MAX_STOP_STRINGS

    assert SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]).stop is not None
    assert SamplingParams(stop=["x" * MAX_STOP_CHARS]).stop is not None
    too_many = {"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], "n": 4}
    too_long = {"stop": ["x" * (MAX_STOP_CHARS // 2 + 1)] * 2}
    for params, words in ((too_many, f"at most {MAX_STOP_STRINGS}"), (too_long, f"at most {MAX_STOP_CHARS}")):
        # The producer (build_request) and a worker parsing a hand-made message alike.
        with pytest.raises(pydantic.ValidationError, match=words) as producer:
            build_request(["hi"], params)
        assert producer.value.errors()[0]["loc"] == ("params", "stop")
        with pytest.raises(pydantic.ValidationError, match=words) as wire:
            GenerateRequest.model_validate({"prompts": ["hi"], "params": params})
        assert validation_summary(wire.value).startswith("params.stop: ")


def test_json_nested_past_the_depth_cap_is_refused_in_schemas_tools_and_template_options() -> None:
    from rollout_queue.tasks.schemas import MAX_JSON_DEPTH, Conversation, json_depth

    assert json_depth(_nested(MAX_JSON_DEPTH)) == MAX_JSON_DEPTH and json_depth("x") == 0
    assert json_depth(_nested(50_000)) == MAX_JSON_DEPTH + 1  # stops counting: no recursion, no time
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested(MAX_JSON_DEPTH - 4)}}
    # At the cap, a whole task message still serializes (pydantic's own limit is ~250 levels).
    deepest = GenerateRequest.model_validate({
        "prompts": [{"messages": messages, "tools": [tool]}],
        "params": {"json_schema": _nested(MAX_JSON_DEPTH)},
    })
    assert json.loads(json.dumps(deepest.model_dump(mode="json")))
    deep = _nested(300)
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    for field, build in (
        ("json_schema", lambda: SamplingParams(json_schema=deep)),
        ("tools", lambda: Conversation(messages=messages, tools=[deep_tool])),
        ("chat_template_kwargs", lambda: Conversation(messages=messages, chat_template_kwargs={"x": deep})),
    ):
        with pytest.raises(pydantic.ValidationError, match=f"more than {MAX_JSON_DEPTH} levels") as refused:
            build()
        assert refused.value.errors()[0]["loc"] == (field,)
