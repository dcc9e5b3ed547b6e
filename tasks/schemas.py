"""Every message that crosses a process boundary, one pydantic model each
(the weight sync's own are in ``weight_sync.protocol``).

Dicts from the wire are parsed here and nowhere else (``model_validate``);
every model forbids unknown keys, so a typo is an error, not a silent default.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from rollout_queue.tasks import keys

# What the engine can carry. vLLM holds token ids, top-k and token counts in
# int32 tensors, and msgspec (its engine-core IPC) refuses ints beyond 64 bits
# ("OverflowError: can't serialize ints"), so a larger value would pass here
# and fail inside the engine, after the task's retries. Weight versions are
# Redis counters (int64).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]

# Stop strings a request may carry, and their characters together: vLLM checks
# every stop string against each sequence's new text at every step, so a long
# list slows every request the engine runs (250,000 strings with n=4 held a
# concurrent 2-token request for 24 s). OpenAI allows 4; vLLM sets no bound.
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 16_384
# Nesting (dicts and lists) of a structured-output schema, a tool's spec or
# chat-template options: pydantic refuses to serialize past ~250 levels
# ("Maximum serialization depth exceeded") and a message nests them a few
# levels deeper, so deeper values are refused here, when they are parsed.
MAX_JSON_DEPTH = 100

# Heartbeats a worker may miss before readers call it dead (WorkerInfo.live_at):
# one late beat on a loaded host is not a death.
MISSED_HEARTBEATS = 3

PauseMode = Literal["wait", "keep", "abort"]
WorkerState = Literal["starting", "serving", "paused", "syncing", "fenced", "sleeping", "stopping"]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


def validation_summary(error: ValidationError, limit: int = 5) -> str:
    """One line per refused field, ``params.max_tokens: <why> (got 0)``: a message for
    an error that travels on (a task's stored failure), without pydantic's URLs."""
    problems = []
    for item in error.errors(include_url=False)[:limit]:
        where = ".".join(str(part) for part in item["loc"]) or "message"
        got = item.get("input")
        shown = f" (got {got!r:.80})" if isinstance(got, (bool, int, float, str)) or got is None else ""
        problems.append(f"{where}: {item['msg']}{shown}")
    more = error.error_count() - limit
    return "; ".join(problems) + (f"; and {more} more" if more > 0 else "")


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep dicts and lists nest in ``value`` (a scalar: 0), counted up to ``limit + 1``.

    Iterative and stops past ``limit``, so a value nested thousands of levels
    costs no recursion and little time.
    """
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth) for child in children)
    return deepest


def check_json_depth(value: Any) -> None:
    """Refuse ``value`` (a field validator's ``ValueError``, which names the field) if it
    nests past ``MAX_JSON_DEPTH``."""
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(
            f"nests more than {MAX_JSON_DEPTH} levels of objects and arrays; this service takes "
            f"at most {MAX_JSON_DEPTH}: flatten it (a $defs entry and $ref for a recursive part)"
        )


# --------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------


# SamplingParams fields newer than its pinned signature (canonical() says why).
_ADDED_LATER = ("grammar",)


