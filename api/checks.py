"""What the gateway checks about one request before it joins a batch.

A batch is one ``generate`` task, and a task the worker refuses fails every
request in it; so each request is checked here first, alone, with what the
gateway knows:

- every string is valid Unicode (a lone surrogate such as ``"\\ud800"`` has no
  UTF-8 form): 400 naming the field;
- size limits, before anything reaches Redis: a text prompt (or a chat
  conversation's contents) of more than ``RQ_API_MAX_PROMPT_CHARS`` characters, a
  token prompt of more than ``RQ_API_MAX_PROMPT_TOKENS`` ids, more than
  ``RQ_API_MAX_REQUEST_SEQUENCES`` sequences (prompts x n): 413;
- token ids below the vocabulary size (``RQ_API_TOKENIZER``'s, else the one the
  serving workers report in the registry)
  and token prompts shorter than the serving workers' ``max_model_len`` (read
  from the worker registry, ``ModelLimits``): 400;
- a structured-output ``regex`` in the subset the workers' grammar backend
  (xgrammar) compiles: no lookaround, backreferences, named groups, ``\\b``;
- the prompts and params exactly as one ``generate`` task validates them
  (``tasks.generate.build_request``).

What only a worker can know (how many tokens a text prompt has) can still fail
a batch; the batcher then serves the other requests without it
(``api.batcher``).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rollout_queue.tasks.errors import BadRequest, BrokerUnavailable, RequestTooLarge
from rollout_queue.tasks.generate import build_request
from rollout_queue.tasks.schemas import PromptKind, SamplingParams, WorkerInfo

try:  # the regex parser of ``re`` itself: private, there since 3.11
    sre_parse: Any = importlib.import_module("re._parser")
except ImportError:  # pragma: no cover - an interpreter without it: compile check only
    sre_parse = None


@dataclass(frozen=True)
class ModelLimits:
    """What the serving model allows; None: not known here (the worker checks it)."""

    vocab_size: int | None = None
    max_model_len: int | None = None
    # The most logprobs a request may ask for (the serving engines' smallest
    # --max-logprobs, -1: the whole vocabulary), and how they compute them.
    max_logprobs: int | None = None
    logprobs_mode: str | None = None
    # The serving workers, and their engine ranks (what vLLM's /get_world_size counts).
    workers: int = 0
    engine_ranks: int = 0


class LimitsReader:
    """``ModelLimits`` for one queue: vocabulary from the tokenizer, context from the registry.

    ``max_model_len`` is the smallest of the live workers consuming the queue
    (a prompt must fit whichever worker takes it), re-read at most every
    ``refresh_s`` seconds, in a thread (the registry client blocks).
    """

    def __init__(
        self,
        read_workers: Callable[[], list[WorkerInfo]],
        queue: str,
        vocab_size: int | None,
        refresh_s: float,
    ) -> None:
        self._read_workers = read_workers
        self._queue = queue
        self._vocab_size = vocab_size
        self._refresh_s = refresh_s
        self._limits = ModelLimits(vocab_size=vocab_size)
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    async def refreshed(self) -> ModelLimits:
        """The limits read from the registry now (not a cached reading)."""
        self._read_at = float("-inf")
        return await self.current()

    async def current(self) -> ModelLimits:
        if time.monotonic() - self._read_at < self._refresh_s:
            return self._limits
        async with self._lock:
            if time.monotonic() - self._read_at >= self._refresh_s:
                self._read_at = time.monotonic()
                try:
                    workers = await asyncio.to_thread(self._read_workers)
                except BrokerUnavailable:
                    return self._limits  # keep the last known; sending will say Redis is away
                serving = [w for w in workers if self._queue in w.queues]
                lengths = [w.max_model_len for w in serving if w.max_model_len]
                # The tokenizer's vocabulary when the gateway has one, else the
                # smallest the serving workers report.
                vocabs = [w.vocab_size for w in serving if w.vocab_size]
                vocab = self._vocab_size or (min(vocabs) if vocabs else None)
                caps = [w.max_logprobs for w in serving]
                bounded = [cap for cap in caps if cap >= 0]
                max_logprobs = min(bounded) if bounded else (-1 if caps else None)
                modes = sorted({w.logprobs_mode for w in serving})
                self._limits = ModelLimits(
                    vocab, min(lengths) if lengths else None, max_logprobs,
                    ",".join(modes) if modes else None, len(serving), sum(w.ranks for w in serving),
                )
        return self._limits


def check_unicode(value: Any, path: str = "") -> None:
    """Refuse strings without a UTF-8 form (lone surrogates), naming where they are."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = value[exc.start : exc.end].encode("unicode_escape").decode()
            raise BadRequest(
                f"{path or 'the body'} holds {bad}, a lone surrogate, which is not valid "
                "Unicode; send each character as itself or as a surrogate pair",
                path or None,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, path)
            check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}.{i}" if path else str(i))


def check_prompts(
    kind: PromptKind, prompts: list[Any], limits: ModelLimits, max_chars: int, max_tokens: int
) -> None:
    """Size, vocabulary and context checks of one request's prompts (param ``prompt``)."""
    many = len(prompts) > 1
    for i, prompt in enumerate(prompts):
        where = f"prompt[{i}]" if many else "prompt"
        if kind == "tokens":
            _check_token_prompt(where, prompt, limits, max_tokens)
        else:
            chars = len(prompt) if kind == "text" else _conversation_chars(prompt)
            if chars > max_chars:
                what = "the conversation" if kind == "chat" else where
                raise RequestTooLarge(
                    f"{what} has {chars} characters; this gateway takes at most {max_chars} "
                    "per prompt (RQ_API_MAX_PROMPT_CHARS)",
                    "messages" if kind == "chat" else "prompt",
                )


