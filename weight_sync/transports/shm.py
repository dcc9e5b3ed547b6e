"""The shared-memory handoff: a colocated CPU worker on the trainer's host.

The trainer packs each bucket into a file of ``/dev/shm`` (``rq-sync-<id>-<k>``,
kept between syncs, removed when the sender closes or its process exits);
the worker's engine maps the same file and loads from it. One copy on each
side (pack, ``load_weights``), no socket, no gloo.
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

    def release(self) -> None:
        _unlink(self._paths)
        self._paths.clear()


class ShmReceiver(HandoffReceiver):
    def open(self, description: dict[str, Any], size: int, device: Any) -> Any:
        import torch

        segment = str(description.get("segment", ""))
        if not _SEGMENT.fullmatch(segment):  # never map another file than a sync's segment
            raise SyncRefused(f"shared-memory segment {segment!r} is not a weight-sync segment")
        path = os.path.join(SHM_DIR, segment)
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


__all__ = ["ShmReceiver", "ShmSender"]
