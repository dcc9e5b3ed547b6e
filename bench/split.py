"""Latency a split adds: one big call split into parts vs the same call as one task.

The same prompts go to one worker both ways, alternating round by round
after a warm-up round of each: as one ``generate`` task (RQ_TASK_MAX_PROMPTS at
the call's size) and split into parts of at most ``--max-prompts``
(``tasks.split``), timed from ``apply_async`` until ``.get()`` returns the
joined result. Greedy, so both legs must generate the same tokens.

    .venv/bin/python bench/split.py                          # CPU: tiny model, 256 prompts, parts of 128
    .venv/bin/python bench/split.py --max-prompts 32         # 8 parts
    python bench/split.py --device cuda --model PATH

Prints one JSON line: medians of both legs, added_ms, ratio (split / one task),
and the fastest round of each (ratio_min). In a worktree whose venv installs
another checkout, run it with PYTHONPATH=. so this tree's tasks/ is used.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import benchlib

from rollout_queue.tasks.app import configure, settings
from rollout_queue.tasks.generate import generate
from rollout_queue.tasks.schemas import SamplingParams
from rollout_queue.tasks.split import SplitResult

DEFAULTS = {"cpu": {"prompts": 256, "input_len": 32, "max_tokens": 32, "rounds": 5},
            "cuda": {"prompts": 1024, "input_len": 128, "max_tokens": 256, "rounds": 5}}


def main() -> None:
    p = benchlib.parser(__doc__)
    p.add_argument("--prompts", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--max-prompts", type=int, default=None,
                   help="RQ_TASK_MAX_PROMPTS of the split leg (default: the setting's default)")
    args = p.parse_args()
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args = benchlib.resolve(args)
    engine = benchlib.engine_settings(args)
    prompts = benchlib.token_prompts(args.model, args.prompts, args.input_len, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {"one_task": [], "split": []}
    tokens: dict[str, list[Any]] = {"one_task": [], "split": []}
    parts = 0

    with benchlib.queue_stack(args, engine, max_inflight=8) as stack:
        base = settings()
        limits = {"one_task": len(prompts), "split": args.max_prompts or base.task_max_prompts}

        def call(leg: str) -> tuple[float, list[Any]]:
            nonlocal parts
            configure(base.model_copy(update={"task_max_prompts": limits[leg]}))
            time.sleep(benchlib.IDLE_S)
            began = time.perf_counter()
            handle = generate.apply_async((prompts, params), queue=stack.queue)
            result: dict[str, Any] = handle.get(timeout=900)
            elapsed = time.perf_counter() - began
            if isinstance(handle, SplitResult):
                parts = len(handle.results)
            handle.forget()
            return elapsed, [s["token_ids"] for o in result["outputs"] for s in o["samples"]]

        for round_ in range(args.rounds + 1):  # round 0 warms both legs up
            for leg in (("one_task", "split") if round_ % 2 else ("split", "one_task")):
                elapsed, out = call(leg)
                benchlib.log(f"round {round_} {leg}: {elapsed:.3f} s")
                if round_:
                    times[leg].append(elapsed * 1000)
                    tokens[leg].append(out)
        configure(base)
    if tokens["one_task"] != tokens["split"]:
        benchlib.log("warning: the two legs generated different greedy tokens")
    one, split = statistics.median(times["one_task"]), statistics.median(times["split"])
    record = {
        "bench": "split",
        "one_task_ms": round(one, 1),
        "split_ms": round(split, 1),
        "added_ms": round(split - one, 1),
        "ratio": round(split / one, 3),
        # On a shared machine the medians swing with other load; the fastest
        # round of each leg is the less disturbed comparison.
        "one_task_min_ms": round(min(times["one_task"]), 1),
        "split_min_ms": round(min(times["split"]), 1),
        "ratio_min": round(min(times["split"]) / min(times["one_task"]), 3),
        "parts": parts,
        "max_prompts": limits["split"],
        "prompts": args.prompts,
        "input_len": args.input_len,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "same_tokens": tokens["one_task"] == tokens["split"],
    }
    benchlib.emit(record, args)


if __name__ == "__main__":
    main()
