"""What the HTTP gateway adds over calling ``generate`` directly: latency and throughput.

One worker on a queue of its own (``benchlib.queue_stack``) and one gateway
(``rollout-queue api`` subprocess) in front of it, same Redis, same engine.

- latency: one 1-prompt request at a time, alternating a ``generate`` task
  sent straight to the queue and an OpenAI completion through the gateway
  (HTTP, translation, batch window, result pub/sub); p50/p99 of both.
- throughput: the same prompts, all at once, three ways, in rotating order:
  one ``generate`` task per prompt (a naive producer), ``prompts_per_task``
  prompts per task (a producer batching by hand), and one concurrent HTTP
  request per prompt through the gateway (which groups them by signature).

    .venv/bin/python bench/api.py                       # CPU: tiny model

Prints one JSON line: p50/p99 per leg and added_p50_ms / added_p99_ms;
generated tokens/s per leg and the gateway's ratio to both direct legs; the
tasks the gateway sent for each throughput round.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import benchlib
import httpx
import openai

from rollout_queue.tasks.generate import generate
from rollout_queue.tasks.schemas import SamplingParams

MODEL_NAME = "bench"
DEFAULTS = {
    "cpu": {"iterations": 100, "input_len": 16, "latency_tokens": 8, "prompts": 128, "output_len": 32,
            "rounds": 3},
    "cuda": {"iterations": 300, "input_len": 128, "latency_tokens": 16, "prompts": 1024,
             "output_len": 256, "rounds": 3},
}



def tasks_sent(base: str) -> float:
    return sum(benchlib.gateway_counter(base, "tasks").values())

def latency_legs(stack: Any, base: str, prompts: list[list[int]], max_tokens: int, warmup: int
                 ) -> tuple[list[float], list[float]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    direct_ms: list[float] = []
    gateway_ms: list[float] = []
    for i, ids in enumerate(prompts):
        started = time.perf_counter()
        handle = generate.apply_async(([ids], params), queue=stack.queue)
        result = handle.get(timeout=300)
        direct = (time.perf_counter() - started) * 1000
        handle.forget()
        started = time.perf_counter()
        response = client.completions.create(
            model=MODEL_NAME, prompt=ids, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        through = (time.perf_counter() - started) * 1000
        if response.choices[0].model_extra["token_ids"] != result["outputs"][0]["samples"][0]["token_ids"]:
            benchlib.log(f"iteration {i}: gateway and direct task generated different tokens")
        if i >= warmup:
            direct_ms.append(direct)
            gateway_ms.append(through)
    return direct_ms, gateway_ms


def direct_round(stack: Any, prompts: list[list[int]], params: SamplingParams, per_task: int) -> tuple[float, int]:
    """Seconds and generated tokens for ``prompts`` sent as tasks of ``per_task`` prompts."""
    started = time.perf_counter()
    handles = [generate.apply_async((prompts[i:i + per_task], params), queue=stack.queue)
               for i in range(0, len(prompts), per_task)]
    results = [h.get(timeout=900) for h in handles]
    seconds = time.perf_counter() - started
    for handle in handles:
        handle.forget()
    return seconds, sum(r["usage"]["completion_tokens"] for r in results)


async def gateway_round(base: str, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with openai.AsyncOpenAI(
        base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=900,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    ) as client:
        started = time.perf_counter()
        responses = await asyncio.gather(*(
            client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=output_len,
                                      temperature=0, extra_body={"ignore_eos": True})
            for ids in prompts
        ))
        seconds = time.perf_counter() - started
    return seconds, sum(r.usage.completion_tokens for r in responses if r.usage)


def main() -> None:
    p = benchlib.parser(__doc__)
    p.add_argument("--iterations", type=int, help="latency: requests per leg")
    p.add_argument("--latency-tokens", type=int, help="latency: tokens per request")
    p.add_argument("--prompts", type=int, help="throughput: prompts per round")
    p.add_argument("--output-len", type=int, help="throughput: tokens per prompt")
    p.add_argument("--prompts-per-task", type=int, default=32)
    p.add_argument("--rounds", type=int)
    p.add_argument("--window-ms", type=float, default=5.0, help="the gateway's batch window")
    args = p.parse_args()
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args = benchlib.resolve(args)
    settings = benchlib.engine_settings(args)
    warmup = 5
    latency_prompts = benchlib.token_prompts(args.model, args.iterations + warmup, args.input_len, args.seed)
    load = benchlib.token_prompts(args.model, args.prompts, args.input_len, args.seed + 1)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    legs: dict[str, list[float]] = {"per_prompt_tasks": [], "batched_tasks": [], "gateway": []}
    gateway_tasks: list[int] = []
    # Enough threads that one-task-per-prompt is never held back by the worker.
    with benchlib.queue_stack(args, settings, max_inflight=max(64, args.prompts)) as stack:
        gateway, base = benchlib.start_gateway(stack, MODEL_NAME, env={"RQ_API_BATCH_WINDOW_MS": str(args.window_ms)})
        try:
            benchlib.log("latency legs")
            direct_ms, gateway_ms = latency_legs(stack, base, latency_prompts, args.latency_tokens, warmup)
            order = list(legs)
            for round_ in range(args.rounds):
                benchlib.log(f"throughput round {round_ + 1}/{args.rounds}: {', '.join(order)}")
                for leg in order:
                    if leg == "gateway":
                        before = tasks_sent(base)
                        seconds, tokens = asyncio.run(gateway_round(base, load, args.output_len))
                        gateway_tasks.append(int(tasks_sent(base) - before))
                    else:
                        per_task = 1 if leg == "per_prompt_tasks" else args.prompts_per_task
                        seconds, tokens = direct_round(stack, load, params, per_task)
                    legs[leg].append(tokens / seconds)
                order = order[1:] + order[:1]  # each leg goes first in turn: load drift cancels
        finally:
            gateway.stop()
    d50, d99 = statistics.median(direct_ms), benchlib.percentile(direct_ms, 99)
    g50, g99 = statistics.median(gateway_ms), benchlib.percentile(gateway_ms, 99)
    tps = {leg: statistics.mean(values) for leg, values in legs.items()}
    record = {
        "bench": "api",
        "direct_p50_ms": round(d50, 2),
        "direct_p99_ms": round(d99, 2),
        "gateway_p50_ms": round(g50, 2),
        "gateway_p99_ms": round(g99, 2),
        "added_p50_ms": round(g50 - d50, 2),
        "added_p99_ms": round(g99 - d99, 2),
        "gateway_tok_s": round(tps["gateway"], 1),
        "per_prompt_tasks_tok_s": round(tps["per_prompt_tasks"], 1),
        "batched_tasks_tok_s": round(tps["batched_tasks"], 1),
        "ratio_vs_per_prompt_tasks": round(tps["gateway"] / tps["per_prompt_tasks"], 3),
        "ratio_vs_batched_tasks": round(tps["gateway"] / tps["batched_tasks"], 3),
        "gateway_tasks_per_round": gateway_tasks,
        "tok_s_per_round": {leg: [round(v, 1) for v in values] for leg, values in legs.items()},
        "window_ms": args.window_ms,
        "iterations": args.iterations,
        "prompts": args.prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prompts_per_task": args.prompts_per_task,
        "rounds": args.rounds,
    }
    benchlib.emit(record, args)


if __name__ == "__main__":
    main()
