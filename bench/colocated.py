"""Colocated weight handoff: a trainer and one worker sharing a host (CPU) or a GPU (CUDA).

In one run, against one real worker started with ``--colocated`` (dummy
weights of the chosen shape):

  CPU   the same weights synced over gloo (``RQ_TRANSPORT=gloo``: today's
        path), handed over through shared memory (``shm``, packed into
        segments), and handed over from the trainer's own storages once they
        are in shared memory (``shared``: ``share_memory_()``, one copy in
        all): first and steady seconds of each, and each over gloo.
  CUDA  the weights handed over by CUDA IPC (``cuda_ipc``), first and steady,
        beside an on-device copy of the same bytes in the same process (the
        floor: the handoff copies them at least once), and the same copies
        across two processes, both ways (a spawned process pulling the
        trainer's tensors opened by CUDA IPC, as the engine does; the trainer
        pushing into that process's buffer); then the engine's GPU
        memory awake and asleep (levels 1 and 2, from nvidia-smi) and the
        seconds to wake it (level 1, no new weights) and to wake it with a
        handoff (level 2).

Prints one JSON line per shape; its phases (the trainer's and the slowest
worker's) are each one's median over the steady syncs, as the seconds are:

    python bench/colocated.py --device cpu                               # qwen2-0.5b, float32
    python bench/colocated.py --device cuda --shapes qwen2-0.5b qwen2-7b # bf16, GPU 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

from bench.weight_transfer import state_dict
from rollout_queue.tasks.settings import environment_redis_url, redis_url_env


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def timed_syncs(sender: Any, weights: dict[str, Any], iters: int, first_version: int) -> tuple[list[float], list[Any]]:
    """Each sync's seconds until the bytes are in the engine: on CUDA the engine's
    copies may still run when the sync returns (the trainer's stream waits for
    them), so each sync is timed to a synchronize of the trainer's device after it
    (the report's own seconds, to the return, are logged beside)."""
    import torch

    cuda = next(iter(weights.values())).device.type == "cuda"
    seconds: list[float] = []
    reports = []
    for i in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        report = sender.sync(weights, version=first_version + i, timeout=600)
        reports.append(report)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        log(f"{report.backend} sync {i}: {seconds[-1]:.4f}s landed, {report.seconds:.4f}s returned; phases "
            f"{ {k: round(v, 4) for k, v in report.phases.items()} } worker {report.worker_phases}")
    return seconds, reports


def steady(seconds: list[float]) -> float:
    return statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]


def steady_phases(reports: list[Any], side: str = "worker_phases") -> dict[str, float]:
    """Each phase's median over the steady syncs (all but the first) of ``reports``:
    the trainer's (``side="phases"``) or the slowest worker's, each sync's own."""
    steady_ones = reports[1:] or reports
    names = dict.fromkeys(name for report in steady_ones for name in getattr(report, side))
    return {name: round(statistics.median(getattr(r, side).get(name, 0.0) for r in steady_ones), 4)
            for name in names}


def engine_memory_mib() -> dict[int, int]:
    """GPU memory per compute process (pid → MiB), from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return {int(pid): int(mib) for pid, mib in (line.split(",") for line in out.strip().splitlines() if line)}


def flat_bytes(tensors: list[Any]) -> tuple[list[int], list[int]]:
    """Each tensor's byte size and its offset in one flat buffer (64-byte aligned); the
    last offset is the buffer's size."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + (n + 63) // 64 * 64)
    return sizes, starts


def flat_copy_seconds(tensors: list[Any], iters: int, into: Any = None) -> dict[str, float]:
    """Median seconds (the first run left out) to copy ``tensors`` into one flat
    buffer on their GPU (``into``, or one made here): one ``copy_`` each (uint8
    views), and one ``torch._foreach_copy_`` of them all as 8-byte words."""
    import torch

    sizes, starts = flat_bytes(tensors)
    flat = torch.empty(starts[-1], dtype=torch.uint8, device=tensors[0].device) if into is None else into
    dests = [flat[at:at + n] for at, n in zip(starts, sizes)]
    sources = [t.view(-1).view(torch.uint8) for t in tensors]
    words = [(d.view(torch.int64), s.view(torch.int64)) for d, s in zip(dests, sources)
             if d.numel() % 8 == 0 and s.data_ptr() % 8 == 0]

    def synchronize() -> None:
        if flat.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(copy: Any) -> float:
        seconds = []
        for _ in range(iters):
            synchronize()
            t0 = time.perf_counter()
            copy()
            synchronize()
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds[1:])

    def each() -> None:
        for dest, source in zip(dests, sources):
            dest.copy_(source, non_blocking=True)

    return {"copy_s": timed(each),
            "foreach_i64_s": timed(lambda: torch._foreach_copy_([d for d, _ in words], [s for _, s in words]))}


