"""The group transports, gloo and NCCL: the trainer broadcasts each bucket over
a process group of itself (rank 0) and every engine rank it serves.

Trainer: joins (or reuses) the group; sends each bucket in pieces (both ends
walk ``wire.iter_buckets``): a tensor of at least ``direct_bytes`` straight
from the trainer's memory, the rest packed into two alternating buffers (kept
between syncs) and sent in ``chunk_bytes`` pieces; over NCCL a bucket's
pieces are one NCCL group.

Engine: joins (or reuses) the group; receives each piece either straight into
the parameter that holds it (``weight_sync.inplace``) or into its bucket's
buffer, from a small pool kept between syncs; buckets are posted ahead while
their buffers stay within two buckets' worth.

Receive buffers come from the pool because on CPU there is no caching
allocator, and a fresh 1 GiB buffer costs a page fault per 4 KiB (measured
here: 0.36 s vs 0.10 s to fill one). Under layerwise reload vLLM keeps views
of a bucket until the layer that owns them is complete, so a loaded buffer
goes back to the pool only once no pending layer refers to it.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import RendezvousTimeout, WorkerLost
from rollout_queue.weight_sync import wire
from rollout_queue.weight_sync.protocol import Manifest, SyncRound, TensorSpec, UpdateRequest
from rollout_queue.weight_sync.transports.base import BucketSink, SendJob, TransportReceiver, TransportSender
from rollout_queue.weight_sync.wire import Bucket, Piece

if TYPE_CHECKING:
    import torch

    from rollout_queue.weight_sync.settings import SyncSettings

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ trainer


class GroupSender(TransportSender):
    """Rank 0 of a gloo or NCCL group; the group lives on while the roster holds."""

    def __init__(self, name: str, settings: SyncSettings) -> None:
        super().__init__(name, settings)
        self.group: Any = None
        self.group_round: SyncRound | None = None  # the round that formed ``group``
        self.roster: dict[str, int] = {}
        # The two packing buffers live on between syncs: fresh ones cost a page
        # fault per 4 KiB on CPU (measured here: 0.36 s vs 0.10 s to fill 1 GiB).
        self._send_buffers: list[torch.Tensor] = []

    def device(self) -> torch.device:
        """NCCL sends from this process's current CUDA device; gloo from host memory."""
        import torch

        if self.name == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def group_for(self, sync_round: SyncRound, offsets: dict[str, int]) -> SyncRound | None:
        if self.group is None or offsets != self.roster:
            self.group = None
            self.group_round = sync_round
        return self.group_round

    def send(self, job: SendJob) -> None:
        """Join (or reuse) the group and broadcast the packed buckets."""
        remaining = lambda: max(job.deadline - time.monotonic(), 0.001)
        offsets = job.decision.offsets
        if not job.decision.reuses_group(job.plan.round):
            assert job.decision.group_round is not None  # set by the decision for every group transfer
            if self.name == "nccl":
                import torch

                torch.cuda.set_device(self.device())
            future: Future[Any] = job.executor.submit(
                wire.new_group, job.store, keys.sync_group(job.decision.group_round), 0, job.decision.world,
                self.name, min(self.settings.timeouts.transfer, remaining()), self.device(),
            )
            try:
                self.group = future.result(timeout=remaining())
            except Exception as exc:
                self.group = None
                raise RendezvousTimeout(
                    f"workers {', '.join(offsets)} did not all join the process group: {exc}",
                    phase="rendezvous", workers=offsets,
                ) from exc
            self.roster = dict(offsets)
        # A peer that stops reading (its link cut) stalls the sends: give up after
        # the transfer phase's own deadline, not the whole sync's.
        send_s = min(self.settings.timeouts.transfer, remaining())
        sending = job.executor.submit(self.send_buckets, job.manifest, job.tensors, self.device(), send_s)
        try:
            sending.result(timeout=send_s + 5.0)
        except Exception as exc:
            # A failed collective leaves the group unusable. Abort it: its
            # connections close, so the peers that can still hear this end
            # fail at once instead of at their own group timeout.
            wire.abort(self.group)
            self.reset()
            raise WorkerLost(
                f"transfer of sync round {job.plan.round} failed: {exc}; a worker died or stalled",
                phase="transfer", workers=offsets,
            ) from exc

    def send_buckets(
        self, manifest: Manifest, tensors: dict[str, torch.Tensor], device: torch.device, timeout_s: float
    ) -> None:
        """Pack bucket k+1 into one buffer while bucket k leaves from the other."""
        deadline = time.monotonic() + timeout_s
        buffers = self._buffers(max(manifest.bucket_sizes), device)
        in_flight: list[list[Any]] = [[], []]  # the works whose pieces each buffer (slot) holds
        direct_works: list[Any] = []  # pieces sent from the trainer's tensors: no buffer to free
        began = time.monotonic()
        trace: list[str] | None = [] if os.environ.get("RQ_SYNC_TRACE") else None
        for bucket in wire.iter_buckets(manifest):
            self.leaving(bucket.index)
            slot = bucket.index % 2
            for work in in_flight[slot]:  # the buffer's previous bucket must be out
                wire.wait(work, deadline - time.monotonic())
            if trace is not None:
                trace.append(f"b{bucket.index} slot free {time.monotonic() - began:.4f}")
            in_flight[slot] = []
            held_by_slot: list[bool] = []  # per piece: whether the slot must outlive its send
            pieces = self._pieces(bucket, buffers[slot][: bucket.size], tensors, device, held_by_slot)
            works = wire.broadcast_bucket(self.group, manifest, pieces)
            if len(works) < len(held_by_slot):  # the bucket as one group: one work
                in_flight[slot].extend(works)
                continue
            for work, by_slot in zip(works, held_by_slot):
                (in_flight[slot] if by_slot else direct_works).append(work)
        for work in [*in_flight[0], *in_flight[1], *direct_works]:
            wire.wait(work, deadline - time.monotonic())
        if trace is not None:
            log.warning("[rq-sync-trace] sender %s; all out %.4f", "; ".join(trace), time.monotonic() - began)

    @staticmethod
    def _pieces(
        bucket: Bucket, buffer: torch.Tensor, tensors: dict[str, torch.Tensor], device: torch.device,
        held_by_slot: list[bool],
    ) -> Iterator[torch.Tensor]:
        """The bucket's pieces as they go out, each made when asked for: a tensor sent
        straight from the trainer's memory, or a range of ``buffer`` packed just before.

        Appends to ``held_by_slot``, per piece, whether it lives in the slot's
        buffer (packed, or a copy made for the wire) and so must be sent before
        the slot is packed again.
        """
        specs = bucket.specs  # in offset order
        packed = 0
        for start, end, direct in bucket.pieces:
            upto = packed
            while upto < len(specs) and specs[upto].offset < end:
                upto += 1
            if direct is not None:  # straight from the trainer's tensor
                source = tensors[direct]
                held_by_slot.append(source.device != device)
                piece = wire.flat_bytes(source.to(device))
            else:
                wire.pack(buffer, specs[packed:upto], tensors)
                held_by_slot.append(True)
                piece = buffer[start:end]
            packed = upto
            # On CUDA the broadcast's stream waits for the packing copies
            # (ProcessGroupNCCL orders it after the current stream): no host sync.
            yield piece

    def _buffers(self, largest: int, device: torch.device) -> list[torch.Tensor]:
        import torch

        if not any(b.device == device and b.numel() >= largest for b in self._send_buffers[:1]):
            self._send_buffers = []  # free the old pair before allocating the new one
            self._send_buffers = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2)]
        return self._send_buffers

    def reset(self) -> None:
        self.group = None
        self.roster = {}

    def close(self) -> None:
        self.reset()
        self._send_buffers = []


