"""Tool calling at the gateway: what ``tool_choice`` asks of the task, what a sample means.

Four modes, as vLLM's server has them:

- ``off``: no tools. ``none``: tools rendered by the chat template, output is text.
- ``auto`` (the default with tools): the worker's tool-call parser
  (``--tool-call-parser``) finds calls in the text; a choice with calls ends
  with ``finish_reason: "tool_calls"``.
- ``named`` (``{"type": "function", "function": {"name": ...}}``): structured
  output makes the sample the function's arguments (its ``parameters`` schema).
- ``required``: structured output makes the sample a JSON array of
  ``{"name", "parameters"}``, one per call.

``named`` and ``required`` need no parser: the gateway reads the constrained
text. Streamed, ``named`` sends the arguments as they come; ``required``
sends its calls when the sample is complete (the array is parsed whole).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from rollout_queue.api.schemas import (
    ChatCompletionRequest,
    FunctionCallDelta,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallDeltaOut,
    ToolCallOut,
)
from rollout_queue.tasks.errors import BadRequest
from rollout_queue.tasks.schemas import Sample, SampleDelta

Mode = Literal["off", "none", "auto", "named", "required"]


def mode(request: ChatCompletionRequest) -> Mode:
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools: send the functions the model may call in tools",
                             "tool_choice")
        return "off"
    if isinstance(choice, NamedToolChoice):
        names = [tool.function.name for tool in request.tools]
        if choice.function.name not in names:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not in tools "
                             f"({', '.join(names)})", "tool_choice")
        return "named"
    return choice or "auto"


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def structured(request: ChatCompletionRequest, tool_mode: Mode) -> dict[str, Any]:
    """The ``SamplingParams`` constraint a named or required tool choice adds (else none)."""
    if tool_mode == "named":
        assert isinstance(request.tool_choice, NamedToolChoice)
        tool = next(t for t in request.tools or [] if t.function.name == request.tool_choice.function.name)
        return {"json_schema": _parameters(tool)}
    if tool_mode == "required":
        return {"json_schema": {
            "type": "array", "minItems": 1,
            "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                "parameters": _parameters(t)},
                 "required": ["name", "parameters"]}
                for t in request.tools or []
            ]},
        }}
    return {}


def conversation(request: ChatCompletionRequest, messages: list[dict[str, Any]], tool_mode: Mode) -> Any:
    """The chat prompt the task carries: the messages alone, or a ``Conversation`` with options."""
    options: dict[str, Any] = {}
    if request.tools:
        options["tools"] = [tool.model_dump(exclude_none=True) for tool in request.tools]
        options["tool_choice"] = "auto" if tool_mode == "auto" else "none"  # the worker parses auto only
    if request.chat_template_kwargs:
        options["chat_template_kwargs"] = request.chat_template_kwargs
    if not request.add_generation_prompt:
        options["add_generation_prompt"] = False
    if request.continue_final_message:
        options["continue_final_message"] = True
    return {"messages": messages, **options} if options else messages


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _required_calls(text: str) -> list[ToolCallOut] | None:
    try:
        calls = json.loads(text)
        return [
            ToolCallOut(id=_call_id(), function=FunctionCallOut(
                name=call["name"], arguments=json.dumps(call["parameters"], ensure_ascii=False)))
            for call in calls
        ]
    except (ValueError, TypeError, KeyError):  # cut off by max_tokens: left as text
        return None


def message(
    request: ChatCompletionRequest, tool_mode: Mode, sample: Sample,
) -> tuple[str | None, list[ToolCallOut], str | None]:
    """``(content, tool_calls, finish_reason)`` of a choice."""
    if tool_mode == "auto" and sample.tool_calls is not None:
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.function.name, arguments=c.function.arguments))
                 for c in sample.tool_calls]
        return sample.content, calls, "tool_calls" if calls else sample.finish_reason
    if tool_mode == "named":
        assert isinstance(request.tool_choice, NamedToolChoice)
        name = request.tool_choice.function.name
        return None, [ToolCallOut(id=_call_id(), function=FunctionCallOut(name=name, arguments=sample.text))], \
            sample.finish_reason
    if tool_mode == "required":
        required = _required_calls(sample.text)
        if required is not None:
            return None, required, sample.finish_reason
    return sample.text, [], sample.finish_reason


class ChoiceStream:
    """One streamed choice: turns each delta into ``(content, tool-call pieces)``."""

    def __init__(self, request: ChatCompletionRequest, tool_mode: Mode) -> None:
        self._request = request
        self._mode = tool_mode
        self._started = False
        self._text = ""
        self.called = False  # a tool call was sent: the choice finishes with "tool_calls" (auto)

    def pieces(self, delta: SampleDelta) -> tuple[str | None, list[ToolCallDeltaOut] | None]:
        if self._mode == "auto" and delta.parsed:
            calls = [ToolCallDeltaOut(index=c.index, id=c.id, type=c.type,
                                      function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                     for c in delta.tool_calls or []]
            self.called = self.called or bool(calls)
            return delta.content, calls or None
        if self._mode == "named":
            assert isinstance(self._request.tool_choice, NamedToolChoice)
            first = not self._started
            self._started = True
            name = self._request.tool_choice.function.name
            piece = ToolCallDeltaOut(
                index=0, id=_call_id() if first else None, type="function" if first else None,
                function=FunctionCallDelta(name=name if first else None, arguments=delta.text),
            )
            return None, [piece]
        if self._mode == "required":
            self._text += delta.text
            if delta.finish_reason is None:
                return None, None
            required = _required_calls(self._text)
            if required is None:
                return self._text, None
            return None, [ToolCallDeltaOut(index=i, id=c.id, type="function",
                                           function=FunctionCallDelta(name=c.function.name,
                                                                      arguments=c.function.arguments))
                          for i, c in enumerate(required)]
        return delta.text, None

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason is not None and self.called else reason
