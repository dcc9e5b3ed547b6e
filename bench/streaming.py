"""Token streaming: time to first token and inter-token gaps, through the queue and the gateway.

One worker on a queue of its own (``benchlib.queue_stack``), one gateway
(``rollout-queue api``) in front of it, and, in this process, an
``EngineHost`` built from the same engine settings: the direct engine call.

- latency: one 1-prompt request at a time, the legs alternated: the direct
  engine (``EngineHost.generate`` with a delta hook, as the worker runs it),
  ``generate.stream`` (Python producer: Redis queue, worker, Redis Stream),
  a streamed OpenAI completion through the gateway (HTTP, SSE), and a plain
  1-token task sent to its result (what the queue costs before any
  streaming: the floor of a streamed TTFT through the queue). For each: time
  to the first token (TTFT) p50/p99 and the gaps between tokens' arrivals
  (p50/p99 over every gap; a chunk holding k tokens counts as k gaps, the
  first k-1 of them zero); added TTFT of each leg over the direct one.
- throughput: the same prompts as one plain task (no stream: nothing is
  published, the path every non-streamed task takes) and as one streamed
  task read with ``generate.stream``, rounds alternated; the streamed/plain ratio.

The latency legs take turns by blocks of ``BLOCK`` requests, each block
after the pause that lets the other engine go idle (``benchlib.IDLE_S``), as
in ``bench/latency.py``; a progress line follows every block, and every
request has ``REQUEST_TIMEOUT_S`` to finish, so a stalled leg fails the bench
with its name rather than going silent.

    .venv/bin/python bench/streaming.py                 # CPU: tiny model
    python bench/streaming.py --device cuda             # GPU: qwen2-0.5b shape (~4 min on an H200)
    .venv/bin/python bench/streaming.py --smoke         # CPU, two short requests per leg: the JSON line only

Prints one JSON line.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from typing import Any

import benchlib
import openai

from rollout_queue.tasks.generate import generate
from rollout_queue.tasks.schemas import GenerateRequest, SampleDelta, SamplingParams
from rollout_queue.workers.engine.run import RunOptions

MODEL_NAME = "bench"

# A pause before every request (4 legs x 203 requests x (1.2 s + ~0.5 s of
# generation) on an H200) made the GPU run's latency legs last over 20
# minutes without a line of output: pauses are per block now.
DEFAULTS = {
    "cpu": {"iterations": 40, "input_len": 16, "latency_tokens": 32, "prompts": 64, "output_len": 32,
            "rounds": 3},
    "cuda": {"iterations": 40, "input_len": 128, "latency_tokens": 128, "prompts": 512,
             "output_len": 256, "rounds": 3},
}
SMOKE = {"iterations": 2, "input_len": 8, "latency_tokens": 4, "prompts": 4, "output_len": 4, "rounds": 1}
REQUEST_TIMEOUT_S = 60.0  # one latency request; a generation of 128 tokens takes about a second
BLOCK = 10  # latency requests of one leg between two pauses


def arrivals_direct(host: Any, ids: list[int], params: SamplingParams) -> list[tuple[float, int]]:
    """(seconds since the call, tokens) per delta of a direct engine call."""
    request = GenerateRequest(prompts=[ids], params=params)
    seen: list[tuple[float, int]] = []
    started = time.perf_counter()

    def on_output(_: int, output: Any) -> None:
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if tokens:
            seen.append((time.perf_counter() - started, tokens))

    host.generate(request, RunOptions(deadline=time.time() + REQUEST_TIMEOUT_S, on_output=on_output))
    return seen


def arrivals_python(queue: str, ids: list[int], params: SamplingParams) -> list[tuple[float, int]]:
    seen: list[tuple[float, int]] = []
    started = time.perf_counter()
    for item in generate.stream([ids], params, queue=queue, timeout=REQUEST_TIMEOUT_S):
        if isinstance(item, SampleDelta) and item.token_ids:
            seen.append((time.perf_counter() - started, len(item.token_ids)))
    return seen


def arrivals_gateway(client: openai.OpenAI, ids: list[int], max_tokens: int) -> list[tuple[float, int]]:
    seen: list[tuple[float, int]] = []
    started = time.perf_counter()
    stream = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    for chunk in stream:
        tokens = sum(len((c.model_extra or {}).get("token_ids") or []) for c in chunk.choices)
        if tokens:
            seen.append((time.perf_counter() - started, tokens))
    return seen


def one_token_task(queue: str, ids: list[int]) -> list[tuple[float, int]]:
    """A plain (not streamed) 1-token task, sent to result: the queue's own round trip."""
    started = time.perf_counter()
    handle = generate.apply_async(([ids], SamplingParams(temperature=0, max_tokens=1)), queue=queue)
    handle.get(timeout=REQUEST_TIMEOUT_S)
    seconds = time.perf_counter() - started
    handle.forget()
    return [(seconds, 1)]


def summarize(runs: list[list[tuple[float, int]]]) -> dict[str, float]:
    ttft = [run[0][0] * 1000 for run in runs]
    gaps: list[float] = []
    for run in runs:
        for (before, _), (at, tokens) in itertools.pairwise(run):
            gaps += [0.0] * (tokens - 1) + [(at - before) * 1000]
    return {
        "ttft_p50_ms": round(statistics.median(ttft), 2),
        "ttft_p99_ms": round(benchlib.percentile(ttft, 99), 2),
        "gap_p50_ms": round(statistics.median(gaps), 2),
        "gap_p99_ms": round(benchlib.percentile(gaps, 99), 2),
        "chunks_per_request": round(statistics.mean(len(run) for run in runs), 1),
    }


