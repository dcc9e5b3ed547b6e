"""Throughput of two workers vs one, through the same queue, in one run.

One worker (GPU 0) serves the workload; a second worker (GPU 1) joins the
same queue and the same workload runs again. Tasks are small enough
(``--prompts-per-task``) that both workers get work.

    .venv/bin/python bench/scaling.py                      # CPU: expect little from 2 cores
    python bench/scaling.py --device cuda --model PATH     # two GPUs

Prints one JSON line: one_worker_tok_s, two_workers_tok_s, ratio.
"""

from __future__ import annotations

import benchlib
from pydantic import SecretStr

from tasks.app import configure
from tasks.schemas import SamplingParams
from tasks.settings import ClientSettings
from workers.localstack import LocalStack, WorkerSpec


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

    def workload(round_index: int) -> list[list[list[int]]]:
        prompts = benchlib.token_prompts(settings.model, args.prompts, args.input_len,
                                         seed=args.seed + round_index)
        size = args.prompts_per_task
        return [prompts[i:i + size] for i in range(0, len(prompts), size)]

    client = ClientSettings()
    url = args.redis_url or client.redis_url.get_secret_value()
    with LocalStack(benchlib.ROOT / ".run" / "bench", prefix="scaling") as stack:
        stack.ensure_redis(url)
        configure(client.model_copy(update={"redis_url": SecretStr(stack.redis_url)}))
        stack.start_worker(spec(0), index=0, timeout=900)
        benchlib.run_tasks(stack.queue, workload(99)[:2], params, 3600)  # warm-up
        one = [benchlib.run_tasks(stack.queue, workload(r), params, 3600) for r in range(args.rounds)]
        stack.start_worker(spec(1), index=1, timeout=900)
        benchlib.run_tasks(stack.queue, workload(98)[:4], params, 3600)  # warm-up
        two = [benchlib.run_tasks(stack.queue, workload(r), params, 3600) for r in range(args.rounds)]
    best_one = max(tokens / seconds for seconds, tokens, _ in one)
    best_two = max(tokens / seconds for seconds, tokens, _ in two)
    benchlib.emit(
        {
            "bench": "scaling",
            "prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len,
            "one_worker_tok_s": round(best_one, 1),
            "two_workers_tok_s": round(best_two, 1),
            "ratio": round(best_two / best_one, 3),
            "workers_used": sorted({w for _, _, ws in two for w in ws}),
        },
        args,
    )


if __name__ == "__main__":
    main()
