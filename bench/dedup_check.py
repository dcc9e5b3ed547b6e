"""What the finished-task check (``workers/queue/dedup.py``) costs each delivery.

Stores ``generate``-shaped results of several sizes in Redis (``REDIS_URL``,
default ``redis://localhost:6379/0``; keys under a random prefix, removed
after), then times, per size, the check every delivery makes
(``DuplicateGuard.finished``: one GETRANGE of the stored result's first
bytes) against reading and decoding the whole result
(``backend.get_task_meta``, what a naive check would do), and against a
Redis PING on the same client (one round trip: the floor).

    .venv/bin/python bench/dedup_check.py [--iterations N]

Prints one JSON line: per size, microseconds per check, per full read, and
their ratio; ``check_vs_ping`` is the check over one bare round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable

from pydantic import SecretStr

from rollout_queue.tasks.app import app, configure
from rollout_queue.tasks.settings import ClientSettings
from rollout_queue.workers.queue.dedup import DuplicateGuard, quick_client


def result_of(prompts: int, tokens: int) -> dict[str, object]:
    sample = {"text": "t " * tokens, "token_ids": list(range(tokens)),
              "logprobs": [-0.5] * tokens, "finish_reason": "length", "weight_versions": [[0, 0]]}
    return {"signature": "bench", "weight_version": 0, "worker": "bench@host",
            "outputs": [{"prompt_token_ids": list(range(16)), "samples": [sample]}] * prompts}


def per_call_us(call: Callable[[], object], iterations: int) -> float:
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(iterations):
            call()
        rounds.append((time.perf_counter() - started) / iterations * 1e6)
    return round(statistics.median(rounds), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    configure(ClientSettings(redis_url=SecretStr(url)))
    backend = app.backend
    guard = DuplicateGuard(backend, quick_client(ClientSettings(redis_url=SecretStr(url))))
    ping = per_call_us(backend.client.ping, args.iterations)
    sizes: dict[str, object] = {}
    for prompts, tokens in ((1, 16), (64, 256), (512, 256)):
        task_id = f"bench-dedup-{uuid.uuid4()}"
        backend.store_result(task_id, result_of(prompts, tokens), "SUCCESS")
        try:
            assert guard.finished(task_id) == "SUCCESS"
            check = per_call_us(lambda t=task_id: guard.finished(t), args.iterations)
            full = per_call_us(lambda t=task_id: backend.get_task_meta(t, cache=False),
                               max(5, args.iterations // 20))
            stored = backend.client.strlen(backend.get_key_for_task(task_id))
        finally:
            backend.forget(task_id)
        sizes[f"{prompts}x{tokens}"] = {"stored_bytes": stored, "check_us": check, "full_read_us": full,
                                        "full_over_check": round(full / check, 1)}
    print(json.dumps({"bench": "dedup_check", "ping_us": ping, "sizes": sizes,
                      "check_vs_ping": round(max(s["check_us"] for s in sizes.values()) / ping, 2)}))


if __name__ == "__main__":
    main()
