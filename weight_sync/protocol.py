"""The weight sync's messages, one pydantic model each, and the protocol version.

Who sends what, in the order of a sync (``weight_sync.sender`` draws the phases):

    SyncPlan        trainer → workers    the trigger (a signed control command);
                                         names the Manifest by digest, carries
                                         the workers' deadlines (WorkerTimeouts)
    SyncAck         worker → trainer     "accepted", "ready", "done" (Redis list)
    SyncDecision    trainer → workers    roster and ranks (the trainer's TCPStore);
                                         in a decided round, claimed by its one
                                         worker (``SyncDecision.claim``)
    UpdateRequest   worker host → engine the one engine call (``collective_rpc``)
    UpdateResult    engine → worker host its seconds, or its SyncFailure
    SyncReport      sender → its caller  what the sync did

One value names a sync round everywhere: its :class:`SyncRound`
(``<epoch>-<nonce>``), carried by the plan and every ack, printed in log lines,
and the one argument of the names derived from it (``keys.sync_acks``,
``keys.sync_decision``, ``keys.sync_handoff``, ``keys.sync_group``). The
weights a round installs are its plan's ``weight_version``: another thing.

A failure crosses a process as a :class:`SyncFailure` (a kind and a message),
mapped back to the error tree by ``tasks.errors.SYNC_ERRORS``. Imports
without torch or vLLM.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler
from pydantic_core import core_schema

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import SYNC_ERRORS, SyncErrorKind, WeightSyncError, sync_error_kind
from rollout_queue.tasks.schemas import PauseMode

# 3: the manifest travels by digest; 4: signed in the control envelope (ControlAuth);
# 5: the workers' deadlines travel in the plan, failures as a kind and a message;
# 6: a transport per worker (``SyncPlan.handoffs``), the roster beyond the group;
# 7: one name per round (``SyncRound``) in the plan, the acks and the decision;
# 8: the ready ack names the group the engine holds (``SyncAck.group_round``);
# 9: a catch-up relayed by a member (``SyncDecision.relay``);
# 10: a round of one handed member is decided by its plan (``SyncPlan.decided``);
# 11: a handoff of the trainer's storages is named in the plan (``SyncPlan.layouts``),
#     and a CUDA engine's copies end by an event the trainer waits on (``SyncAck.released``);
# 12: a decided round's "done" ack names the key of the trainer's store its worker
#     waits on for the next trigger (``SyncAck.listening``).
PROTOCOL_VERSION = 12

_ROUND = re.compile(r"(0|[1-9][0-9]*)-([0-9A-Za-z_.-]+)")


class SyncRound(str):
    """The name of one weight-sync round, ``<epoch>-<nonce>`` (e.g. ``42-3f9a1c2b7d0e``).

    The epoch (one more each round: ``keys.SYNC_EPOCH``) orders rounds; the
    nonce keeps the name unique should the counter ever start again (Redis
    flushed). It is a ``str`` in its one rendering, so the same text is the
    plan's and every ack's ``round`` (JSON), the argument the round's Redis
    and store names are derived from, and what log lines print.
    """

    __slots__ = ()

    def __new__(cls, name: str) -> Self:
        if not _ROUND.fullmatch(name):
            raise ValueError(f"{name!r} is not a sync round: <epoch>-<nonce>, e.g. 42-3f9a1c2b7d0e")
        return super().__new__(cls, name)

    @classmethod
    def new(cls, epoch: int) -> Self:
        """Round ``epoch``, with a fresh nonce."""
        return cls(f"{int(epoch)}-{uuid.uuid4().hex[:12]}")

    @property
    def epoch(self) -> int:
        return int(self.partition("-")[0])

    @property
    def nonce(self) -> str:
        return self.partition("-")[2]

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        # Validated from (and serialized as) its one string.
        return core_schema.no_info_after_validator_function(
            cls, core_schema.str_schema(), serialization=core_schema.to_string_ser_schema())


# The transports a worker can be handed the weights by instead of the group
# (weight_sync/transports).
HandoffName = Literal["shm", "cuda_ipc"]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorSpec(_Message):
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: list[int]
    bucket: int
    offset: int  # byte offset inside the bucket
    nbytes: int


class Manifest(_Message):
    """Every tensor of the sync and where it sits in which bucket."""

    tensors: list[TensorSpec]
    bucket_sizes: list[int]  # bytes per bucket, in send order
    # Each bucket travels in pieces of this many bytes (0: whole), so the
    # receiver loads the tensors of one piece while the next is on the wire.
    chunk_bytes: int = Field(default=0, ge=0)
    # A tensor of at least this many bytes travels as a piece of its own, sent
    # straight from the trainer's tensor (no packing copy); 0: every tensor is packed.
    direct_bytes: int = Field(default=0, ge=0)

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    def wire(self) -> tuple[str, str]:
        """Its JSON and that JSON's sha256: the plan carries the digest (signed with
        the plan), the JSON travels beside it (a Redis key, see ``keys.sync_manifest``)."""
        text = self.model_dump_json()
        return text, hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def from_wire(cls, text: str | bytes, digest: str) -> Manifest:
        """The manifest whose JSON is ``text``, once its sha256 is ``digest``."""
        raw = text.encode() if isinstance(text, str) else text
        if hashlib.sha256(raw).hexdigest() != digest:
            raise ValueError(f"the manifest stored for digest {digest[:12]} does not hash to it")
        return cls.model_validate_json(raw)


class WorkerTimeouts(_Message):
    """A worker's deadlines for one sync, seconds; the trainer sets them
    (``SyncSettings.timeouts.worker``) and they travel in the plan."""

    probe: float = Field(default=5.0, gt=0)  # reach the trainer's store, before pausing
    pause: float = Field(default=120.0, gt=0)  # the engine pauses ("wait": requests finish)
    store_connect: float = Field(default=30.0, gt=0)  # connect to the trainer's store
    decision: float = Field(default=180.0, gt=0)  # the trainer's decision is in its store
    group_join: float = Field(default=60.0, gt=0)  # every rank joined; the group's timeout
    receive: float = Field(default=600.0, gt=0)  # every bucket received and loaded
    update: float = Field(default=900.0, gt=0)  # the engine call: join, receive, finish
    resume: float = Field(default=60.0, gt=0)  # the engine resumes (after a sync or failure)
    abort: float = Field(default=120.0, gt=0)  # the engine rolls a failed update back
    # The trainer has written the round's outcome (the pool's version) within
    # this long: a worker that missed the round stays fenced at least that long.
    outcome: float = Field(default=300.0, gt=0)


class SyncPlan(_Message):
    """The one broadcast that triggers a sync (signed with the command: ``ControlAuth``)."""

    protocol: int = PROTOCOL_VERSION
    round: SyncRound
    weight_version: int  # the weights this round installs: the workers' new weight_version
    pause: PauseMode
    store_host: str
    store_port: int
    # Proposed membership: node → engine ranks it brings. The decision in the
    # store fixes the final roster (who answered ready) and rank offsets.
    members: dict[str, int]
    # The group transport (``weight_sync.transports``), for every member not
    # named in ``handoffs``; those get the weights handed over in place.
    # "vllm": the trainer's own group, joined at /init_weight_transfer_engine
    # (``transports.trainer_group``); the trainer broadcasts, not the coordinator.
    backend: Literal["gloo", "nccl", "vllm"]
    handoffs: dict[str, HandoffName] = {}
    # The manifest travels once per layout, not in every trigger (a 7B model's is
    # ~50 KB of JSON: ~2 ms to publish and as much to read): the plan names it
    # by digest; each side attaches it locally (``manifest``, never serialized).
    manifest_digest: str
    manifest: Manifest | None = Field(default=None, exclude=True)
    issued_at: float
    timeouts: WorkerTimeouts = WorkerTimeouts()
    # The plan is the decision: a round of one member, handed the weights, whose
    # handoff the trainer announces as the trigger travels. The worker takes the
    # round by writing the go decision itself (``SyncDecision.claim``) once it
    # has paused, and loads at once: no "ready" ack, no decision to wait for.
    # A trainer that gives the round up writes its no-go the same way; the
    # first write stands, so the worker never loads from memory the trainer
    # has moved on from.
    decided: bool = False
    # Handoff transport → the digest of the trainer's storages layout it hands
    # over (``transports.handoff``), stored in the trainer's store before this
    # plan was published: an engine that holds that layout loads at once, one
    # that does not reads it there. A handoff not named here announces its
    # buckets in the store as they are packed.
    layouts: dict[str, str] = {}

    def transport_of(self, node: str) -> str:
        """The transport ``node`` gets its weights by in this sync."""
        return self.handoffs.get(node, self.backend)

    def transports(self) -> list[str]:
        """The transports of this sync, handoffs first (they announce, the group waits)."""
        used = {self.transport_of(node) for node in self.members}
        return sorted(used, key=lambda name: (name == self.backend, name))


class SyncFailure(_Message):
    """Why a step failed, as it crosses a process: the error's kind (its class in
    ``tasks.errors.SYNC_ERRORS``) and its message."""

    kind: SyncErrorKind
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> SyncFailure:
        """The failure ``exc`` stands for. An error from outside the sync's errors
        travels as "failed", its class named in the message (``TimeoutError: ...``)."""
        known = isinstance(exc, WeightSyncError)
        return cls(kind=sync_error_kind(exc), message=str(exc) if known else f"{type(exc).__name__}: {exc}")

    def error(self, phase: str = "", workers: list[str] | tuple[str, ...] = ()) -> WeightSyncError:
        """The error of the tree this failure stands for."""
        return SYNC_ERRORS[self.kind](self.message, phase=phase, workers=workers)

    def __str__(self) -> str:
        return self.message


class SyncAck(_Message):
    """A worker's acknowledgement of one phase, pushed to Redis."""

    node: str
    round: SyncRound
    phase: Literal["accepted", "ready", "done"]  # "accepted" answers the trigger (ok=False: refused)
    ok: bool
    error: SyncFailure | None = None
    seconds: dict[str, float] = {}
    # "ready": the round whose process group this worker's engine holds for the
    # plan's transport (None: none). A trainer keeps its group only while every
    # member still holds it: another trainer's sync in between moves a worker
    # into a group of its own.
    group_round: SyncRound | None = None
    # "done": what the engine's reads of the trainer's memory end with (CUDA IPC
    # event handles, hex): the copies may still run on the GPU when the engine
    # answers; the trainer's stream waits for these before it writes again.
    released: list[str] = []
    # "done" of a decided round: the key of the trainer's store this worker waits
    # on for its next decided round's trigger (``keys.sync_trigger``: the trainer
    # writes the trigger there instead of broadcasting it); None: it waits on none.
    listening: str | None = None


