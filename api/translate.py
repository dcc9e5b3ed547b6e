"""OpenAI requests → ``generate`` arguments, and results → OpenAI responses.

The one place OpenAI semantics meet the task contract: which request field
becomes which ``SamplingParams`` field (ranges are checked there, once),
how prompts of each endpoint become a prompt kind, how a request's share of
a task result becomes choices (``index = prompt * n + sample``), logprobs,
usage and, for ``stream: true``, server-sent-event chunks.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from rollout_queue.api import tools
from rollout_queue.api.batcher import Share
from rollout_queue.api.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    RolloutInfo,
    StructuredOutputs,
    TokenLogprob,
    TopLogprob,
    UsageOut,
    _Sampling,
)
from rollout_queue.api.tokens import TokenNamer
from rollout_queue.tasks.errors import BadRequest
from rollout_queue.tasks.schemas import Conversation, PromptKind, PromptOutput, Sample, SamplingParams

# Request fields copied as they are when given (None: the SamplingParams default).
_PASSTHROUGH = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "min_weight_version",
)


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------


def completion_prompts(request: CompletionRequest) -> tuple[PromptKind, list[Any]]:
    """``prompt`` as a list of one kind: strings or token-id lists."""
    _refuse_unsupported_completion_fields(request)
    prompt = request.prompt
    if isinstance(prompt, str):
        return "text", [_nonempty_text(prompt, "prompt")]
    if not prompt:
        raise BadRequest("prompt must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return "text", [_nonempty_text(p, "prompt") for p in prompt]  # type: ignore[arg-type]
    if all(isinstance(p, int) for p in prompt):
        return "tokens", [list(prompt)]
    lists = [list(p) for p in prompt]  # type: ignore[arg-type]
    if any(not p for p in lists):
        raise BadRequest("token-id prompts must not be empty", "prompt")
    return "tokens", lists


def _nonempty_text(text: str, param: str) -> str:
    if not text:
        raise BadRequest(f"{param} must not be an empty string", param)
    return text


def _refuse_unsupported_completion_fields(request: CompletionRequest) -> None:
    if request.echo and request.stream:
        raise BadRequest("echo is not supported with stream=true; send one or the other", "echo")
    if request.suffix:
        raise BadRequest("suffix is not supported by this gateway", "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise BadRequest(
            f"best_of ({request.best_of}) must equal n ({request.n}): this gateway returns "
            "every sample it generates",
            "best_of",
        )


def chat_prompts(request: ChatCompletionRequest) -> list[Any]:
    """The conversation as one chat prompt: ``[{"role", "content"}, ...]``, or with tools
    or template options a ``Conversation`` (``{"messages", "tools", ...}``)."""
    if request.chat_template is not None:
        raise BadRequest(
            "chat_template is not supported by this gateway: the worker renders the model's own "
            "template (chat_template_kwargs are passed to it); leave chat_template out", "chat_template",
        )
    conversation = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise BadRequest(
                        f"messages[{i}] has a {part.type!r} content part; this gateway serves "
                        "text only",
                        f"messages.{i}.content",
                    )
                parts.append(part.text)
            content = "\n".join(parts)
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        elif not content:
            entry["content"] = ""
        for field in ("name", "tool_call_id"):
            if getattr(message, field) is not None:
                entry[field] = getattr(message, field)
        conversation.append(entry)
    prompt = tools.conversation(request, conversation, tools.mode(request))
    try:  # the task's own rules (tasks.schemas.Conversation), said as the request's
        Conversation.model_validate(prompt if isinstance(prompt, dict) else {"messages": prompt})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        reason = str(error["msg"]).removeprefix("Value error, ")
        raise BadRequest(f"{where}: {reason}" if where else reason, where or "messages") from None
    return [prompt]


def completion_params(request: CompletionRequest) -> SamplingParams:
    """The task's params; ``max_tokens: 0`` with ``echo`` scores the prompt (see ``scoring_only``)."""
    max_tokens = 16 if request.max_tokens is None else request.max_tokens  # OpenAI's default
    if max_tokens == 0:
        if not request.echo:
            raise BadRequest(
                "max_tokens 0 returns no tokens; it scores the prompt only with echo=true "
                "(and logprobs), or ask for at least 1 token", "max_tokens",
            )
        max_tokens = 1  # the engine generates at least one token; the response leaves it out
    prompt_logprobs = request.prompt_logprobs
    if request.echo and request.logprobs is not None:
        # Echoed prompt tokens carry logprobs like generated ones (vLLM does the same).
        prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
    return _params(request, max_tokens=max_tokens, logprobs=request.logprobs, prompt_logprobs=prompt_logprobs)


