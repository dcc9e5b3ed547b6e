"""What the benchmarks share: device presets, one engine config for both legs, the stack.

Every benchmark compares the queue against vLLM's offline ``LLM`` built from
the same ``EngineSettings`` (``cli.offline``), in the same run, with both
engines loaded side by side and the legs alternated, so a noisy machine
slows both alike. Each prints exactly one JSON line on stdout; logs go to
stderr (vLLM's included) and to ``.run/bench/`` (a folder each for the benches
that start workers of their own, so that two can run side by side).

A bench process never runs torch on the CPU itself: on CUDA, vLLM *forks*
its EngineCore from it, and a fork of a process whose OpenMP pool has started
deadlocks in libgomp at the child's first parallel op (seen: the offline
engine hung in ``InputBatch.__init__ -> torch.zeros``). Models are therefore
built in a child process (:func:`build_model`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Before vLLM is imported anywhere in this process: keep stdout for the JSON line.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

from pydantic import SecretStr

from rollout_queue.cli.localstack import TINY_MODEL_SEED, LocalStack, WorkerSpec
from rollout_queue.tasks.app import configure
from rollout_queue.tasks.settings import ClientSettings, redis_url_env
from rollout_queue.workers.settings import EngineSettings

ROOT = Path(__file__).resolve().parent.parent

# vLLM's shared-memory readers busy-loop for 1 s after their last read
# (shm_broadcast.SpinCondition): the engine of the leg that just ran keeps a
# core spinning that long. Legs start after this pause, so the idle engine
# does not slow the measured one (on 2 cores it does, by a lot).
IDLE_S = 1.2

# Per device: the engine config and the workload (docs/BENCHMARKS.md).
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"dtype": "float32", "max_model_len": 512, "gpu_memory_utilization": 0.1,
            "prompts": 256, "input_len": 32, "output_len": 64, "prompts_per_task": 32, "rounds": 5},
    # Two engines share the GPU (worker + offline baseline): 0.4 each.
    "cuda": {"dtype": "auto", "max_model_len": 1024, "gpu_memory_utilization": 0.4,
             "prompts": 1024, "input_len": 128, "output_len": 256, "prompts_per_task": 64, "rounds": 3},
}


def parser(description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--model", help="model path or id (default: the tiny model, built into .models/)")
    p.add_argument("--dtype")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--redis-url", help="default: REDIS_URL if it answers, else an embedded valkey-server")
    p.add_argument("--seed", type=int, default=0)
    return p


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The generation workload flags (unset ones come from the device preset)."""
    p.add_argument("--prompts", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--prompts-per-task", type=int)
    p.add_argument("--rounds", type=int)


def run_tasks(queue: str, chunks: list[list[list[int]]], params: Any, timeout: float) -> tuple[float, int, set[str]]:
    """Enqueue every chunk as one task at once; seconds until the last result,
    generated tokens, and the workers that served them."""
    seconds, tokens, by_worker = run_tasks_by_worker(queue, chunks, params, timeout)
    return seconds, tokens, set(by_worker)


def run_tasks_by_worker(
    queue: str, chunks: list[list[list[int]]], params: Any, timeout: float
) -> tuple[float, int, dict[str, int]]:
    """:func:`run_tasks`, with how many of the tasks each worker served."""
    from rollout_queue.tasks.generate import generate

    started = time.perf_counter()
    handles = [generate.apply_async((chunk, params), queue=queue) for chunk in chunks]
    tokens, by_worker = 0, {}
    for handle in handles:
        result = handle.get(timeout=timeout)
        handle.forget()
        tokens += result["usage"]["completion_tokens"]
        by_worker[result["worker"]] = by_worker.get(result["worker"], 0) + 1
    return time.perf_counter() - started, tokens, by_worker


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every option left unset from the device's preset."""
    for key, value in PRESETS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.model is None:
        kind = "qwen2-0.5b" if args.device == "cuda" else "llama"
        args.model = str(build_model(ROOT / ".models", kind, TINY_MODEL_SEED).resolve())
    return args


def build_model(models_dir: Path, kind: str, seed: int, *, weights: bool = True) -> Path:
    """The tiny model ``kind``/``seed`` in ``models_dir``, built once, in a child process
    (``weights=False``: its config and tokenizer only, for an engine that draws its
    weights itself, ``load_format="dummy"``).

    The child (``python -m rollout_queue.cli make-tiny-model``) does the torch CPU work
    (random init, safetensors) and takes its OpenMP threads with it when it
    exits: this process stays safe for vLLM to fork from. Built in a scratch
    folder and renamed into place, so a concurrent reader never sees half a model.
    """
    path = models_dir / (f"tiny-{kind}-seed{seed}" if weights else f"{kind}-config")
    if (path / ("model.safetensors" if weights else "config.json")).exists():
        return path
    models_dir.mkdir(parents=True, exist_ok=True)
    scratch = models_dir / f".{path.name}.{os.getpid()}.tmp"
    log(f"building {kind} (seed {seed}{'' if weights else ', config only'}) into {path} in a child process")
    subprocess.run(
        [sys.executable, "-m", "rollout_queue.cli", "make-tiny-model", str(scratch), "--kind", kind,
         "--seed", str(seed), *([] if weights else ["--no-weights"])],
        cwd=ROOT, check=True, stdin=subprocess.DEVNULL, stdout=sys.stderr,  # stdout: the JSON line only
    )
    try:
        scratch.rename(path)
    except OSError:  # someone else finished first: theirs is the same model
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    """The one engine config both legs run."""
    return EngineSettings(
        model=args.model, device=args.device, dtype=args.dtype,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        load_format=getattr(args, "load_format", None) or "auto",
    )


def worker_spec(settings: EngineSettings, max_inflight: int = 64) -> WorkerSpec:
    return WorkerSpec(
        model=settings.model, device=settings.device, dtype=settings.dtype,
        max_model_len=settings.max_model_len or 0, max_inflight=max_inflight,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        extra=[] if settings.load_format == "auto" else ["--load-format", settings.load_format],
    )


def token_prompts(model: str, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` random token-id prompts of ``length`` ids, no special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(count)]


# The queue of a worker already serving the bench's engine config: the stack
# starts none and sends there (the suite's smoke runs share one worker:
# tests/test_bench_smoke.py). Figures measured so are the shared worker's.
SHARED_QUEUE_ENV = "RQ_BENCH_QUEUE"


@contextmanager
def queue_stack(args: argparse.Namespace, settings: EngineSettings, max_inflight: int = 64) -> Iterator[LocalStack]:
    """Redis (found or started) and one worker on a queue of its own (or the queue
    named by ``RQ_BENCH_QUEUE``); producers configured."""
    shared = os.environ.get(SHARED_QUEUE_ENV) or None
    with LocalStack(ROOT / ".run" / "bench", prefix="bench", queue=shared) as stack:
        connect(args, stack)
        if shared is not None:
            log(f"the worker already serving queue {shared}")
        else:
            log(f"starting worker {stack.worker_name()}")
            t = time.monotonic()
            stack.start_worker(worker_spec(settings, max_inflight))
            log(f"worker serving after {time.monotonic() - t:.0f} s")
        yield stack


def connect(args: argparse.Namespace, stack: LocalStack) -> None:
    """Redis for ``stack`` (``--redis-url``, REDIS_URL, or one it starts); producers configured for it."""
    client = ClientSettings()
    stack.ensure_redis(args.redis_url or client.redis_url.get_secret_value())
    log(f"redis: {stack.redis_note}")
    configure(client.model_copy(update={"redis_url": SecretStr(stack.redis_url)}))


def wait_for_free_device(device: str, timeout: float = 90.0) -> None:
    """On CUDA, wait until the engines of a stopped leg have given their GPU
    memory back (a killed process's memory is freed a moment after it dies):
    the next engine sizes its KV cache from the memory free when it starts,
    and refuses to start if its fraction is not free."""
    if device != "cuda" or shutil.which("nvidia-smi") is None:
        return
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    deadline = time.monotonic() + timeout
    used = total = 0.0
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["nvidia-smi", "-i", gpu, "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=False,
        ).stdout
        try:
            used, total = (float(field) for field in out.strip().splitlines()[0].split(","))
        except (IndexError, ValueError):
            return  # nvidia-smi said nothing readable: nothing to wait on
        if used < 0.05 * total:
            return
        time.sleep(1.0)
    log(f"GPU {gpu} still has {used:.0f} of {total:.0f} MiB in use after {timeout:.0f} s; starting anyway")


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def machine(device: str) -> str:
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
        return f"{name} x{torch.cuda.device_count()}, {os.cpu_count()} CPUs"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs ({socket.gethostname()})"


def emit(record: dict[str, Any], args: argparse.Namespace) -> None:
    """The benchmark's one JSON line."""
    import vllm

    record.update(
        device=args.device,
        model=Path(args.model).name,
        vllm=vllm.__version__,
        machine=machine(args.device),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        # Other work on the machine skews every figure; say how much there was.
        load_1m=round(os.getloadavg()[0], 1),
    )
    print(json.dumps(record), flush=True)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def start_gateway(stack: Any, model_name: str, queue: str | None = None,
                  env: dict[str, str] | None = None) -> tuple[Any, str]:
    """A ``rollout-queue api`` subprocess in front of ``stack``'s queue; (process, base URL)."""
    import httpx

    from rollout_queue.cli.localstack import LocalProcess, free_port

    port = free_port()
    full_env = {
        **redis_url_env(stack.redis_url), "RQ_API_QUEUE": queue or stack.queue, "RQ_API_HOST": "127.0.0.1",
        "RQ_API_PORT": str(port), "RQ_API_MODEL_NAME": model_name, "RQ_API_LOG_LEVEL": "warning",
        **(env or {}),
    }
    proc = LocalProcess("gateway", [sys.executable, "-m", "rollout_queue.cli", "api"],
                        ROOT / ".run" / "bench" / "gateway.log", full_env)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    proc.wait_until(healthy, 120, "the gateway to answer /health")
    return proc, base


def gateway_counter(base: str, name: str) -> dict[str, float]:
    """A counter of the gateway's /metrics (``rollout_queue_api_<name>_total``), by its label set."""
    import httpx

    prefix = f"rollout_queue_api_{name}_total"
    found: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix):
            labels, value = line[len(prefix):].rsplit(" ", 1)
            found[labels] = float(value)
    return found