class Relay(_Message):
    """Workers outside the round's group that one member's engine forwards every
    bucket to as it arrives (the workers a trainer's own group cannot reach:
    ``weight_sync.vllm_transfer``). The relay group is formed for the round, in
    the coordinator's store under ``keys.sync_relay(round)``: the source's first
    engine rank is its rank 0; every engine rank of the targets receives."""

    source: str  # the member whose engine forwards
    offsets: dict[str, int]  # target node -> its first rank in the relay group (from 1)
    world: int  # 1 + the targets' engine ranks


class SyncDecision(_Message):
    """Written by the trainer into its store once the ready acks are in."""

    go: bool
    reason: str | None = None
    # The group's members: node → first global rank; world = 1 + Σ ranks.
    offsets: dict[str, int] = {}
    world: int = 0
    # The round that formed the process group this round's transfer uses: this
    # round (a new group), or an earlier one (its group kept: the roster held).
    # The group's name in the store derives from it (``keys.sync_group``).
    group_round: SyncRound | None = None
    # The members handed the weights instead (``SyncPlan.handoffs``).
    handoff: list[str] = []
    # The members that take the buckets from another member's engine instead.
    relay: Relay | None = None

    @property
    def roster(self) -> set[str]:
        """Every worker the sync goes ahead with."""
        return {*self.offsets, *self.handoff, *(self.relay.offsets if self.relay is not None else ())}

    @classmethod
    def handed(cls, node: str) -> SyncDecision:
        """The go decision of a decided round (``SyncPlan.decided``): ``node`` handed the weights."""
        return cls(go=True, world=1, handoff=[node])

    def claim(self, store: Any, sync_round: SyncRound) -> SyncDecision:
        """Write this as round ``sync_round``'s decision unless one is there; the one
        that stands. In a decided round the worker claims the go and a trainer giving
        the round up claims its no-go: one atomic compare-and-set in the store decides."""
        stood = store.compare_set(keys.sync_decision(sync_round), "", self.model_dump_json())
        return SyncDecision.model_validate_json(stood)

    def relayed(self, node: str) -> bool:
        """Whether ``node`` takes this round's buckets through the relay."""
        return self.relay is not None and node in self.relay.offsets

    def reuses_group(self, sync_round: SyncRound) -> bool:
        """Whether round ``sync_round`` transfers over a group an earlier round formed."""
        return self.group_round is not None and self.group_round != sync_round


