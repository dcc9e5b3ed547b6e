"""Every bench in bench/ runs at a smoke size (seconds, the tiny model, one
round) and prints its JSON line: a bench that rots fails the suite.

The benches that send to one worker (``benchlib.queue_stack``) share the
session's ``gen_worker`` (the bench's default model is its model:
``RQ_BENCH_QUEUE``); those that start workers of their own (two for scaling
and sessions, a killed one for resume, a dummy-weight one for the weight
transfer) or none do so at their smallest, their CPU workers forked from the
session's zygote (``RQ_LOCAL_ZYGOTE``: ``cli.zygote``) as the suite's are.
The bench processes themselves are forked from it too (``python bench/X.py``
run as the interpreter would, torch and vLLM imported already): the module
took 209 s run from fresh interpreters, 158 s forked (quiet, one run each).

``examples/trl_grpo.py`` (TRL's GRPOTrainer against a stack of its own) runs
beside them, for two steps.

They run two at a time (``LANES``), longest first, from one module fixture;
each bench's test waits for its own run. A bench spends most of a smoke run
starting engines (imports, single-threaded), so two side by side take about
half the time of one after the other on two cores. Nothing is shared between
two running benches but the Redis database and the shared worker: each bench
that starts workers has its own pool, queue and log folder.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psutil
import pytest

from rollout_queue.cli.zygote import Zygote
from rollout_queue.tasks.settings import redis_url_env
from tests.conftest import CONTROL_SECRET, zygote_env
from tests.procs import ROOT, Proc, python

# bench file -> (smoke flags, whether it sends to the shared worker)
BENCHES: dict[str, tuple[list[str], bool]] = {
    "colocated.py": (["--device", "cpu", "--shapes", "qwen2-tiny", "--iters", "1", "--bucket-mib", "1"], False),
    "control_plane.py": (["--workers", "4", "--processes", "1", "--rounds", "1", "--tasks", "8",
                          "--idle-s", "0.5", "--lifetime", "120", "--sweep-keys", "0", "1000"], False),
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
                   "--kill-output-len", "256"], False),
    "scaling.py": (["--prompts", "8", "--input-len", "8", "--output-len", "4", "--prompts-per-task", "4",
                    "--rounds", "1"], False),
    "shared_gpu.py": (["--smoke"], False),
    "sessions.py": (["--sessions", "2", "--turns", "2", "--max-tokens", "2", "--rounds", "1"], False),
    "weight_transfer.py": (["--shape", "qwen2-tiny", "--iters", "1"], False),
}
BENCH_TIMEOUT_S = 600
LANES = 2
# The examples no other test runs, in the same lanes (examples/grpo.py: tests/test_rl_loop.py):
# TRL's GRPOTrainer against a stack of its own (two workers and a gateway), two steps.
EXAMPLES: dict[str, list[str]] = {
    "trl_grpo.py": ["--steps", "2", "--workers", "2", "--log-dir", str(ROOT / ".run" / "examples" / "trl-grpo")],
}
# Started first, longest first, so the lanes end together: each smoke run's seconds
# measured 2026-12-05 (workers forked from the zygote, load 3-4): resume 70, shared_gpu 55,
# streaming 40, latency 39, scaling 32, sessions 30, trl_grpo 28, throughput 25,
# weight_transfer 21, sync_pattern 19; the others 15 s or less each. (Resume's kill by
# tokens since: 118 -> 84 s in a fresh-clone suite run; still the longest.)
LONGEST = ["resume.py", "shared_gpu.py", "streaming.py", "latency.py", "scaling.py", "sessions.py",
           "trl_grpo.py", "throughput.py", "weight_transfer.py", "sync_pattern.py"]


def test_every_bench_in_bench_has_a_smoke_run() -> None:
    benches = {p.name for p in (ROOT / "bench").glob("*.py")} - {"benchlib.py", "_raw_peer.py"}
    assert benches == set(BENCHES)


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


def run_bench(bench: str, flags: list[str], env: dict[str, str], folder: str = "bench",
              zygote: Zygote | None = None) -> tuple[int | None, str]:
    """Run ``folder/bench`` to its end (or ``BENCH_TIMEOUT_S``), forked from ``zygote`` when
    given (torch and vLLM imported already); its exit code and this run's log."""
    proc = Proc(f"{folder}-{bench.removesuffix('.py')}", [python(), str(ROOT / folder / bench), *flags], env,
                zygote=zygote)
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


