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

The worker host's part (acks, pause, the engine call, commit) is
``workers.node.sync``; the user's face is ``tasks.sync_weights``.

Imports: this package may import ``tasks`` (errors, schemas, keys, settings,
the Celery app for the sender's trigger) but never ``workers`` (which imports
it), and never vLLM or torch at import time: ``protocol``, ``wire`` and
``sender`` import without them (torch is imported lazily, where tensors are
handled); only ``receiver``, ``inplace`` and ``bench_receiver``, which run
inside vLLM's processes, import them.
"""

# ``tasks`` imports this package (its ``sync_weights`` face, the settings'
# WorkerTimeouts): set it up first, so that importing a module of this
# package before ``tasks`` finds ``tasks`` whole.
import rollout_queue.tasks  # noqa: F401  isort: skip
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
