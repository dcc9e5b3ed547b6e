"""Rank 1 of the raw-broadcast baseline: receive buckets of the given sizes, N rounds.

Run by bench/weight_transfer.py; prints "ready" once joined and "done" at the end.
Round i starts when the trainer sets ``bench/go/i`` in the store; the peer
posts every bucket and answers ``bench/posted/i``.
"""

from __future__ import annotations

import json
import sys

import torch

from rollout_queue.weight_sync import wire


def main() -> int:
    host, port, backend, device = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    sizes: list[int] = json.loads(sys.argv[5])  # the bucket sizes of one round
    rounds = int(sys.argv[6])
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    store = wire.connect_store(host, port, 120.0)
    group = wire.new_group(store, "raw", 1, 2, backend, 120.0, torch.device(device))
    print("ready", flush=True)
    # Buffers kept across rounds, as the worker keeps its receive buffers.
    buffers = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
    for index in range(rounds):
        # Nothing is posted before the trainer's raw leg begins: a posted NCCL
        # receive is a kernel spinning on the worker's GPU, time-sliced against
        # the worker's own kernels while the sync legs run.
        store.get(f"bench/go/{index}")
        works = [wire.broadcast(group, buffer) for buffer in buffers]
        store.set(f"bench/posted/{index}", "1")
        for work in works:
            wire.wait(work, 300.0)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
