"""Sticky sessions: multi-turn conversations over two workers, with and without stickiness.

Two workers started with ``--sticky-sessions`` on one queue, one gateway.
``--sessions`` conversations of ``--turns`` turns each; every turn sends the
whole conversation so far (the earlier turns' real answers included) through
the gateway, all sessions of a turn at once. Legs alternate, ``--rounds``
each: ``sticky`` (``X-Session-ID`` per conversation: a turn goes to the
worker that served the last) and ``shared`` (no session key: any worker).
Each leg's conversations are new, and both engines' prefix caches are reset
before it, so a leg hits only what its own earlier turns left.

    .venv/bin/python bench/sessions.py                    # CPU: tiny model, 2 workers

Prints one JSON line: per leg, the prefix-cache hit rate of the turns after
the first (prompt tokens found in the cache / looked up, summed over both
engines, from each engine's scheduler stats) and the mean seconds per turn
(all sessions' requests of one turn, sent at once); the sticky leg's route
counts (``rollout_queue_api_session_turns_total``).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import benchlib
import httpx
from pydantic import SecretStr

from rollout_queue.cli.localstack import LocalStack, WorkerSpec
from rollout_queue.tasks.app import configure
from rollout_queue.tasks.control import engine_command
from rollout_queue.tasks.settings import ClientSettings

MODEL_NAME = "bench"
WORDS = ["river", "stone", "light", "cloud", "garden", "letter", "window", "bridge", "market", "forest"]


def opening(rng: random.Random, turn: int) -> str:
    return f"turn {turn}: " + " ".join(rng.choice(WORDS) for _ in range(8))


async def conversation_turn(client: httpx.AsyncClient, base: str, history: list[dict[str, str]],
                            session: str | None, max_tokens: int) -> str:
    headers = {"X-Session-ID": session} if session else {}
    body = {"model": MODEL_NAME, "messages": history, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    response = await client.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=900)
    response.raise_for_status()
    return str(response.json()["choices"][0]["message"]["content"])


def prefix_totals(workers: list[str]) -> tuple[int, int]:
    stats = engine_command("stats", workers=workers)
    return (sum(s["prefix_cache_hits"] for s in stats.values()),
            sum(s["prefix_cache_queries"] for s in stats.values()))


def leg(base: str, workers: list[str], sticky: bool, sessions: int, turns: int, max_tokens: int,
        seed: int) -> dict[str, Any]:
    engine_command("reset_prefix_cache", workers=workers)
    rng = random.Random(seed)
    tag = f"{'sticky' if sticky else 'shared'}-{seed}"
    histories: list[list[dict[str, str]]] = [[] for _ in range(sessions)]
    seconds: list[float] = []
    hits = queries = 0

    async def run() -> None:
        nonlocal hits, queries
        limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
        async with httpx.AsyncClient(limits=limits) as client:
            for turn in range(turns):
                for history in histories:
                    history.append({"role": "user", "content": opening(rng, turn)})
                before = prefix_totals(workers)
                started = time.perf_counter()
                answers = await asyncio.gather(*(
                    conversation_turn(client, base, history, f"{tag}-{i}" if sticky else None, max_tokens)
                    for i, history in enumerate(histories)
                ))
                seconds.append(time.perf_counter() - started)
                after = prefix_totals(workers)
                if turn > 0:  # the first turn has nothing to hit
                    hits += after[0] - before[0]
                    queries += after[1] - before[1]
                for history, answer in zip(histories, answers, strict=True):
                    history.append({"role": "assistant", "content": answer})

    asyncio.run(run())
    return {"hit_rate": hits / queries if queries else 0.0, "s_per_turn": statistics.mean(seconds)}


def main() -> None:
    p = benchlib.parser(__doc__)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    p.add_argument("--rounds", type=int, default=2, help="legs of each kind, alternating")
    args = benchlib.resolve(p.parse_args())
    settings = benchlib.engine_settings(args)
    spec = WorkerSpec(model=settings.model, device=settings.device, dtype=settings.dtype,
                      max_model_len=settings.max_model_len or 0, max_inflight=256,
                      gpu_memory_utilization=settings.gpu_memory_utilization, extra=["--sticky-sessions"])
    client = ClientSettings()
    url = args.redis_url or client.redis_url.get_secret_value()
    results: dict[str, list[dict[str, Any]]] = {"sticky": [], "shared": []}
    with LocalStack(benchlib.ROOT / ".run" / "bench" / "sessions", prefix="sessions") as stack:
        stack.ensure_redis(url)
        configure(client.model_copy(update={"redis_url": SecretStr(stack.redis_url)}))
        for index in (0, 1):
            stack.start_worker(spec, index=index, timeout=900)
        workers = [stack.worker_name(0), stack.worker_name(1)]
        gateway, base = benchlib.start_gateway(stack, MODEL_NAME)
        try:
            leg(base, workers, True, 8, 2, args.max_tokens, seed=10_000)  # warm-up
            before = benchlib.gateway_counter(base, "session_turns")
            for round_ in range(args.rounds):
                for sticky in ((True, False) if round_ % 2 == 0 else (False, True)):
                    name = "sticky" if sticky else "shared"
                    benchlib.log(f"round {round_ + 1}/{args.rounds}: {name}")
                    results[name].append(leg(base, workers, sticky, args.sessions, args.turns, args.max_tokens,
                                             seed=args.seed + 2 * round_ + sticky))
            after = benchlib.gateway_counter(base, "session_turns")
        finally:
            gateway.stop()
    summary = {name: {"hit_rate": round(statistics.mean(r["hit_rate"] for r in runs), 3),
                      "s_per_turn": round(statistics.mean(r["s_per_turn"] for r in runs), 3)}
               for name, runs in results.items()}
    benchlib.emit({
        "bench": "sessions", "sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "workers": 2,
        "sticky_hit_rate": summary["sticky"]["hit_rate"], "shared_hit_rate": summary["shared"]["hit_rate"],
        "sticky_s_per_turn": summary["sticky"]["s_per_turn"], "shared_s_per_turn": summary["shared"]["s_per_turn"],
        "turn_time_ratio": round(summary["sticky"]["s_per_turn"] / summary["shared"]["s_per_turn"], 3),
        "routes": {k.strip("{}").split("=")[1].strip('"'): v - before.get(k, 0.0) for k, v in after.items()},
        "legs": results,
    }, args)


if __name__ == "__main__":
    main()