# ------------------------------------------------------------------- engine


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


def buffer_layout(pieces: list[Piece], in_place: dict[str, Any]) -> tuple[list[int | None], int]:
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


def buffer_offsets(specs: list[TensorSpec], pieces: list[Piece], at: list[int | None]) -> list[int]:
    """Each tensor's offset in its bucket's buffer (see ``buffer_layout``). A tensor
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


class GroupReceiver(TransportReceiver):
    """An engine rank of the trainer's gloo or NCCL group."""

    RECEIVE_AHEAD = 2  # buckets posted to the wire beyond the one being loaded

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.group: Any = None
        self.group_round: SyncRound | None = None  # the round that formed ``group``
        self.store: Any = None
        self.buffers = _BufferPool()

    def begin(self, request: UpdateRequest, rank: int, device: Any) -> None:
        plan, decision = request.plan, request.decision
        if decision.group_round is None:
            raise ValueError(f"round {plan.round}'s decision names no process group for {request.node}")
        kept = self.group is not None and self.group_round == decision.group_round
        if kept and decision.reuses_group(plan.round):
            return
        self.group = None
        if self.name == "nccl":
            import torch

            torch.cuda.set_device(device)
        self.store = wire.connect_store(plan.store_host, plan.store_port, plan.timeouts.store_connect)
        self.group = wire.new_group(self.store, keys.sync_group(decision.group_round), rank, decision.world,
                                    self.name, timeout_s=plan.timeouts.group_join, device=device)
        self.group_round = decision.group_round

    def receive(self, sink: BucketSink, manifest: Manifest, device: Any, deadline: float) -> dict[str, float]:
        try:
            receive = _BucketReceive(self, sink, manifest, device, sink.in_place_targets(manifest), deadline,
                                     self.RECEIVE_AHEAD)
            receive.run()
        except Exception:
            self.group = None  # a failed collective leaves the group unusable
            self.buffers = _BufferPool()  # a receive may still be writing into one
            raise
        return receive.stats()

    def finish(self) -> None:
        self.buffers.settle()
        if self.name == "nccl":
            import torch

            torch.cuda.synchronize()

    def abort(self) -> None:
        self.buffers.settle()


