"""The two ends every transport has, and what each is handed.

The trainer's end (:class:`TransportSender`) gets one :class:`SendJob` per
sync: the plan, the decision, the tensors (cast, on its device), the store,
and the workers it serves. The engine's end (:class:`TransportReceiver`)
lives inside vLLM's worker process, one per transport name on each engine
rank, and hands each received bucket to a :class:`BucketSink` (the engine's
``weight_sync.receiver.EngineReceiver``), which loads it into the model.
Both ends live on between syncs: a process group, packing buffers, mapped
memory are kept.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rollout_queue.weight_sync.protocol import Manifest, SyncDecision, SyncPlan, SyncRound, TensorSpec, UpdateRequest

if TYPE_CHECKING:
    import torch

    from rollout_queue.weight_sync.settings import SyncSettings


@dataclass
class SendJob:
    """One sync's transfer, as the trainer's end of a transport sees it."""

    plan: SyncPlan
    decision: SyncDecision
    manifest: Manifest
    tensors: dict[str, torch.Tensor]  # by name, cast and on ``TransportSender.device()``
    store: Any  # the trainer's TCPStore
    nodes: list[str]  # the workers this transport serves in this sync
    deadline: float  # time.monotonic() by which the send must be done
    executor: ThreadPoolExecutor  # for blocking legs, waited for with a timeout
    # The tensors are the caller's own (none cast or moved for this sync), lying
    # as this says (``sender.TensorList.layout``): a handoff may name their
    # storages instead of packing copies of them (in the manifest's order: the
    # manifest is planned from that list). None: copies made for the sync.
    own: tuple[tuple[Any, ...], ...] | None = None


class TransportSender(abc.ABC):
    """The trainer's end of one transport; one per sender and name, kept between syncs."""

    def __init__(self, name: str, settings: SyncSettings) -> None:
        self.name = name
        self.settings = settings
        # Called with each bucket's index just before that bucket leaves, on the
        # thread that sends it: the seam for fault injection (a test cuts a link
        # mid-transfer here). What it raises fails the send as a broken wire would.
        self.before_bucket: Callable[[int], None] | None = None

    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the tensors must be to leave through this transport."""

    def group_for(self, sync_round: SyncRound, offsets: dict[str, int]) -> SyncRound | None:
        """The round whose process group serves these rank offsets in round
        ``sync_round``: an earlier round's, kept, or ``sync_round`` itself (a new
        group, formed by ``send``). ``None``: this transport has no group."""
        return None

    def leaving(self, bucket: int) -> None:
        """Bucket ``bucket`` is about to leave (runs ``before_bucket``)."""
        if self.before_bucket is not None:
            self.before_bucket(bucket)

    def announce_layout(self, plan: SyncPlan, tensors: dict[str, torch.Tensor],
                        own: tuple[tuple[Any, ...], ...], store: Any) -> str | None:
        """Before ``plan`` is published: the digest of a layout of the caller's own
        ``tensors`` (lying as ``own`` says) that this transport hands over as they lie,
        stored where its engines read it (``SyncPlan.layouts``); None (the default):
        ``send`` delivers them."""
        return None

    @abc.abstractmethod
    def send(self, job: SendJob) -> None:
        """Deliver every bucket of ``job``; a failure raises ``WeightSyncError``."""

    def finished(self, plan: SyncPlan) -> None:
        """The sync's commit is over (whatever its outcome)."""

    def released(self, handles: list[str]) -> None:
        """An engine's reads of this sync's memory end when ``handles`` fire
        (``SyncAck.released``: its copies may still run on the GPU); whatever the
        trainer runs after the sync waits for them."""

    def reset(self) -> None:
        """Forget what a failed sync may have broken (a process group)."""

    def close(self) -> None:
        """Free what is kept between syncs; the next send builds it again."""
        self.reset()


class BucketSink(Protocol):
    """Where a receiving transport puts what arrives: the engine rank's receiver."""

    layerwise_open: bool

    def load(self, buffer: Any, specs: Sequence[TensorSpec], offsets: Sequence[int], *,
             learn_in_place: bool = True) -> None:
        """``load_weights`` on these tensors of ``buffer``, each at its offset."""

    def load_tensors(self, tensors: Sequence[tuple[TensorSpec, Any, int, int]]) -> dict[str, float]:
        """Load tensors that lie in several buffers (per tensor: its spec, its
        buffer, its byte offset there, the buffer's index): one copy each for what
        lands in place, one ``load_weights`` for the rest. Returns the count and
        bytes of the tensors copied in place (``in_place_tensors``,
        ``in_place_bytes``) and the host's seconds before the first copy is
        issued (``resolve_s``: where each tensor lands, or the check that the last
        load's answer still holds) and issuing the copies (``issue_s``)."""

    def arrived(self, names: Sequence[str]) -> None:
        """These manifest tensors are in the model now."""

    def in_place_targets(self, manifest: Manifest) -> dict[str, Any]:
        """Direct pieces that can be received straight into a parameter: where they land."""

    def touched(self) -> None:
        """Bytes are about to land straight in the model's parameters."""


class TransportReceiver(abc.ABC):
    """The engine's end of one transport, on one engine rank; kept between syncs."""

    def __init__(self, name: str) -> None:
        self.name = name

    @abc.abstractmethod
    def begin(self, request: UpdateRequest, rank: int, device: Any) -> None:
        """Join what the trainer built for this sync (``rank``: this rank's global rank)."""

    @abc.abstractmethod
    def receive(self, sink: BucketSink, manifest: Manifest, device: Any, deadline: float) -> dict[str, float]:
        """Take every bucket and hand it to ``sink``; returns seconds and counts."""

    def finish(self) -> str | None:
        """Every bucket is loaded and the load finalized. Returns what the engine's
        reads of the trainer's memory end with when they may still run on the device
        (an event's handle, hex: ``UpdateResult.released``), None when they are done."""
        return None

    def abort(self) -> None:
        """The sync failed: drop what may be broken."""


__all__ = ["BucketSink", "SendJob", "TransportReceiver", "TransportSender"]