def scoring_only(request: CompletionRequest) -> bool:
    """``max_tokens: 0`` with ``echo``: the prompt's logprobs, no generated token."""
    return request.echo and request.max_tokens == 0


def chat_params(request: ChatCompletionRequest, default_max_tokens: int) -> SamplingParams:
    if request.top_logprobs is not None and not request.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens = next(
        (v for v in (request.max_completion_tokens, request.max_tokens) if v is not None),
        default_max_tokens,
    )
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    forced = tools.structured(request, tools.mode(request))
    if forced and _structured(request):
        raise BadRequest("a named or required tool_choice constrains the output to its tool's arguments; "
                         "it cannot be combined with response_format or guided decoding", "tool_choice")
    return _params(request, max_tokens=max_tokens, logprobs=logprobs, forced=forced)


def _params(
    request: _Sampling, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
    forced: dict[str, Any] | None = None,
) -> SamplingParams:
    if request.logit_bias:
        raise BadRequest("logit_bias is not supported by this gateway", "logit_bias")
    fields: dict[str, Any] = {"n": request.n, "max_tokens": max_tokens, "logprobs": logprobs}
    if prompt_logprobs is not None:
        fields["prompt_logprobs"] = prompt_logprobs
    for name in _PASSTHROUGH:
        value = getattr(request, name)
        if value is not None:
            fields[name] = value
    if request.stop is not None:
        fields["stop"] = request.stop
    fields.update(forced or _structured(request))
    try:  # SamplingParams' own rules (n > 1 needs sampling, ...), said as the request's
        return SamplingParams.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        message = error["msg"].removeprefix("Value error, ")
        raise BadRequest(f"{param}: {message}" if param else message, param) from exc