def throughput_round(queue: str, prompts: list[list[int]], params: SamplingParams, streamed: bool) -> float:
    started = time.perf_counter()
    if streamed:
        *_, result = generate.stream(prompts, params, queue=queue, timeout=900)
        tokens = result.usage.completion_tokens  # type: ignore[union-attr]
    else:
        handle = generate.apply_async((prompts, params), queue=queue)
        tokens = handle.get(timeout=900)["usage"]["completion_tokens"]
        handle.forget()
    return tokens / (time.perf_counter() - started)


def main() -> None:
    p = benchlib.parser(__doc__)
    p.add_argument("--iterations", type=int, help="latency: requests per leg")
    p.add_argument("--latency-tokens", type=int, help="latency: tokens per request")
    p.add_argument("--input-len", type=int)
    p.add_argument("--prompts", type=int, help="throughput: prompts per task")
    p.add_argument("--output-len", type=int, help="throughput: tokens per prompt")
    p.add_argument("--rounds", type=int)
    p.add_argument("--smoke", action="store_true", help="two short requests per leg, one round: a quick check")
    args = p.parse_args()
    for key, value in (SMOKE if args.smoke else DEFAULTS[args.device]).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args = benchlib.resolve(args)
    settings = benchlib.engine_settings(args)
    warmup = 1 if args.smoke else 3
    prompts = benchlib.token_prompts(args.model, args.iterations + warmup, args.input_len, args.seed)
    load = benchlib.token_prompts(args.model, args.prompts, args.input_len, args.seed + 1)
    latency = SamplingParams(temperature=0, max_tokens=args.latency_tokens, ignore_eos=True)
    bulk = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    from rollout_queue.workers.engine.host import EngineHost
    from rollout_queue.workers.node.main import cpu_environment

    if settings.device == "cpu":
        cpu_environment(settings.cpu_weights)  # the worker's engine environment, for the direct engine too

    runs: dict[str, list[list[tuple[float, int]]]] = {"direct": [], "python": [], "gateway": []}
    one_token_task_ms: list[float] = []
    tok_s: dict[str, list[float]] = {"plain": [], "streamed": []}
    with benchlib.queue_stack(args, settings) as stack:
        gateway, base = benchlib.start_gateway(stack, MODEL_NAME)
        host = EngineHost(settings)
        try:
            benchlib.log("loading the direct engine")
            host.start()
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                   timeout=REQUEST_TIMEOUT_S)
            benchlib.log(f"latency legs: {len(prompts)} requests each, in blocks of {BLOCK}")
            legs = {
                "direct": lambda ids: arrivals_direct(host, ids, latency),
                "python": lambda ids: arrivals_python(stack.queue, ids, latency),
                "gateway": lambda ids: arrivals_gateway(client, ids, args.latency_tokens),
                "task": lambda ids: one_token_task(stack.queue, ids),
            }
            seconds = dict.fromkeys(legs, 0.0)
            for block_index, start in enumerate(range(0, len(prompts), BLOCK)):
                block = prompts[start : start + BLOCK]
                turn = block_index % len(legs)
                for leg in list(legs)[turn:] + list(legs)[:turn]:  # each leg goes first in turn
                    time.sleep(benchlib.IDLE_S)  # the other engine's spinning readers go quiet
                    began = time.perf_counter()
                    for i, ids in enumerate(block, start):
                        run = legs[leg](ids)
                        if i < warmup:
                            continue
                        if leg == "task":
                            one_token_task_ms.append(run[0][0] * 1000)
                        else:
                            runs[leg].append(run)
                    seconds[leg] += time.perf_counter() - began
                benchlib.log(f"latency {min(start + BLOCK, len(prompts))}/{len(prompts)}; seconds per leg "
                             "so far: " + ", ".join(f"{leg} {value:.1f}" for leg, value in seconds.items()))
            order = ["plain", "streamed"]
            for round_ in range(args.rounds):
                benchlib.log(f"throughput round {round_ + 1}/{args.rounds}")
                for leg in order:
                    time.sleep(benchlib.IDLE_S)
                    tok_s[leg].append(throughput_round(stack.queue, load, bulk, leg == "streamed"))
                order.reverse()
        finally:
            gateway.stop()
            host.shutdown()
    figures = {leg: summarize(values) for leg, values in runs.items()}
    direct_ttft = figures["direct"]["ttft_p50_ms"]
    plain, streamed = statistics.mean(tok_s["plain"]), statistics.mean(tok_s["streamed"])
    record = {
        "bench": "streaming",
        **{f"{leg}_{key}": value for leg, values in figures.items() for key, value in values.items()},
        "one_token_task_p50_ms": round(statistics.median(one_token_task_ms), 2),
        "python_added_ttft_p50_ms": round(figures["python"]["ttft_p50_ms"] - direct_ttft, 2),
        "gateway_added_ttft_p50_ms": round(figures["gateway"]["ttft_p50_ms"] - direct_ttft, 2),
        "plain_task_tok_s": round(plain, 1),
        "streamed_task_tok_s": round(streamed, 1),
        "streamed_vs_plain": round(streamed / plain, 3),
        "tok_s_per_round": {leg: [round(v, 1) for v in values] for leg, values in tok_s.items()},
        "iterations": args.iterations,
        "latency_tokens": args.latency_tokens,
        "prompts": args.prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
    }
    benchlib.emit(record, args)


if __name__ == "__main__":
    sys.exit(main())
