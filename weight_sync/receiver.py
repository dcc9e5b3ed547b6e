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

``rq_update`` runs the three middle steps in one call (one engine round trip
instead of three); the host uses it.

With direct loading (CUDA), a tensor that ``load_weights`` only copies, whole,
into a region of one parameter is received straight into that region from
the sync after the one that showed it (``workers/inplace.py``); a bucket's
buffer then holds only its other pieces, back to back.

Receive buffers come from a small pool that lives on between syncs: on CPU
there is no caching allocator, and a fresh 1 GiB buffer costs a page fault per
4 KiB (measured here: 0.36 s vs 0.10 s to fill one). Under layerwise reload
vLLM keeps views of a bucket until the layer that owns them is complete, so a
loaded buffer goes back to the pool only once no pending layer refers to it.
"""

from __future__ import annotations

import collections
import enum
import os
import sys
import time
from typing import Any

from tasks import transport
from tasks.errors import ManifestMismatch, WeightSyncError
from tasks.schemas import Manifest, SyncDecision, SyncPlan
from workers import cpu_weights
from workers.inplace import InPlaceMap

if cpu_weights.requested():  # imported by vLLM's worker process before it loads the model
    cpu_weights.keep_plain_weights()


class Phase(enum.Enum):
    IDLE = "idle"
    JOINED = "joined"
    RECEIVED = "received"


_NEXT_STEP = {
    Phase.IDLE: "rq_begin_update",
    Phase.JOINED: "rq_receive_buckets",
    Phase.RECEIVED: "rq_finish_update",
}


class _BufferPool:
    """Receive buffers: in flight, loaded (maybe still referenced), or free."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.busy: list[Any] = []
        self.loaded: list[Any] = []
        self.free: list[Any] = []

    def take(self, size: int, device: Any) -> Any:
        import torch

        self._reclaim()
        for i, buffer in enumerate(self.free):
            if buffer.device == device and buffer.numel() >= size:
                chosen = self.free.pop(i)
                break
        else:
            chosen = torch.empty(size, dtype=torch.uint8, device=device)
        self.busy.append(chosen)
        return chosen[:size]

    def loaded_into_model(self, view: Any, still_referenced: bool) -> None:
        base = next(b for b in self.busy if b.data_ptr() == view.data_ptr())
        self.busy.remove(base)
        (self.loaded if still_referenced else self.free).append(base)

    def settle(self) -> None:
        """The sync is over (finalized or aborted): nothing refers to any buffer."""
        everything = sorted(self.free + self.loaded + self.busy, key=lambda b: b.numel(), reverse=True)
        self.free, self.loaded, self.busy = everything[: self.keep], [], []

    def _reclaim(self) -> None:
        if not self.loaded:
            return
        held = _pending_layerwise_storages()
        if held is None:  # cannot tell on this vLLM: keep them until the sync ends
            return
        still_held = []
        for buffer in self.loaded:
            (still_held if buffer.untyped_storage().data_ptr() in held else self.free).append(buffer)
        self.loaded = still_held


def _pending_layerwise_storages() -> set[int] | None:
    """Storages of the tensors that layers not yet processed still hold."""
    import torch

    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    held: set[int] = set()
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in getattr(info, "loaded_weights", ()):
            for value in bound.arguments.values():
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    held.add(value.untyped_storage().data_ptr())
    return held