def _structured(request: _Sampling) -> dict[str, Any]:
    """response_format and vLLM's structured-output extras → at most one field."""
    found: dict[str, tuple[str, Any]] = {}
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found["response_format"] = ("json_object", True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise BadRequest(
                "response_format of type json_schema needs a json_schema object",
                "response_format.json_schema",
            )
        found["response_format"] = ("json_schema", fmt.json_schema.schema_)
    if request.structured_outputs is not None:
        found.update(_structured_outputs(request.structured_outputs))
    for param, field_name in (
        ("regex", "regex"),
        ("guided_regex", "regex"),
        ("choice", "choice"),
        ("guided_choice", "choice"),
        ("guided_json", "json_schema"),
    ):
        value = getattr(request, param)
        if value is not None:
            found[param] = (field_name, _json_value(value, param) if param == "guided_json" else value)
    if len(found) > 1:
        raise BadRequest(
            f"at most one structured-output constraint per request, got {', '.join(found)}",
            sorted(found)[1],
        )
    return dict(found.values())


def _structured_outputs(given: StructuredOutputs) -> dict[str, tuple[str, Any]]:
    """vLLM's ``structured_outputs`` object → ``{param: (SamplingParams field, value)}``."""
    found: dict[str, tuple[str, Any]] = {}
    for option, field_name in (("regex", "regex"), ("json_", "json_schema"), ("choice", "choice"),
                               ("grammar", "grammar")):
        value = getattr(given, option)
        if value is not None:
            param = f"structured_outputs.{option.rstrip('_')}"
            found[param] = (field_name, _json_value(value, param) if field_name == "json_schema" else value)
    if given.json_object:
        found["structured_outputs.json_object"] = ("json_object", True)
    return found


def _json_value(value: Any, param: str) -> Any:
    """A JSON schema given as an object, or as a string holding one."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"{param} is not valid JSON: {exc}", param) from exc


# --------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(outputs: list[PromptOutput]) -> UsageOut:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.samples)
    return UsageOut(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def rollout_info(share: Share) -> RolloutInfo:
    return RolloutInfo(
        task_id=share.task_id,
        signature=share.signature,
        weight_version=share.weight_version,
        worker=share.worker,
        batch_prompts=share.batch_prompts,
    )


def fingerprint(share: Share) -> str:
    return f"rq-{share.signature}-w{share.weight_version}"


def _samples(share: Share) -> Iterator[tuple[int, PromptOutput, Sample]]:
    """(choice index, prompt output, sample), index = prompt * n + sample."""
    index = 0
    for output in share.outputs:
        for sample in output.samples:
            yield index, output, sample
            index += 1


def completion_logprobs(sample: Sample, namer: TokenNamer) -> CompletionLogprobs | None:
    if sample.logprobs is None:
        return None
    tokens = [namer.name(t) for t in sample.token_ids]
    top: list[dict[str, float] | None]
    if sample.top_logprobs is not None:
        top = [{namer.name(t): lp for t, lp in position} for position in sample.top_logprobs]
    else:  # logprobs=0: the sampled token only
        top = [{token: lp} for token, lp in zip(tokens, sample.logprobs)]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=list(sample.logprobs), top_logprobs=top, text_offset=offsets
    )


def chat_logprobs(sample: Sample, namer: TokenNamer) -> ChatLogprobs | None:
    if sample.logprobs is None:
        return None
    tops = sample.top_logprobs or [[] for _ in sample.token_ids]
    content = [
        TokenLogprob(
            token=namer.name(token_id),
            logprob=logprob,
            bytes=namer.bytes_of(token_id),
            top_logprobs=[
                TopLogprob(token=namer.name(t), logprob=lp, bytes=namer.bytes_of(t)) for t, lp in top
            ],
        )
        for token_id, logprob, top in zip(sample.token_ids, sample.logprobs, tops)
    ]
    return ChatLogprobs(content=content)


def completion_response(
    request: CompletionRequest, share: Share, namer: TokenNamer, response_id: str, created: int
) -> Completion:
    if scoring_only(request):
        share = _without_generated(share)
    prompt_texts = _prompt_texts(request, share, namer) if request.echo else None
    choices = []
    for index, output, sample in _samples(share):
        logprobs = completion_logprobs(sample, namer)
        text = sample.text
        if prompt_texts is not None:
            prompt_text = prompt_texts[index // request.n]
            text = prompt_text + text
            if logprobs is not None:
                logprobs = _echoed_logprobs(output, logprobs, namer)
        choices.append(CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            token_ids=sample.token_ids if request.return_token_ids else None,
            prompt_token_ids=output.prompt_token_ids if request.return_token_ids else None,
            prompt_logprobs=_vllm_prompt_logprobs(output, namer) if request.prompt_logprobs is not None else None,
        ))
    return Completion(choices=choices, **_envelope(request.model, share, response_id, created))


def _without_generated(share: Share) -> Share:
    """The share with every sample emptied (``max_tokens: 0``: the token generated is not returned)."""
    outputs = [
        output.model_copy(update={"samples": [
            sample.model_copy(update={
                "text": "", "token_ids": [], "logprobs": [] if sample.logprobs is not None else None,
                "top_logprobs": [] if sample.top_logprobs is not None else None, "finish_reason": "length",
            })
            for sample in output.samples
        ]})
        for output in share.outputs
    ]
    return dataclasses.replace(share, outputs=outputs)


def _prompt_texts(request: CompletionRequest, share: Share, namer: TokenNamer) -> list[str]:
    """Each prompt as text, for echo: the string sent, or token ids decoded with
    ``RQ_API_TOKENIZER`` (without a tokenizer a token prompt echoes no text; its
    tokens are still in logprobs and ``prompt_token_ids``)."""
    kind, prompts = completion_prompts(request)
    if kind == "text":
        return list(prompts)
    tokenizer = namer.tokenizer
    return ["" if tokenizer is None else str(tokenizer.decode(o.prompt_token_ids)) for o in share.outputs]


def _echoed_logprobs(output: PromptOutput, generated: CompletionLogprobs, namer: TokenNamer) -> CompletionLogprobs:
    """The prompt's tokens, logprobs and top logprobs, then the generated ones (first prompt token: None)."""
    prompt_ids = output.prompt_token_ids
    tokens = [namer.name(t) for t in prompt_ids]
    lps = output.prompt_logprobs or [None] * len(prompt_ids)
    tops: list[dict[str, float] | None] = [
        None if position is None else {namer.name(t): lp for t, lp in position}
        for position in (output.prompt_top_logprobs or [None] * len(prompt_ids))
    ]
    for i, (token, lp) in enumerate(zip(tokens, lps)):
        if lp is not None and tops[i] is not None:
            tops[i].setdefault(token, lp)  # type: ignore[union-attr]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens + generated.tokens,
        token_logprobs=list(lps) + generated.token_logprobs,
        top_logprobs=tops + (generated.top_logprobs or []),
        text_offset=offsets + [offset + o for o in generated.text_offset],
    )


