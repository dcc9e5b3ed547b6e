"""The receiving end of the weight sync, inside vLLM's worker processes.

vLLM mixes :class:`WeightReceiver` into its worker class
(``worker_extension_cls``, set by ``workers.engine.host``); it holds one
:class:`EngineReceiver`, made at ``rq_attach``, and forwards each call to it.
The worker host (``workers.node.sync``) calls it on every engine rank at once
with ``collective_rpc``. Its steps mirror the sender's and run in this order,
each refusing to run out of turn::

    rq_attach(load_mode, line_path)      once, at engine start (and the update
                                         line's listener: ``weight_sync.update_line``)
    rq_update(UpdateRequest)             the sync's one engine call, in turn:
      rq_begin_update(request)           join the transport           IDLE → JOINED
      rq_receive_buckets()               receive and load buckets     JOINED → RECEIVED
      rq_finish_update()                 verify, finalize             RECEIVED → IDLE
    rq_abort_update()                    from any phase               → IDLE

A single-rank engine also takes ``rq_update`` over the update line, from a
thread of its own; the receiver serves one call at a time, whichever way it
came (``EngineReceiver.serial``).

``rq_update`` answers an ``UpdateResult``: its seconds, or the failure (a kind
and a message) that stopped it. Its deadlines are the plan's
(``WorkerTimeouts``). How the buckets arrive is the worker's transport's
(``weight_sync.transports``: a process group, or a buffer the trainer hands
over); loading them is this module's. Calls only the benchmarks make live in
``weight_sync.bench_receiver``.

With direct loading (CUDA), a tensor that ``load_weights`` only copies, whole,
into a region of one parameter is received straight into that region from
the sync after the one that showed it (``weight_sync/inplace.py``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout_queue.tasks.errors import ManifestMismatch, WeightSyncError
from rollout_queue.weight_sync import cpu_weights, transports, wire
from rollout_queue.weight_sync.inplace import InPlaceMap
from rollout_queue.weight_sync.protocol import (
    Manifest,
    SyncFailure,
    SyncPlan,
    TensorSpec,
    UpdateRequest,
    UpdateResult,
)
from rollout_queue.weight_sync.transports.base import TransportReceiver
from rollout_queue.weight_sync.update_line import LineListener, core_stream, on_stream

log = logging.getLogger(__name__)

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



@dataclass
class _SteadyLoad:
    """A planned load of a handoff's storages (``EngineReceiver.load_tensors``), kept
    for the next load of the same layout: its ``tensors`` (the handoff's list, the
    same object while the layout holds), the in-place map's generation it was
    planned from, the copies' destinations and sources, what goes through
    ``load_weights``, the parameters the destinations rest on, and which one each
    destination rests on. Planning walks the model and slices every source (2 ms
    of a 0.5B sync on the 2-core VM); checking that the plan still holds reads a
    few attributes per parameter."""

    tensors: Sequence[tuple[TensorSpec, Any, int, int]]
    generation: int
    destinations: list[Any]
    sources: list[Any]
    known: list[tuple[str, Any]]
    anchors: list[tuple[Any, str, Any, int]]
    rests_on: list[int]  # per destination, its parameter's index in ``anchors``

    def serves(self, tensors: Sequence[tuple[TensorSpec, Any, int, int]], generation: int) -> bool:
        """Whether this plan was made for ``tensors`` with the in-place map at ``generation``
        (its parameters are checked as the copies go: :meth:`copy`)."""
        return self.tensors is tensors and self.generation == generation

    def copy(self) -> float | None:
        """Issue the planned copies, each parameter checked to be where the plan found
        it (``InPlaceMap.holds``) just before the first copy into it: the first copy
        goes after one check, not after all of them (0.3-0.4 ms of a steady 7B
        handoff on an H100 host). Returns when the first copy was issued (monotonic);
        None when a parameter moved: the copies issued before it went to places that
        held, and the caller plans the load anew."""
        import torch

        checked = bytearray(len(self.anchors))
        first: float | None = None
        with torch._C.DisableTorchFunctionSubclass():
            for region, source, at in zip(self.destinations, self.sources, self.rests_on):
                if not checked[at]:
                    if not InPlaceMap.holds(self.anchors[at]):
                        return None
                    checked[at] = 1
                if first is None:
                    first = time.monotonic()
                region.copy_(source, non_blocking=True)
        return time.monotonic() if first is None else first


class EngineReceiver:
    """One engine rank's end of the sync: phases, the transports' ends, loading.

    ``worker``: vLLM's worker this rank runs in (its model runner, rank, config).
    """

    def __init__(self, worker: Any, load_mode: str) -> None:
        self.worker = worker
        self.load_mode = load_mode
        self.phase = Phase.IDLE
        self.plan: SyncPlan | None = None
        self.manifest: tuple[str, Manifest] | None = None  # the last one sent: digest, manifest
        self.transport: TransportReceiver | None = None  # the current sync's
        self.transports: dict[str, TransportReceiver] = {}  # by name, kept between syncs
        self.received: set[str] = set()
        self.layerwise_open = False
        self.bytes_touched = False  # a receive straight into the model's parameters was posted
        self.in_place = InPlaceMap()
        self.last_stats: dict[str, float] = {}  # of the last receive
        self._steady: _SteadyLoad | None = None  # the last load of a handoff's storages, as planned
        # What the last update's reads of the trainer's memory end with, when they
        # may still run on the device (``TransportReceiver.finish``).
        self.released: str | None = None
        # The sync's calls come from the engine core's thread (collective_rpc) and from
        # the update line's: one at a time.
        self.serial = threading.RLock()

    # ---------------------------------------------------------------- helpers

    def expect(self, phase: Phase, method: str) -> None:
        if self.phase is not phase:
            raise WeightSyncError(
                f"{method} called in phase {self.phase.value}; call {_NEXT_STEP[self.phase]} first",
                phase="load",
            )

    def model(self) -> Any:
        return self.worker.model_runner.model

    def device(self) -> Any:
        return next(self.model().parameters()).device

    def end(self, name: str) -> TransportReceiver:
        """This rank's end of transport ``name`` (kept between syncs)."""
        if name not in self.transports:
            self.transports[name] = transports.receiver_class(name)(name)
        return self.transports[name]

    # ------------------------------------------------------------------ phases

    def update(self, request: dict[str, Any]) -> dict[str, Any]:
        """Join, receive and load, verify and finalize (an ``UpdateRequest``); answers
        an ``UpdateResult``: the seconds of each step, or what failed."""
        entered = time.monotonic()
        try:
            parsed = UpdateRequest.model_validate(request)
            t0 = time.monotonic()
            self.begin_update(parsed)
            t1 = time.monotonic()
            stats = self.receive_buckets()
            t2 = time.monotonic()
            self.finish_update()
        except Exception as exc:  # noqa: BLE001  answered as a kind and a message; the host rolls back
            return _failed(exc)
        left = time.monotonic()
        # entered_at/left_at: this host's monotonic clock, one for every process on it; the
        # worker host subtracts its own stamps around the call (the call's way in and out).
        seconds = {"join_s": t1 - t0, "receive_s": t2 - t1, **stats, "finish_s": left - t2,
                   "entered_at": entered, "left_at": left}
        return UpdateResult(seconds=seconds, released=self.released).model_dump(mode="json")

    def begin_update(self, request: UpdateRequest) -> int:
        """Join this sync's transport (a group: join or reuse it); returns this rank's global rank.

        ``request.manifest``: the plan's manifest, sent when it is not the one this
        rank received last (it is kept for the syncs that follow).
        """
        self.expect(Phase.IDLE, "rq_begin_update")
        self.released = None
        plan, decision = request.plan, request.decision
        if request.manifest is not None:
            self.manifest = (plan.manifest_digest, Manifest.from_wire(request.manifest, plan.manifest_digest))
        if self.manifest is None or self.manifest[0] != plan.manifest_digest:
            raise WeightSyncError(
                f"manifest {plan.manifest_digest[:12]} was never sent to this engine rank", phase="load")
        plan.manifest = self.manifest[1]
        rank = decision.offsets.get(request.node, 0) + int(getattr(self.worker, "rank", 0))
        self.transport = self.end(plan.transport_of(request.node))
        self.transport.begin(request, rank, self.device())
        self.plan = plan
        self.received = set()
        self.bytes_touched = False
        self.phase = Phase.JOINED
        return rank

    def receive_buckets(self) -> dict[str, float]:
        """Take every bucket from the transport and load it into the model."""
        self.expect(Phase.JOINED, "rq_receive_buckets")
        assert self.plan is not None and self.plan.manifest is not None and self.transport is not None
        manifest = self.plan.manifest
        model = self.model()
        device = self.device()  # before a layerwise reload moves the parameters to "meta"
        deadline = time.monotonic() + self.plan.timeouts.receive
        if self.load_mode == "layerwise":
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(model)
            self.layerwise_open = True
        stats = self.transport.receive(self, manifest, device, deadline)
        if "planned" not in stats:  # not a load of the trainer's storages: drop that plan, and what it maps
            self._steady = None
        self.phase = Phase.RECEIVED
        self.last_stats = stats
        timed = {"wire_s": stats.get("wire_s", 0.0), "load_s": stats.get("load_s", 0.0)}
        # The load's host side, where the transport timed it (a handoff of the trainer's storages).
        timed.update({step: stats[step] for step in ("resolve_s", "issue_s") if step in stats})
        return timed

    def finish_update(self) -> int:
        """Check that every manifest entry arrived; finish layerwise processing."""
        self.expect(Phase.RECEIVED, "rq_finish_update")
        assert self.plan is not None and self.plan.manifest is not None and self.transport is not None
        expected = {spec.name for spec in self.plan.manifest.tensors}
        missing = expected - self.received
        if missing:
            raise ManifestMismatch(
                f"{len(missing)} manifest tensors never arrived, e.g. {sorted(missing)[:3]}",
                phase="commit",
            )
        if self.layerwise_open:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model(), self.worker.model_config)
            self.layerwise_open = False
            refresh_tied_layers(self.model(), self.received)
        self.released = self.transport.finish()
        self.phase = Phase.IDLE
        return len(self.received)

    def abort_update(self) -> bool:
        """Back to IDLE from any phase; True when some weight had already changed."""
        changed = bool(self.received) or self.layerwise_open or self.bytes_touched
        if self.layerwise_open:
            # Leave no half-processed layer behind: whatever arrived is
            # finalized; the host fences this worker until the next sync.
            try:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self.model(), self.worker.model_config)
            finally:
                self.layerwise_open = False
        if self.transport is not None:
            self.transport.abort()
        self._steady = None  # it holds the trainer's memory the transport just let go of
        self.received = set()
        self.bytes_touched = False
        self.phase = Phase.IDLE
        return changed

    # ------------------------------------------------- what transports call (BucketSink)

    def load(self, buffer: Any, specs: Sequence[TensorSpec], offsets: Sequence[int], *,
             learn_in_place: bool = True) -> None:
        """``load_weights`` on these tensors of a received bucket (each at its offset
        in ``buffer``); with direct loading, learn meanwhile which of them can be
        received in place (``learn_in_place``)."""
        if not specs:
            return
        model = self.model()
        views = wire.bucket_views(buffer, specs, offsets)
        if (not learn_in_place or self.load_mode != "direct"
                or all(self.in_place.known(spec.name) for spec in specs)):
            model.load_weights(weights=views)
            return
        with self.in_place.watch(model, buffer, specs, offsets):
            model.load_weights(weights=views)

    def load_tensors(self, tensors: Sequence[tuple[TensorSpec, Any, int, int]]) -> dict[str, float]:
        """Load tensors that lie in several buffers (a handoff of the trainer's own
        storages). With direct loading, the tensors the in-place map knows are
        copied straight into their parameter regions (one ``copy_`` each), those
        it does not know yet are loaded in one ``load_weights`` while it watches
        (the first sync), the rest go through one ``load_weights``. Returns what
        ``BucketSink.load_tensors`` says, and ``planned``: 1.0 when this load found
        each tensor's place anew, 0.0 when it reused the last load's plan."""
        model = self.model()
        if self.load_mode != "direct":
            model.load_weights(weights=[self._typed(spec, buffer, at) for spec, buffer, at, _ in tensors])
            return {"in_place_tensors": 0, "in_place_bytes": 0}
        t0 = time.monotonic()
        steady = self._steady
        if steady is not None and steady.serves(tensors, self.in_place.generation):
            # One copy_ each: torch's multi-tensor copy runs byte-wide kernels here
            # (seen on an H200: 2.4x the time of plain copies of the same bytes).
            self.touched()
            t1 = steady.copy()
            if t1 is not None:  # resolve: until the first copy (its parameter checked)
                t2 = time.monotonic()
                if steady.known:
                    model.load_weights(weights=steady.known)
                return {"in_place_tensors": len(steady.destinations),
                        "in_place_bytes": sum(int(region.numel()) for region in steady.destinations),
                        "resolve_s": t1 - t0, "issue_s": t2 - t1, "planned": 0.0}
            log.info("a parameter under the kept load plan moved: planning the load anew")
        destinations, sources, known, unknown = self._plan_load(model, tensors)
        t1 = time.monotonic()
        if destinations:
            self.touched()
            for region, source in zip(destinations, sources):
                region.copy_(source, non_blocking=True)
        t2 = time.monotonic()
        if known:
            model.load_weights(weights=known)
        if unknown:  # the first sync of a layout: one load_weights, watched
            buffers = [(buffer, [spec for spec, _ in placed], [at for _, at in placed])
                       for buffer, placed in unknown.values()]
            with self.in_place.watch_buffers(model, buffers):
                model.load_weights(weights=[view for buffer, specs, offsets in buffers
                                            for view in wire.bucket_views(buffer, specs, offsets)])
        return {"in_place_tensors": len(destinations),
                "in_place_bytes": sum(int(region.numel()) for region in destinations),
                "resolve_s": t1 - t0, "issue_s": t2 - t1, "planned": 1.0}

    def _plan_load(self, model: Any, tensors: Sequence[tuple[TensorSpec, Any, int, int]]) -> tuple[
            list[Any], list[Any], list[tuple[str, Any]], dict[int, tuple[Any, list[tuple[TensorSpec, int]]]]]:
        """``load_tensors``' plan: the regions the mapped tensors land in and their
        sources, the typed views ``load_weights`` takes, and (by buffer) the tensors
        not mapped yet. A plan with none of the latter is kept for the next load of
        the same ``tensors`` (a steady handoff of the trainer's storages)."""
        targets = self.in_place.targets(model, [spec for spec, _, _, _ in tensors])
        sources: list[Any] = []
        destinations: list[Any] = []
        placed: list[str] = []
        known: list[tuple[str, Any]] = []
        unknown: dict[int, tuple[Any, list[tuple[TensorSpec, int]]]] = {}  # by buffer
        for spec, buffer, at, index in tensors:
            region = targets.get(spec.name)
            if region is not None:
                destinations.append(region)
                sources.append(buffer[at : at + spec.nbytes])
                placed.append(spec.name)
            elif self.in_place.known(spec.name):
                known.append(self._typed(spec, buffer, at))
            else:
                unknown.setdefault(index, (buffer, []))[1].append((spec, at))
        if unknown:
            self._steady = None
        else:
            anchors, rests_on = self.in_place.anchors(model, placed)
            self._steady = _SteadyLoad(
                tensors=tensors, generation=self.in_place.generation, destinations=destinations, sources=sources,
                known=known, anchors=anchors, rests_on=rests_on)
        return destinations, sources, known, unknown

    @staticmethod
    def _typed(spec: TensorSpec, buffer: Any, at: int) -> tuple[str, Any]:
        return wire.bucket_views(buffer, [spec], [at])[0]

    def arrived(self, names: Sequence[str]) -> None:
        self.received.update(names)

    def in_place_targets(self, manifest: Manifest) -> dict[str, Any]:
        """Direct pieces that vLLM would only copy, whole, into a parameter: where they land."""
        if self.load_mode != "direct":
            return {}
        sent_direct = {name for bucket in wire.iter_buckets(manifest) for _, _, name in bucket.pieces if name}
        return self.in_place.targets(self.model(), [t for t in manifest.tensors if t.name in sent_direct])

    def touched(self) -> None:
        self.bytes_touched = True