def _other_process(inbox: Any, outbox: Any, iters: int) -> None:
    """The second process of ``cross_process_copy_seconds``."""
    import torch

    tensors = inbox.get()  # rebuilt from their CUDA IPC handles (CPU: shared memory)
    device = tensors[0].device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    outbox.put(flat_copy_seconds(tensors, iters))
    flat = torch.empty(flat_bytes(tensors)[1][-1], dtype=torch.uint8, device=device)
    if device.type == "cpu":
        flat.share_memory_()
    del tensors
    outbox.put(flat)  # the first process copies into it
    inbox.get()  # until it is done with it
    del flat


def cross_process_copy_seconds(tensors: list[Any], iters: int) -> dict[str, float]:
    """The floor's copies across two processes on one GPU, both ways: a spawned
    process copies ``tensors`` (opened by CUDA IPC) into its own buffer (pull:
    the engine's copies), and this one copies them into the other's buffer
    (opened by CUDA IPC: push)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    child = context.Process(target=_other_process, args=(inbox, outbox, iters), daemon=True)
    child.start()
    try:
        inbox.put(tensors)
        pull = dict(outbox.get(timeout=300))
        theirs = outbox.get(timeout=300)
        push = flat_copy_seconds(tensors, iters, into=theirs)
        del theirs
        inbox.put("done")
        return {**{f"pull_{k}": v for k, v in pull.items()}, **{f"push_{k}": v for k, v in push.items()}}
    finally:
        child.join(timeout=60)


def cpu_run(args: argparse.Namespace, stack: Any, shape: str, model_dir: Path) -> dict[str, Any]:
    from rollout_queue.cli.localstack import WorkerSpec
    from rollout_queue.weight_sync import sync_weights
    from rollout_queue.weight_sync.settings import SyncSettings

    stack.start_worker(WorkerSpec(model=model_dir, device="cpu", dtype="float32", max_model_len=512,
                                  gpu_memory_utilization=0.05,
                                  extra=["--load-format", "dummy", "--colocated", "--enforce-eager",
                                         "--cpu-weights", args.cpu_weights]),
                       timeout=900)
    weights = state_dict(shape, "float32", "cpu")
    total = sum(t.numel() * t.element_size() for t in weights.values())
    chosen = {"bucket_bytes": args.bucket_mib << 20}
    gloo = sync_weights.WeightSender(SyncSettings(transport="gloo", **chosen), stack.tag)
    gloo_s, gloo_reports = timed_syncs(gloo, weights, args.iters, 1)
    gloo.close()
    shm = sync_weights.WeightSender(SyncSettings(**chosen), stack.tag)
    shm_s, shm_reports = timed_syncs(shm, weights, args.iters, 1 + args.iters)
    assert shm_reports[-1].backend == "shm", shm_reports[-1].backend
    # The trainer's tensors moved into shared memory (model.share_memory()): the
    # handoff names them, and the engine copies from them straight into place.
    for tensor in weights.values():
        tensor.share_memory_()
    own_s, own_reports = timed_syncs(shm, weights, args.iters, 1 + 2 * args.iters)
    shm.close()
    return {
        "bench": "colocated", "device": "cpu", "shape": shape, "dtype": "float32", "bytes": total,
        "cpu_weights": args.cpu_weights, "bucket_mib": args.bucket_mib, "iters": args.iters,
        "gloo_first_s": round(gloo_s[0], 4), "gloo_steady_s": round(steady(gloo_s), 4),
        "shm_first_s": round(shm_s[0], 4), "shm_steady_s": round(steady(shm_s), 4),
        "shm_over_gloo": round(steady(shm_s) / steady(gloo_s), 3),
        "shared_first_s": round(own_s[0], 4), "shared_steady_s": round(steady(own_s), 4),
        "shared_over_gloo": round(steady(own_s) / steady(gloo_s), 3),
        "shared_worker_phases_s": steady_phases(own_reports),
        "gloo_worker_phases_s": steady_phases(gloo_reports),
        "shm_worker_phases_s": steady_phases(shm_reports),
        "shm_phases_s": steady_phases(shm_reports, "phases"),
    }


def cuda_run(args: argparse.Namespace, stack: Any, shape: str, model_dir: Path) -> dict[str, Any]:
    import torch

    from rollout_queue.cli.localstack import WorkerSpec
    from rollout_queue.weight_sync import sync_weights
    from rollout_queue.weight_sync.settings import SyncSettings

    proc = stack.start_worker(
        WorkerSpec(model=model_dir, device="cuda", dtype="bfloat16", max_model_len=1024,
                   gpu_memory_utilization=args.gpu_memory_utilization,
                   extra=["--load-format", "dummy", "--colocated", "--enforce-eager"],
                   env={"CUDA_VISIBLE_DEVICES": "0"}),
        timeout=900)
    weights = state_dict(shape, "bfloat16", "cuda:0")
    total = sum(t.numel() * t.element_size() for t in weights.values())
    sender = sync_weights.WeightSender(SyncSettings(bucket_bytes=args.bucket_mib << 20), stack.tag)
    ipc_s, reports = timed_syncs(sender, weights, args.iters, 1)
    assert reports[-1].backend == "cuda_ipc", reports[-1].backend

    # The floor: the same bytes copied once on the device (into one flat buffer).
    copy_s = flat_copy_seconds(list(weights.values()), max(args.iters, 3))["copy_s"]
    torch.cuda.empty_cache()  # the flat buffer
    # The same copies across two processes, as the engine's are (pull: out of
    # these tensors opened by CUDA IPC; push: into the other's buffer): whether
    # memory of another process copies slower (the engine's copies took ~10.5 ms
    # for the floor's 8.2 on an H200).
    cross = cross_process_copy_seconds(list(weights.values()), max(args.iters, 3))
    log(f"floor {copy_s:.4f}s; the same copies across two processes: {cross}")

    # Sleep and wake: the engine core's memory from nvidia-smi.
    core_pids = [c.pid for c in __import__("psutil").Process(proc.pid).children(recursive=True)]
    def engine_mib() -> int:
        used = engine_memory_mib()
        return sum(used.get(pid, 0) for pid in core_pids)
    awake = engine_mib()
    sleeping: dict[str, Any] = {}
    for level in (1, 2):
        free_awake = torch.cuda.mem_get_info(0)[0]
        t0 = time.perf_counter()
        sync_weights.sleep(level, pool=stack.tag)
        slept_s = time.perf_counter() - t0
        asleep = engine_mib()
        freed_gib = (torch.cuda.mem_get_info(0)[0] - free_awake) / (1 << 30)
        t0 = time.perf_counter()
        if level == 1:
            sync_weights.wake(pool=stack.tag)
        else:
            sync_weights.wake(weights, version=args.iters + 1, pool=stack.tag)
        woke_s = time.perf_counter() - t0
        sleeping[f"level{level}"] = {
            "awake_mib": awake, "asleep_mib": asleep, "freed_fraction": round(1 - asleep / max(awake, 1), 4),
            "device_freed_gib": round(freed_gib, 2),
            "sleep_s": round(slept_s, 4), ("wake_s" if level == 1 else "wake_with_handoff_s"): round(woke_s, 4),
        }
        log(f"sleep level {level}: {sleeping[f'level{level}']}")
    sender.close()
    stack.stop_worker(proc)
    return {
        "bench": "colocated", "device": "cuda", "gpu": torch.cuda.get_device_name(0), "shape": shape,
        "dtype": "bfloat16", "bytes": total, "tensors": len(weights), "bucket_mib": args.bucket_mib,
        "iters": args.iters,
        "ipc_first_s": round(ipc_s[0], 4), "ipc_steady_s": round(steady(ipc_s), 4),
        "device_copy_s": round(copy_s, 4), "ipc_over_copy": round(steady(ipc_s) / copy_s, 2),
        "cross_process_copy_s": {k: round(v, 4) for k, v in cross.items()},
        "ipc_over_pull_copy": round(steady(ipc_s) / cross["pull_copy_s"], 2),
        "ipc_phases_s": steady_phases(reports, "phases"),
        "ipc_worker_phases_s": steady_phases(reports),
        "sleep": sleeping,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shapes", nargs="+", default=None, help="qwen2-0.5b (default), qwen2-7b")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=1024)
    parser.add_argument("--cpu-weights", choices=["packed", "plain"], default="plain")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument("--redis-url", default=environment_redis_url())
    args = parser.parse_args()
    if args.device == "cuda":
        import torch

        torch.cuda.set_device(0)  # CUDA first: no CPU op in this process before it

    from rollout_queue.cli.localstack import LocalStack
    from rollout_queue.cli.tiny_model import make_tiny_model

    run_dir = ROOT / ".artifacts" / "bench-colocated"
    run_dir.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes or ["qwen2-0.5b"]:
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        model_dir = make_tiny_model(ROOT / ".models" / f"{shape}-config", kind=shape, weights=False, dtype=dtype)
        with LocalStack(run_dir, prefix="bench-colo") as stack:
            url = stack.ensure_redis(args.redis_url)
            os.environ.update(redis_url_env(url))
            from rollout_queue.tasks.app import configure
            from rollout_queue.tasks.settings import ClientSettings

            configure(ClientSettings())
            run = cpu_run if args.device == "cpu" else cuda_run
            print(json.dumps(run(args, stack, shape, model_dir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
