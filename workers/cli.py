"""``rollout-queue``: thin CLI. Flags → settings → ``run(settings)``."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _worker(args: argparse.Namespace) -> int:
    from workers.main import run_worker
    from workers.settings import WorkerSettings

    overrides: dict[str, Any] = {
        k: v for k, v in vars(args).items()
        if k not in ("command", "func") and v is not None
    }
    if "redis_url" in overrides:
        from pydantic import SecretStr

        overrides["redis_url"] = SecretStr(overrides["redis_url"])
    return run_worker(WorkerSettings(**overrides))


def _make_tiny_model(args: argparse.Namespace) -> int:
    from workers.tiny_model import make_tiny_model

    path = make_tiny_model(args.path, seed=args.seed, kind=args.kind, weights=not args.no_weights,
                           dtype=args.dtype)
    print(path)
    return 0


def _status(args: argparse.Namespace) -> int:
    from workers.status import run_status

    return run_status(watch=args.watch, interval=args.interval, redis_url=args.redis_url, node=args.node)


def _dead_letters(args: argparse.Namespace) -> int:
    from pydantic import SecretStr

    from tasks.settings import ClientSettings
    from workers.dead_letters import run_dead_letters

    settings = ClientSettings(redis_url=SecretStr(args.redis_url)) if args.redis_url else ClientSettings()
    return run_dead_letters(settings, queue=args.queue, requeue_id=args.requeue, drop_id=args.drop)


def _api(args: argparse.Namespace) -> int:
    from api.server import run_api

    return run_api(host=args.host, port=args.port, redis_url=args.redis_url)


def _quickstart(args: argparse.Namespace) -> int:
    from workers.quickstart import run_quickstart

    return run_quickstart()


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="rollout-queue", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="run one worker node hosting one vLLM engine")
    w.add_argument("--model", required=True, help="model path or Hugging Face id")
    w.add_argument("--device", choices=["cpu", "cuda"])
    w.add_argument("--name", help="Celery node name, e.g. gpu0@host")
    w.add_argument("--max-inflight", type=int, help="tasks in flight at once")
    w.add_argument("--intake-sequences", type=int,
                   help="fetch the next task only while the engine holds fewer unfinished "
                        "sequences than this, e.g. the engine's max_num_seqs (default: off)")
    w.add_argument("--tensor-parallel-size", type=int)
    w.add_argument("--max-model-len", type=int)
    w.add_argument("--dtype")
    w.add_argument("--gpu-memory-utilization", type=float)
    w.add_argument("--max-num-seqs", type=int, help="sequences in the running batch (vLLM)")
    w.add_argument("--max-num-batched-tokens", type=int, help="tokens per engine step (vLLM)")
    w.add_argument("--enforce-eager", action="store_true", default=None)
    w.add_argument("--enable-sleep-mode", action="store_true", default=None)
    w.add_argument("--weight-load-mode", choices=["auto", "layerwise", "direct"])
    w.add_argument("--cpu-weights", choices=["packed", "plain"],
                   help="CPU: vLLM's packed GEMM weights (default) or plain tensors (faster weight syncs)")
    w.add_argument("--load-format", help="vLLM load format, e.g. 'dummy' for random weights")
    w.add_argument("--metrics-port", type=int)
    w.add_argument("--checkpoint-tokens", type=int,
                   help="save each sample's progress every N tokens for resume (default 64; 0: off)")
    w.add_argument("--drain-timeout", type=float,
                   help="on SIGTERM, hand unfinished tasks on after this many seconds (default: finish them)")
    w.add_argument("--metrics-host", help="address /metrics listens on (default 127.0.0.1; 0.0.0.0: all)")
    w.add_argument("--pool", help="weight-sync pool (workers of one policy); default 'default'")
    w.add_argument("--queues", type=lambda s: s.split(","), help="queues to consume, comma-separated")
    w.add_argument("--redis-url")
    w.add_argument("--heartbeat-s", type=float, help="registry heartbeat interval (default 2)")
    w.add_argument("--registry-ttl-s", type=float,
                   help="a worker whose heartbeat stopped leaves the registry after this (default 10)")
    w.add_argument("--reap-grace-s", type=float,
                   help="a node gone from the registry this long is dead: its tasks are redelivered (default 10)")
    w.add_argument("--log-level")
    w.add_argument("--insecure-control", action="store_true", default=None,
                   help="start without WEIGHT_SYNC_SECRET: accept unsigned control commands from any "
                        "Redis client (loopback-only setups; env RQ_INSECURE_CONTROL=1)")
    w.add_argument("--allow-celery-control", action="store_true", default=None,
                   help="accept Celery's unsigned state-changing control commands (shutdown, "
                        "pool_restart, add_consumer...; env RQ_ALLOW_CELERY_CONTROL=1)")
    w.set_defaults(func=_worker)

    m = sub.add_parser("make-tiny-model", help="write a small random model for tests")
    m.add_argument("path")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--kind", default="llama", choices=["llama", "qwen2-0.5b", "qwen2-7b"])
    m.add_argument("--dtype", help="weights dtype (qwen2 kinds; default bfloat16)")
    m.add_argument("--no-weights", action="store_true",
                   help="config and tokenizer only (engines with --load-format dummy)")
    m.set_defaults(func=_make_tiny_model)

    s = sub.add_parser("status", help="workers, versions and queue depths")
    s.add_argument("--watch", action="store_true")
    s.add_argument("--interval", type=float, default=2.0)
    s.add_argument("--redis-url")
    s.add_argument("--node", help="show one worker; exit 1 when it is not live (healthcheck)")
    s.set_defaults(func=_status)

    d = sub.add_parser("dead-letters", help="list, requeue or drop queue items no worker could decode")
    d.add_argument("--queue", help="only this queue's dead letters")
    action = d.add_mutually_exclusive_group()
    action.add_argument("--requeue", metavar="ID", help="put it back on its queue (only if it now decodes)")
    action.add_argument("--drop", metavar="ID", help="delete it")
    d.add_argument("--redis-url")
    d.set_defaults(func=_dead_letters)

    a = sub.add_parser("api", help="run the OpenAI-compatible HTTP gateway")
    a.add_argument("--host", default=None)
    a.add_argument("--port", type=int, default=None)
    a.add_argument("--redis-url")
    a.set_defaults(func=_api)

    q = sub.add_parser("quickstart", help="start Redis (if needed) and a CPU worker, generate, stop")
    q.set_defaults(func=_quickstart)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
