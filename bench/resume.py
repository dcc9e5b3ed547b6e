"""What checkpoints cost and what they save: throughput with and without, tokens lost per kill.

One worker, started with ``--checkpoint-tokens K``. The same workload runs
through it with checkpoints off and on in turn (the ``checkpoint_tokens``
engine op switches them between legs; the prefix cache is reset before each
leg; the order alternates; ``--rounds`` of each; medians): one engine, so the
ratio measures the checkpoints, not a difference between two engines (two
engines on one H200, both without checkpoints, differed by 7 %). Then the
worker takes one long task and is killed with ``kill -9`` once every sample
has kept a random share (15-45 %) of its tokens, at a random moment within
the next two checkpoint intervals (so the kill lands mid-task, between two
checkpoints, on a slow machine or a fast one), and restarted under the same
name (it restores its own tasks before consuming anything, the same path as
the reaper's on another node). A long task that ends before its kill (on a
loaded machine a short one's checkpoints can trail its end) is replaced by
another aiming at half the share, up to three (``kill_task.attempts``); one
that ends as its kill lands, the same way, on a restarted worker.

    .venv/bin/python bench/resume.py                     # CPU, tiny model
    python bench/resume.py --device cuda                 # H200: 1,024 x 256-token generations

Prints one JSON line:

- ``tok_s_without`` / ``tok_s_with`` / ``ratio`` (target >= 0.97), and each
  round's ratio (``round_ratios``: the spread);
- ``tokens_lost_per_sample`` (mean, max; target <= K): what the victim had
  generated when it died minus what its checkpoint kept. What it had
  generated is estimated from the checkpoint's growth, polled every 10 ms
  before the kill: its last length plus its rate times the time since;
- ``kept_tokens`` / ``resumed_tokens``: of the long task's samples, generated
  before the kill and kept, and generated after it (a restart would generate both);
- ``resume_s``: from the restarted worker serving until the task's first new
  checkpoint (its prompts and kept tokens prefilled, K more tokens
  generated); ``kill_to_result_s`` adds the restart itself.
"""

from __future__ import annotations

import random
import signal
import statistics
import time
from typing import Any

import benchlib
from pydantic import SecretStr

from rollout_queue.cli.localstack import LocalStack, WorkerSpec
from rollout_queue.tasks import keys
from rollout_queue.tasks.app import configure
from rollout_queue.tasks.control import engine_command
from rollout_queue.tasks.schemas import SamplingParams
from rollout_queue.tasks.settings import ClientSettings
from rollout_queue.workers.engine.progress import read_progress

# Long tasks submitted at most, each killed once checkpointed mid-way (one that ends first is replaced).
KILL_ATTEMPTS = 3
CPU_DEFAULTS = {"prompts": 64, "output_len": 128, "prompts_per_task": 32, "rounds": 3}


def saved_lengths(client: Any, task_id: str) -> dict[str, int]:
    saved = read_progress(client.hgetall(keys.progress_key(task_id)))
    return {f"{prompt}:{sample}": len(progress.token_ids) for (prompt, sample), progress in saved.items()}


