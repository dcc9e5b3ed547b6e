"""The receiving end of the weight sync, inside vLLM's worker processes.

vLLM mixes :class:`WeightReceiver` into its worker class
(``worker_extension_cls``, set by ``workers.engine.host``); the worker host
(``workers.node.sync``) calls it on every engine rank at once with
``collective_rpc``. Its steps mirror the sender's and run in this order, each
refusing to run out of turn::

    rq_attach(load_mode)                 once, at engine start
    rq_update(UpdateRequest)             the sync's one engine call, in turn:
      rq_begin_update(request)           join (or reuse) the group   IDLE → JOINED
      rq_receive_buckets()               receive and load buckets     JOINED → RECEIVED
      rq_finish_update()                 verify, finalize             RECEIVED → IDLE
    rq_abort_update()                    from any phase               → IDLE

``rq_update`` answers an ``UpdateResult``: its seconds, or the failure (a kind
and a message) that stopped it. Its deadlines are the plan's
(``WorkerTimeouts``). Calls only the benchmarks make live in
``weight_sync.bench_receiver``.

With direct loading (CUDA), a tensor that ``load_weights`` only copies, whole,
into a region of one parameter is received straight into that region from
the sync after the one that showed it (``weight_sync/inplace.py``); a bucket's
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

from rollout_queue.tasks.errors import ManifestMismatch, WeightSyncError
from rollout_queue.weight_sync import cpu_weights, wire
from rollout_queue.weight_sync.inplace import InPlaceMap
from rollout_queue.weight_sync.protocol import (
    Manifest,
    SyncFailure,
    SyncPlan,
    TensorSpec,
    UpdateRequest,
    UpdateResult,
)
from rollout_queue.weight_sync.wire import Bucket, Piece

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
        still_held: list[Any] = []
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


def _buffer_layout(pieces: list[Piece], in_place: dict[str, Any]) -> tuple[list[int | None], int]:
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


def _buffer_offsets(specs: list[TensorSpec], pieces: list[Piece], at: list[int | None]) -> list[int]:
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


class _BucketReceive:
    """One sync's receive and load, bucket by bucket; each method one step.

    Buckets are posted to the wire ahead (``top_up``) while their buffers stay
    within ``ahead`` buckets' worth (and at least ``ahead`` of them): the wire
    never waits for a load or for this process to post. When most pieces land
    in place, that is every bucket at once. Each bucket's pieces are then
    awaited in order (``receive``) and the tensors they complete loaded
    (``load``).
    """

    def __init__(self, receiver: WeightReceiver, state: _ReceiverState, manifest: Manifest, device: Any,
                 in_place: dict[str, Any], deadline: float, ahead: int) -> None:
        self.receiver = receiver
        self.state = state
        self.manifest = manifest
        self.device = device
        self.deadline = deadline
        self.ahead = ahead
        self.buckets = list(wire.iter_buckets(manifest))
        self.in_place = in_place
        # A bucket's buffer holds its other pieces only, back to back.
        self.layouts = [_buffer_layout(bucket.pieces, in_place) for bucket in self.buckets]
        self.budget = ahead * max(manifest.bucket_sizes)
        # Per posted bucket: its buffer, and (end of the bytes it completes, work) per wait.
        self.posted: collections.deque[tuple[Any, list[tuple[int, Any]]]] = collections.deque()
        self.upcoming = 0  # the next bucket to post
        self.wire_s = 0.0
        self.load_s = 0.0
        self.started = time.monotonic()
        self.trace: list[str] | None = [] if os.environ.get("RQ_SYNC_TRACE") else None

    def run(self) -> None:
        self.top_up()
        for bucket in self.buckets:
            self.receive(bucket)
        if self.trace is not None:
            print("[rq-sync-trace] receiver " + "; ".join(self.trace), file=sys.stderr, flush=True)

    def top_up(self) -> None:
        """Post the next buckets while the buffers in flight stay within the budget."""
        while self.upcoming < len(self.buckets):
            held = sum(self.layouts[i][1] for i in range(self.upcoming - len(self.posted), self.upcoming))
            if len(self.posted) >= self.ahead and held + self.layouts[self.upcoming][1] > self.budget:
                return
            self.posted.append(self.post(self.buckets[self.upcoming]))
            self.upcoming += 1

    def post(self, bucket: Bucket) -> tuple[Any, list[tuple[int, Any]]]:
        """Start receiving ``bucket``: each piece into the parameter it lands in, or
        into its place in a buffer from the pool."""
        at, need = self.layouts[bucket.index]
        buffer = self.state.buffers.take(need, self.device) if need else None
        targets = []
        for (start, end, direct), offset in zip(bucket.pieces, at):
            if offset is None:
                assert direct is not None
                self.state.touched = True
                targets.append(self.in_place[direct])
            else:
                assert buffer is not None  # ``need`` counts this piece
                targets.append(buffer[offset : offset + end - start])
        works = wire.broadcast_bucket(self.state.group, self.manifest, targets)
        ends = [end for _, end, _ in bucket.pieces]
        if len(works) < len(ends):  # the bucket as one group: one work, loaded at its end
            ends = ends[-1:]
        return buffer, list(zip(ends, works))

    def receive(self, bucket: Bucket) -> None:
        """Wait for the bucket's pieces in order; load the tensors they complete."""
        buffer, works = self.posted.popleft()
        specs = bucket.specs
        loaded = 0
        loaded_upto = 0  # bytes of this bucket handed to load_weights so far
        for piece, (end, work) in enumerate(works):
            t0 = time.monotonic()
            wire.wait(work, self.deadline - time.monotonic())
            last = piece == len(works) - 1
            if last:
                self.top_up()
            t1 = time.monotonic()
            self.wire_s += t1 - t0
            # One load_weights call per chunk_bytes (or per bucket), however
            # many pieces that took: each call has a fixed cost (measured on
            # the GPU: ~0.5 ms; 160 calls for a 7B model tripled its load time).
            chunk = self.manifest.chunk_bytes
            if not last and (not chunk or end - loaded_upto < chunk):
                continue
            ready = loaded
            while ready < len(specs) and specs[ready].offset + specs[ready].nbytes <= end:
                ready += 1
            loaded_upto = end
            if ready > loaded:
                self.load(buffer, bucket, specs[loaded:ready])
                loaded = ready
            self.load_s += time.monotonic() - t1
            if self.trace is not None:
                self.trace.append(f"b{bucket.index}.{piece} wait {t0 - self.started:.4f}-"
                                  f"{t1 - self.started:.4f} load -{time.monotonic() - self.started:.4f}")
        if buffer is not None:
            self.state.buffers.loaded_into_model(buffer, still_referenced=self.state.layerwise_open)

    def load(self, buffer: Any, bucket: Bucket, specs: list[TensorSpec]) -> None:
        """Load these tensors of ``bucket`` (those not already received in place)."""
        batch = [spec for spec in specs if spec.name not in self.in_place]
        at = self.layouts[bucket.index][0]
        self.receiver._rq_load(buffer, batch, _buffer_offsets(batch, bucket.pieces, at))
        self.state.received.update(spec.name for spec in specs)

    def stats(self) -> dict[str, float]:
        return {"wire_s": self.wire_s, "load_s": self.load_s, "in_place_tensors": len(self.in_place),
                "in_place_bytes": sum(s.nbytes for s in self.manifest.tensors if s.name in self.in_place)}


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

    def _rq_device(self) -> Any:
        return next(self._rq_model().parameters()).device

    # ------------------------------------------------------------------ phases

    def rq_attach(self, load_mode: str) -> str:
        self._rq = _ReceiverState(load_mode)
        return load_mode

    def rq_update(self, request: dict[str, Any]) -> dict[str, Any]:
        """Join, receive and load, verify and finalize (an ``UpdateRequest``); answers
        an ``UpdateResult``: the seconds of each step, or what failed."""
        try:
            parsed = UpdateRequest.model_validate(request)
            t0 = time.monotonic()
            self.rq_begin_update(parsed)
            t1 = time.monotonic()
            stats = self.rq_receive_buckets()
            t2 = time.monotonic()
            self.rq_finish_update()
        except Exception as exc:  # noqa: BLE001  answered as a kind and a message; the host rolls back
            return UpdateResult(failure=SyncFailure.of(exc)).model_dump(mode="json")
        seconds = {"join_s": t1 - t0, "receive_s": t2 - t1, **stats, "finish_s": time.monotonic() - t2}
        return UpdateResult(seconds=seconds).model_dump(mode="json")

    def rq_begin_update(self, request: UpdateRequest) -> int:
        """Join (or reuse) the sync group; returns this rank's global rank.

        ``request.manifest``: the plan's manifest, sent when it is not the one this
        rank received last (it is kept for the syncs that follow).
        """
        state = self._rq_expect(Phase.IDLE, "rq_begin_update")
        plan, decision = request.plan, request.decision
        if request.manifest is not None:
            state.manifest = (plan.manifest_digest, Manifest.from_wire(request.manifest, plan.manifest_digest))
        if state.manifest is None or state.manifest[0] != plan.manifest_digest:
            raise WeightSyncError(
                f"manifest {plan.manifest_digest[:12]} was never sent to this engine rank", phase="load")
        plan.manifest = state.manifest[1]
        rank = decision.offsets[request.node] + int(getattr(self, "rank", 0))
        if not (decision.reuse_group and state.group is not None and state.group_id == decision.group_id):
            state.group = None
            if plan.backend == "nccl":
                import torch

                torch.cuda.set_device(self._rq_device())
            state.store = wire.connect_store(plan.store_host, plan.store_port, plan.timeouts.store_connect)
            state.group = wire.new_group(
                state.store, decision.group_id, rank, decision.world, plan.backend,
                timeout_s=plan.timeouts.group_join, device=self._rq_device(),
            )
            state.group_id = decision.group_id
        state.plan = plan
        state.received = set()
        state.touched = False
        state.phase = Phase.JOINED
        return rank

    def rq_receive_buckets(self) -> dict[str, float]:
        """Receive every bucket from rank 0 and load it into the model."""
        state = self._rq_expect(Phase.JOINED, "rq_receive_buckets")
        assert state.plan is not None and state.plan.manifest is not None
        manifest = state.plan.manifest
        model = self._rq_model()
        device = self._rq_device()  # before a layerwise reload moves the parameters to "meta"
        deadline = time.monotonic() + state.plan.timeouts.receive
        try:
            if state.load_mode == "layerwise":
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(model)
                state.layerwise_open = True
            receive = _BucketReceive(self, state, manifest, device, self._rq_in_place(state, manifest),
                                     deadline, self.RECEIVE_AHEAD)
            receive.run()
        except Exception:
            state.group = None  # a failed collective leaves the group unusable
            state.buffers = _BufferPool()  # a receive may still be writing into one
            raise
        state.phase = Phase.RECEIVED
        state.last_stats = receive.stats()
        return {"wire_s": receive.wire_s, "load_s": receive.load_s}

    def _rq_in_place(self, state: _ReceiverState, manifest: Manifest) -> dict[str, Any]:
        """Direct pieces that vLLM would only copy, whole, into a parameter: where they land."""
        if state.load_mode != "direct":
            return {}
        sent_direct = {name for bucket in wire.iter_buckets(manifest) for _, _, name in bucket.pieces if name}
        return state.in_place.targets(self._rq_model(), [t for t in manifest.tensors if t.name in sent_direct])

    def _rq_load(self, buffer: Any, specs: list[TensorSpec], offsets: list[int]) -> None:
        """``load_weights`` on these tensors of a received bucket (each at its offset
        in ``buffer``); with direct loading, learn meanwhile which of them can be
        received in place."""
        if not specs:
            return
        state, model = self._rq_state(), self._rq_model()
        views = wire.bucket_views(buffer, specs, offsets)
        if state.load_mode != "direct" or all(state.in_place.known(spec.name) for spec in specs):
            model.load_weights(weights=views)
            return
        with state.in_place.watch(model, buffer, specs, offsets):
            model.load_weights(weights=views)

    def rq_finish_update(self) -> int:
        """Check that every manifest entry arrived; finish layerwise processing."""
        state = self._rq_expect(Phase.RECEIVED, "rq_finish_update")
        assert state.plan is not None and state.plan.manifest is not None
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
