"""Settings, one class per process kind, read from the environment.

Nothing here is read at import time: ``ClientSettings()`` reads the
environment when it is built, which the Celery app does the first time it is
configured, and the CLIs do in ``main()``.

Every field ``x`` reads the variable ``RQ_X`` (``RQ_RESULT_EXPIRES``,
``RQ_WEIGHT_SYNC_SECRET``...): a prefix, so that a variable some systems set
for other reasons (``NAME``, ``MODEL``) never changes a worker. One widely
known name is kept as an alias: ``REDIS_URL`` (``RQ_REDIS_URL`` wins when both
are set).

A secret setting (``SecretStr``: ``RQ_WEIGHT_SYNC_SECRET``, ``RQ_REDIS_URL``,
``RQ_API_TOKEN``) can instead be read from a file named by the same variable
with ``_FILE`` appended (``RQ_WEIGHT_SYNC_SECRET_FILE=/run/secrets/...``,
compose ``secrets:``); the file wins over the plain variable unless it is
empty, and one trailing newline is dropped.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import AliasChoices, Field, SecretStr, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from rollout_queue.tasks.errors import SettingsFileError


def redact_url(url: str) -> str:
    """``redis://:secret@host`` → ``redis://:***@host`` for logs and reprs."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user, _, _ = creds.partition(":")
    return f"{scheme}://{user}:***@{host}"


ENV_PREFIX = "RQ_"
# The variables read besides RQ_<FIELD>: names users already set for other tools.
ENV_ALIASES = {"redis_url": "REDIS_URL"}


def env_name(field: str) -> str:
    """The environment variable a settings field is read from."""
    return f"{ENV_PREFIX}{field.upper()}"


def redis_url_env(url: str) -> dict[str, str]:
    """The environment that makes a child process use ``url``: both names, since
    ``RQ_REDIS_URL`` wins over ``REDIS_URL`` and the caller's may be set to another."""
    return {env_name("redis_url"): url, ENV_ALIASES["redis_url"]: url}


def environment_redis_url(default: str = "redis://127.0.0.1:6379/0") -> str:
    """The Redis URL the environment names, as ``ClientSettings`` reads it (for scripts'
    ``--redis-url`` defaults): ``RQ_REDIS_URL``, else ``REDIS_URL``, else ``default``."""
    import os

    return os.environ.get(env_name("redis_url")) or os.environ.get(ENV_ALIASES["redis_url"]) or default


def is_secret(field: FieldInfo) -> bool:
    return SecretStr in (field.annotation, *get_args(field.annotation))


class SecretFiles(PydanticBaseSettingsSource):
    """Secret fields read from the file ``<PREFIX><FIELD>_FILE`` names (Docker and
    compose ``secrets:`` mount them under ``/run/secrets``)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads them all at once

    def __call__(self) -> dict[str, Any]:
        prefix = str(self.config.get("env_prefix", ""))
        values: dict[str, Any] = {}
        for name, field in self.settings_cls.model_fields.items():
            variable = f"{prefix}{name.upper()}_FILE"
            path = os.environ.get(variable) if is_secret(field) else None
            if not path:
                continue
            try:
                text = Path(path).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise SettingsFileError(
                    f"{variable}={path}: cannot read it ({getattr(exc, 'strerror', None) or exc}); "
                    f"point it at a readable file, or unset it and set {prefix}{name.upper()}"
                ) from exc
            value = text.removesuffix("\n").removesuffix("\r")
            if value:  # empty (compose's /dev/null default): as if unset
                values[name] = value
        return values


class Settings(BaseSettings):
    """Base of every settings class: secrets may also come from files (``SecretFiles``)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, SecretFiles(settings_cls), env_settings, dotenv_settings, file_secret_settings


