"""What the handoff transports (shm, cuda_ipc) share: name memory the engine can map.

Trainer, two ways:

- *storages* (one copy in all): when the tensors are the caller's own (its
  parameters, updated in place between syncs; the engine's dtype, so none
  was cast) and each lies in memory the engine can map (a CUDA tensor on the
  engine's GPU; a CPU tensor in shared memory, ``model.share_memory()``), the
  trainer names each storage under them once (a CUDA IPC handle, a
  ``/dev/shm`` name) and stores that layout once (``keys.sync_handoff_layout``,
  by digest), before the round's plan is published: the plan names its digest
  (``SyncPlan.layouts``, :meth:`HandoffSender.announce_layout`). No packing,
  nothing announced per round; the engine copies from the trainer's tensors
  straight into its parameters. The layout is kept while the storages are the
  same ones, so a steady sync shares nothing new and the engine, holding the
  digest the plan names, loads at once.
- *packed* (otherwise): each bucket is packed into a buffer the engine can
  map (kept between syncs, one per bucket, so a steady sync allocates
  nothing and the engine maps nothing new), and its description is written
  under ``keys.sync_handoff`` once the bytes are there: bucket k is announced
  while bucket k+1 is packed.

A send that fails announces the failure under every bucket key it had not
announced yet: an engine waiting for one fails at once, not at its deadline.

Ordering, both ways: the engine reads the trainer's memory only after the
trainer's writes to it, and the trainer writes it again only after the
engine's reads. On CPU both ends finish their copies before they go on. On
CUDA nobody waits on the host: the trainer records an event after its writes
(named in the layout and in every bucket's description, ``fence``), the
engine's stream waits on it before the copies, and the engine records an
event after them whose handle its "done" ack carries (``SyncAck.released``);
the trainer's stream waits on that one before anything it runs after the
sync (:meth:`TransportSender.released`). The copies run on the GPU while the
engine answers and the worker resumes: the engine's own work after them is
on the same stream.

Engine: maps what the plan's layout or each bucket's key names (kept while
the description holds) and loads: a layout of storages tensor by tensor,
packed buckets bucket by bucket.
"""

from __future__ import annotations

import abc
import datetime
import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import RendezvousTimeout, SyncRefused, WorkerLost
from rollout_queue.weight_sync import wire
from rollout_queue.weight_sync.protocol import Manifest, SyncPlan, SyncRound, UpdateRequest
from rollout_queue.weight_sync.transports.base import BucketSink, SendJob, TransportReceiver, TransportSender

if TYPE_CHECKING:
    import torch

    from rollout_queue.weight_sync.settings import SyncSettings

log = logging.getLogger(__name__)


