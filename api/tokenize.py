"""``/tokenize`` and ``/detokenize``: vLLM's token endpoints, on the gateway's tokenizer.

They need ``RQ_API_TOKENIZER`` (the tokenizer of the served model): without it
the gateway holds no tokenizer and answers 400 saying so. A chat request
is rendered with the tokenizer's chat template first (what a worker does).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollout_queue.api.schemas import ChatMessageIn, TokenId
from rollout_queue.tasks.errors import BadRequest


class TokenizeRequest(BaseModel):
    """``prompt`` (text) or ``messages`` (a conversation), as vLLM's ``/tokenize``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId] = Field(min_length=0)


class DetokenizeResponse(BaseModel):
    prompt: str


def _require(tokenizer: Any | None) -> Any:
    if tokenizer is None:
        raise BadRequest(
            "this gateway has no tokenizer: start it with RQ_API_TOKENIZER=<the served model's "
            "path or Hugging Face id> to serve /tokenize and /detokenize"
        )
    return tokenizer


def tokenize(tokenizer: Any | None, request: TokenizeRequest, max_model_len: int | None) -> TokenizeResponse:
    tok = _require(tokenizer)
    if (request.prompt is None) == (request.messages is None):
        raise BadRequest("send exactly one of prompt and messages", "prompt")
    if request.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=request.add_generation_prompt
        )
        ids = list(tok(text, add_special_tokens=False).input_ids)
    else:
        ids = list(tok(request.prompt, add_special_tokens=request.add_special_tokens).input_ids)
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids)


def detokenize(tokenizer: Any | None, request: DetokenizeRequest) -> DetokenizeResponse:
    tok = _require(tokenizer)
    vocab = len(tok)
    bad = [t for t in request.tokens if t >= vocab]
    if bad:
        raise BadRequest(
            f"tokens has id {bad[0]}; this model's vocabulary has {vocab} tokens", "tokens"
        )
    return DetokenizeResponse(prompt=tok.decode(request.tokens))