@pytest.fixture(scope="module")
def bench_runs(
    redis_url: str, gen_worker: Proc, zygote: Callable[[], Zygote | None]
) -> Iterator[dict[str, Future[tuple[int | None, str]]]]:
    """Every bench's smoke run, started ``LANES`` at a time; by bench, its exit code and log."""
    # The workers a bench starts serve without a warm-up: a smoke run's figures do not matter.
    # Their CPU workers are forked from the suite's zygote, as the suite's are.
    env = {**redis_url_env(redis_url), "RQ_WEIGHT_SYNC_SECRET": CONTROL_SECRET, "RQ_SKIP_WARM_UP": "1",
           **zygote_env(zygote)}
    order = LONGEST + sorted((set(BENCHES) | set(EXAMPLES)) - set(LONGEST))
    forks = zygote()
    with ThreadPoolExecutor(LANES, thread_name_prefix="bench-smoke") as lanes:
        runs = {}
        for name in order:
            if name in EXAMPLES:
                runs[name] = lanes.submit(run_bench, name, EXAMPLES[name], env, "examples", forks)
                continue
            flags, shared = BENCHES[name]
            bench_env = {**env, "RQ_BENCH_QUEUE": "generate"} if shared else env
            runs[name] = lanes.submit(run_bench, name, flags, bench_env, "bench", forks)
        try:
            yield runs
        finally:
            for run in runs.values():
                run.cancel()  # those not started (a failed module); the running ones end at their timeout


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_the_bench_runs_at_smoke_size_and_prints_its_json_line(
    bench: str, bench_runs: dict[str, Future[tuple[int | None, str]]]
) -> None:
    assert_ran_with_a_json_line(f"bench/{bench}", bench_runs[bench])


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_example_runs_to_its_end_and_prints_its_json_line(
    example: str, bench_runs: dict[str, Future[tuple[int | None, str]]]
) -> None:
    assert_ran_with_a_json_line(f"examples/{example}", bench_runs[example])


def assert_ran_with_a_json_line(script: str, run: Future[tuple[int | None, str]]) -> None:
    code, log = run.result()
    tail = "\n".join(log.splitlines()[-30:])
    assert code == 0, f"{script} exited with {code}:\n{tail}"
    assert json_lines(log), f"{script} printed no JSON line:\n{tail}"


def bench_record(run: Future[tuple[int | None, str]], bench: str) -> dict[str, Any]:
    """The one JSON line of ``bench`` its smoke run printed, once it exited 0."""
    code, log = run.result()
    assert code == 0, "\n".join(log.splitlines()[-30:])
    (record,) = [line for line in json_lines(log) if line.get("bench") == bench]
    return record


def test_the_latency_smoke_run_breaks_the_queue_leg_down_by_phase(
    bench_runs: dict[str, Future[tuple[int | None, str]]]
) -> None:
    from rollout_queue.tasks.trace import PHASES

    record = bench_record(bench_runs["latency.py"], "latency")
    assert list(record["phases_p50_ms"]) == [*PHASES, "total", "outside_engine"]
    assert record["traces_out_of_order"] == 0
    # The worker's first tasks after it said it serves: the warm-up's figure.
    assert len(record["first_tasks_ms"]) == 10 and all(ms > 0 for ms in record["first_tasks_ms"])
    # From the unrounded times: the rounded ones give it to within a rounding step.
    first, tenth = record["first_tasks_ms"][0], record["first_tasks_ms"][-1]
    assert record["first_over_tenth"] == pytest.approx(first / tenth, rel=0.02, abs=0.01)
    # The producer's own first call is warmed and reported apart; the first and
    # tenth tasks' phases say where the first one's extra time went.
    assert record["producer_first_apply_async_ms"] > 0
    assert list(record["first_task_phases_ms"]) == list(record["tenth_task_phases_ms"]) == [
        *PHASES, "total", "outside_engine"]


def test_the_control_plane_smoke_run_times_a_sweep_by_the_ledger_index_and_by_a_walk_of_the_keyspace(
    bench_runs: dict[str, Future[tuple[int | None, str]]]
) -> None:
    sweeps = bench_record(bench_runs["control_plane.py"], "control_plane")["sweep_ms"]
    assert isinstance(sweeps, dict) and list(sweeps) == ["0", "1000"]
    assert all(set(timings) == {"index", "scan"} and min(timings.values()) > 0 for timings in sweeps.values())
