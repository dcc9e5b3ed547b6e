"""Tool calls and chat-template options, through the gateway and from Python.

The shared worker (``gen@tests``) runs ``--tool-call-parser hermes``; the
tiny model's chat template renders tools and tool calls the Hermes way (see
``cli.tiny_model.CHAT_TEMPLATE``). Its weights are random, so a call is
forced with a guided regex (``auto`` tool choice: the worker's parser must
still find and parse it) or with a named/required tool choice (structured
output of the function's parameters).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from rollout_queue.tasks import generate
from rollout_queue.tasks.errors import InvalidRequest
from rollout_queue.tasks.schemas import Conversation
from rollout_queue.workers.engine.tools import ToolCalls
from tests.procs import Proc
from tests.test_api import MODEL, RESULT_TIMEOUT, Gateway, start_gateway

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
# What the model must write in auto mode: one Hermes call, its arguments chosen by the model.
CALL_REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}\n</tool_call>'
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_gateway(redis_url: str, gen_worker: Proc) -> Iterator[Gateway]:
    gw = start_gateway("api-tools-gateway", redis_url, {})
    yield gw
    gw.proc.stop()


@pytest.fixture(scope="module")
def tokenizer(model_a: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_a))


def _forced(client: Any, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=80,
        extra_body={"guided_regex": CALL_REGEX, "return_token_ids": True, **extra.pop("extra_body", {})}, **extra,
    )


def test_a_two_turn_tool_loop_through_the_openai_client(
    tools_gateway: Gateway, tokenizer: Any,
) -> None:
    client = tools_gateway.client()
    first = _forced(client, QUESTION)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    city = json.loads(call.function.arguments)["city"]
    assert city in ("Paris", "Oslo")
    # The model saw the tools: the template's tool block is in the rendered prompt.
    prompt = tokenizer.decode(choice.model_extra["prompt_token_ids"])
    assert '"name": "get_time"' in prompt and "<tools>" in prompt

    # Turn two: the call and its result go back; the worker renders both.
    messages = [*QUESTION, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": f"sunny in {city}"}]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=4,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    prompt = tokenizer.decode(second.choices[0].model_extra["prompt_token_ids"])
    rendered_call = f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{rendered_call}<|im_end|>\n<|im_start|>tool\nsunny in {city}<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert second.usage.completion_tokens == 4


def test_streamed_tool_calls_add_up_to_the_unstreamed_call(tools_gateway: Gateway) -> None:
    client = tools_gateway.client()
    whole = _forced(client, QUESTION).choices[0].message.tool_calls[0]
    name, arguments, ids, finish, content = None, "", set(), None, ""
    for chunk in _forced(client, QUESTION, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                assert piece.index == 0
                name = piece.function.name or name
                arguments += piece.function.arguments or ""
                if piece.id:
                    ids.add(piece.id)
            finish = choice.finish_reason or finish
    assert (name, json.loads(arguments)) == (whole.function.name, json.loads(whole.function.arguments))
    assert len(ids) == 1 and finish == "tool_calls" and content == ""


def test_tool_choice_none_renders_the_tools_and_returns_text(tools_gateway: Gateway) -> None:
    choice = _forced(tools_gateway.client(), QUESTION, tool_choice="none").choices[0]
    assert choice.message.tool_calls in (None, [])
    assert choice.message.content.startswith('<tool_call>\n{"name": "get_weather"')
    assert choice.finish_reason != "tool_calls"


def test_a_named_tool_choice_returns_that_tools_arguments(tools_gateway: Gateway) -> None:
    client = tools_gateway.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=named, temperature=0, max_tokens=40,
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    streamed = "".join(
        piece.function.arguments or ""
        for chunk in client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=named, temperature=0,
            max_tokens=40, stream=True)
        for choice in chunk.choices for piece in choice.delta.tool_calls or []
    )
    assert json.loads(streamed) == json.loads(call.function.arguments)


def test_template_options_reach_the_chat_template(tools_gateway: Gateway, tokenizer: Any) -> None:
    client = tools_gateway.client()

    def prompt_of(**body: Any) -> str:
        response = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=1, extra_body={"return_token_ids": True, **body.pop("extra", {})},
            **body,
        )
        return str(tokenizer.decode(response.choices[0].model_extra["prompt_token_ids"]))

    assert prompt_of(messages=QUESTION, extra={"chat_template_kwargs": {"enable_thinking": False}}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    partial = [*QUESTION, {"role": "assistant", "content": "It is"}]
    continued = prompt_of(messages=partial, extra={"continue_final_message": True, "add_generation_prompt": False})
    assert continued.endswith("<|im_start|>assistant\nIt is")


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
     "messages", "add_generation_prompt=false"),
])
def test_bad_tool_requests_are_refused_with_the_reason(
    tools_gateway: Gateway, body: dict[str, Any], param: str, words: str,
) -> None:
    import httpx

    full = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, **body}
    response = httpx.post(f"{tools_gateway.base}/v1/chat/completions", json=full, timeout=RESULT_TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"].startswith(param), error


def test_python_producers_send_conversations_with_tools_and_get_parsed_calls(gen_worker: Proc) -> None:
    conversation = {"messages": QUESTION, "tools": [WEATHER]}
    result = generate.delay([conversation, QUESTION], {"temperature": 0, "max_tokens": 80,
                                                       "regex": CALL_REGEX}).get(timeout=RESULT_TIMEOUT)
    parsed, plain = (output["samples"][0] for output in result["outputs"])
    [call] = parsed["tool_calls"]
    assert call["function"]["name"] == "get_weather" and parsed["content"] is None
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
    assert plain["tool_calls"] is None and plain["content"] is None  # no tools: not parsed
    assert plain["text"].startswith("<tool_call>")


def test_a_worker_without_a_parser_refuses_auto_tool_choice_and_renders_none() -> None:
    tools = ToolCalls(None)
    with pytest.raises(InvalidRequest, match="--tool-call-parser"):
        tools.check(Conversation.model_validate({"messages": QUESTION, "tools": [WEATHER]}))
    tools.check(Conversation.model_validate({"messages": QUESTION, "tools": [WEATHER], "tool_choice": "none"}))
    with pytest.raises(ValueError, match="not one of vLLM's"):
        ToolCalls("no-such-parser")
