"""Token deltas of a streamed task → OpenAI server-sent events, as they come.

``completion_events`` and ``chat_events`` take what ``api.streaming`` yields
(``SampleDelta`` s, then the whole result as a ``Share``) and write OpenAI's
chunk format: chat sends a role chunk when a choice starts, then one chunk
per delta (content, logprobs, token ids when asked), the finish reason on a
choice's last delta; completions send the text. With
``stream_options.include_usage`` a last chunk carries the usage. An error
after the stream began becomes an ``error`` event (vLLM's and OpenAI's
shape), then ``[DONE]``: the status line is already sent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from rollout_queue.api import errors, tools, translate
from rollout_queue.api.batcher import Share
from rollout_queue.api.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
)
from rollout_queue.api.tokens import TokenNamer
from rollout_queue.tasks.schemas import SampleDelta

log = logging.getLogger("rollout_queue.api")

Items = AsyncIterator[SampleDelta | Share]
DONE = "data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _error_event(exc: BaseException) -> str:
    response = errors.from_exception(exc)
    return f"data: {bytes(response.body).decode()}\n\n"


def _sample(delta: SampleDelta) -> Any:
    """The delta as a ``Sample``-shaped object for ``translate``'s logprob builders."""
    return delta


def _index(delta: SampleDelta, n: int) -> int:
    return delta.prompt * n + delta.sample


async def completion_events(
    request: CompletionRequest, first: SampleDelta | Share, rest: Items, namer: TokenNamer,
    response_id: str, created: int, n: int,
) -> AsyncIterator[str]:
    with_usage = request.stream_options is not None and request.stream_options.include_usage
    offsets: dict[int, int] = {}

    def chunk(delta: SampleDelta) -> str:
        index = _index(delta, n)
        logprobs = translate.completion_logprobs(_sample(delta), namer)
        if logprobs is not None:  # offsets run over the whole text, as in a plain response
            start = offsets.get(index, 0)
            logprobs.text_offset = [start + o for o in logprobs.text_offset]
            offsets[index] = start + sum(len(t) for t in logprobs.tokens)
        choice = CompletionChoice(
            index=index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=delta.token_ids if request.return_token_ids else None,
        )
        body = translate.to_json(Completion(id=response_id, created=created, model=request.model, choices=[choice]))
        if with_usage:
            body["usage"] = None
        else:
            body.pop("usage")
        return _event(body)

    item: SampleDelta | Share | None = first
    try:
        while item is not None:
            if isinstance(item, Share):
                if with_usage:
                    last = Completion(
                        id=response_id, created=created, model=request.model,
                        system_fingerprint=translate.fingerprint(item), choices=[],
                        usage=translate.usage(item.outputs),
                    )
                    yield _event(translate.to_json(last))
                break
            yield chunk(item)
            item = await anext(rest, None)
    except Exception as exc:  # noqa: BLE001  the stream is open: the error travels in it
        log.warning("stream %s stopped: %s", response_id, exc)
        yield _error_event(exc)
    finally:
        # Cancelled (the client went away) or done: the relay's cleanup (abort) runs now.
        await rest.aclose()  # type: ignore[attr-defined]
    yield DONE


async def chat_events(
    request: ChatCompletionRequest, first: SampleDelta | Share, rest: Items, namer: TokenNamer,
    response_id: str, created: int, n: int,
) -> AsyncIterator[str]:
    with_usage = request.stream_options is not None and request.stream_options.include_usage
    tool_mode = tools.mode(request)
    choices: dict[int, tools.ChoiceStream] = {}

    def chunk(choice: ChatChunkChoice) -> str:
        body = translate.to_json(
            ChatCompletionChunk(id=response_id, created=created, model=request.model, choices=[choice])
        )
        if not with_usage:
            body.pop("usage")
        return _event(body)

    item: SampleDelta | Share | None = first
    try:
        while item is not None:
            if isinstance(item, Share):
                if with_usage:
                    last = ChatCompletionChunk(
                        id=response_id, created=created, model=request.model,
                        system_fingerprint=translate.fingerprint(item), choices=[],
                        usage=translate.usage(item.outputs),
                    )
                    yield _event(translate.to_json(last))
                break
            index = _index(item, n)
            if index not in choices:
                choices[index] = tools.ChoiceStream(request, tool_mode)
                yield chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))
            content, calls = choices[index].pieces(item)
            logprobs = translate.chat_logprobs(_sample(item), namer)
            # A parser may hold text back (a tag begun): nothing to send yet, unless token ids are asked for.
            held = tool_mode in ("auto", "required") and not (content or calls or logprobs)
            if not held or item.finish_reason is not None or request.return_token_ids:
                yield chunk(ChatChunkChoice(
                    index=index,
                    delta=ChatDelta(content=content, tool_calls=calls),
                    logprobs=logprobs,
                    finish_reason=choices[index].finish_reason(item.finish_reason),
                    stop_reason=item.stop_reason,
                    token_ids=item.token_ids if request.return_token_ids else None,
                ))
            item = await anext(rest, None)
    except Exception as exc:  # noqa: BLE001  the stream is open: the error travels in it
        log.warning("stream %s stopped: %s", response_id, exc)
        yield _error_event(exc)
    finally:
        # Cancelled (the client went away) or done: the relay's cleanup (abort) runs now.
        await rest.aclose()  # type: ignore[attr-defined]
    yield DONE
