"""``ApiSettings``: what the HTTP gateway process reads from its environment.

Every field reads the environment variable ``RQ_API_<FIELD>`` (``RQ_API_TOKEN``,
``RQ_API_PORT``, ``RQ_API_BATCH_WINDOW_MS``...). The queue connection itself
(``RQ_REDIS_URL`` or ``REDIS_URL``, time limits) is the shared
``tasks.settings.ClientSettings``.
``RQ_API_TOKEN_FILE`` names a file holding the token instead (``tasks.settings``).
Built once, in ``run_api``, and passed down.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from rollout_queue.tasks import keys
from rollout_queue.tasks.logs import LogFormat
from rollout_queue.tasks.settings import Settings


class ApiSettings(Settings):
    model_config = SettingsConfigDict(env_prefix="RQ_API_", extra="ignore")

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)
    # Bearer token every /v1 request must carry; None: no auth.
    token: SecretStr | None = None
    # The model id reported by /v1/models; requests naming another get 404.
    model_name: str = "rollout-queue"
    # Celery queue the gateway's generate tasks go to (one pool of workers).
    queue: str = keys.GENERATE_QUEUE
    # Tokenizer (path or Hugging Face id) used only to show logprob tokens as
    # text; None: tokens are shown as "token_id:N" (vLLM's
    # --return-tokens-as-token-ids spelling), exact and cheap.
    tokenizer: str | None = None

    # Micro-batcher: requests with one sampling signature that arrive within
    # this window share one generate task, up to max_batch_prompts prompts.
    batch_window_ms: float = Field(5.0, ge=0.0, le=10_000.0)
    max_batch_prompts: int = Field(256, ge=1)
    # Bound on generate tasks in flight (enqueued or being collected, not yet
    # answered); past it new requests are refused with saturated_status.
    max_inflight_tasks: int = Field(256, ge=1)
    saturated_status: Literal[429, 503] = 429
    # Seconds a request waits for its task's result before a 504; the task
    # message expires at the same moment, so no worker serves it afterwards.
    request_timeout_s: float = Field(600.0, gt=0.0)
    # Chat requests without max_tokens generate until a stop, the context end
    # or this many tokens.
    default_max_tokens: int = Field(4096, ge=1)
    # Safety net under the result pub/sub: pending results are also read
    # directly this often (seconds).
    result_poll_s: float = Field(1.0, gt=0.0)
    # Size limits, checked before anything reaches Redis (413 past them): the
    # body in bytes; one prompt in characters (a text prompt, or a chat
    # conversation's contents together) and in token ids (a token prompt).
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_prompt_chars: int = Field(500_000, ge=1)
    max_prompt_tokens: int = Field(131_072, ge=1)
    # Sequences one request may ask for (prompts x n): 413 past it. Requests
    # with more sequences than a task holds (RQ_TASK_MAX_SEQUENCES) are split
    # over several tasks, so several workers serve them.
    max_request_sequences: int = Field(4096, ge=1)
    # A completion request of many prompts (one GRPO batch) is spread over the
    # serving workers: split into one part per worker, each of at least this
    # many prompts, joined in prompt order. 0: a request is split only past
    # what one task holds.
    spread_min_prompts: int = Field(8, ge=0)
    # The workers' max_model_len (prompts must fit it) is read from the worker
    # registry at most this often (seconds).
    limits_refresh_s: float = Field(5.0, gt=0.0)
    # Serve /docs, /redoc and /openapi.json (behind RQ_API_TOKEN when it is set).
    docs: bool = False
    log_level: str = "info"
    # "json": one JSON object per log line (time, level, logger, message, node).
    log_format: LogFormat = "text"
    # One uvicorn log line per request (off: it costs throughput).
    access_log: bool = False

    @field_validator("saturated_status", mode="before")
    @classmethod
    def _status_from_text(cls, value: Any) -> Any:
        # The environment gives "503"; a Literal of ints matches no string.
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value

    def bearer_token(self) -> str | None:
        """The token /v1 requests must carry; None (no auth) when unset or empty
        (compose passes an unset variable through as empty)."""
        return (self.token.get_secret_value() if self.token is not None else "") or None