def refresh_tied_layers(model: Any, loaded: set[str] | None = None) -> list[str]:
    """Re-run the weight processing of layers that share a weight with another layer.

    vLLM's layerwise reload processes a tied weight through one owner only
    (its documented limitation 2). On CPU that leaves a tied ``lm_head`` with
    the oneDNN handle packed from the *old* embedding: seen here, a tied model
    kept sampling the old model's tokens after a sync. Processing of unquantized
    embeddings and heads is idempotent (CPU: a new GEMM handle; CUDA: nothing).
    ``loaded``: checkpoint names that arrived; a tie none of them touched is left,
    and the owner that arrived (processed by the reload) is not processed twice.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    by_storage: dict[int, list[tuple[str, Any]]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None and weight.numel() and not weight.is_meta:
            by_storage.setdefault(weight.data_ptr(), []).append((name, module))
    refreshed = []
    for sharing in by_storage.values():
        if len(sharing) < 2:
            continue
        if loaded is not None and not any(f"{name}.weight" in loaded for name, _ in sharing):
            continue
        for name, module in sharing:
            if loaded is not None and f"{name}.weight" in loaded:
                continue  # the reload processed this owner already
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                refreshed.append(name)
    return refreshed


def _buffer_layout(
    pieces: list[tuple[int, int, str | None]], in_place: dict[str, Any]
) -> tuple[list[int | None], int]:
    """Where each piece of a bucket lands in its buffer (``None``: in place), and
    the buffer's size: the pieces not received in place, back to back."""
    at: list[int | None] = []
    used = 0
    for start, end, direct in pieces:
        if direct is not None and direct in in_place:
            at.append(None)
        else:
            at.append(used)
            used += end - start
    return at, used


def _buffer_offsets(
    specs: list[Any], pieces: list[tuple[int, int, str | None]], at: list[int | None]
) -> list[int]:
    """Each tensor's offset in its bucket's buffer (see ``_buffer_layout``). A tensor
    starts in one piece and, if it runs on, continues in the next (adjacent) ones."""
    offsets = []
    piece = 0
    for spec in specs:
        while pieces[piece][1] <= spec.offset:
            piece += 1
        start = at[piece]
        assert start is not None, f"{spec.name} was received in place"
        offsets.append(start + spec.offset - pieces[piece][0])
    return offsets


class _ReceiverState:
    def __init__(self, load_mode: str) -> None:
        self.load_mode = load_mode
        self.phase = Phase.IDLE
        self.group: Any = None
        self.group_id = ""
        self.store: Any = None
        self.plan: SyncPlan | None = None
        self.manifest: tuple[str, Manifest] | None = None  # the last one sent: digest, manifest
        self.received: set[str] = set()
        self.layerwise_open = False
        self.touched = False  # a receive straight into the model's parameters was posted
        self.in_place = InPlaceMap()
        self.last_stats: dict[str, float] = {}  # of the last receive
        self.buffers = _BufferPool()


