"""OpenAI wire models: the requests the gateway accepts and the responses it sends.

Unknown top-level fields of a completion or chat request are ignored, as
vLLM's server does (clients send ``store``, ``metadata``,
``parallel_tool_calls``...): the gateway logs them and names them in the
``X-Ignored-Fields`` response header. Nested objects (messages, options)
still forbid unknown fields: ignoring part of a conversation would change
what is generated. Ranges are not re-checked here: the translation into
``tasks.SamplingParams`` (``api.translate``) is the one place they are. What
is checked here is that every integer fits what the engine can carry (int32
counts and token ids, int64 seeds and versions: vLLM's msgpack and tensors
overflow past them) and that token ids are not negative.
vLLM's extra sampling fields arrive top-level (the ``openai`` client merges
``extra_body`` into the body) and are declared on ``_Sampling``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# Counts (tokens, samples, logprobs): anything larger cannot reach the engine.
Count = Annotated[int, Field(le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]

# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; every chunk is final here anyway


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs``: one constraint (its other options are refused, by name)."""

    regex: str | None = None
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Request):
    """Sampling fields shared by completions and chat, OpenAI's and vLLM's."""

    # Unknown fields land in ``model_extra``; the routes report and ignore them.
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str
    n: Count = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=INT64_MAX)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    # vLLM extras (extra_body): each maps to one tasks.SamplingParams field.
    top_k: Count | None = None
    min_p: float | None = None
    min_tokens: Count | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_json: dict[str, Any] | str | None = None
    structured_outputs: StructuredOutputs | None = None
    # Logprob tokens spelled "token_id:N" even when the gateway has a tokenizer.
    return_tokens_as_token_ids: bool = False
    # rollout-queue extras: never served by older weights; token ids back.
    min_weight_version: Annotated[int, Field(le=INT64_MAX)] | None = None
    return_token_ids: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Count | None = 16
    logprobs: Count | None = None
    echo: bool = False
    # vLLM's extra: logprobs of the prompt's tokens (with their top k), as prompt_logprobs per choice.
    prompt_logprobs: Count | None = None
    suffix: str | None = None
    best_of: Count | None = None

    @field_validator("prompt")
    @classmethod
    def _token_ids_in_range(cls, value: Any) -> Any:
        # Checked here, not in the union's int type, so the error is one line.
        lists = [value] if value and isinstance(value[0], int) else value
        for i, ids in enumerate(lists if isinstance(value, list) else []):
            for token in ids if isinstance(ids, list) else []:
                if not 0 <= token <= INT32_MAX:
                    where = "prompt" if lists is not value else f"prompt[{i}]"
                    raise ValueError(
                        f"{where} has token id {token}; a token id is at least 0 and "
                        "less than the model's vocabulary size"
                    )
        return value


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str = ""


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns of an agent transcript
    tool_call_id: str | None = None  # tool results
    reasoning_content: str | None = None  # sent back by some clients; not rendered


class FunctionSpec(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Request):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; the model decides how many calls it makes
    # vLLM's chat-template extras.
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused (api.translate): the worker renders the model's own
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# --------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class RolloutInfo(BaseModel):
    """Where a response came from: which task, signature, weights and worker."""

    task_id: str
    signature: str
    weight_version: int
    worker: str
    batch_prompts: int  # prompts in the task this request shared


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    # vLLM's shape: per prompt token {token_id: {"logprob", "rank", "decoded_token"}}, None first.
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageOut | None = None
    rollout: RolloutInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    # vLLM's place for them (with return_token_ids): the conversation's tokens, once.
    prompt_token_ids: list[int] | None = None
    usage: UsageOut | None = None
    rollout: RolloutInfo | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rollout-queue"
    # The smallest max_model_len among live workers of the gateway's queue
    # (the worker registry); None while none is live.
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail
