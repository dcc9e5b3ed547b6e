"""Chat templates with tools, and tool calls parsed out of samples (vLLM's parsers).

``render`` applies the model's chat template to a ``Conversation`` as vLLM's
``chat()`` does: tools and ``chat_template_kwargs`` go to the template, an
assistant's tool-call arguments (JSON text on the wire) become objects first.

``ToolCalls`` wraps the worker's ``--tool-call-parser`` (any name vLLM's
``ToolParserManager`` knows: ``hermes``, ``llama3_json``, ``pythonic``...):
``parse`` fills a finished sample's ``tool_calls`` and ``content``;
``streamer`` makes the per-sample incremental parser a streamed task's deltas
go through. Only conversations with tools (and ``tool_choice`` other than
"none") are parsed; the sample's ``text`` and token ids stay what the model
generated.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from rollout_queue.tasks.errors import InvalidRequest
from rollout_queue.tasks.schemas import Conversation, Sample, SampleDelta, ToolCall, ToolCallDelta, ToolFunction

log = logging.getLogger(__name__)


def template_messages(conversation: Conversation) -> list[dict[str, Any]]:
    """The messages as chat templates expect them (arguments as objects, no null fields)."""
    messages = []
    for message in conversation.messages:
        entry = message.model_dump(exclude_none=True)
        entry.setdefault("content", "")
        for call in entry.get("tool_calls", []):
            call["function"]["arguments"] = _arguments_object(call["function"]["arguments"])
        messages.append(entry)
    return messages


def _arguments_object(text: str) -> Any:
    # A malformed history entry must not fail every later turn (vLLM coerces the same way).
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        log.warning("tool call arguments are not JSON (%d chars); rendered as {}", len(text))
        return {}
    return value if isinstance(value, dict) else {}


def render(tokenizer: Any, conversation: Conversation) -> str:
    """The conversation through the model's chat template, as text."""
    try:
        return str(tokenizer.apply_chat_template(
            template_messages(conversation),
            tools=conversation.tools,
            tokenize=False,
            add_generation_prompt=conversation.add_generation_prompt,
            continue_final_message=conversation.continue_final_message,
            **conversation.chat_template_kwargs,
        ))
    except (TypeError, ValueError, KeyError) as exc:
        raise InvalidRequest(f"the model's chat template refused the conversation: {exc}") from exc
    except Exception as exc:  # jinja2's TemplateError and friends: the request's, not the worker's
        if type(exc).__module__.startswith("jinja2"):
            raise InvalidRequest(f"the model's chat template failed on the conversation: {exc}") from exc
        raise


class ToolCalls:
    """The worker's tool-call parser (``--tool-call-parser``), or None."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.tokenizer: Any = None  # the engine's, once loaded
        self._parser_class: Any = None
        if name:
            from vllm.tool_parsers import ToolParserManager

            try:
                self._parser_class = ToolParserManager.get_tool_parser(name)
            except KeyError as exc:
                known = ", ".join(sorted(ToolParserManager.list_registered()))
                raise ValueError(f"--tool-call-parser {name!r} is not one of vLLM's: {known}") from exc

    def check(self, conversation: Conversation) -> None:
        """Refuse tools the worker cannot parse, as vLLM's server does for auto tool choice."""
        if conversation.parses_tools and self._parser_class is None:
            raise InvalidRequest(
                "tool_choice 'auto' needs a worker started with --tool-call-parser (e.g. hermes); "
                "send tool_choice 'none' to render the tools without parsing calls"
            )

    def _parser(self, conversation: Conversation) -> tuple[Any, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest.model_validate({
            "model": "rollout-queue", "tools": conversation.tools, "tool_choice": conversation.tool_choice,
            "messages": [m.model_dump(exclude_none=True) for m in conversation.messages],
        })
        return self._parser_class(self.tokenizer, request.tools), request

    def parse(self, conversation: Conversation, sample: Sample) -> None:
        """Fill ``sample.tool_calls`` and ``sample.content`` from its text."""
        if not conversation.parses_tools or self._parser_class is None:
            return
        try:
            parser, request = self._parser(conversation)
            found = parser.extract_tool_calls(sample.text, request)
        except Exception:  # a parser's bug must not lose the generation: the text stays
            log.exception("the %s tool-call parser failed; the sample is returned as text", self.name)
            sample.tool_calls, sample.content = [], sample.text
            return
        sample.tool_calls = [
            ToolCall(id=call.id, function=ToolFunction(name=call.function.name, arguments=call.function.arguments))
            for call in (found.tool_calls if found.tools_called else [])
        ]
        sample.content = found.content if found.tools_called else sample.text

    def streamer(self, conversation: Conversation) -> ToolStream | None:
        if not conversation.parses_tools or self._parser_class is None:
            return None
        parser, request = self._parser(conversation)
        return ToolStream(parser, request)


class ToolStream:
    """One sample's incremental parse: each delta's text becomes content and tool-call pieces."""

    def __init__(self, parser: Any, request: Any) -> None:
        self._parser = parser
        self._request = request
        self._text = ""
        self._token_ids: list[int] = []

    def feed(self, delta: SampleDelta) -> None:
        previous_text, previous_ids = self._text, self._token_ids
        self._text += delta.text
        self._token_ids = previous_ids + delta.token_ids
        message = self._parser.extract_tool_calls_streaming(
            previous_text, self._text, delta.text, previous_ids, self._token_ids, delta.token_ids, self._request,
        )
        delta.parsed = True
        if message is None:
            return
        delta.content = message.content or None
        calls = []
        for call in message.tool_calls or []:
            function = call.function or {}
            if not isinstance(function, dict):
                function = function.model_dump(exclude_none=True)
            calls.append(ToolCallDelta(
                index=call.index, id=call.id, type=call.type, name=function.get("name"),
                arguments=function.get("arguments"),
            ))
        delta.tool_calls = calls or None
