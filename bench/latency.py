"""Latency the queue adds to a 1-prompt task, over a direct engine call.

Every prompt (a fresh token-id prompt each) goes both ways: as a 1-prompt
``generate`` task through Redis to one worker (until ``.get()`` returns), and
straight into vLLM's offline ``LLM.generate`` in this process, built from
the same engine config; the legs alternate in blocks, the first block warms
up. The difference of the percentiles is what the queue costs: Celery
messaging, the result backend, validation and result building.

    .venv/bin/python bench/latency.py                        # CPU: tiny model
    python bench/latency.py --device cuda --model PATH       # GPU
    .venv/bin/python bench/latency.py --trace                # and where the time goes

Prints one JSON line: p50/p99 of both legs, added_p50_ms / added_p99_ms, ratio_p50,
and the queue leg's first block as the worker's first tasks after it said it
serves (``first_tasks_ms``; ``first_over_tenth``, the warm-up's figure: the
worker ran its warm-up before serving, and this producer its first call:
``producer_first_apply_async_ms``; with ``--trace`` also the first and the
tenth task's phases, ``first_task_phases_ms`` / ``tenth_task_phases_ms``).
With ``--trace`` the queue leg's tasks carry a phase trace (``tasks.trace``),
and the line also holds each phase's p50 and p99 (``phases_p50_ms``,
``phases_p99_ms``: publish, Redis and fetch, strategy, thread hand-off,
prepare, engine add, first token, decode, result build, before store, store
and read; ``total`` is apply_async to .get(), ``outside_engine`` the total less
first token and decode: the queue's own time), and ``apply_async_p50_ms``
(the call itself, which returns a little after the message is out).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import benchlib

from rollout_queue.tasks import trace
from rollout_queue.tasks.generate import generate
from rollout_queue.tasks.schemas import SamplingParams

DEFAULTS = {"cpu": {"iterations": 100, "input_len": 16, "max_tokens": 8},
            "cuda": {"iterations": 300, "input_len": 128, "max_tokens": 16}}


BLOCK = 10


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    p = benchlib.parser(__doc__)
    p.add_argument("--iterations", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--trace", action="store_true", help="trace the queue leg's tasks phase by phase")
    args = p.parse_args()
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args = benchlib.resolve(args)
    settings = benchlib.engine_settings(args)
    warmup = BLOCK
    prompts = benchlib.token_prompts(args.model, args.iterations + warmup, args.input_len, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    from vllm.inputs import TokensPrompt

    from rollout_queue.cli.offline import offline_llm, shutdown
    from rollout_queue.workers.engine.host import to_vllm_params

    direct_params = to_vllm_params(params)
    times: dict[str, list[float]] = {"queue": [], "direct": []}
    tokens: dict[str, list[list[int]]] = {"queue": [], "direct": []}
    traces: list[dict[str, float]] = []  # the queue leg's, warm-up included (cut below)
    # The worker's first tasks after it said it serves (its own warm-up ran before):
    # the first against the tenth is the warm-up's target (first <= 2x tenth).
    first_ms: list[float] = []
    apply_ms: list[float] = []
    read: list[Any] = []  # the queue leg's results read, their keys not yet deleted

    def queue_call(ids: list[int]) -> list[int]:
        began = time.time()
        handle = generate.apply_async(([ids], params), queue=stack.queue, trace=args.trace)
        apply_ms.append((time.time() - began) * 1000)
        result: dict[str, Any] = handle.get(timeout=300)
        read.append(handle)  # forgotten after the block: the caller has its result here
        if args.trace:
            traces.append(result["trace"])
        return list(result["outputs"][0]["samples"][0]["token_ids"])

    def direct_call(ids: list[int]) -> list[int]:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids)], direct_params, use_tqdm=False)
        return list(outputs[0].outputs[0].token_ids)

    def warm_producer() -> float:
        """This process's first ``apply_async`` (Celery builds its producer pool, the
        result backend and its subscription on first use: ~20 ms on the 2-core VM),
        its milliseconds: a task sent to a queue no worker reads, then dropped, so
        that the first block times the worker's first tasks, not the producer's."""
        nobody = f"{stack.queue}-producer-warm-up"
        began = time.perf_counter()
        handle = generate.apply_async(([prompts[0]], params), queue=nobody)
        ms = (time.perf_counter() - began) * 1000
        handle.forget()
        # The queue, and the exchange kombu declared for it on the way.
        stack.client().delete(nobody, f"_kombu.binding.{nobody}", f"_kombu.binding_permanent.{nobody}")
        return ms

    with benchlib.queue_stack(args, settings, max_inflight=4) as stack:
        llm = offline_llm(settings)
        try:
            producer_first_ms = warm_producer()
            # Blocks of BLOCK prompts per leg, alternating, each after the
            # other engine has gone idle; both legs see the same prompts.
            for start in range(0, len(prompts), BLOCK):
                block = prompts[start : start + BLOCK]
                for leg, call in (("queue", queue_call), ("direct", direct_call)):
                    time.sleep(benchlib.IDLE_S)
                    for i, ids in enumerate(block, start):
                        began = time.perf_counter()
                        out = call(ids)
                        ms = (time.perf_counter() - began) * 1000
                        if i >= warmup:
                            times[leg].append(ms)
                            tokens[leg].append(out)
                        elif leg == "queue":
                            first_ms.append(ms)
                    for handle in read:  # outside the timed calls, as the direct leg has no cleanup
                        handle.forget()
                    read.clear()
        finally:
            shutdown(llm)
    if tokens["queue"] != tokens["direct"]:
        benchlib.log("warning: the two legs generated different greedy tokens for some prompts")
    queue_ms, direct_ms = times["queue"], times["direct"]
    q50, q99 = statistics.median(queue_ms), percentile(queue_ms, 99)
    d50, d99 = statistics.median(direct_ms), percentile(direct_ms, 99)
    record = {
        "bench": "latency",
        "queue_p50_ms": round(q50, 2),
        "queue_p99_ms": round(q99, 2),
        "direct_p50_ms": round(d50, 2),
        "direct_p99_ms": round(d99, 2),
        "added_p50_ms": round(q50 - d50, 2),
        "added_p99_ms": round(q99 - d99, 2),
        "ratio_p50": round(q50 / d50, 3),
        "first_tasks_ms": [round(ms, 1) for ms in first_ms],
        "first_over_tenth": round(first_ms[0] / first_ms[-1], 2),
        "producer_first_apply_async_ms": round(producer_first_ms, 1),
        "iterations": args.iterations,
        "input_len": args.input_len,
        "max_tokens": args.max_tokens,
    }
    if args.trace:
        record.update(trace_summary(traces[warmup:], apply_ms[warmup:]))
        # Where the first task's extra time goes (the warm-up's target), beside the tenth's.
        for label, at in (("first", 0), ("tenth", warmup - 1)):
            record[f"{label}_task_phases_ms"] = {
                name: round(ms, 2) for name, ms in trace.phases_ms(traces[at]).items()}
            record[f"{label}_task_apply_async_ms"] = round(apply_ms[at], 2)
    benchlib.emit(record, args)


def trace_summary(traces: list[dict[str, float]], apply_ms: list[float]) -> dict[str, Any]:
    """Each phase's p50 and p99 over the traced tasks (``tasks.trace``), in path order."""
    by_phase: dict[str, list[float]] = {}
    out_of_order = 0
    for one in traces:
        out_of_order += bool(trace.in_order(one))
        for name, ms in trace.phases_ms(one).items():
            by_phase.setdefault(name, []).append(ms)
    if out_of_order:
        benchlib.log(f"warning: {out_of_order} of {len(traces)} traces have stamps out of order")
    order = [*trace.PHASES, "total", "outside_engine"]
    phases = {name: by_phase[name] for name in order if len(by_phase.get(name, [])) >= 2}
    return {
        "trace": True,
        "phases_p50_ms": {name: round(statistics.median(v), 2) for name, v in phases.items()},
        "phases_p99_ms": {name: round(percentile(v, 99), 2) for name, v in phases.items()},
        "apply_async_p50_ms": round(statistics.median(apply_ms), 2),
        "traces_out_of_order": out_of_order,
    }


if __name__ == "__main__":
    main()