def _vllm_prompt_logprobs(output: PromptOutput, namer: TokenNamer) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, ``{id: {logprob, rank, decoded_token}}``."""
    missing = [None] * len(output.prompt_token_ids)
    lps = output.prompt_logprobs or missing
    tops = output.prompt_top_logprobs or missing
    ranks = output.prompt_ranks or missing
    entries: list[dict[str, dict[str, Any]] | None] = []
    for token, lp, top, token_rank in zip(output.prompt_token_ids, lps, tops, ranks):
        if lp is None:
            entries.append(None)
            continue
        entry = {str(t): {"logprob": v, "rank": rank, "decoded_token": namer.name(t)}
                 for rank, (t, v) in enumerate(top or [], start=1)}
        # The prompt's own token, as vLLM adds it: with its rank, also past the top k.
        entry.setdefault(str(token), {"logprob": lp, "rank": token_rank, "decoded_token": namer.name(token)})
        entries.append(entry)
    return entries


def chat_response(
    request: ChatCompletionRequest, share: Share, namer: TokenNamer, response_id: str, created: int
) -> ChatCompletion:
    tool_mode = tools.mode(request)
    choices = []
    for index, output, sample in _samples(share):
        content, calls, finish_reason = tools.message(request, tool_mode, sample)
        choices.append(ChatChoice(
            index=index,
            message=ChatMessageOut(content=content, tool_calls=calls),
            logprobs=chat_logprobs(sample, namer),
            finish_reason=finish_reason,
            stop_reason=sample.stop_reason,
            token_ids=sample.token_ids if request.return_token_ids else None,
            prompt_token_ids=output.prompt_token_ids if request.return_token_ids else None,
        ))
    # One conversation per request: vLLM returns its tokens once, beside the choices.
    prompt_ids = share.outputs[0].prompt_token_ids if request.return_token_ids and share.outputs else None
    return ChatCompletion(
        choices=choices, prompt_token_ids=prompt_ids, **_envelope(request.model, share, response_id, created)
    )


def _envelope(model: str, share: Share, response_id: str, created: int) -> dict[str, Any]:
    """What completions and chat completions answer alike, beside their choices."""
    return {
        "id": response_id, "created": created, "model": model, "system_fingerprint": fingerprint(share),
        "usage": usage(share.outputs), "rollout": rollout_info(share),
    }


def to_json(body: Completion | ChatCompletion | ChatCompletionChunk) -> dict[str, Any]:
    """The wire form: every OpenAI field (nulls included); token ids only when asked for."""
    data = body.model_dump(mode="json")
    for key in ("rollout", "prompt_token_ids"):
        if data.get(key) is None:
            data.pop(key, None)
    for choice in data["choices"]:
        for key in ("token_ids", "prompt_token_ids", "prompt_logprobs"):
            if choice.get(key) is None:
                choice.pop(key, None)
    return data
