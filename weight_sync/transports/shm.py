"""The shared-memory handoff: a colocated CPU worker on the trainer's host.

A trainer whose parameters live in shared memory (``model.share_memory()``:
torch names each storage by a ``/dev/shm`` file) announces those names, and
the worker's engine copies straight from them into its parameters: one copy
in all. Otherwise the trainer packs each bucket into a file of ``/dev/shm``
(``rq-sync-<id>-<k>``, kept between syncs, removed when the sender closes or
its process exits) that the engine maps: one copy on each side (pack,
``load_weights``). No socket, no gloo.
"""

from __future__ import annotations

import os
import re
import uuid
import weakref
from typing import TYPE_CHECKING, Any

from rollout_queue.tasks.errors import SyncRefused
from rollout_queue.weight_sync.transports.handoff import HandoffReceiver, HandoffSender

if TYPE_CHECKING:
    import torch

    from rollout_queue.weight_sync.settings import SyncSettings

SHM_DIR = "/dev/shm"
_SEGMENT = re.compile(r"rq-sync-[0-9a-f]{12}-\d+")
_TORCH_SEGMENT = re.compile(r"torch_\d+_\d+_\d+")  # torch's own shared storages


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class ShmSender(HandoffSender):
    def __init__(self, name: str, settings: SyncSettings) -> None:
        super().__init__(name, settings)
        self._paths: list[str] = []
        self._cleanup = weakref.finalize(self, _unlink, self._paths)  # also at interpreter exit

    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def allocate(self, index: int, size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        import torch

        if not self._paths:
            self._token = uuid.uuid4().hex[:12]
        path = os.path.join(SHM_DIR, f"rq-sync-{self._token}-{index}")
        buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self._paths.append(path)
        return buffer, {"segment": os.path.basename(path), "size": size}

    def share(self, storage: torch.Tensor) -> dict[str, Any] | None:
        """A storage already in shared memory (``model.share_memory()``) is named by
        its ``/dev/shm`` file; any other is packed (moving the caller's tensors
        into shared memory is the caller's choice, not the sync's)."""
        untyped = storage.untyped_storage()
        if not untyped.is_shared():
            return None
        try:
            manager, name, _ = untyped._share_filename_cpu_()  # the name torch gave its segment
        except RuntimeError:
            return None
        segment = name.decode().lstrip("/")
        if not _TORCH_SEGMENT.fullmatch(segment) or not os.path.exists(os.path.join(SHM_DIR, segment)):
            return None
        # torch's segment starts with its reference count: a reader maps it through
        # torch (with the trainer's shm manager), not as a plain file.
        return {"segment": segment, "size": int(untyped.nbytes()), "manager": manager.decode()}

    def release(self) -> None:
        _unlink(self._paths)
        self._paths.clear()


class ShmReceiver(HandoffReceiver):
    def open(self, description: dict[str, Any], size: int, device: Any) -> Any:
        import torch

        segment = str(description.get("segment", ""))
        if not (_SEGMENT.fullmatch(segment) or _TORCH_SEGMENT.fullmatch(segment)):
            # never map another file than a sync's segment or a shared torch storage
            raise SyncRefused(f"shared-memory segment {segment!r} is not a weight-sync segment")
        path = os.path.join(SHM_DIR, segment)
        if _TORCH_SEGMENT.fullmatch(segment):
            return self._open_torch_storage(description, path, size)
        try:
            found = os.path.getsize(path)
        except OSError as exc:
            raise SyncRefused(
                f"shared-memory segment {path} is not on this host ({exc}): the shm transport needs the "
                "worker on the trainer's host, sharing its /dev/shm; start the worker without --colocated "
                "or sync with RQ_TRANSPORT=gloo") from exc
        if found < size:
            raise SyncRefused(f"shared-memory segment {path} holds {found} bytes, the bucket {size}")
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)

    @staticmethod
    def _open_torch_storage(description: dict[str, Any], path: str, size: int) -> Any:
        """A storage the trainer keeps in torch's shared memory, mapped as torch maps it."""
        import torch

        manager = str(description.get("manager", ""))
        if not manager.endswith("/manager.sock") or not os.path.exists(manager) or not os.path.exists(path):
            raise SyncRefused(
                f"the trainer's shared storage {path} (shm manager {manager!r}) is not on this host: the shm "
                "transport needs the worker on the trainer's host; start the worker without --colocated "
                "or sync with RQ_TRANSPORT=gloo")
        storage = torch.UntypedStorage._new_shared_filename_cpu(
            manager.encode(), ("/" + os.path.basename(path)).encode(), size)
        return torch.empty(0, dtype=torch.uint8).set_(storage)


__all__ = ["ShmReceiver", "ShmSender"]