class ClientSettings(Settings):
    """What every process that talks to the queue needs (producer, worker, api)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    redis_url: SecretStr = Field(
        default=SecretStr("redis://localhost:6379/0"),
        validation_alias=AliasChoices("rq_redis_url", "redis_url"),
    )
    # Seconds a finished task's result stays in Redis unless its reader
    # deletes it (``generate_many`` and the gateway do, once read; a plain
    # ``AsyncResult.get()`` does not: call ``.forget()``). 6 h, the default
    # visibility timeout: a message whose ack was lost comes back after that
    # long at most, and its stored result is what marks it done
    # (workers/queue/dedup.py). Celery's default is a day.
    result_expires: int = Field(default=6 * 3600, ge=1)
    # Seconds before Redis hands an unacknowledged task to another worker.
    # Must stay well above the longest generation (late acks).
    visibility_timeout: int = 6 * 3600
    # Per-task time limits (seconds); the soft one aborts the engine requests.
    task_soft_time_limit: float = 3600.0
    task_time_limit: float = 3660.0
    # A generate call with more prompts than this is split into subtasks of at
    # most this many (tasks/split.py), so one big call spreads over the
    # workers. 128: two fill a CPU engine's batch (max_num_seqs 256), eight an
    # H200's (1024). Measured on CPU (bench/split.py, 256 prompts on one
    # worker): 2 parts of 128 cost +1 % over one task, 8 parts of 32 +75 %.
    task_max_prompts: int = Field(default=128, ge=1)
    # ... and a part holds at most this many sequences (prompts x n): with
    # n=64, parts of 16 prompts. 1024: an H200 engine's running batch; with
    # n <= 8 the prompt cap above is the one that splits.
    task_max_sequences: int = Field(default=1024, ge=1)
    # A generate call asking for more sequences than this (prompts x n, all
    # parts together) is refused with InvalidRequest before anything is sent.
    call_max_sequences: int = Field(default=65_536, ge=1)
    # Redeliveries of a task whose worker died, before it fails for good.
    task_max_redeliveries: int = 3
    # How long a producer retries an unreachable broker before giving up
    # (then ``BrokerUnavailable``).
    broker_connect_timeout: float = 10.0
    # How long a worker retries storing a finished task's result while Redis
    # is away (a restart), before the task fails.
    result_store_timeout: float = 300.0
    # ``rediss://`` URLs: certificate checks and files (see docs/RELIABILITY.md).
    redis_tls_cert_reqs: Literal["required", "optional", "none"] = "required"
    redis_tls_ca_file: str | None = None
    redis_tls_certfile: str | None = None
    redis_tls_keyfile: str | None = None
    # HMAC key of every state-changing control command (tasks/auth.py): workers
    # refuse commands not signed with it. The same value on every process.
    weight_sync_secret: SecretStr | None = None
    # Redis's maxmemory-policy must be noeviction (an evicted queue, unacked entry
    # or result is a lost task): workers, the gateway and producers refuse another
    # policy unless this is set (tasks.registry.check_eviction_policy).
    allow_evicting_redis: bool = False
    # Producers: every generate call carries a phase trace back in its result
    # (tasks/trace.py; one call: apply_async(..., trace=True)). Workers always
    # honour a traced task; an untraced one costs them nothing.
    trace_phases: bool = False

    @model_validator(mode="after")
    def _visibility_above_time_limit(self) -> ClientSettings:
        longest = max(self.task_soft_time_limit, self.task_time_limit)
        if self.visibility_timeout <= longest:
            raise ValueError(
                f"visibility_timeout ({self.visibility_timeout} s) must exceed the task time limit "
                f"({longest:.0f} s): Redis would hand a task still running to a second worker"
            )
        return self

    @property
    def redacted_url(self) -> str:
        return redact_url(self.redis_url.get_secret_value())

    def __repr_args__(self):  # type: ignore[no-untyped-def]
        # SecretStr already hides the URL; show where it points, not "**********".
        for name, value in super().__repr_args__():
            yield (name, self.redacted_url) if name == "redis_url" else (name, value)


def _allowed(field: FieldInfo) -> str:
    """The values a field accepts, in words: "a number > 0 and <= 1", "one of a, b"."""
    choices = get_args(field.annotation) if get_origin(field.annotation) is Literal else ()
    if choices:
        return "one of " + ", ".join(str(c) for c in choices)
    bounds = [f"{op} {getattr(m, attr)}" for m in field.metadata
              for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
              if getattr(m, attr, None) is not None]
    kind = "an integer" if int in (field.annotation, *get_args(field.annotation)) else "a number"
    return f"{kind} " + " and ".join(bounds) if bounds else ""


def describe_invalid(
    exc: ValidationError, model: type[BaseSettings], env_prefix: str = ENV_PREFIX,
    flagged: Collection[str] = (),
) -> list[str]:
    """One line per bad setting: its flag (fields in ``flagged``), its variable, the value,
    what is allowed.

    ``--gpu-memory-utilization / RQ_GPU_MEMORY_UTILIZATION = 2: allowed: a number > 0 and <= 1``
    """
    lines = []
    for error in exc.errors(include_url=False):
        name = str(error["loc"][0]) if error["loc"] else ""
        field = model.model_fields.get(name)
        if field is None:  # a check across fields: its message says it all
            lines.append(str(error["msg"]).removeprefix("Value error, "))
            continue
        variable = f"{env_prefix}{name.upper()}"
        if name in ENV_ALIASES:
            variable += f" (or {ENV_ALIASES[name]})"
        allowed = _allowed(field)
        reason = f"allowed: {allowed}" if allowed else str(error["msg"])
        flag = f"--{name.replace('_', '-')} / " if name in flagged else ""
        lines.append(f"{flag}{variable} = {error.get('input')!r}: {reason}")
    return lines
