"""Where a process runs, as the transports tell "same host" and "same GPU".

``host_id``: the host name and the kernel's boot id, so two processes in one
container (or two containers that share a host name, /dev/shm and a boot)
compare equal, and a machine rebooted under the same name does not. A GPU is
named by its UUID (``weight_sync.transports.cuda_ipc.device_uuid``), never by
its index: ``CUDA_VISIBLE_DEVICES`` renumbers devices per process.
"""

from __future__ import annotations

import functools
import socket
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def host_id() -> str:
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


__all__ = ["host_id"]
