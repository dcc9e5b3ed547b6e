"""What the handoff transports (shm, cuda_ipc) share: pack once, name it in the store.

Trainer: packs each bucket into a buffer the colocated engine can map (kept
between syncs, one per bucket, so a steady sync allocates nothing and the
engine maps nothing new), waits until the bytes are there (CUDA: its stream
is synchronized), and writes the buffer's description under
``keys.sync_handoff`` in its store: bucket k is announced while bucket k+1
is packed. No process group, no wire.

Engine: per bucket, waits for its key (the plan's receive deadline), maps
the buffer (kept while the description holds), and hands the bucket's
tensors to ``load_weights``. The trainer's buffers are written again only
by the next sync, after every worker's "done" ack of this one.
"""

from __future__ import annotations

import abc
import datetime
import json
import time
from typing import TYPE_CHECKING, Any

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import RendezvousTimeout, WorkerLost
from rollout_queue.weight_sync import wire
from rollout_queue.weight_sync.protocol import Manifest, SyncPlan, SyncRound, UpdateRequest
from rollout_queue.weight_sync.transports.base import BucketSink, SendJob, TransportReceiver, TransportSender

if TYPE_CHECKING:
    import torch

    from rollout_queue.weight_sync.settings import SyncSettings


class HandoffSender(TransportSender):
    """Packs each bucket into a mappable buffer and names it in the store."""

    def __init__(self, name: str, settings: SyncSettings) -> None:
        super().__init__(name, settings)
        self._buffers: list[torch.Tensor] = []
        self._descriptions: list[str] = []
        self._announced: tuple[Any, list[str]] | None = None  # the store and the keys of the last send

    @abc.abstractmethod
    def allocate(self, index: int, size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """A new buffer of ``size`` bytes for bucket ``index``, and its description."""

    def packed(self) -> None:
        """The packing copies just issued must be complete before the bucket is announced."""

    def release(self) -> None:
        """The buffers are being dropped."""

    def send(self, job: SendJob) -> None:
        try:
            buffers = self._ensure(job.manifest.bucket_sizes)
            announced: list[str] = []
            for bucket in wire.iter_buckets(job.manifest):
                if time.monotonic() > job.deadline:
                    raise TimeoutError("the sync's deadline passed while packing")
                self.leaving(bucket.index)
                wire.pack(buffers[bucket.index][: bucket.size], bucket.specs, job.tensors)
                self.packed()
                key = keys.sync_handoff(job.plan.round, self.name, bucket.index)
                job.store.set(key, self._descriptions[bucket.index])
                announced.append(key)
            self._announced = (job.store, announced)
        except Exception as exc:
            raise WorkerLost(
                f"handoff of sync round {job.plan.round} over {self.name} failed: {type(exc).__name__}: {exc}",
                phase="transfer", workers=job.nodes,
            ) from exc

    def _ensure(self, sizes: list[int]) -> list[torch.Tensor]:
        if [int(b.numel()) for b in self._buffers] != list(sizes):
            self.close()
            made = [self.allocate(index, size) for index, size in enumerate(sizes)]
            self._buffers = [buffer for buffer, _ in made]
            self._descriptions = [json.dumps(description) for _, description in made]
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


class HandoffReceiver(TransportReceiver):
    """Maps the trainer's buffers and loads each bucket from them."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.store: Any = None
        self.store_address: tuple[str, int] | None = None
        self.round: SyncRound | None = None  # the round being received
        self._mapped: dict[str, Any] = {}  # description -> the buffer mapped from it

    @abc.abstractmethod
    def open(self, description: dict[str, Any], size: int, device: Any) -> Any:
        """The trainer's buffer that ``description`` names, as a uint8 tensor of ``size`` bytes."""

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

    def receive(self, sink: BucketSink, manifest: Manifest, device: Any, deadline: float) -> dict[str, float]:
        assert self.round is not None  # set by begin()
        wait_s = load_s = 0.0
        used: set[str] = set()
        for bucket in wire.iter_buckets(manifest):
            t0 = time.monotonic()
            self.store.set_timeout(datetime.timedelta(seconds=max(deadline - t0, 0.001)))
            text = self.store.get(keys.sync_handoff(self.round, self.name, bucket.index)).decode()
            buffer = self._mapped.get(text)
            if buffer is None or int(buffer.numel()) < bucket.size:
                buffer = self.open(json.loads(text), bucket.size, device)
                self._mapped[text] = buffer
            used.add(text)
            t1 = time.monotonic()
            sink.load(buffer[: bucket.size], bucket.specs, [spec.offset for spec in bucket.specs],
                      learn_in_place=False)
            sink.arrived([spec.name for spec in bucket.specs])
            wait_s += t1 - t0
            load_s += time.monotonic() - t1
        # Keep only this layout's buffers mapped (a new layout maps new ones).
        self._mapped = {text: self._mapped[text] for text in used}
        return {"wire_s": wait_s, "load_s": load_s, "in_place_tensors": 0, "in_place_bytes": 0}

    def abort(self) -> None:
        self.store = None
        self.store_address = None


__all__ = ["HandoffReceiver", "HandoffSender"]