class WeightReceiver:
    """vLLM's worker extension: mixed into its worker class (``self`` is the worker),
    it holds the rank's :class:`EngineReceiver` and forwards the sync's calls."""

    rq_receiver: EngineReceiver
    rq_line: LineListener | None = None

    def _receiver(self) -> EngineReceiver:
        receiver = getattr(self, "rq_receiver", None)
        if receiver is None:
            raise WeightSyncError("rq_attach was never called on this engine rank", phase="load")
        return receiver

    def rq_attach(self, load_mode: str, line_path: str | None = None) -> dict[str, Any]:
        """Make this rank's receiver; on a single-rank engine, also listen for
        ``rq_update`` on the update line at ``line_path`` (its updates run on this
        thread's CUDA stream). Answers the load mode and the line's path (None: no line)."""
        self.rq_receiver = EngineReceiver(self, load_mode)
        if self.rq_line is not None:  # attached again: the old line serves an old receiver
            self.rq_line.close()
            self.rq_line = None
        world_size = int(getattr(getattr(self, "parallel_config", None), "world_size", 1))
        if line_path and world_size == 1:
            stream = core_stream(self.rq_receiver.device())
            self.rq_line = LineListener(line_path, self.rq_update, _failed, lambda: on_stream(stream))
        return {"load_mode": load_mode, "line": line_path if self.rq_line is not None else None}

    def rq_device_uuid(self) -> str:
        """The UUID of this rank's GPU ("" on CPU): the trainer tells "same GPU" by it."""
        device = self._receiver().device()
        if device.type != "cuda":
            return ""
        from rollout_queue.weight_sync.transports.cuda_ipc import device_uuid

        return device_uuid(device.index)

    def rq_update(self, request: dict[str, Any]) -> dict[str, Any]:
        receiver = self._receiver()
        with receiver.serial:
            return receiver.update(request)

    def rq_transfer_join(self, init: dict[str, Any]) -> int:
        """Join the trainer's own group (vLLM's weight-transfer init, ``transports.trainer_group``)
        as rank ``init["rank_offset"]`` + this rank; returns that rank."""
        receiver = self._receiver()
        end = receiver.end("vllm")
        rank = int(init["rank_offset"]) + int(getattr(self, "rank", 0))
        return end.join(init, rank, receiver.device(), self.model_config.dtype)  # type: ignore[attr-defined, no-any-return]

    def rq_transfer_leave(self) -> bool:
        """Leave the trainer's group; False when this rank was in none."""
        end = self._receiver().transports.get("vllm")
        joined = end is not None and end.group_round is not None  # type: ignore[attr-defined]
        if end is not None:
            end.leave()  # type: ignore[attr-defined]
        return joined

    def rq_begin_update(self, request: UpdateRequest) -> int:
        receiver = self._receiver()
        with receiver.serial:
            return receiver.begin_update(request)

    def rq_receive_buckets(self) -> dict[str, float]:
        receiver = self._receiver()
        with receiver.serial:
            return receiver.receive_buckets()

    def rq_finish_update(self) -> int:
        receiver = self._receiver()
        with receiver.serial:
            return receiver.finish_update()

    def rq_abort_update(self) -> bool:
        receiver = self._receiver()
        with receiver.serial:
            return receiver.abort_update()

    def rq_settle(self) -> bool:
        """Wait until this rank's device has run what was issued on it (a handoff's
        copies run on after the update's answer): before a sleep unmaps their memory."""
        device = self._receiver().device()
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        return True


def _failed(exc: BaseException) -> dict[str, Any]:
    """The update line's answer to a call that raised (``update`` answers its own failures)."""
    return UpdateResult(failure=SyncFailure.of(exc)).model_dump(mode="json")


__all__ = ["EngineReceiver", "Phase", "WeightReceiver", "refresh_tied_layers"]