class HandoffSender(TransportSender):
    """Packs each bucket into a mappable buffer and names it in the store."""

    def __init__(self, name: str, settings: SyncSettings) -> None:
        super().__init__(name, settings)
        self._buffers: list[torch.Tensor] = []
        self._descriptions: list[str] = []
        self._announced: tuple[Any, list[str]] | None = None  # the store and the keys of the last send
        # The storages layout last announced: what it was made of (names and
        # addresses), its text, and its digest.
        self._layout: tuple[tuple[Any, ...], str, str] | None = None
        # The store the layout of that digest is stored in (the store of a later sender may be another).
        self._layout_stored: tuple[Any, str] | None = None

    @abc.abstractmethod
    def allocate(self, index: int, size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """A new buffer of ``size`` bytes for bucket ``index``, and its description."""

    def share(self, storage: torch.Tensor) -> dict[str, Any] | None:
        """A description of ``storage`` (uint8, over one whole storage of the
        trainer's) that the engine can map, or None when it cannot be shared as
        it lies (the sync is packed then)."""
        return None

    def fence(self) -> dict[str, Any]:
        """What the engine waits on before it reads (``packed`` marks it), put in
        the layout and in every bucket's description: nothing, where ``packed``
        waits for the writes itself."""
        return {}

    def packed(self) -> None:
        """The writes just issued (packing, or the trainer's own) come before the
        engine's reads: done, or marked where the engine waits (``fence``)."""

    def release(self) -> None:
        """The buffers are being dropped."""

    def announce_layout(self, plan: SyncPlan, tensors: dict[str, torch.Tensor],
                        own: tuple[tuple[Any, ...], ...], store: Any) -> str | None:
        """Before ``plan`` is published: the digest of the layout naming the storages
        under ``tensors`` (the caller's own, lying as ``own`` says), stored in ``store``
        with the trainer's writes to them marked done; the plan names it
        (``SyncPlan.layouts``). None when one of them cannot be named: ``send``
        packs them."""
        digest = self._storages_layout(plan.manifest_digest, tensors, own)
        if digest is None:
            return None
        self.leaving(0)
        self.packed()
        self._store_layout(store)
        return digest

    def send(self, job: SendJob) -> None:
        if self.name in job.plan.layouts:
            return  # the plan named the trainer's storages: nothing to pack or announce
        announced: list[str] = []
        self._announced = (job.store, announced)
        try:
            buffers = self._ensure(job.manifest.bucket_sizes)
            for bucket in wire.iter_buckets(job.manifest):
                if time.monotonic() > job.deadline:
                    raise TimeoutError("the sync's deadline passed while packing")
                self.leaving(bucket.index)
                wire.pack(buffers[bucket.index][: bucket.size], bucket.specs, job.tensors)
                self.packed()
                key = keys.sync_handoff(job.plan.round, self.name, bucket.index)
                job.store.set(key, self._descriptions[bucket.index])
                announced.append(key)
        except Exception as exc:
            error = WorkerLost(
                f"handoff of sync round {job.plan.round} over {self.name} failed: {type(exc).__name__}: {exc}",
                phase="transfer", workers=job.nodes,
            )
            self._announce_failure(job, announced, str(error))
            raise error from exc

    def _announce_failure(self, job: SendJob, announced: list[str], message: str) -> None:
        """Every bucket key not announced yet says the send failed (best effort)."""
        failure = json.dumps({"failed": message})
        for index in range(max(len(job.manifest.bucket_sizes), 1)):
            key = keys.sync_handoff(job.plan.round, self.name, index)
            if key in announced:
                continue
            try:
                job.store.set(key, failure)
            except Exception:  # noqa: BLE001  the store gone: the engine's deadline ends its wait
                return
            announced.append(key)

    def _store_layout(self, store: Any) -> None:
        """The announced layout's text, stored once in ``store`` under its digest."""
        assert self._layout is not None  # made by _storages_layout
        _, text, digest = self._layout
        if self._layout_stored == (store, digest):
            return
        if self._layout_stored is not None and self._layout_stored[0] is store:
            try:
                store.delete_key(keys.sync_handoff_layout(self.name, self._layout_stored[1]))
            except Exception:  # best effort: a layout left behind is only bytes
                log.debug("could not drop the old handoff layout", exc_info=True)
        store.set(keys.sync_handoff_layout(self.name, digest), text)
        self._layout_stored = (store, digest)

    def _storages_layout(self, manifest_digest: str, tensors: dict[str, torch.Tensor],
                         own: tuple[tuple[Any, ...], ...]) -> str | None:
        """The digest of the layout naming the storages under ``tensors`` (made or
        kept in ``_layout``), or None when one of them cannot be named (not
        contiguous, elsewhere, not mappable). The tensors of a layout equal to the
        last one's (``own``) lie where they lay: the layout made then holds."""
        import torch

        if self._layout is not None and self._layout[0] == (manifest_digest, own):
            return self._layout[2]
        device = self.device()
        if any(where != device or not contiguous for _, _, _, where, contiguous, *_ in own):
            return None
        described: dict[int, int] = {}  # storage address -> its index in the layout
        storages: list[dict[str, Any]] = []
        places: list[tuple[int, int]] = []
        for name, *_, data, address, nbytes in own:  # where each lies, as listed (sender.TensorList)
            if address not in described:
                whole = torch.empty(0, dtype=torch.uint8, device=device).set_(tensors[name].untyped_storage())
                description = self.share(whole)
                if description is None:
                    return None
                described[address] = len(storages)
                storages.append({**description, "bytes": nbytes})
            places.append((described[address], data - address))
        # The manifest's digest in it: the places are those of its tensors, in its order.
        text = json.dumps({"manifest": manifest_digest, "storages": storages, "tensors": places, **self.fence()})
        self._layout = ((manifest_digest, own), text, hashlib.sha256(text.encode()).hexdigest()[:32])
        return self._layout[2]

    def _ensure(self, sizes: list[int]) -> list[torch.Tensor]:
        if [int(b.numel()) for b in self._buffers] != list(sizes):
            self.close()
            made = [self.allocate(index, size) for index, size in enumerate(sizes)]
            self._buffers = [buffer for buffer, _ in made]
            self._descriptions = [json.dumps({**description, **self.fence()}) for _, description in made]
        return self._buffers

    def finished(self, plan: SyncPlan) -> None:
        """The workers' acks are in: drop the sync's keys from the store."""
        if self._announced is None:
            return
        store, announced = self._announced
        self._announced = None
        for key in announced:
            try:
                store.delete_key(key)
            except Exception:  # noqa: BLE001, S112  best effort: the store may be gone
                continue

    def close(self) -> None:
        self.release()
        self._buffers = []
        self._descriptions = []
        self._layout = None
        self._layout_stored = None


class HandoffReceiver(TransportReceiver):
    """Maps the trainer's buffers and loads each bucket from them."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.store: Any = None
        self.store_address: tuple[str, int] | None = None
        self.round: SyncRound | None = None  # the round being received
        self.layout_digest: str | None = None  # the storages layout the round's plan names
        # description -> the buffer mapped from it, and its fence opened here
        self._mapped: dict[str, tuple[Any, Any]] = {}
        # The storages layout last received: its digest, per manifest tensor (spec,
        # the mapped storage, the tensor's byte offset in it, the storage's index),
        # and its fence opened here.
        self._layout: tuple[str, list[tuple[Any, Any, int, int]], Any] | None = None

    @abc.abstractmethod
    def open(self, description: dict[str, Any], size: int, device: Any) -> Any:
        """The trainer's buffer that ``description`` names, as a uint8 tensor of ``size`` bytes."""

    def open_fence(self, description: dict[str, Any]) -> Any:
        """What the trainer's ``fence`` in ``description`` names, opened here (None: nothing)."""
        return None

    def wait(self, fence: Any) -> None:
        """The loads issued after this read what the trainer wrote before marking ``fence``."""

    def begin(self, request: UpdateRequest, rank: int, device: Any) -> None:
        plan = request.plan
        address = (plan.store_host, plan.store_port)
        if self.store is None or self.store_address != address:
            try:
                self.store = wire.connect_store(plan.store_host, plan.store_port, plan.timeouts.store_connect)
            except Exception as exc:  # torch raises RuntimeError/DistNetworkError
                raise RendezvousTimeout(
                    f"cannot reach the trainer's store at {plan.store_host}:{plan.store_port}: {exc}",
                    phase="rendezvous") from exc
            self.store_address = address
        self.round = plan.round
        self.layout_digest = plan.layouts.get(self.name)

    def _read(self, key: str, deadline: float) -> str:
        self.store.set_timeout(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        return str(self.store.get(key).decode())

    def _announced(self, bucket: int, deadline: float) -> str:
        assert self.round is not None  # set by begin()
        text = self._read(keys.sync_handoff(self.round, self.name, bucket), deadline)
        if text.startswith('{"failed"'):
            raise WorkerLost(f"the trainer's handoff failed before bucket {bucket} was there: "
                             f"{json.loads(text)['failed']}", phase="transfer")
        return text

    def receive(self, sink: BucketSink, manifest: Manifest, device: Any, deadline: float) -> dict[str, float]:
        if self.layout_digest is not None:
            t0 = time.monotonic()
            digest = self.layout_digest
            held = self._layout is not None and self._layout[0] == digest
            text = None if held else self._read(keys.sync_handoff_layout(self.name, digest), deadline)
            return self._receive_storages(sink, manifest, device, digest, text, time.monotonic() - t0)
        self._layout = None
        wait_s = load_s = 0.0
        used: set[str] = set()
        for bucket in wire.iter_buckets(manifest):
            t0 = time.monotonic()
            text = self._announced(bucket.index, deadline)
            mapped = self._mapped.get(text)
            if mapped is None or int(mapped[0].numel()) < bucket.size:
                description = json.loads(text)
                mapped = (self.open(description, bucket.size, device), self.open_fence(description))
                self._mapped[text] = mapped
            used.add(text)
            buffer, fence = mapped
            t1 = time.monotonic()
            self.wait(fence)
            sink.load(buffer[: bucket.size], bucket.specs, [spec.offset for spec in bucket.specs],
                      learn_in_place=False)
            sink.arrived([spec.name for spec in bucket.specs])
            wait_s += t1 - t0
            load_s += time.monotonic() - t1
        # Keep only this layout's buffers mapped (a new layout maps new ones).
        self._mapped = {text: self._mapped[text] for text in used}
        return {"wire_s": wait_s, "load_s": load_s, "in_place_tensors": 0, "in_place_bytes": 0}

    def _receive_storages(self, sink: BucketSink, manifest: Manifest, device: Any, digest: str,
                          text: str | None, wait_s: float) -> dict[str, float]:
        """Load every manifest tensor from the trainer's own storages, as the layout of
        ``digest`` names them (``text``: that layout, read now; None: the one held)."""
        t0 = time.monotonic()
        if text is not None:
            self._layout = None
            self._mapped = {}  # a packed layout's buffers are not needed any more
            layout = json.loads(text)
            storages = [self.open(description, int(description["bytes"]), device)
                        for description in layout["storages"]]
            if len(layout["tensors"]) != len(manifest.tensors):
                raise SyncRefused(f"the trainer's layout names {len(layout['tensors'])} tensors, "
                                  f"the manifest {len(manifest.tensors)}")
            placed = []
            for spec, (index, offset) in zip(manifest.tensors, layout["tensors"]):
                if offset < 0 or offset + spec.nbytes > int(storages[index].numel()):
                    raise SyncRefused(f"{spec.name} ({spec.nbytes} bytes at {offset}) lies outside "
                                      f"the trainer's storage {index} ({int(storages[index].numel())} bytes)")
                placed.append((spec, storages[index], int(offset), int(index)))
            self._layout = (digest, placed, self.open_fence(layout))
        t1 = time.monotonic()
        assert self._layout is not None and self._layout[0] == digest
        self.wait(self._layout[2])
        loaded = sink.load_tensors(self._layout[1])
        sink.arrived([spec.name for spec in manifest.tensors])
        return {"wire_s": wait_s + t1 - t0, "load_s": time.monotonic() - t1, **loaded}

    def abort(self) -> None:
        self.store = None
        self.store_address = None
        self._layout = None


__all__ = ["HandoffReceiver", "HandoffSender"]