class UpdateRequest(_Message):
    """The engine call of a sync (``rq_update`` on every engine rank): join, receive
    and load, verify and finalize. Travels as JSON through vLLM's ``collective_rpc``."""

    plan: SyncPlan  # its manifest travels in ``manifest`` below, when it must
    decision: SyncDecision
    node: str  # the worker whose engine ranks these are: its rank offset in the decision
    # The manifest's JSON, when the engine does not hold the plan's one already
    # (it keeps the last one it was sent): only a new layout travels.
    manifest: str | None = None


class UpdateResult(_Message):
    """One engine rank's answer to an ``UpdateRequest``: its seconds per step, or
    the failure that stopped it (the host then rolls the engine back)."""

    seconds: dict[str, float] = {}
    failure: SyncFailure | None = None
    # What this rank's reads of the trainer's memory end with (a CUDA IPC event's
    # handle, hex), when its copies may still run on the GPU (``SyncAck.released``).
    released: str | None = None


class SyncReport(_Message):
    version: int  # the weight_version the workers now hold
    epoch: int  # ``round.epoch``
    round: SyncRound
    workers: list[str]
    tensors: int
    bytes: int
    seconds: float
    gb_per_s: float
    backend: str
    reused_group: bool
    phases: dict[str, float]
    # Slowest worker's own seconds per step (pause, join, receive, load, commit).
    worker_phases: dict[str, float] = {}
