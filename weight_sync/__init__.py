"""The weight sync: the trainer pushes new weights into every worker's engine.

What lives here, one concept a module:

    protocol        the messages (SyncPlan, SyncAck, SyncDecision, UpdateRequest,
                    UpdateResult, SyncReport, Manifest) and the protocol version
    wire            buckets and pieces (``iter_buckets``: the walk both ends
                    make), packing, process groups over the trainer's TCPStore
    sender          the trainer's end (``WeightSender``); its docstring draws
                    the protocol's phases
    receiver        the engine's end, inside vLLM's worker processes
                    (``WeightReceiver``, the engine's ``worker_extension_cls``),
                    its receive buffers and phases
    inplace         receiving a tensor straight into the parameter that holds it
    cpu_weights     plain (unpacked) linear weights on vLLM's CPU backend
    bench_receiver  the receiver plus the calls only benchmarks and tests make

    sync_weights    the trainer's face: ``broadcast``, ``catch_up``, ``status``
    vllm_transfer   the fleet as one vLLM weight-transfer engine (the gateway's
                    routes for a trainer written for ``vllm serve``, TRL's)
    settings        the trainer's ``SyncSettings`` and ``SyncTimeouts``
    transports      how the bytes travel, one module per transport, by name:
                    gloo and nccl (a process group), shm and cuda_ipc (a
                    handoff to a colocated worker), vllm (the group a vLLM-server
                    trainer makes itself)

The worker host's part (acks, pause, the engine call, commit) is
``workers.node.sync``.

Imports: this package sits above ``tasks`` and may import it (errors, schemas,
keys, the client settings, the Celery app for the sender's trigger);
``tasks`` never imports it (``tasks.sync_weights`` is handed out lazily).
Never ``workers`` (which imports it), and never vLLM or torch at import time: ``protocol``, ``wire`` and
``sender`` import without them (torch is imported lazily, where tensors are
handled); only ``receiver``, ``inplace`` and ``bench_receiver``, which run
inside vLLM's processes, import them.
"""

from rollout_queue.weight_sync.protocol import (
    PROTOCOL_VERSION,
    Manifest,
    SyncAck,
    SyncDecision,
    SyncFailure,
    SyncPlan,
    SyncReport,
    TensorSpec,
    UpdateRequest,
    UpdateResult,
    WorkerTimeouts,
)

__all__ = [
    "PROTOCOL_VERSION",
    "Manifest",
    "SyncAck",
    "SyncDecision",
    "SyncFailure",
    "SyncPlan",
    "SyncReport",
    "TensorSpec",
    "UpdateRequest",
    "UpdateResult",
    "WorkerTimeouts",
]
