"""Generation throughput through the queue vs vLLM's offline ``LLM.generate``.

Same engine config (``EngineSettings`` → ``engine_kwargs``), same token-id
prompts, same sampling params (``ignore_eos``: every prompt generates exactly
``--output-len`` tokens), in one run: one worker serves the queue leg while an
offline ``LLM`` in this process serves the baseline leg; the legs alternate
for ``--rounds`` rounds (which goes first alternates); the ratio is of the
median rounds (``ratio_best``: of the best rounds).

    .venv/bin/python bench/throughput.py                       # CPU: tiny model, 256 prompts x 64 tokens
    python bench/throughput.py --device cuda --model PATH      # GPU: 1024 prompts x (128 in, 256 out)

Prints one JSON line: queue_tok_s, offline_tok_s, ratio (queue / offline), ...
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import benchlib

from rollout_queue.tasks.schemas import SamplingParams


def queue_leg(stack: Any, chunks: list[list[list[int]]], params: SamplingParams, timeout: float) -> tuple[float, int]:
    """All tasks enqueued at once; seconds until the last result is back, and tokens."""
    seconds, tokens, _ = benchlib.run_tasks(stack.queue, chunks, params, timeout)
    return seconds, tokens


def offline_leg(llm: Any, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    from vllm.inputs import TokensPrompt

    from rollout_queue.workers.engine.host import to_vllm_params

    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    started = time.perf_counter()
    outputs = llm.generate(inputs, to_vllm_params(params), use_tqdm=False)
    seconds = time.perf_counter() - started
    return seconds, sum(len(c.token_ids) for out in outputs for c in out.outputs)


def main() -> None:
    p = benchlib.parser(__doc__)
    benchlib.add_workload_args(p)
    p.add_argument("--temperature", type=float, default=1.0)
    args = benchlib.resolve(p.parse_args())
    settings = benchlib.engine_settings(args)
    # Fresh prompts each round (the same for both legs): no leg reuses its own prefix cache.
    warm_prompts, *rounds = (
        benchlib.token_prompts(args.model, args.prompts, args.input_len, args.seed + r)
        for r in range(args.rounds + 1)
    )
    per_task = args.prompts_per_task
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    expected = args.prompts * args.output_len

    from rollout_queue.cli.offline import offline_llm, shutdown

    runs: dict[str, list[float]] = {"queue": [], "offline": []}
    tasks = -(-args.prompts // per_task)
    with benchlib.queue_stack(args, settings, max_inflight=tasks) as stack:
        llm = offline_llm(settings)
        try:
            # Warm-up at full size: the first batches of a new shape are slow on both legs.
            warm_chunks = [warm_prompts[i : i + per_task] for i in range(0, len(warm_prompts), per_task)]
            queue_leg(stack, warm_chunks, params, timeout=3600)
            offline_leg(llm, warm_prompts, params)
            for round_, prompts in enumerate(rounds):
                chunks = [prompts[i : i + per_task] for i in range(0, len(prompts), per_task)]
                # Alternate which leg goes first: load that drifts hits both alike.
                for leg in ("queue", "offline") if round_ % 2 == 0 else ("offline", "queue"):
                    time.sleep(benchlib.IDLE_S)
                    if leg == "queue":
                        seconds, tokens = queue_leg(stack, chunks, params, timeout=3600)
                    else:
                        seconds, tokens = offline_leg(llm, prompts, params)
                    if tokens != expected:
                        raise SystemExit(f"{leg} leg generated {tokens} tokens, expected {expected}")
                    runs[leg].append(tokens / seconds)
                    benchlib.log(f"round {round_ + 1} {leg}: {tokens / seconds:.0f} tok/s ({seconds:.1f} s)")
        finally:
            shutdown(llm)
    # Medians: robust to a round that other work on the machine slowed down.
    queue_tok_s, offline_tok_s = statistics.median(runs["queue"]), statistics.median(runs["offline"])
    record: dict[str, Any] = {
        "bench": "throughput",
        "queue_tok_s": round(queue_tok_s, 1),
        "offline_tok_s": round(offline_tok_s, 1),
        "ratio": round(queue_tok_s / offline_tok_s, 3),
        "ratio_best": round(max(runs["queue"]) / max(runs["offline"]), 3),
        "runs_tok_s": {leg: [round(v, 1) for v in values] for leg, values in runs.items()},
        "prompts": args.prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "tasks": tasks,
        "temperature": args.temperature,
    }
    benchlib.emit(record, args)


if __name__ == "__main__":
    main()
