"""Generations that survive their worker: checkpoints, resume, preemption hand-off.

Two workers on a queue and pool of their own (``res``): ``res-a`` serves
throughout, ``res-b`` is the one that dies. Each test makes its moment
deterministic: the victim is the only worker taking the task (``res-a`` is
fenced: the pool's fleet version is ahead of it), and the victim is killed
only once its checkpoint is in Redis.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib

from tasks import generate, keys
from tasks.schemas import WorkerInfo
from tests.conftest import WorkerStarter, wait_for
from tests.procs import Proc
from workers.progress import SampleProgress

QUEUE = POOL = "res"
VICTIM_POOL = "res-victim"
INTERVAL = 16  # --checkpoint-tokens of both workers
# Faster death detection than the defaults (10 s TTL + 10 s grace), same code.
WORKER_ENV = {"REGISTRY_TTL_S": "6", "REAP_GRACE_S": "4"}
WORKER_ARGS = ["--max-model-len", "1024", "--checkpoint-tokens", str(INTERVAL)]
# Long samples: the victim is killed after its first checkpoints, long before
# it could finish (the tiny model makes a few hundred tokens a second here).
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 1.0, "logprobs": 1, "n": 2}
PROMPTS = ["the resumed sample", "another long one"]


def checkpoint(client: redis_lib.Redis, task_id: str) -> dict[tuple[int, int], SampleProgress]:
    raw = client.hgetall(keys.progress_key(task_id))
    return {
        (int(name.split(":")[0]), int(name.split(":")[1])): SampleProgress.from_json(value)
        for name, value in raw.items()  # type: ignore[union-attr]
    }


def registry(client: redis_lib.Redis, node: str) -> WorkerInfo | None:
    raw = client.get(keys.worker_key(node))
    return WorkerInfo.model_validate_json(raw) if raw else None  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def survivor(start_worker: WorkerStarter, model_a: Path) -> Iterator[Proc]:
    proc = start_worker(model_a, "res-a@tests", queue=QUEUE, pool=POOL, max_inflight=4,
                        extra=WORKER_ARGS, env=WORKER_ENV)
    yield proc
    proc.stop()


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


def wait_for_checkpoint(client: redis_lib.Redis, task_id: str, samples: int, tokens: int,
                        proc: Proc) -> None:
    proc.wait_until(
        lambda: len(saved := checkpoint(client, task_id)) == samples
        and all(len(p.token_ids) >= tokens for p in saved.values()),
        120, f"a checkpoint of {samples} samples with >= {tokens} tokens each")


def test_kill_9_mid_generation_resumes_every_sample_on_the_other_worker_from_its_checkpoint(
    survivor: Proc, start_worker: WorkerStarter, model_a: Path, redis_client: redis_lib.Redis,
) -> None:
    with Fenced(redis_client, survivor):
        victim = start_worker(model_a, "res-b@tests", queue=QUEUE, pool=VICTIM_POOL, max_inflight=4,
                              extra=WORKER_ARGS, env=WORKER_ENV)
        handle = generate.apply_async((PROMPTS, LONG), queue=QUEUE)
        wait_for_checkpoint(redis_client, handle.id, 4, 2 * INTERVAL, victim)
        victim.kill_tree(signal.SIGKILL)
        victim.popen.wait(10)
        kept = checkpoint(redis_client, handle.id)  # what the victim left: nothing writes now
        before = registry(redis_client, "res-a@tests")
        assert before is not None
    # TTL 6 s + grace 4 s + a reaper pass, then 4 x up to 900 tokens.
    result = handle.get(timeout=180)
    assert result["worker"] == "res-a@tests"
    resumed = 0
    for p, output in enumerate(result["outputs"]):
        assert len(output["samples"]) == LONG["n"]
        for s, sample in enumerate(output["samples"]):
            old = kept[(p, s)].token_ids
            assert INTERVAL <= len(old) < LONG["max_tokens"]
            assert len(sample["token_ids"]) == LONG["max_tokens"]
            assert len(sample["logprobs"]) == LONG["max_tokens"]
            assert sample["token_ids"][: len(old)] == old  # the victim's tokens are kept
            assert sample["logprobs"][: len(old)] == kept[(p, s)].logprobs
            assert sample["workers"] == [[0, "res-b@tests"], [len(old), "res-a@tests"]]
            assert sample["weight_versions"] == [[0, 0]]
            assert sample["finish_reason"] == "length"
            resumed += LONG["max_tokens"] - len(old)
    # The survivor generated only the rest: its registry counts its tokens.
    wait_for(lambda: (info := registry(redis_client, "res-a@tests")) is not None
             and info.generated_tokens > before.generated_tokens, 10, "the survivor's next heartbeat")
    after = registry(redis_client, "res-a@tests")
    assert after is not None
    generated = after.generated_tokens - before.generated_tokens
    assert generated == resumed < len(PROMPTS) * LONG["n"] * LONG["max_tokens"]
    assert result["usage"]["completion_tokens"] == len(PROMPTS) * LONG["n"] * LONG["max_tokens"]
    wait_for(lambda: not redis_client.exists(keys.progress_key(handle.id)), 10,
             "the finished task's checkpoint to be deleted")
    print(f"kill -9: kept {sum(len(p.token_ids) for p in kept.values())} tokens, "
          f"the survivor generated {generated} of {len(PROMPTS) * LONG['n'] * LONG['max_tokens']}")