class SamplingParams(_Message):
    """One sampling signature: OpenAI and vLLM sampling fields, checked ranges."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="None, 0 or -1: disabled")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(16, ge=1, le=INT32_MAX)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    n: int = Field(1, ge=1, le=256)
    stop: list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    # Up to the serving engines' max_logprobs (vLLM's default 20; a worker
    # started with --max-logprobs N or -1 takes more): the engine refuses past it.
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    prompt_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    # Structured output: at most one of these.
    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect, as vLLM's structured_outputs.grammar)
    # Never start this task on a worker whose weights are older.
    min_weight_version: int = Field(0, ge=0, le=INT64_MAX)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop has {len(value)} strings; at most {MAX_STOP_STRINGS} are allowed "
                "(the engine checks each one at every step of every sequence)"
            )
        chars = sum(len(s) for s in value)
        if chars > MAX_STOP_CHARS:
            raise ValueError(
                f"stop strings have {chars} characters together; at most {MAX_STOP_CHARS} are allowed"
            )
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value or None

    @field_validator("top_k")
    @classmethod
    def _top_k_disabled(cls, value: int | None) -> int | None:
        return None if value is not None and value <= 0 else value

    @field_validator("json_schema")
    @classmethod
    def _schema_is_json(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_json_depth(value)
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"json_schema must be plain JSON (dicts, lists, str, numbers): {exc}") from exc
        return value

    @field_validator("n")
    @classmethod
    def _n_needs_sampling(cls, value: int, info: ValidationInfo) -> int:
        # A field validator (not a model one) so the error names "n".
        if value > 1 and info.data.get("temperature") == 0.0:
            raise ValueError(
                f"n={value} with temperature 0 would return {value} identical greedy samples; "
                "vLLM refuses it: use n=1, or temperature > 0 for several samples"
            )
        return value

    @field_validator("choice")
    @classmethod
    def _choice_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("choice must list at least one option")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        structured = [
            name
            for name, on in (
                ("json_schema", self.json_schema is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
                ("grammar", self.grammar is not None),
            )
            if on
        ]
        if len(structured) > 1:
            raise ValueError(f"at most one structured output field, got {', '.join(structured)}")
        return self

    def canonical(self) -> dict[str, Any]:
        """Every field, defaults included, JSON-ready: what travels and is hashed.
        Fields added later are left out while at their default, so signatures stay
        what they were and workers of the version before still read the params."""
        data = self.model_dump(mode="json")
        for name in _ADDED_LATER:
            if data[name] is None:
                del data[name]
        return data


class ToolFunction(_Message):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Message):
    """A call of a tool, in an assistant message or parsed from a sample (OpenAI's shape)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolFunction


class ChatMessage(_Message):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None  # None: an assistant message with tool calls only
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError(f"{self.role!r} message without content: only an assistant's tool calls may "
                             "stand without it")
        return self


class Conversation(_Message):
    """A chat prompt with the options its chat template is rendered with (vLLM's ``chat()``).

    ``tools`` (OpenAI function specs) are rendered by the model's template; with
    ``tool_choice`` other than "none" and a worker started with a tool-call
    parser (``--tool-call-parser hermes``), each sample's tool calls are parsed
    into ``Sample.tool_calls``. A plain list of messages is a conversation with
    the defaults.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] = "auto"
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("tools", "chat_template_kwargs")
    @classmethod
    def _not_too_deep(cls, value: Any) -> Any:
        check_json_depth(value)
        return value

    @model_validator(mode="after")
    def _one_ending(self) -> Conversation:
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message needs add_generation_prompt=false: the last "
                                 "message is continued, not answered")
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message continues the last message, which must be the "
                                 f"assistant's (it is {self.messages[-1].role!r})")
        return self

    @property
    def parses_tools(self) -> bool:
        """Whether the worker parses this conversation's samples for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"


TextPrompt = Annotated[str, Field(min_length=1)]
TokenPrompt = Annotated[list[TokenId], Field(min_length=1)]


def _chat_form(prompt: Any) -> str | None:
    """A chat prompt's form: a list of messages, or a conversation with its options."""
    if isinstance(prompt, (Conversation, dict)):
        return "conversation"
    return "messages" if isinstance(prompt, (list, tuple)) else None


ChatPrompt = Annotated[
    Annotated[list[ChatMessage], Field(min_length=1), Tag("messages")]
    | Annotated[Conversation, Tag("conversation")],
    Discriminator(_chat_form),
]
PromptKind = Literal["text", "chat", "tokens"]


def _prompts_kind(prompts: Any) -> PromptKind | None:
    """The kind of a task's prompts (``GenerateRequest._one_kind`` made it one):
    only that kind's checks run, so a bad prompt gets its own kind's error, not
    one from each kind it is not."""
    return _kind_of(prompts[0]) if isinstance(prompts, (list, tuple)) and prompts else None


Prompts = Annotated[
    Annotated[list[TextPrompt], Tag("text")]
    | Annotated[list[TokenPrompt], Tag("tokens")]
    | Annotated[list[ChatPrompt], Tag("chat")],
    Discriminator(_prompts_kind),
]


class GenerateRequest(_Message):
    """The arguments of one ``generate`` task, validated."""

    prompts: Prompts
    params: SamplingParams

    def conversation(self, index: int) -> Conversation:
        """Prompt ``index`` of a chat task, as a conversation with its options."""
        prompt = self.prompts[index]
        return prompt if isinstance(prompt, Conversation) else Conversation(messages=prompt)  # type: ignore[arg-type]

    @field_validator("prompts", mode="before")
    @classmethod
    def _one_kind(cls, value: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            raise ValueError(  # noqa: TRY004  pydantic turns ValueError, not TypeError, into a field error
                "prompts must be a list of strings, chat conversations or token-id lists"
            )
        if not value:
            raise ValueError("prompts must not be empty")
        kinds = {_kind_of(p) for p in value}
        if None in kinds:
            bad = next(i for i, p in enumerate(value) if _kind_of(p) is None)
            raise ValueError(
                f"prompt {bad} is {type(value[bad]).__name__}; expected a string, a chat "
                "conversation ([{'role', 'content'}, ...] or {'messages': [...], 'tools': [...]}) "
                "or a list of token ids"
            )
        if len(kinds) > 1:
            raise ValueError(f"prompts mix kinds ({', '.join(sorted(map(str, kinds)))}); one kind per task")
        return list(value)

    @property
    def kind(self) -> PromptKind:
        kind = _kind_of(self.prompts[0])
        assert kind is not None  # the validator above refused anything else
        return kind


def _kind_of(prompt: Any) -> PromptKind | None:
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, Conversation) or (isinstance(prompt, dict) and "messages" in prompt):
        return "chat"
    if isinstance(prompt, (list, tuple)) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return "tokens"
        if all(isinstance(m, (dict, ChatMessage)) for m in prompt):
            return "chat"
    if isinstance(prompt, (list, tuple)) and not prompt:
        return "tokens"  # empty: refused by min_length with a clear message
    return None


class Sample(_Message):
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    # Per generated token: [[token_id, logprob], ...] of the top `logprobs` tokens.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None
    # [[first_token_index, version], ...]: more than one span only when a
    # pause="keep" sync happened while this sample was being generated.
    weight_versions: list[tuple[int, int]]
    # [[first_token_index, node], ...]: the worker that generated each part;
    # more than one span only when the task was resumed from a checkpoint on
    # another worker (or after a pause="abort" sync) — a trainer can filter on it.
    workers: list[tuple[int, str]] = Field(default_factory=list)
    # Parsed by the worker's tool-call parser (a conversation with tools):
    # the calls in ``text``, and the text around them. None: not parsed.
    tool_calls: list[ToolCall] | None = None
    content: str | None = None


class PromptOutput(_Message):
    prompt_token_ids: list[int]
    prompt_logprobs: list[float | None] | None = None
    # Per prompt token, with prompt_logprobs > 0: [[token_id, logprob], ...] of
    # the top tokens at that position (None for the first token).
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # Per prompt token, with prompt_logprobs: the engine's rank of that token
    # (1: the likeliest; None for the first token).
    prompt_ranks: list[int | None] | None = None
    samples: list[Sample]


class Usage(_Message):
    prompt_tokens: int
    completion_tokens: int


class Timing(_Message):
    queued_s: float
    generate_s: float


class GenerationResult(_Message):
    signature: str
    weight_version: int
    worker: str
    outputs: list[PromptOutput]
    usage: Usage
    timing: Timing
    # A traced task's stamps, stamp name -> unix time (tasks/trace.py); absent
    # from results nobody asked to trace (left out of their dumps too).
    trace: dict[str, float] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_trace(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        if dumped.get("trace", 0) is None:
            del dumped["trace"]
        return dumped



class ToolCallDelta(_Message):
    index: int = Field(ge=0)
    id: str | None = None
    type: Literal["function"] | None = None
    name: str | None = None
    arguments: str | None = None


class SampleDelta(_Message):
    """What one sample of a streamed task generated since its previous delta.

    ``prompt`` is the prompt's index in the task, ``sample`` the sample's
    index among its ``n``; ``finish_reason`` is set on the sample's last delta.
    """

    prompt: int = Field(ge=0)
    sample: int = Field(ge=0)
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # With a tool-call parser (see ``Sample.tool_calls``): what the parser let
    # through of this delta, text and tool-call fragments (OpenAI's streamed
    # ``tool_calls`` entries: index, then id, name, argument pieces).
    parsed: bool = False
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class StreamEvent(_Message):
    """One entry of a streamed task's Redis Stream (``keys.token_stream``).

    Each run of the task (``attempt``: a retry or a redelivery is a new one)
    writes ``start``, its ``delta`` events, then ``end``, numbered by ``seq``
    from 0 so a reader sees a gap (entries trimmed by the stream's bound).
    A ``delta`` event carries every delta its worker gathered for the task
    since its previous write (``workers.engine.streaming``): several prompts
    and samples, possibly several deltas of one sample, in generated order.
    ``end`` is written before the result is stored; the result itself goes to
    the result backend as for any task.
    """

    kind: Literal["start", "delta", "end"]
    attempt: str
    seq: int = Field(ge=0)
    worker: str
    deltas: list[SampleDelta] = []


# --------------------------------------------------------------------------
# Remote control
# --------------------------------------------------------------------------


class ControlAuth(_Message):
    """The signature a state-changing control command carries (its ``auth`` argument).

    ``hmac`` is HMAC-SHA256, keyed with ``RQ_WEIGHT_SYNC_SECRET``, over the
    command's name, its other arguments and the fields below
    (``tasks.auth.signing_payload``). A worker refuses it outside a short
    window around ``issued_at``, a ``nonce`` it has already seen, and a
    ``destination`` that does not name it (None: every worker).
    """

    issued_at: float = Field(allow_inf_nan=False)
    nonce: str = Field(pattern=r"^[0-9A-Za-z_-]{16,64}$")
    destination: list[str] | None = None
    hmac: str = Field(pattern=r"^[0-9a-f]{64}$")


# --------------------------------------------------------------------------
# Worker registry
# --------------------------------------------------------------------------


class WorkerInfo(_Message):
    node: str
    # Workers of one pool serve one policy and are synced together.
    pool: str = keys.DEFAULT_POOL
    queues: list[str] = [keys.GENERATE_QUEUE]
    model: str
    device: str
    dtype: str
    tensor_parallel_size: int = 1
    weight_version: int = 0
    state: WorkerState = "starting"
    inflight_requests: int = 0
    waiting_requests: int = 0
    inflight_tasks: int = 0
    tokens_per_s: float = 0.0
    generated_tokens: int = 0
    kv_cache_usage: float = 0.0
    max_model_len: int = 0
    vocab_size: int = 0  # the model's vocabulary (0: not reported)
    # The engine's logprob settings (vLLM's defaults when not reported):
    # max_logprobs -1 means the whole vocabulary.
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    metrics_port: int | None = None
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    # Seconds between this worker's heartbeats (``heartbeat_at`` refreshes).
    heartbeat_s: float = Field(2.0, gt=0.0)
    # When the engine last answered the heartbeat's no-op question (0: not yet asked).
    engine_answered_at: float = 0.0
    # Started with --colocated: it shares its host (CPU) or GPU (CUDA) with the
    # trainer, which then hands it the weights in place (weight_sync/transports).
    colocated: bool = False
    host_id: str = ""  # weight_sync.locality.host_id() of the worker's host
    device_uuids: list[str] = []  # UUIDs of its engine ranks' GPUs (colocated CUDA workers)

    @property
    def ranks(self) -> int:
        return self.tensor_parallel_size

    @property
    def dead_after_s(self) -> float:
        """Heartbeat age at which readers call this worker dead (``live_at``)."""
        return MISSED_HEARTBEATS * self.heartbeat_s

    def live_at(self, now: float) -> bool:
        """Whether its last heartbeat is recent at ``now`` (the reader's clock).

        Sooner than the registry key's expiry (``registry_ttl_s``, 10 s): a
        worker killed with ``kill -9`` is dead ``dead_after_s`` (6 s by
        default) after its last heartbeat. Compares the worker's clock with the
        reader's: on another host, keep clocks in sync (NTP).
        """
        return now - self.heartbeat_at <= self.dead_after_s