class WeightReceiver:
    """Mixed into vLLM's worker: ``self`` is the worker (model_runner, device...)."""

    _rq: _ReceiverState
    RECEIVE_AHEAD = 2  # buckets posted to the wire beyond the one being loaded

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

    def rq_update(
        self, plan_json: dict[str, Any], decision_json: dict[str, Any], node: str, timeout_s: float,
        manifest_json: str | None = None,
    ) -> dict[str, float]:
        """Join, receive and load, verify and finalize; seconds of each step."""
        t0 = time.monotonic()
        self.rq_begin_update(plan_json, decision_json, node, manifest_json)
        t1 = time.monotonic()
        stats = self.rq_receive_buckets(timeout_s)
        t2 = time.monotonic()
        self.rq_finish_update()
        return {"join_s": t1 - t0, "receive_s": t2 - t1, **stats, "finish_s": time.monotonic() - t2}

    def rq_begin_update(
        self, plan_json: dict[str, Any], decision_json: dict[str, Any], node: str,
        manifest_json: str | None = None,
    ) -> int:
        """Join (or reuse) the sync group; returns this rank's global rank.

        ``manifest_json``: the plan's manifest, sent when it is not the one this
        rank received last (it is kept for the syncs that follow).
        """
        state = self._rq_expect(Phase.IDLE, "rq_begin_update")
        plan = SyncPlan.model_validate(plan_json)
        if manifest_json is not None:
            state.manifest = (plan.manifest_digest, Manifest.from_wire(manifest_json, plan.manifest_digest))
        if state.manifest is None or state.manifest[0] != plan.manifest_digest:
            raise WeightSyncError(
                f"manifest {plan.manifest_digest[:12]} was never sent to this engine rank", phase="load")
        plan.manifest = state.manifest[1]
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
                timeout_s=60.0, device=self._rq_device(),
            )
            state.group_id = decision.group_id
        state.plan = plan
        state.received = set()
        state.touched = False
        state.phase = Phase.JOINED
        return rank

    def _rq_device(self) -> Any:
        return next(self._rq_model().parameters()).device

    def rq_receive_buckets(self, timeout_s: float) -> dict[str, float]:
        """Receive every bucket from rank 0 and load it into the model."""

        state = self._rq_expect(Phase.JOINED, "rq_receive_buckets")
        assert state.plan is not None
        manifest = state.plan.manifest
        assert manifest is not None
        model = self._rq_model()
        device = self._rq_device()
        deadline = time.monotonic() + timeout_s
        by_bucket: dict[int, list[Any]] = {}
        for spec in manifest.tensors:
            by_bucket.setdefault(spec.bucket, []).append(spec)
        recv_s = load_s = 0.0
        start = time.monotonic()
        trace: list[str] | None = [] if os.environ.get("RQ_SYNC_TRACE") else None
        try:
            if state.load_mode == "layerwise":
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(model)
                state.layerwise_open = True
            sizes = manifest.bucket_sizes
            pieces = [transport.piece_ranges(manifest, size, by_bucket.get(index, []))
                      for index, size in enumerate(sizes)]
            # Direct pieces that vLLM would only copy, whole, into a parameter land there.
            in_place: dict[str, Any] = {}
            if state.load_mode == "direct":
                sent_direct = {name for bucket in pieces for _, _, name in bucket if name}
                in_place = state.in_place.targets(model, [t for t in manifest.tensors if t.name in sent_direct])
            # A bucket's buffer holds its other pieces only, back to back.
            layouts = [_buffer_layout(bucket, in_place) for bucket in pieces]
            budget = self.RECEIVE_AHEAD * max(sizes)

            def post(index: int) -> tuple[Any, list[tuple[int, Any]]]:
                at, need = layouts[index]
                buffer = state.buffers.take(need, device) if need else None
                targets = []
                for (start, end, direct), offset in zip(pieces[index], at):
                    if offset is None:
                        state.touched = True
                        targets.append(in_place[direct])
                    else:
                        targets.append(buffer[offset : offset + end - start])
                works = transport.broadcast_bucket(state.group, manifest, targets)
                ends = [end for _, end, _ in pieces[index]]
                if len(works) < len(ends):  # the bucket as one group: one work, loaded at its end
                    ends = ends[-1:]
                return buffer, list(zip(ends, works))

            # Buckets are posted ahead while their buffers stay within RECEIVE_AHEAD
            # buckets' worth (and at least RECEIVE_AHEAD of them): the wire never
            # waits for a load or for this process to post. When most pieces land
            # in place, that is every bucket at once.
            posted: collections.deque[tuple[Any, list[tuple[int, Any]]]] = collections.deque()
            upcoming = 0

            def top_up() -> None:
                nonlocal upcoming
                while upcoming < len(sizes):
                    held = sum(layouts[i][1] for i in range(upcoming - len(posted), upcoming))
                    if len(posted) >= self.RECEIVE_AHEAD and held + layouts[upcoming][1] > budget:
                        return
                    posted.append(post(upcoming))
                    upcoming += 1

            top_up()
            for index in range(len(sizes)):
                buffer, works = posted.popleft()
                specs = by_bucket.get(index, [])  # in offset order
                at = layouts[index][0]
                loaded = 0
                loaded_upto = 0  # bytes of this bucket handed to load_weights so far
                for piece, (end, work) in enumerate(works):
                    t0 = time.monotonic()
                    transport.wait(work, deadline - time.monotonic())
                    last = piece == len(works) - 1
                    if last:
                        top_up()
                    t1 = time.monotonic()
                    recv_s += t1 - t0
                    # One load_weights call per chunk_bytes (or per bucket), however
                    # many pieces that took: each call has a fixed cost (measured on
                    # the GPU: ~0.5 ms; 160 calls for a 7B model tripled its load time).
                    if not last and (not manifest.chunk_bytes or end - loaded_upto < manifest.chunk_bytes):
                        continue
                    ready = loaded
                    while ready < len(specs) and specs[ready].offset + specs[ready].nbytes <= end:
                        ready += 1
                    loaded_upto = end
                    if ready > loaded:
                        batch = [spec for spec in specs[loaded:ready] if spec.name not in in_place]
                        self._rq_load(buffer, batch, _buffer_offsets(batch, pieces[index], at))
                        state.received.update(spec.name for spec in specs[loaded:ready])
                        loaded = ready
                    load_s += time.monotonic() - t1
                    if trace is not None:
                        trace.append(f"b{index}.{piece} wait {t0 - start:.4f}-{t1 - start:.4f} "
                                     f"load -{time.monotonic() - start:.4f}")
                if buffer is not None:
                    state.buffers.loaded_into_model(buffer, still_referenced=state.layerwise_open)
        except Exception:
            state.group = None  # a failed collective leaves the group unusable
            state.buffers = _BufferPool()  # a receive may still be writing into one
            raise
        state.phase = Phase.RECEIVED
        state.last_stats = {"wire_s": recv_s, "load_s": load_s,
                            "in_place_tensors": len(in_place),
                            "in_place_bytes": sum(spec.nbytes for spec in manifest.tensors if spec.name in in_place)}
        if trace is not None:
            print("[rq-sync-trace] receiver " + "; ".join(trace), file=sys.stderr, flush=True)
        return {"wire_s": recv_s, "load_s": load_s}

    def _rq_load(self, buffer: Any, specs: list[Any], offsets: list[int]) -> None:
        """``load_weights`` on these tensors of a received bucket (each at its offset
        in ``buffer``); with direct loading, learn meanwhile which of them can be
        received in place."""
        if not specs:
            return
        state, model = self._rq_state(), self._rq_model()
        views = transport.bucket_views(buffer, specs, offsets)
        if state.load_mode != "direct" or all(state.in_place.known(spec.name) for spec in specs):
            model.load_weights(weights=views)
            return
        with state.in_place.watch(model, buffer, specs, offsets):
            model.load_weights(weights=views)

    def rq_finish_update(self) -> int:
        """Check that every manifest entry arrived; finish layerwise processing."""
        state = self._rq_expect(Phase.RECEIVED, "rq_finish_update")
        assert state.plan is not None
        assert state.plan.manifest is not None
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
            refresh_tied_layers(self._rq_model(), state.received)
        state.buffers.settle()
        if state.plan.backend == "nccl":
            import torch

            torch.cuda.synchronize()
        state.phase = Phase.IDLE
        return len(state.received)

    def rq_abort_update(self) -> bool:
        """Back to IDLE from any phase; True when some weight had already changed."""
        state = self._rq_state()
        changed = bool(state.received) or state.layerwise_open or state.touched
        if state.layerwise_open:
            # Leave no half-processed layer behind: whatever arrived is
            # finalized; the host fences this worker until the next sync.
            try:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self._rq_model(), self.model_config)  # type: ignore[attr-defined]
            finally:
                state.layerwise_open = False
        state.buffers.settle()
        state.received = set()
        state.touched = False
        state.phase = Phase.IDLE
        return changed

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
            refresh_tied_layers(model, {name})
        else:
            model.load_weights(weights=[(name, tensor)])
        return tensor.numel()

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
        works = [transport.broadcast(state.group, buffer) for buffer in raw]
        for work in works:
            transport.wait(work, timeout_s)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.monotonic() - t0

    def rq_last_receive(self) -> dict[str, float]:
        """Wire and load seconds of the last sync's receive, and what went in place."""
        return dict(self._rq_state().last_stats)

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
