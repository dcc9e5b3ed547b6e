"""The benches' smoke runs (``tests/test_bench_smoke.py``): what each runs, and
where it runs.

Every bench in bench/ runs at a smoke size (seconds, the tiny model, one
round). Those that send to one worker (``benchlib.queue_stack``) share the
session's ``gen_worker`` (``RQ_BENCH_QUEUE``); they run in the bench module,
last in the session (``conftest.pytest_collection_modifyitems``), two at a
time. Those that start workers of their own (two for scaling and sessions, a
killed one for resume, a dummy-weight one for the weight transfer) or none,
and the example, share nothing with the other tests but the Redis database
(each has its own pool, queue and log folder): they run one at a time in a
lane of their own beside the whole suite, from its first test on
(``conftest.early_smoke_runs``). The suite's other tests leave about one of
the two cores idle on average (their time goes to engines starting and
tasks waiting), which that lane takes; the bench module then waits only for
the shared worker's benches and whatever the lane has left.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import psutil

from rollout_queue.cli.zygote import ADDRESS_ENV as ZYGOTE_ENV
from rollout_queue.cli.zygote import Zygote
from rollout_queue.tasks.settings import redis_url_env
from tests.procs import ROOT, Proc, python

# bench file -> (smoke flags, whether it sends to the shared worker)
BENCHES: dict[str, tuple[list[str], bool]] = {
    "colocated.py": (["--device", "cpu", "--shapes", "qwen2-tiny", "--iters", "1", "--bucket-mib", "1"], False),
    "control_plane.py": (["--workers", "4", "--processes", "1", "--rounds", "1", "--tasks", "8",
                          "--idle-s", "0.5", "--lifetime", "120"], False),
    "dedup_check.py": (["--iterations", "5"], False),
    "sync_pattern.py": (["--shape", "qwen2-tiny", "--iters", "2", "--direct-mib", "1"], False),
    "latency.py": (["--iterations", "3", "--input-len", "8", "--max-tokens", "2", "--trace"], True),
    "throughput.py": (["--prompts", "8", "--input-len", "8", "--output-len", "4", "--prompts-per-task", "4",
                       "--rounds", "1"], True),
    "split.py": (["--prompts", "8", "--input-len", "8", "--max-tokens", "2", "--rounds", "1",
                  "--max-prompts", "4"], True),
    "api.py": (["--iterations", "3", "--latency-tokens", "2", "--prompts", "8", "--output-len", "4",
                "--prompts-per-task", "4", "--rounds", "1"], True),
    "streaming.py": (["--iterations", "3", "--latency-tokens", "4", "--input-len", "8", "--prompts", "4",
                      "--output-len", "4", "--rounds", "1"], True),
    "redis_memory.py": (["--tasks", "4", "--prompt-chars", "40", "--max-tokens", "2"], True),
    "resume.py": (["--prompts", "4", "--input-len", "8", "--output-len", "8", "--prompts-per-task", "4",
                   "--rounds", "1", "--checkpoint-tokens", "4", "--kill-prompts", "2",
                   "--kill-output-len", "1536"], False),
    "scaling.py": (["--prompts", "8", "--input-len", "8", "--output-len", "4", "--prompts-per-task", "4",
                    "--rounds", "1"], False),
    "shared_gpu.py": (["--smoke"], False),
    "sessions.py": (["--sessions", "2", "--turns", "2", "--max-tokens", "2", "--rounds", "1"], False),
    "weight_transfer.py": (["--shape", "qwen2-tiny", "--iters", "1"], False),
}
BENCH_TIMEOUT_S = 600
# The examples no other test runs, in the same lanes (examples/grpo.py: tests/test_rl_loop.py):
# TRL's GRPOTrainer against a stack of its own (two workers and a gateway), two steps.
EXAMPLES: dict[str, list[str]] = {
    "trl_grpo.py": ["--steps", "2", "--workers", "2", "--log-dir", str(ROOT / ".run" / "examples" / "trl-grpo")],
}
# Started first, longest first, so the lanes end together: each smoke run's seconds
# measured 2026-12-05 (workers forked from the zygote, load 3-4): resume 70, shared_gpu 55,
# streaming 40, latency 39, scaling 32, sessions 30, trl_grpo 28, throughput 25,
# weight_transfer 21, sync_pattern 19; the others 15 s or less each.
LONGEST = ["resume.py", "shared_gpu.py", "streaming.py", "latency.py", "scaling.py", "sessions.py",
           "trl_grpo.py", "throughput.py", "weight_transfer.py", "sync_pattern.py"]




def own_workers() -> list[str]:
    """The smoke runs that need no shared worker (benches and examples), longest first."""
    mine = [name for name, (_, shared) in BENCHES.items() if not shared] + list(EXAMPLES)
    return sorted(mine, key=lambda name: (LONGEST.index(name) if name in LONGEST else len(LONGEST), name))


def smoke_env(redis_url: str, control_secret: str, zygote: Callable[[], Zygote | None]) -> dict[str, str]:
    """The environment of every smoke run: the suite's Redis and secret, its zygote."""
    # The workers a bench starts serve without a warm-up: a smoke run's figures do not matter.
    env = {**redis_url_env(redis_url), "RQ_WEIGHT_SYNC_SECRET": control_secret, "RQ_SKIP_WARM_UP": "1"}
    forks = zygote()
    if forks is not None:  # their CPU workers are forked from the suite's zygote, as the suite's are
        env[ZYGOTE_ENV] = forks.address
    return env


def start(lane: ThreadPoolExecutor, name: str, env: dict[str, str]) -> Future[tuple[int | None, str]]:
    """Smoke run ``name`` (a bench or an example) queued on ``lane``."""
    if name in EXAMPLES:
        return lane.submit(run_bench, name, EXAMPLES[name], env, "examples")
    flags, shared = BENCHES[name]
    return lane.submit(run_bench, name, flags, {**env, "RQ_BENCH_QUEUE": "generate"} if shared else env)


def json_lines(text: str) -> list[dict[str, object]]:
    """The JSON objects among a log's lines (the bench's stdout shares the log with its stderr)."""
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                found.append(value)
    return found


def run_bench(bench: str, flags: list[str], env: dict[str, str], folder: str = "bench") -> tuple[int | None, str]:
    """Run ``folder/bench`` to its end (or ``BENCH_TIMEOUT_S``); its exit code and this run's log."""
    proc = Proc(f"{folder}-{bench.removesuffix('.py')}", [python(), str(ROOT / folder / bench), *flags], env)
    try:
        proc.popen.wait(BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Its children run in sessions of their own: stop them as well as its group (the workers
        # forked from the zygote end with the bench's connection to it).
        below = psutil.Process(proc.pid).children(recursive=True)
        proc.stop()
        for child in below:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    finally:
        proc.stop()
    return proc.popen.returncode, proc.this_start_log()
