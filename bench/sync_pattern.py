"""Weight-sync wire pattern vs raw broadcast, between two bare processes.

No engine, no control messages: the trainer's own sending loop
(``WeightSender.send_buckets``: packing slots, tensors of ``direct_bytes`` or
more sent straight from their memory) against a receiver that posts every
piece at once, direct pieces straight into tensors of their own (as a worker
receiving in place does), alternated with a raw broadcast of the same bucket
sizes from ready buffers. One JSON line with ``pattern_s / raw_s``: what the
protocol's piece pattern costs on the wire, apart from what the engine's and
the trainer's processes add (``bench/weight_transfer.py`` measures those).

    python bench/sync_pattern.py                    # CPU, gloo, 0.5B-shaped float32
    python bench/sync_pattern.py --device cuda      # GPU 1 -> GPU 0, NCCL, 7B-shaped bf16
"""

from __future__ import annotations

import argparse
import json
import queue
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _side(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch

    from bench.weight_transfer import state_dict
    from rollout_queue.tasks.schemas import WorkerInfo
    from rollout_queue.weight_sync import wire
    from rollout_queue.weight_sync.sender import WeightSender
    from rollout_queue.weight_sync.settings import SyncSettings

    cuda = args.device == "cuda"
    device = f"cuda:{1 - rank}" if cuda else "cpu"  # trainer on GPU 1, receiver on GPU 0
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dtype = "bfloat16" if cuda else "float32"
    backend = "nccl" if cuda else "gloo"
    store = wire.connect_store("127.0.0.1", port, 120.0, is_master=rank == 0)
    group = wire.new_group(store, "pattern", rank, 2, backend, 120.0, torch.device(device))

    weights = state_dict(args.shape, dtype, device)
    sender = WeightSender(SyncSettings(direct_bytes=args.direct_mib << 20))
    sending = sender.transport(backend)
    sending.group = group  # type: ignore[attr-defined]  # a GroupSender
    member = WorkerInfo(node="receiver", model="bench", device=args.device, dtype=dtype)
    manifest, tensors = sender.manifest(list(weights.items()), [member], backend)
    raw = [torch.empty(size, dtype=torch.uint8, device=device) for size in manifest.bucket_sizes]

    def pattern() -> None:
        if rank == 0:
            sending.send_buckets(manifest, tensors, torch.device(device), 300.0)  # type: ignore[attr-defined]
            return
        works = []
        for bucket in wire.iter_buckets(manifest):  # grouped per bucket as the worker does
            targets = [wire.flat_bytes(weights[direct]) if direct else raw[bucket.index][start:end]
                       for start, end, direct in bucket.pieces]
            works += wire.broadcast_bucket(group, manifest, targets)
        for work in works:
            wire.wait(work, 300.0)

    def raw_broadcast() -> None:
        for work in [wire.broadcast(group, buffer) for buffer in raw]:
            wire.wait(work, 300.0)

    def timed(leg: Any) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        leg()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"pattern": [], "raw": []}
    for _ in range(args.iters):  # alternated; the first of each is warm-up
        times["pattern"].append(timed(pattern))
        times["raw"].append(timed(raw_broadcast))
    if rank == 0:
        out.put({
            "manifest": manifest, "times": times,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        })


def _result(results: Any, sides: list[Any], deadline: float) -> Any:
    """Rank 0's result; a side that exits without it (its traceback is above) ends the
    bench at once, the other side killed, instead of leaving it waiting for its peer."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            codes = [side.exitcode for side in sides]
            if any(code not in (None, 0) for code in codes) or all(code is not None for code in codes) \
                    or time.monotonic() > deadline:
                for side in sides:
                    side.kill()
                raise SystemExit(f"sync_pattern: no result from the two sides (exit codes {codes}); "
                                 "see their tracebacks above") from None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", default=None, help="qwen2-0.5b (CPU default) or qwen2-7b (CUDA default)")
    parser.add_argument("--direct-mib", type=int, default=16)
    parser.add_argument("--iters", type=int, default=6)
    args = parser.parse_args()
    args.shape = args.shape or ("qwen2-7b" if args.device == "cuda" else "qwen2-0.5b")

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sides = [ctx.Process(target=_side, args=(rank, port, args, results)) for rank in (0, 1)]
    for side in sides:
        side.start()
    got = _result(results, sides, time.monotonic() + 900)
    for side in sides:
        side.join(120)
    manifest, times = got["manifest"], got["times"]
    pattern_s = statistics.median(times["pattern"][1:])
    raw_s = statistics.median(times["raw"][1:])
    print(json.dumps({
        "bench": "sync_pattern",
        "device": args.device,
        "shape": args.shape,
        "bytes": got["bytes"],
        "buckets": len(manifest.bucket_sizes),
        "direct_mib": args.direct_mib,
        "direct_tensors": sum(spec.nbytes >= manifest.direct_bytes > 0 for spec in manifest.tensors),
        "pattern_s": round(pattern_s, 4),
        "raw_s": round(raw_s, 4),
        "pattern_over_raw": round(pattern_s / raw_s, 3),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
