"""Throughput of two workers vs one, through the same queue, in one run.

One worker (GPU 0) serves the workload; a second worker (GPU 1) joins the
same queue and the same workload runs again. Tasks are small enough
(``--prompts-per-task``) that both workers get work.

    .venv/bin/python bench/scaling.py                      # CPU: expect little from 2 cores
    python bench/scaling.py --device cuda --model PATH     # two GPUs

Each leg runs a warm-up that reaches every worker it has (a task per
worker through the worker's own queue), then ``--rounds`` measured rounds
(at least 3); figures are medians. The two-worker leg reports each worker's
share of the tasks and of the generated tokens (workers take tasks by engine
room: ``workers/queue/intake.py``).

Prints one JSON line: one_worker_tok_s, two_workers_tok_s, ratio (medians),
the best rounds, and shares.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

import benchlib
from pydantic import SecretStr

from rollout_queue.cli.localstack import LocalStack, WorkerSpec
from rollout_queue.tasks.app import configure
from rollout_queue.tasks.schemas import SamplingParams
from rollout_queue.tasks.settings import ClientSettings


def main() -> None:
    p = benchlib.parser(__doc__)
    benchlib.add_workload_args(p)
    args = benchlib.resolve(p.parse_args())
    settings = benchlib.engine_settings(args)
    cuda = args.device == "cuda"
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)

    def spec(index: int) -> WorkerSpec:
        return WorkerSpec(
            model=settings.model, device=settings.device, dtype=settings.dtype,
            max_model_len=settings.max_model_len or 0, max_inflight=256,
            gpu_memory_utilization=0.85 if cuda else settings.gpu_memory_utilization,
            env={"CUDA_VISIBLE_DEVICES": str(index)} if cuda else {},
        )

    def run_round(chunks: list[list[list[int]]], queue: str) -> tuple[float, dict[str, list[int]]]:
        """Seconds for every chunk; per worker, the tokens of each task it served."""
        from rollout_queue.tasks.generate import generate

        started = time.perf_counter()
        handles = [generate.apply_async((chunk, params), queue=queue) for chunk in chunks]
        served: dict[str, list[int]] = collections.defaultdict(list)
        for handle in handles:
            result = handle.get(timeout=3600)
            handle.forget()
            served[result["worker"]].append(result["usage"]["completion_tokens"])
        return time.perf_counter() - started, served

    def warm(workers: int) -> None:
        """A task through each worker's own queue (``<queue>-w<i>``): every engine warm."""
        from rollout_queue.tasks.generate import generate

        chunks = workload(99)[:workers]
        handles = [generate.apply_async((chunk, params), queue=f"{stack.queue}-w{i}")
                   for i, chunk in enumerate(chunks)]
        for handle in handles:
            handle.get(timeout=3600)

    def leg(workers: int) -> dict[str, Any]:
        warm(workers)
        rounds = [run_round(workload(r), stack.queue) for r in range(max(3, args.rounds))]
        rates = [sum(map(sum, served.values())) / seconds for seconds, served in rounds]
        tasks: collections.Counter[str] = collections.Counter()
        tokens: collections.Counter[str] = collections.Counter()
        for _, served in rounds:
            for node, counts in served.items():
                tasks[node] += len(counts)
                tokens[node] += sum(counts)
        return {
            "tok_s": statistics.median(rates), "best_tok_s": max(rates),
            "task_share": {n: round(c / sum(tasks.values()), 3) for n, c in sorted(tasks.items())},
            "token_share": {n: round(c / sum(tokens.values()), 3) for n, c in sorted(tokens.items())},
        }

    def workload(round_index: int) -> list[list[list[int]]]:
        prompts = benchlib.token_prompts(settings.model, args.prompts, args.input_len,
                                         seed=args.seed + round_index)
        size = args.prompts_per_task
        return [prompts[i:i + size] for i in range(0, len(prompts), size)]

    client = ClientSettings()
    url = args.redis_url or client.redis_url.get_secret_value()
    with LocalStack(benchlib.ROOT / ".run" / "bench" / "scaling", prefix="scaling") as stack:
        stack.ensure_redis(url)
        configure(client.model_copy(update={"redis_url": SecretStr(stack.redis_url)}))
        stack.start_worker(spec(0), index=0, timeout=900)
        one = leg(1)
        stack.start_worker(spec(1), index=1, timeout=900)
        two = leg(2)
    benchlib.emit(
        {
            "bench": "scaling",
            "prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len,
            "rounds": max(3, args.rounds),
            "one_worker_tok_s": round(one["tok_s"], 1),
            "two_workers_tok_s": round(two["tok_s"], 1),
            "ratio": round(two["tok_s"] / one["tok_s"], 3),
            "ratio_best": round(two["best_tok_s"] / one["best_tok_s"], 3),
            "task_share": two["task_share"], "token_share": two["token_share"],
        },
        args,
    )


if __name__ == "__main__":
    main()
