"""Every bench in bench/ runs at a smoke size (seconds, the tiny model, one
round) and prints its JSON line: a bench that rots fails the suite.

``examples/trl_grpo.py`` (TRL's GRPOTrainer against a stack of its own) runs
beside them, for two steps. What each runs and where: ``tests/bench_smoke.py``
(the runs that start workers of their own go in a lane beside the whole
suite; this module, last in the session, runs the shared worker's benches
and waits for every run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from rollout_queue.cli.zygote import Zygote
from tests.bench_smoke import BENCHES, EXAMPLES, LONGEST, json_lines, smoke_env, start
from tests.conftest import CONTROL_SECRET
from tests.procs import ROOT, Proc


def test_every_bench_in_bench_has_a_smoke_run() -> None:
    benches = {p.name for p in (ROOT / "bench").glob("*.py")} - {"benchlib.py", "_raw_peer.py"}
    assert benches == set(BENCHES)


SHARED_LANES = 2  # the shared worker's benches, at the end of the session


@pytest.fixture(scope="module")
def bench_runs(
    redis_url: str, gen_worker: Proc, zygote: Callable[[], Zygote | None],
    early_smoke_runs: dict[str, Future[tuple[int | None, str]]],
) -> Iterator[dict[str, Future[tuple[int | None, str]]]]:
    """Every smoke run by name, its exit code and log: those of the early lane
    (``conftest.early_smoke_runs``, started with the session), and the shared
    worker's benches, started here ``SHARED_LANES`` at a time."""
    env = smoke_env(redis_url, CONTROL_SECRET, zygote)
    order = LONGEST + sorted(set(BENCHES) - set(LONGEST))
    with ThreadPoolExecutor(SHARED_LANES, thread_name_prefix="bench-smoke") as lanes:
        runs = dict(early_smoke_runs)
        for name in order:
            if name in BENCHES and BENCHES[name][1]:  # the shared worker's
                runs[name] = start(lanes, name, env)
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


def test_the_latency_smoke_run_breaks_the_queue_leg_down_by_phase(
    bench_runs: dict[str, Future[tuple[int | None, str]]]
) -> None:
    from rollout_queue.tasks.trace import PHASES

    code, log = bench_runs["latency.py"].result()
    assert code == 0, "\n".join(log.splitlines()[-30:])
    (record,) = [line for line in json_lines(log) if line.get("bench") == "latency"]
    assert list(record["phases_p50_ms"]) == [*PHASES, "total", "outside_engine"]
    assert record["traces_out_of_order"] == 0
    # The worker's first tasks after it said it serves: the warm-up's figure.
    assert len(record["first_tasks_ms"]) == 10 and all(ms > 0 for ms in record["first_tasks_ms"])
    # From the unrounded times: the rounded ones give it to within a rounding step.
    first, tenth = record["first_tasks_ms"][0], record["first_tasks_ms"][-1]
    assert record["first_over_tenth"] == pytest.approx(first / tenth, rel=0.02, abs=0.01)