class _BucketReceive:
    """One sync's receive and load over a group, bucket by bucket; each method one step.

    Buckets are posted to the wire ahead (``top_up``) while their buffers stay
    within ``ahead`` buckets' worth (and at least ``ahead`` of them): the wire
    never waits for a load or for this process to post. When most pieces land
    in place, that is every bucket at once. Each bucket's pieces are then
    awaited in order (``receive``) and the tensors they complete loaded
    (``load``).
    """

    def __init__(self, end: GroupReceiver, sink: BucketSink, manifest: Manifest, device: Any,
                 in_place: dict[str, Any], deadline: float, ahead: int) -> None:
        self.end = end
        self.sink = sink
        self.manifest = manifest
        self.device = device
        self.deadline = deadline
        self.ahead = ahead
        self.buckets = list(wire.iter_buckets(manifest))
        self.in_place = in_place
        # A bucket's buffer holds its other pieces only, back to back.
        self.layouts = [buffer_layout(bucket.pieces, in_place) for bucket in self.buckets]
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
        buffer = self.end.buffers.take(need, self.device) if need else None
        targets = []
        for (start, end, direct), offset in zip(bucket.pieces, at):
            if offset is None:
                assert direct is not None
                self.sink.touched()
                targets.append(self.in_place[direct])
            else:
                assert buffer is not None  # ``need`` counts this piece
                targets.append(buffer[offset : offset + end - start])
        works = wire.broadcast_bucket(self.end.group, self.manifest, targets)
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
            self.end.buffers.loaded_into_model(buffer, still_referenced=self.sink.layerwise_open)

    def load(self, buffer: Any, bucket: Bucket, specs: list[TensorSpec]) -> None:
        """Load these tensors of ``bucket`` (those not already received in place)."""
        batch = [spec for spec in specs if spec.name not in self.in_place]
        at = self.layouts[bucket.index][0]
        if batch:
            self.sink.load(buffer, batch, buffer_offsets(batch, bucket.pieces, at))
        self.sink.arrived([spec.name for spec in specs])

    def stats(self) -> dict[str, float]:
        return {"wire_s": self.wire_s, "load_s": self.load_s, "in_place_tensors": len(self.in_place),
                "in_place_bytes": sum(s.nbytes for s in self.manifest.tensors if s.name in self.in_place)}


__all__ = ["GroupReceiver", "GroupSender", "buffer_layout", "buffer_offsets"]
