"""The receiver with the engine calls only benchmarks and tests make.

Production workers load ``weight_sync.receiver.WeightReceiver``; a worker
started with ``--worker-extension-cls weight_sync.bench_receiver.BenchReceiver``
(``BENCH_EXTENSION``: bench/weight_transfer.py, the weight-sync tests) also
answers the ``rq_engine`` ops ``receive_one``, ``receive_raw``,
``last_receive`` and ``weight_checksum`` (``workers.node.control``).
"""

from __future__ import annotations

import time

from rollout_queue.tasks.errors import WeightSyncError
from rollout_queue.weight_sync import wire
from rollout_queue.weight_sync.receiver import Phase, WeightReceiver, refresh_tied_layers

BENCH_EXTENSION = "rollout_queue.weight_sync.bench_receiver.BenchReceiver"

__all__ = ["BENCH_EXTENSION", "BenchReceiver"]


class BenchReceiver(WeightReceiver):
    """``WeightReceiver`` plus the benchmarks' baselines and probes."""

    def rq_receive_one(self, name: str, dtype: str, shape: list[int], timeout_s: float) -> int:
        """One tensor over the current group, loaded at once: the benchmark's
        baseline of one control round trip per tensor."""
        import torch

        state = self._rq_expect(Phase.IDLE, "rq_receive_one")
        if state.group is None:
            raise WeightSyncError("no sync group: run a sync first", phase="transfer")
        tensor = torch.empty(shape, dtype=wire.torch_dtype(dtype), device=self._rq_device())
        wire.wait(wire.broadcast(state.group, tensor.view(-1).view(torch.uint8)), timeout_s)
        model = self._rq_model()
        if state.load_mode == "layerwise":
            # After a layerwise reload the parameters carry no weight loaders:
            # every load, even of one tensor, goes through the reload lifecycle.
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            initialize_layerwise_reload(model)
            model.load_weights(weights=[(name, tensor)])
            finalize_layerwise_reload(model, self.model_config)  # type: ignore[attr-defined]
            refresh_tied_layers(model, {name})
        else:
            model.load_weights(weights=[(name, tensor)])
        return int(tensor.numel())

    def rq_receive_raw(self, sizes: list[int], timeout_s: float) -> float:
        """Buckets of ``sizes`` over the current group into buffers kept for this
        (all posted at once, nothing loaded): the benchmark's raw broadcast into
        this process. Returns the seconds from posting to the last byte."""
        import torch

        state = self._rq_expect(Phase.IDLE, "rq_receive_raw")
        if state.group is None:
            raise WeightSyncError("no sync group: run a sync first", phase="transfer")
        device = self._rq_device()
        raw = getattr(self, "_rq_raw", None)
        if raw is None or [b.numel() for b in raw] != sizes:
            self._rq_raw = raw = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        t0 = time.monotonic()
        works = [wire.broadcast(state.group, buffer) for buffer in raw]
        for work in works:
            wire.wait(work, timeout_s)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.monotonic() - t0

    def rq_last_receive(self) -> dict[str, float]:
        """Wire and load seconds of the last sync's receive, and what went in place."""
        return dict(self._rq_state().last_stats)

    def rq_weight_checksum(self) -> dict[str, float]:
        """Sum of every parameter (float64) and the count: compare across syncs."""
        import torch

        total = 0.0
        count = 0
        with torch.no_grad():
            for _, param in self._rq_model().named_parameters():
                total += float(param.detach().double().sum().item())
                count += param.numel()
        return {"sum": total, "numel": float(count)}
