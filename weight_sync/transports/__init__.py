"""How a sync's bytes reach a worker's engine: transports, chosen by name.

    name       kind      where                                     module
    gloo       group     any worker, CPU (a gloo process group)    groups
    nccl       group     any worker, CUDA (an NCCL process group)  groups
    shm        handoff   a colocated CPU worker on this host       shm
    cuda_ipc   handoff   a colocated worker on the trainer's GPU   cuda_ipc
    vllm       group     the trainer's own group (vLLM's           trainer_group
                         StatelessProcessGroup: TRL's client), joined
                         at /init_weight_transfer_engine

A *group* transport broadcasts the buckets over a process group of the
trainer and every worker that gets it; a *handoff* transport packs each
bucket once into memory the worker's engine can map (shared memory, a CUDA
IPC handle) and names it in the trainer's store. The plan says per worker
which transport it gets (``SyncPlan.transport_of``), so one sync may mix
them; the coordinator (``weight_sync.sender``) runs the protocol's phases
whatever travels underneath.

Each transport has two ends, looked up here by name and imported only when
first asked for (as vLLM's ``WeightTransferEngineFactory`` does): the
trainer's (:class:`~weight_sync.transports.base.TransportSender`) and the
engine's (:class:`~weight_sync.transports.base.TransportReceiver`). A new
transport registers both with :func:`register`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_queue.weight_sync.transports.base import TransportReceiver, TransportSender

# name -> (module, sender class, receiver class); imported on first use.
_REGISTRY: dict[str, tuple[str, str, str]] = {}

GROUP_TRANSPORTS = ("gloo", "nccl")
HANDOFF_TRANSPORTS = ("shm", "cuda_ipc")
# Transports whose engine end converts a tensor of another dtype to the engine's
# (the trainer announces its own dtypes), so the worker does not refuse it.
CONVERTING_TRANSPORTS = ("vllm",)


def register(name: str, module: str, sender: str, receiver: str) -> None:
    """Register transport ``name``: its two ends are ``module.sender`` and ``module.receiver``."""
    if name in _REGISTRY and _REGISTRY[name] != (module, sender, receiver):
        raise ValueError(f"transport {name!r} is already registered as {_REGISTRY[name]}")
    _REGISTRY[name] = (module, sender, receiver)


def names() -> list[str]:
    return sorted(_REGISTRY)


def _lookup(name: str, end: int) -> type:
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no weight-sync transport named {name!r}; known: {', '.join(names())}") from None
    return getattr(importlib.import_module(entry[0]), entry[end])  # type: ignore[no-any-return]


def sender_class(name: str) -> type[TransportSender]:
    """The trainer's end of transport ``name``."""
    return _lookup(name, 1)


def receiver_class(name: str) -> type[TransportReceiver]:
    """The engine's end of transport ``name``."""
    return _lookup(name, 2)


_HERE = __name__
register("gloo", f"{_HERE}.groups", "GroupSender", "GroupReceiver")
register("nccl", f"{_HERE}.groups", "GroupSender", "GroupReceiver")
register("shm", f"{_HERE}.shm", "ShmSender", "ShmReceiver")
register("cuda_ipc", f"{_HERE}.cuda_ipc", "CudaIpcSender", "CudaIpcReceiver")
register("vllm", f"{_HERE}.trainer_group", "TrainerGroupSender", "TrainerGroupReceiver")

__all__ = [
    "CONVERTING_TRANSPORTS", "GROUP_TRANSPORTS", "HANDOFF_TRANSPORTS", "names", "receiver_class", "register",
    "sender_class",
]
