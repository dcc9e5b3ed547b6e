"""Dispatch by engine room (``workers.intake``): a worker takes a task only
when its engine has room, so idle workers share a burst and a smaller one
gets proportionally less.

Two workers on a queue and pool of their own (``disp``), both idle when a
burst of tasks is sent at once: ``disp-4`` fetches while its engine holds
fewer than 4 unfinished sequences, ``disp-8`` fewer than 8
(``--intake-sequences``). The figures (shares, most sequences seen in flight)
go to ``.artifacts/figures/dispatch.json``.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks import control
from tasks.generate import generate
from tests.conftest import WorkerStarter
from tests.procs import ARTIFACTS, Proc
from workers.engine_stats import StatsSnapshot
from workers.intake import Intake

QUEUE = POOL = "disp"
BUDGETS = {"disp-4@tests": 4, "disp-8@tests": 8}
FIGURES = ARTIFACTS / "figures" / "dispatch.json"


@pytest.fixture(scope="module")
def figures() -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {}
    yield found
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    FIGURES.write_text(json.dumps(found, indent=2) + "\n")


@pytest.fixture(scope="module")
def disp_workers(start_worker: WorkerStarter, model_a: Path) -> Iterator[list[Proc]]:
    procs = [
        start_worker(model_a, node, queue=QUEUE, pool=POOL, max_inflight=16,
                     extra=["--intake-sequences", str(budget)])
        for node, budget in BUDGETS.items()
    ]
    yield procs
    for proc in procs:
        proc.stop()


class InflightWatch:
    """Polls both workers' engine stats while a burst runs: the most unfinished
    sequences each engine held."""

    def __init__(self) -> None:
        self.most: dict[str, int] = collections.defaultdict(int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> InflightWatch:  # noqa: PYI034  a final class
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for node, stats in control.engine_stats(workers=list(BUDGETS), timeout=30).items():
                self.most[node] = max(self.most[node], stats["unfinished_sequences"])


def burst(tasks: int, prompts: int, tokens: int) -> dict[str, int]:
    """Send ``tasks`` tasks at once; tasks served per worker."""
    params = {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}
    handles = [generate.apply_async(([f"task {t} prompt {p}" for p in range(prompts)], params),
                                    queue=QUEUE) for t in range(tasks)]
    served = collections.Counter(h.get(timeout=600)["worker"] for h in handles)
    return dict(served)


def test_two_idle_workers_each_serve_at_least_40_percent_of_24_tasks_sent_at_once(
    disp_workers: list[Proc], figures: dict[str, Any]
) -> None:
    # 8 prompts a task: as much as either engine's budget, so each worker
    # holds one task at a time and takes the next when it is done.
    with InflightWatch() as watch:
        served = burst(24, 8, 16)
    figures["equal"] = {"served": served, "most_sequences_in_flight": dict(watch.most)}
    assert sum(served.values()) == 24
    assert set(served) == set(BUDGETS), served
    assert min(served.values()) >= 0.4 * 24, served
    # Never more than one 8-prompt task in an engine at once.
    assert all(most <= 8 for most in watch.most.values()), watch.most


def test_a_worker_with_half_the_room_holds_half_as_much_and_leaves_the_rest_in_redis(
    disp_workers: list[Proc], figures: dict[str, Any]
) -> None:
    # 2 prompts a task: disp-4 holds 2 tasks at once, disp-8 holds 4. What
    # each holds is the rule, asserted; the tasks each serves follow from it
    # and from its engine's speed (recorded: on a loaded 2-core machine one
    # engine can stall for seconds while the other runs).
    with InflightWatch() as watch:
        served = burst(24, 2, 32)
    figures["proportional"] = {"served": served, "most_sequences_in_flight": dict(watch.most)}
    assert sum(served.values()) == 24
    assert set(served) == set(BUDGETS), served
    # A task is taken while the room is not zero: at most budget - 1 + its size.
    for node, budget in BUDGETS.items():
        assert watch.most[node] <= budget - 1 + 2, (node, watch.most)
    assert watch.most["disp-8@tests"] > BUDGETS["disp-4@tests"], (
        f"disp-8 never held more than disp-4 may: {watch.most}")


class FakeEngine:
    """Pure logic: the intake rule against set numbers."""

    def __init__(self) -> None:
        self.sequences = 0
        self.waiting = 0

    def unfinished_sequences(self) -> int:
        return self.sequences

    @property
    def stats(self) -> Any:
        snapshot = StatsSnapshot(waiting_requests=self.waiting)

        class Stats:
            def snapshot(self) -> StatsSnapshot:
                return snapshot

        return Stats()


def test_the_intake_takes_one_task_at_a_time_while_the_engine_has_room() -> None:
    engine = FakeEngine()
    intake = Intake(engine, budget=8)
    assert intake.has_room()
    intake.fetched("a", {"rq_sequences": 6})
    assert not intake.has_room(), "a task between the fetch and the engine blocks the next fetch"
    engine.sequences = 6
    intake.entered("a")
    assert intake.has_room(), "6 of 8: room for more"
    engine.waiting = 2
    assert not intake.has_room(), "the scheduler has requests waiting: no room"
    engine.waiting = 0
    engine.sequences = 8
    assert not intake.has_room(), "at the budget"
    engine.sequences = 0
    intake.fetched("b", {"rq_sequences": "not a number"})
    intake.entered("b")
    intake.entered("b")  # idempotent: a task that ends after its requests went in
    assert intake.has_room() and intake.waiting_to_enter() == 0