def main() -> None:
    p = benchlib.parser(__doc__)
    benchlib.add_workload_args(p)
    p.add_argument("--checkpoint-tokens", type=int, default=64)
    p.add_argument("--stream-interval", type=int,
                   help="vLLM's engine-level --stream-interval for both workers (for a vLLM without "
                        "the per-request one, < 0.32: what checkpoints then cost without per-step outputs)")
    p.add_argument("--kill-prompts", type=int, help="prompts of the killed task (default: 8 CPU, 64 GPU)")
    p.add_argument("--kill-output-len", type=int, help="its max_tokens (default: 512 CPU, 768 GPU)")
    args = p.parse_args()
    if args.device == "cpu":
        for key, value in CPU_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    args = benchlib.resolve(args)
    cuda = args.device == "cuda"
    kill_prompts = args.kill_prompts or (64 if cuda else 8)
    kill_len = args.kill_output_len or (768 if cuda else 512)
    settings = benchlib.engine_settings(args)
    interval = args.checkpoint_tokens
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, logprobs=0)
    rng = random.Random(args.seed)

    def spec(checkpoint_tokens: int) -> WorkerSpec:
        return WorkerSpec(
            model=settings.model, device=settings.device, dtype=settings.dtype,
            max_model_len=max(settings.max_model_len or 0, args.input_len + kill_len + 8),
            max_inflight=256, gpu_memory_utilization=settings.gpu_memory_utilization,
            extra=["--checkpoint-tokens", str(checkpoint_tokens),
                   *(["--stream-interval", str(args.stream_interval)] if args.stream_interval else [])],
            env={"RQ_REGISTRY_TTL_S": "6", "RQ_REAP_GRACE_S": "4"},
        )

    def workload(round_index: int) -> list[list[list[int]]]:
        prompts = benchlib.token_prompts(settings.model, args.prompts, args.input_len,
                                         seed=args.seed + round_index)
        size = args.prompts_per_task
        return [prompts[i:i + size] for i in range(0, len(prompts), size)]

    def leg(checkpoint_tokens: int, round_index: int, tasks: int | None = None) -> float:
        engine_command("checkpoint_tokens", {"tokens": checkpoint_tokens}, workers=[node])
        engine_command("reset_prefix_cache", workers=[node])  # each leg prefills its prompts
        time.sleep(benchlib.IDLE_S)
        chunks = workload(round_index)[:tasks]
        seconds, tokens, _ = benchlib.run_tasks(stack.queue, chunks, params, 3600)
        return tokens / seconds

    client_settings = ClientSettings()
    url = args.redis_url or client_settings.redis_url.get_secret_value()
    with LocalStack(benchlib.ROOT / ".run" / "bench" / "resume", prefix="resume") as stack:
        stack.ensure_redis(url)
        configure(client_settings.model_copy(update={"redis_url": SecretStr(stack.redis_url)}))
        client = stack.client()
        victim = stack.start_worker(spec(interval), index=0, timeout=900)
        node = stack.worker_name(0)
        for tokens in (0, interval):  # warm-up: the engine has run the workload's shapes
            leg(tokens, 99, tasks=1)
        rates: dict[int, list[float]] = {0: [], interval: []}
        for r in range(args.rounds):
            for tokens in ((0, interval) if r % 2 == 0 else (interval, 0)):
                rates[tokens].append(leg(tokens, r))
                benchlib.log(f"round {r} checkpoint_tokens {tokens}: {rates[tokens][-1]:.0f} tok/s")
        without, with_ = statistics.median(rates[0]), statistics.median(rates[interval])
        round_ratios = [round(w / o, 3) for w, o in zip(rates[interval], rates[0], strict=True)]

        # ---- kill -9 of worker 1 mid-task, restart under the same name
        from rollout_queue.tasks.generate import generate

        # The last round ends on its leg without checkpoints when the rounds are even.
        engine_command("checkpoint_tokens", {"tokens": interval}, workers=[node])
        kill_params = params.model_copy(update={"max_tokens": kill_len})

        def until_kill(attempt: int) -> tuple[Any, list[tuple[float, dict[str, int]]]] | None:
            """Submit the long task and return once it is time to kill (its handle and the
            lengths seen), or None when it finished first."""
            prompts = benchlib.token_prompts(settings.model, kill_prompts, args.input_len,
                                             seed=args.seed + 1000 + attempt)
            handle = generate.apply_async((prompts, kill_params), queue=stack.queue)
            history: list[tuple[float, dict[str, int]]] = []
            kill_after: float | None = None
            # Tokens every sample has kept when the kill nears; a retry aims earlier.
            target = max(interval, rng.uniform(0.15, 0.45) * kill_len / 2 ** attempt)
            full: tuple[float, int] | None = None  # when every sample first had a checkpoint, the least kept then
            while True:
                now, lengths = time.monotonic(), saved_lengths(client, handle.id)
                if not history or lengths != history[-1][1]:
                    history.append((now, lengths))
                least = min(lengths.values()) if len(lengths) == kill_prompts else 0
                if least and full is None:
                    full = (now, least)
                if kill_after is None and least >= target:
                    # Seconds per checkpoint interval, from the growth seen since every sample had one
                    # (or since the submit, prefill included, when none was seen).
                    (t0, n0) = full if full is not None and least > full[1] else (history[0][0], 0)
                    per_interval = (now - t0) * interval / (least - n0)
                    kill_after = now + rng.uniform(0.0, 2.0) * per_interval
                if kill_after is not None and now >= kill_after:
                    return handle, history
                if handle.ready():
                    return None
                time.sleep(0.01)

        def restart() -> Any:
            """Worker 0 again, under the same name. The dead worker's registry entry says
            "serving" until its TTL ends: only then can the new one's be told from it."""
            while client.exists(keys.worker_key(node)):
                time.sleep(0.1)
            return stack.start_worker(spec(interval), index=0, timeout=900)

        # On a loaded machine the checkpoints of a short task can trail its end (the
        # worker's writer thread starved): the task then finishes before the kill, or
        # as it lands (its checkpoints gone with its stored result).
        for attempt in range(KILL_ATTEMPTS):
            running = until_kill(attempt)
            if running is None:
                benchlib.log(f"the kill task finished before the kill (attempt {attempt + 1}); again, aiming earlier")
                continue
            handle, history = running
            killed_at = time.monotonic()
            victim.kill(signal.SIGKILL)
            stack.stop_worker(victim)
            kept = saved_lengths(client, handle.id)
            if kept and not handle.ready():
                break
            benchlib.log(f"the kill task finished as the kill landed (attempt {attempt + 1}); again on a restarted "
                         "worker, aiming earlier")
            victim = restart()
        else:
            raise SystemExit(f"the task finished before the kill {KILL_ATTEMPTS} times: raise --kill-output-len")
        lost = []
        for name, length in kept.items():
            # From the first full interval on: a request's first output (1 token) is saved
            # with the first write of another sample, and would inflate the rate.
            changes = [(t, lens[name]) for t, lens in history if lens.get(name, 0) >= interval] or [(killed_at, length)]
            (t0, n0), (t1, n1) = changes[0], changes[-1]
            rate = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
            lost.append(max(0.0, min(kill_len - length, rate * (killed_at - t1))))
        restart()
        serving_at = time.monotonic()
        first_new: float | None = None
        while not handle.ready():
            if first_new is None and any(n > kept.get(k, 0) for k, n in saved_lengths(client, handle.id).items()):
                first_new = time.monotonic()
            time.sleep(0.01)
        result = handle.get(timeout=3600)
        done_at = time.monotonic()
        resumed = sum(len(s["token_ids"]) for o in result["outputs"] for s in o["samples"]) - sum(kept.values())
        full = kill_prompts * kill_len
    benchlib.emit(
        {
            "bench": "resume",
            "checkpoint_tokens": interval, "stream_interval": args.stream_interval,
            "prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len,
            "rounds": args.rounds,
            "tok_s_without": round(without, 1),
            "tok_s_with": round(with_, 1),
            "ratio": round(with_ / without, 3),
            "round_ratios": round_ratios,
            "kill_task": {"prompts": kill_prompts, "max_tokens": kill_len, "attempts": attempt + 1},
            "tokens_lost_per_sample": {"mean": round(statistics.mean(lost), 1), "max": round(max(lost), 1)},
            "kept_tokens": sum(kept.values()),
            "resumed_tokens": resumed,
            "restart_would_generate": full,
            "resume_s": None if first_new is None else round(first_new - serving_at, 2),
            "kill_to_result_s": round(done_at - killed_at, 1),
            "result_workers": sorted({w for o in result["outputs"] for s in o["samples"] for _, w in s["workers"]}),
        },
        args,
    )


if __name__ == "__main__":
    main()
