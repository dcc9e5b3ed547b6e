"""The CUDA IPC handoff: a colocated worker whose engine runs on the trainer's GPU.

The trainer names its own parameters' storages by CUDA IPC handles (one per
storage, shared once: the optimizer updates them in place), or, when its
tensors are copies made for the sync (a cast), packs each bucket into a
buffer on its GPU (kept between syncs, one per bucket: a few IPC handles,
however many tensors). The engine opens the handles on its own device (the
same physical GPU, checked by UUID: device indices differ between processes
with another ``CUDA_VISIBLE_DEVICES``) and loads from it. No NCCL group
(NCCL refuses two ranks on one GPU), no copy through the host.

Neither side waits on the host for the other's GPU work: two interprocess
events order it (``transports.handoff``, "Ordering"). The trainer records
``written`` after its writes (its handle in the layout and each bucket's
description); the engine's stream waits on it before copying, and records
``released`` after the copies, whose handle goes back in the "done" ack; the
trainer's current stream waits on that before whatever it runs next (the
optimizer step that writes the parameters again).

Handles travel as JSON (hex bytes), never pickled: the engine rebuilds the
tensor itself from known classes (``torch.multiprocessing.reductions``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from rollout_queue.tasks.errors import SyncRefused
from rollout_queue.weight_sync.transports.handoff import HandoffReceiver, HandoffSender

if TYPE_CHECKING:
    import torch

    from rollout_queue.weight_sync.settings import SyncSettings


def device_uuid(index: int | None = None) -> str:
    """The physical identity of a CUDA device of this process (default: the current one)."""
    import torch

    return _uuid_of(torch.cuda.current_device() if index is None else index)


@functools.cache
def _uuid_of(index: int) -> str:
    """A device's UUID never changes in a process: asked once (every sync's plan asks)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def _opened_event(opened: dict[str, torch.cuda.Event], handle: str) -> torch.cuda.Event:
    """The other process's interprocess event of ``handle`` (hex), opened on this
    process's current device once and kept in ``opened``."""
    import torch

    if handle not in opened:
        opened[handle] = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), bytes.fromhex(handle))
    return opened[handle]


class CudaIpcSender(HandoffSender):
    def __init__(self, name: str, settings: SyncSettings) -> None:
        super().__init__(name, settings)
        self._written: torch.cuda.Event | None = None  # recorded after the trainer's writes
        self._engines: dict[str, torch.cuda.Event] = {}  # the engines' "released" events, by handle

    def device(self) -> torch.device:
        import torch

        return torch.device("cuda", torch.cuda.current_device())

    def allocate(self, index: int, size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        import torch

        buffer = torch.empty(size, dtype=torch.uint8, device=self.device())
        return buffer, self.share(buffer)

    def share(self, storage: torch.Tensor) -> dict[str, Any]:
        """Any CUDA memory of this device can be named by an IPC handle."""
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(storage)
        (_, shape, stride, offset, storage_cls, dtype, _, handle, storage_bytes, storage_offset, _,
         counter_handle, counter_offset, event_handle, event_sync) = args
        return {
            "uuid": device_uuid(storage.device.index), "shape": list(shape), "stride": list(stride),
            "offset": int(offset), "storage": storage_cls.__name__, "dtype": str(dtype),
            "handle": bytes(handle).hex(), "storage_bytes": int(storage_bytes),
            "storage_offset": int(storage_offset), "counter_handle": bytes(counter_handle).hex(),
            "counter_offset": int(counter_offset),
            "event_handle": bytes(event_handle).hex() if event_handle else "", "event_sync": bool(event_sync),
        }

    def _written_event(self) -> torch.cuda.Event:
        import torch

        if self._written is None:
            self._written = torch.cuda.Event(interprocess=True)
            self._written.record()  # created on this device, so that it has a handle
        return self._written

    def fence(self) -> dict[str, Any]:
        return {"written": bytes(self._written_event().ipc_handle()).hex()}

    def packed(self) -> None:
        self._written_event().record()  # the engine's stream waits on it: the trainer goes on

    def released(self, handles: list[str]) -> None:
        import torch

        stream = torch.cuda.current_stream()
        for handle in handles:
            stream.wait_event(_opened_event(self._engines, handle))

    def release(self) -> None:
        import torch

        self._buffers = []
        torch.cuda.ipc_collect()  # blocks the engines let go of return to the allocator


class CudaIpcReceiver(HandoffReceiver):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._fences: dict[str, torch.cuda.Event] = {}  # the trainer's "written" events, by handle
        self._released: torch.cuda.Event | None = None

    def open(self, description: dict[str, Any], size: int, device: Any) -> Any:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        mine = device_uuid(device.index)
        if description.get("uuid") != mine:
            raise SyncRefused(
                f"the trainer's buffer is on GPU {description.get('uuid')}, this engine on {mine}: "
                "CUDA IPC needs both on one GPU; sync this worker over NCCL (start it without --colocated)")
        storage_cls = {"TypedStorage": torch.storage.TypedStorage,
                       "UntypedStorage": torch.UntypedStorage}[description["storage"]]
        if description["dtype"] != "torch.uint8":
            raise SyncRefused(f"a handoff buffer is uint8, this one {description['dtype']}")
        tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(description["shape"]), tuple(description["stride"]), description["offset"],
            storage_cls, torch.uint8, device.index, bytes.fromhex(description["handle"]),
            description["storage_bytes"], description["storage_offset"], False,
            bytes.fromhex(description["counter_handle"]), description["counter_offset"],
            bytes.fromhex(description["event_handle"]) if description["event_handle"] else None,
            description["event_sync"],
        )
        return tensor[:size]

    def open_fence(self, description: dict[str, Any]) -> Any:
        handle = description.get("written")
        return _opened_event(self._fences, handle) if handle else None

    def wait(self, fence: Any) -> None:
        if fence is not None:
            fence.wait()  # this stream's copies wait for the trainer's writes

    def finish(self) -> str:
        """The copies may still run: the trainer waits on this event (``released``)
        before writing its memory again; this engine's own work runs after them
        on the same stream."""
        import torch

        if self._released is None:
            self._released = torch.cuda.Event(interprocess=True)
        self._released.record()
        return bytes(self._released.ipc_handle()).hex()

    def abort(self) -> None:
        import torch

        torch.cuda.synchronize()  # copies issued before the failure end before the trainer hears of it
        super().abort()


__all__ = ["CudaIpcReceiver", "CudaIpcSender", "device_uuid"]
