"""Two engines sharing one device (a worker pair, the memory split) against one engine alone.

A small model leaves the GPU idle between scheduler steps (the step's
Python work: scheduling, sampling bookkeeping, outputs), so a second engine
on the same GPU may fill those gaps. Both configurations serve the same
queue workload (``--prompts`` split into tasks of ``--prompts-per-task``):

- ``one``:  one worker given ``--gpu-memory-utilization`` of the device;
- ``pair``: two workers on the same queue and device, half of it each, each
  taking at most half of the tasks at once (``--max-inflight``), so the
  load splits evenly.

Each round starts a configuration afresh, warms every engine (through each
worker's own queue), measures it ``--repeats`` times and stops it; the
order reverses every round. ``ratio`` is pair / one (median tok/s).

    .venv/bin/python bench/shared_gpu.py                   # CPU: tiny model (two engines on the cores)
    python bench/shared_gpu.py --device cuda               # GPU: qwen2-0.5b shape (~4 min on an H200)
    .venv/bin/python bench/shared_gpu.py --smoke           # CPU, a few prompts: the JSON line only

Prints one JSON line: one_tok_s, pair_tok_s, ratio, per-worker task counts, ...
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import benchlib

from rollout_queue.cli.localstack import LocalStack
from rollout_queue.tasks.schemas import SamplingParams

# The memory of the one engine; each engine of the pair gets half.
MEMORY = {"cpu": 0.1, "cuda": 0.8}
SMOKE = {"prompts": 8, "input_len": 16, "output_len": 8, "prompts_per_task": 2, "rounds": 1, "repeats": 1}
CONFIGS = {"one": 1, "pair": 2}  # engines per configuration


def main() -> None:
    p = benchlib.parser(__doc__)
    benchlib.add_workload_args(p)
    p.add_argument("--repeats", type=int, default=2, help="measured runs per configuration per round")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--smoke", action="store_true", help="a few short prompts, one round: a quick check")
    args = p.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = MEMORY[args.device]
    args = benchlib.resolve(args)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    tasks = -(-args.prompts // args.prompts_per_task)
    if tasks < 2:
        raise SystemExit(f"{args.prompts} prompts make {tasks} task: the pair needs at least 2 tasks")

    runs: dict[str, list[float]] = {name: [] for name in CONFIGS}
    served: dict[str, list[int]] = {}
    order = list(CONFIGS)
    for round_ in range(args.rounds):
        for name in order:
            benchlib.wait_for_free_device(args.device)  # the configuration before has let go of its memory
            started = time.monotonic()
            values, counts = measure(args, CONFIGS[name], round_, params)
            runs[name] += values
            served[name] = counts
            benchlib.log(f"round {round_ + 1} {name}: {', '.join(f'{v:.0f}' for v in values)} tok/s "
                         f"({time.monotonic() - started:.0f} s with its start)")
        order.reverse()
    tok_s = {name: statistics.median(values) for name, values in runs.items()}
    record: dict[str, Any] = {
        "bench": "shared_gpu",
        "one_tok_s": round(tok_s["one"], 1),
        "pair_tok_s": round(tok_s["pair"], 1),
        "ratio": round(tok_s["pair"] / tok_s["one"], 3),
        "runs_tok_s": {name: [round(v, 1) for v in values] for name, values in runs.items()},
        "pair_tasks_per_worker": served["pair"],  # of the last measured run: the split of the load
        "gpu_memory_utilization": {"one": args.gpu_memory_utilization,
                                   "pair_each": round(args.gpu_memory_utilization / 2, 3)},
        "prompts": args.prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "tasks": tasks,
        "repeats": args.repeats,
        "rounds": args.rounds,
    }
    benchlib.emit(record, args)


def measure(args: Any, engines: int, round_: int, params: SamplingParams) -> tuple[list[float], list[int]]:
    """Start ``engines`` workers sharing the device, warm each, measure ``--repeats`` runs, stop them.

    Returns tok/s of each run and how many tasks each worker served in the last."""
    settings = benchlib.engine_settings(args)
    settings = settings.model_copy(update={"gpu_memory_utilization": args.gpu_memory_utilization / engines})
    tasks = -(-args.prompts // args.prompts_per_task)
    # Each worker holds at most its share of the tasks: one worker never takes the pair's whole load.
    spec = benchlib.worker_spec(settings, max_inflight=-(-tasks // engines))
    per_task = args.prompts_per_task
    warm = benchlib.token_prompts(args.model, max(min(args.prompts, 64), args.prompts // 4), args.input_len,
                                  args.seed + 10_000)
    values: list[float] = []
    counts: list[int] = []
    with LocalStack(benchlib.ROOT / ".run" / "bench" / "shared", prefix="shared") as stack:
        benchlib.connect(args, stack)
        for index in range(engines):
            started = time.monotonic()
            # One after the other: an engine sizes its KV cache from the memory free when it starts.
            stack.start_worker(spec, index=index, timeout=900)
            benchlib.log(f"worker {index + 1}/{engines} serving after {time.monotonic() - started:.0f} s")
        for index in range(engines):  # each engine's first batches, through its own queue
            benchlib.run_tasks(f"{stack.queue}-w{index}", chunked(warm, per_task), params, 3600)
        for k in range(args.repeats):
            prompts = benchlib.token_prompts(args.model, args.prompts, args.input_len,
                                             args.seed + round_ * args.repeats + k)
            time.sleep(benchlib.IDLE_S)
            seconds, tokens, by_worker = benchlib.run_tasks_by_worker(stack.queue, chunked(prompts, per_task),
                                                                      params, 3600)
            if tokens != args.prompts * args.output_len:
                raise SystemExit(f"{engines} engine(s) generated {tokens} tokens, "
                                 f"expected {args.prompts * args.output_len}")
            values.append(tokens / seconds)
            counts = sorted(by_worker.values(), reverse=True)
    return values, counts


def chunked(prompts: list[list[int]], per_task: int) -> list[list[list[int]]]:
    return [prompts[i : i + per_task] for i in range(0, len(prompts), per_task)]


if __name__ == "__main__":
    main()