def check_sequences(prompts: int, n: int, limit: int, param: str) -> None:
    """Refuse a request asking for more than ``limit`` sequences (prompts x n)."""
    if prompts * n > limit:
        raise RequestTooLarge(
            f"this request asks for {prompts * n} sequences ({prompts} prompts x n={n}); this "
            f"gateway takes at most {limit} per request (RQ_API_MAX_REQUEST_SEQUENCES): send fewer "
            "prompts or a smaller n per request",
            param if prompts > 1 else "n",
        )


def _conversation_chars(prompt: Any) -> int:
    """Characters of a chat prompt's messages, their tool calls and its tool specs."""
    messages = prompt["messages"] if isinstance(prompt, dict) else prompt
    chars = sum(len(m.get("content") or "") for m in messages)
    chars += sum(len(json.dumps(m["tool_calls"])) for m in messages if m.get("tool_calls"))
    if isinstance(prompt, dict) and prompt.get("tools"):
        chars += len(json.dumps(prompt["tools"]))
    return chars


def _check_token_prompt(where: str, ids: list[int], limits: ModelLimits, max_tokens: int) -> None:
    if len(ids) > max_tokens:
        raise RequestTooLarge(
            f"{where} has {len(ids)} token ids; this gateway takes at most {max_tokens} "
            "per prompt (RQ_API_MAX_PROMPT_TOKENS)",
            "prompt",
        )
    vocab = limits.vocab_size
    if vocab is not None:
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise BadRequest(
                f"{where} has token id {bad}; this model's vocabulary has {vocab} tokens "
                f"(ids 0..{vocab - 1})",
                "prompt",
            )
    context = limits.max_model_len
    if context is not None and len(ids) >= context:
        raise BadRequest(
            f"{where} has {len(ids)} tokens; the workers' max_model_len is {context} "
            "(prompt plus at least one generated token must fit)",
            "prompt",
        )


def check_logprobs(params: SamplingParams, limits: ModelLimits, logprobs_param: str) -> None:
    """``logprobs`` and ``prompt_logprobs`` within what the serving engines return."""
    cap = limits.max_logprobs
    if cap is None or cap < 0:
        return
    for param, asked in ((logprobs_param, params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if asked is not None and asked > cap:
            raise BadRequest(
                f"{param} is {asked}; the serving workers return at most {cap} logprobs per token: "
                f"ask for at most {cap}, or start the workers with --max-logprobs {asked} "
                "(-1: the whole vocabulary)", param,
            )


def check_task(kind: PromptKind, prompts: list[Any], params: SamplingParams, param: str) -> None:
    """The request's prompts as one ``generate`` task of their own would take them."""
    try:
        build_request(prompts, params)
    except ValidationError as exc:
        error = exc.errors()[0]
        message = str(error["msg"]).removeprefix("Value error, ")
        raise BadRequest(f"{param}: {message}", param) from None


def check_regex(pattern: str | None, param: str) -> None:
    """Refuse a regex that does not compile, or uses what xgrammar cannot match."""
    if pattern is None:
        return
    if "\x00" in pattern:
        raise BadRequest(f"{param} must not contain a NUL character", param)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise BadRequest(f"{param} is not a valid regular expression: {exc}", param) from None
    if sre_parse is None:
        return
    parsed = sre_parse.parse(pattern)
    if parsed.state.groupdict:
        _unsupported(param, "named groups ((?P<name>...))")
    if parsed.state.flags & ~re.UNICODE:  # set by (?i), (?s), (?x)...; UNICODE is a str's default
        _unsupported(param, "inline flags ((?i), (?s)...)")
    _walk(parsed, param)


_UNSUPPORTED = {
    "ASSERT": "lookahead or lookbehind ((?=...), (?<=...))",
    "ASSERT_NOT": "negative lookahead or lookbehind ((?!...), (?<!...))",
    "GROUPREF": "backreferences (\\1)",
    "GROUPREF_EXISTS": "conditional groups ((?(1)...))",
    "ATOMIC_GROUP": "atomic groups ((?>...))",
    "POSSESSIVE_REPEAT": "possessive quantifiers (*+, ++, ?+)",
}
_BOUNDARIES = {"AT_BOUNDARY", "AT_NON_BOUNDARY"}


def _walk(parsed: Any, param: str) -> None:
    for op, arg in parsed:
        name = str(op)
        if name in _UNSUPPORTED:
            _unsupported(param, _UNSUPPORTED[name])
        if name == "AT" and str(arg) in _BOUNDARIES:
            _unsupported(param, "word boundaries (\\b, \\B)")
        if name == "SUBPATTERN" and (arg[1] or arg[2]):  # (?i:...): flags for a group
            _unsupported(param, "inline flags ((?i:...)...)")
        for sub in _subpatterns(arg):
            _walk(sub, param)


def _subpatterns(arg: Any) -> list[Any]:
    if isinstance(arg, sre_parse.SubPattern):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [sub for item in arg for sub in _subpatterns(item)]
    return []


def _unsupported(param: str, what: str) -> None:
    raise BadRequest(
        f"{param} uses {what}, which structured output (xgrammar) cannot match; "
        "rewrite the pattern without it",
        param,
    )
