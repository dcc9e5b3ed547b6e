"""The receiver with the engine calls only benchmarks and tests make.

Production workers load ``weight_sync.receiver.WeightReceiver``; a worker
started with ``--worker-extension-cls weight_sync.bench_receiver.BenchReceiver``
(``BENCH_EXTENSION``: bench/weight_transfer.py, the weight-sync tests) also
answers the ``rq_engine`` ops ``receive_one``, ``receive_raw``,
``last_receive`` and ``weight_checksum``: the worker hands
:func:`register_engine_ops` its registry (``workers.node.control``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollout_queue.tasks.errors import WeightSyncError
from rollout_queue.weight_sync import wire
from rollout_queue.weight_sync.receiver import EngineReceiver, Phase, WeightReceiver, refresh_tied_layers

BENCH_EXTENSION = "rollout_queue.weight_sync.bench_receiver.BenchReceiver"

__all__ = ["BENCH_EXTENSION", "BenchReceiver", "register_engine_ops"]


def _group(receiver: EngineReceiver) -> Any:
    """The process group of this rank's last group sync."""
    for name in ("nccl", "gloo"):
        end = receiver.transports.get(name)
        if end is not None and getattr(end, "group", None) is not None:
            return end.group  # type: ignore[attr-defined]
    raise WeightSyncError("no sync group: run a sync first", phase="transfer")


class BenchReceiver(WeightReceiver):
    """``WeightReceiver`` plus the benchmarks' baselines and probes."""

    _rq_raw: list[Any] | None = None

    def rq_receive_one(self, name: str, dtype: str, shape: list[int], timeout_s: float) -> int:
        """One tensor over the current group, loaded at once: the benchmark's
        baseline of one control round trip per tensor."""
        import torch

        receiver = self._receiver()
        receiver.expect(Phase.IDLE, "rq_receive_one")
        group = _group(receiver)
        tensor = torch.empty(shape, dtype=wire.torch_dtype(dtype), device=receiver.device())
        wire.wait(wire.broadcast(group, tensor.view(-1).view(torch.uint8)), timeout_s)
        model = receiver.model()
        if receiver.load_mode == "layerwise":
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

        receiver = self._receiver()
        receiver.expect(Phase.IDLE, "rq_receive_raw")
        group = _group(receiver)
        device = receiver.device()
        raw = self._rq_raw
        if raw is None or [b.numel() for b in raw] != sizes:
            self._rq_raw = raw = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        t0 = time.monotonic()
        works = [wire.broadcast(group, buffer) for buffer in raw]
        for work in works:
            wire.wait(work, timeout_s)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.monotonic() - t0

    def rq_last_receive(self) -> dict[str, float]:
        """Wire and load seconds of the last sync's receive, and what went in place."""
        return dict(self._receiver().last_stats)

    def rq_weight_checksum(self) -> dict[str, float]:
        """Sum of every parameter (float64) and the count: compare across syncs."""
        import torch

        total = 0.0
        count = 0
        with torch.no_grad():
            for _, param in self._receiver().model().named_parameters():
                total += float(param.detach().double().sum().item())
                count += param.numel()
        return {"sum": total, "numel": float(count)}


def register_engine_ops(register: Callable[..., None]) -> None:
    """The ``rq_engine`` ops answered by :class:`BenchReceiver`'s calls, each on
    every engine rank: ``register(name, op, read_only=...)``, where ``op``
    takes the worker's runtime and the op's arguments. The worker calls this
    when its engine loads this receiver."""
    register("receive_one", lambda runtime, args: runtime.host.collective_rpc(
        "rq_receive_one", 120.0, args["name"], args["dtype"], args["shape"], 60.0))
    register("receive_raw", lambda runtime, args: runtime.host.collective_rpc(
        "rq_receive_raw", 300.0, args["sizes"], 120.0))
    register("last_receive", lambda runtime, args: runtime.host.collective_rpc("rq_last_receive", 60.0),
             read_only=True)
    register("weight_checksum", lambda runtime, args: runtime.host.collective_rpc("rq_weight_checksum", 120.0),
             read_only=True)
