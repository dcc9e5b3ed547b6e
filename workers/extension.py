"""The receiving side of the weight protocol, inside vLLM's worker processes.

vLLM mixes :class:`WeightReceiver` into its worker class
(``worker_extension_cls``); the host calls these methods on every engine
rank at once with ``collective_rpc``. The receiver's phases mirror the
sender's and are called in this order, each refusing to run out of turn::

    rq_attach(load_mode)                   once, at engine start
    rq_begin_update(plan, decision)        join (or reuse) the group  IDLE → JOINED
    rq_receive_buckets(timeout_s)          receive and load buckets   JOINED → RECEIVED
    rq_finish_update()                     verify, finalize           RECEIVED → IDLE
    rq_abort_update()                      from any phase             → IDLE

Each bucket arrives in a fresh buffer: under layerwise reload vLLM may keep a
view of a bucket until the layer that owns it is complete, so a buffer is
never overwritten; the caching allocator makes fresh buffers cheap.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from tasks import transport
from tasks.errors import ManifestMismatch, WeightSyncError
from tasks.schemas import SyncDecision, SyncPlan


class Phase(enum.Enum):
    IDLE = "idle"
    JOINED = "joined"
    RECEIVED = "received"


_NEXT_STEP = {
    Phase.IDLE: "rq_begin_update",
    Phase.JOINED: "rq_receive_buckets",
    Phase.RECEIVED: "rq_finish_update",
}


class _ReceiverState:
    def __init__(self, load_mode: str) -> None:
        self.load_mode = load_mode
        self.phase = Phase.IDLE
        self.group: Any = None
        self.group_id = ""
        self.store: Any = None
        self.plan: SyncPlan | None = None
        self.received: set[str] = set()
        self.layerwise_open = False


class WeightReceiver:
    """Mixed into vLLM's worker: ``self`` is the worker (model_runner, device...)."""

    _rq: _ReceiverState

    # ---------------------------------------------------------------- helpers

    def _rq_state(self) -> _ReceiverState:
        state = getattr(self, "_rq", None)
        if state is None:
            raise WeightSyncError("rq_attach was never called on this engine rank", phase="load")
        return state

    def _rq_expect(self, phase: Phase, method: str) -> _ReceiverState:
        state = self._rq_state()
        if state.phase is not phase:
            raise WeightSyncError(
                f"{method} called in phase {state.phase.value}; call {_NEXT_STEP[state.phase]} first",
                phase="load",
            )
        return state

    def _rq_model(self) -> Any:
        return self.model_runner.model  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ phases

    def rq_attach(self, load_mode: str) -> str:
        self._rq = _ReceiverState(load_mode)
        return load_mode

    def rq_begin_update(self, plan_json: dict[str, Any], decision_json: dict[str, Any], node: str) -> int:
        """Join (or reuse) the sync group; returns this rank's global rank."""
        state = self._rq_expect(Phase.IDLE, "rq_begin_update")
        plan = SyncPlan.model_validate(plan_json)
        decision = SyncDecision.model_validate(decision_json)
        rank = decision.offsets[node] + int(getattr(self, "rank", 0))
        if not (decision.reuse_group and state.group is not None and state.group_id == decision.group_id):
            state.group = None
            if plan.backend == "nccl":
                import torch

                torch.cuda.set_device(self._rq_device())
            state.store = transport.connect_store(plan.store_host, plan.store_port, 30.0)
            state.group = transport.new_group(
                state.store, decision.group_id, rank, decision.world, plan.backend,
                timeout_s=60.0,
            )
            state.group_id = decision.group_id
        state.plan = plan
        state.received = set()
        state.phase = Phase.JOINED
        return rank

    def _rq_device(self) -> Any:
        return next(self._rq_model().parameters()).device

    def rq_receive_buckets(self, timeout_s: float) -> dict[str, float]:
        """Receive every bucket from rank 0 and load it into the model."""
        import torch

        state = self._rq_expect(Phase.JOINED, "rq_receive_buckets")
        assert state.plan is not None
        manifest = state.plan.manifest
        model = self._rq_model()
        device = self._rq_device()
        deadline = time.monotonic() + timeout_s
        by_bucket: dict[int, list[Any]] = {}
        for spec in manifest.tensors:
            by_bucket.setdefault(spec.bucket, []).append(spec)
        recv_s = load_s = 0.0
        try:
            if state.load_mode == "layerwise":
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(model)
                state.layerwise_open = True
            sizes = manifest.bucket_sizes

            def post(index: int) -> tuple[Any, Any]:
                buffer = torch.empty(sizes[index], dtype=torch.uint8, device=device)
                return buffer, transport.broadcast(state.group, buffer)

            # Bucket k+1 is already on its way while bucket k loads.
            pending = post(0) if sizes else None
            for index in range(len(sizes)):
                t0 = time.monotonic()
                assert pending is not None
                buffer, work = pending
                transport.wait(work, deadline - time.monotonic())
                pending = post(index + 1) if index + 1 < len(sizes) else None
                t1 = time.monotonic()
                specs = by_bucket.get(index, [])
                model.load_weights(weights=transport.bucket_views(buffer, specs))
                state.received.update(spec.name for spec in specs)
                load_s += time.monotonic() - t1
                recv_s += t1 - t0
        except Exception:
            state.group = None  # a failed collective leaves the group unusable
            raise
        state.phase = Phase.RECEIVED
        return {"receive_s": recv_s, "load_s": load_s}

    def rq_finish_update(self) -> int:
        """Check that every manifest entry arrived; finish layerwise processing."""
        state = self._rq_expect(Phase.RECEIVED, "rq_finish_update")
        assert state.plan is not None
        expected = {spec.name for spec in state.plan.manifest.tensors}
        missing = expected - state.received
        if missing:
            raise ManifestMismatch(
                f"{len(missing)} manifest tensors never arrived, e.g. {sorted(missing)[:3]}",
                phase="commit",
            )
        if state.layerwise_open:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self._rq_model(), self.model_config)  # type: ignore[attr-defined]
            state.layerwise_open = False
        if state.plan.backend == "nccl":
            import torch

            torch.cuda.synchronize()
        state.phase = Phase.IDLE
        return len(state.received)

    def rq_abort_update(self) -> str:
        state = self._rq_state()
        if state.layerwise_open:
            # Leave no half-processed layer behind: whatever arrived is
            # finalized; the host fences this worker until the next sync.
            try:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self._rq_model(), self.model_config)  # type: ignore[attr-defined]
            finally:
                state.layerwise_open = False
        state.phase = Phase.IDLE
        return "aborted"

    def rq_receive_one(self, name: str, dtype: str, shape: list[int], timeout_s: float) -> int:
        """One tensor over the current group, loaded at once: the seeds' per-parameter
        style (one control round trip per tensor), kept for the benchmark's baseline."""
        import torch

        state = self._rq_expect(Phase.IDLE, "rq_receive_one")
        if state.group is None:
            raise WeightSyncError("no sync group: run a sync first", phase="transfer")
        tensor = torch.empty(shape, dtype=transport.torch_dtype(dtype), device=self._rq_device())
        transport.wait(transport.broadcast(state.group, tensor.view(-1).view(torch.uint8)), timeout_s)
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
        else:
            model.load_weights(weights=[(name, tensor)])
        return tensor.numel()

    def rq_close_group(self) -> bool:
        state = self._rq_state()
        had = state.group is not None
        state.group = None
        state.store = None
        state.group_id = ""
        return had

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
