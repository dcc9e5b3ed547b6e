"""The fleet as one vLLM weight-transfer engine: vLLM's protocol, the project's rounds.

A trainer written for ``vllm serve`` (TRL's ``VLLMClient``) drives vLLM's
weight-transfer routes; the gateway (``api.vllm_server``) hands each to
:class:`FleetWeightTransfer`, which runs it on the fleet::

    trainer (rank 0 of its own group)          this coordinator                 each worker
    ─────────────────────────────────          ────────────────                 ───────────
    POST /init_weight_transfer_engine ───────► ranks: rank_offset + Σ ranks     rq_engine "transfer_join"
      ‖ opens rank 0 (StatelessProcessGroup      of the workers before (sorted   (signed): every engine rank
        + NCCL; gloo on CPU)                      by node), one signed command ─► joins the trainer's group
    POST /start_weight_update ───────────────► opens an update at fleet
                                               version + 1
    POST /update_weights (names, dtypes, ────► vLLM's packed layout as a        one sync round
      shapes) ‖ broadcasts the packed chunks   manifest; one sync round         (workers.node.sync): accept
                                               (weight_sync.sender's phases:    the manifest, pause, ready,
                                               trigger, ready, decision,        receive each chunk from the
                                               commit) over transport "vllm" ◄─ trainer and load it, commit
    POST /finish_weight_update ──────────────► closes the update                 the update's version
    POST /shutdown_weight_transfer_engine ───► rq_engine "transfer_leave" ─────► leave the group

The receive path is the project's (``weight_sync.receiver``: phases,
layerwise load, finalize, fencing, the plan's deadlines); only the bytes'
way differs (``weight_sync.transports.trainer_group``). A worker that fails
a round is fenced by the fleet's version until a round reaches it.

A worker that is not in the trainer's group (started since its init, or
restarted: the same node in a new process, told by its ``started_at``) and
is behind the round's version catches up in the trainer's next update: it is
a member of that round too, and one member's engine forwards each chunk it
receives from the trainer to it as it arrives (``SyncDecision.relay``, a
group formed for the round in this coordinator's store)::

    trainer ──chunk k──► group members (one of them, the source) ──chunk k──► catching-up workers

The bytes are the trainer's, so any member can forward them (whatever its
own weights), in any load mode (a CPU engine keeps no plain linear weights
to send after its own load, and a worker checks a manifest against its
checkpoint's names, not the engine's fused ones).
The catching-up worker loads them through the same receiver, and takes the
update's version only once the update has brought every tensor of its
checkpoint (several ``/update_weights`` of one update count together); until
then it stays fenced, and the round reports it under ``fenced`` with why. A
forward that fails leaves the source's own update alone. The trainer's next
``/init_weight_transfer_engine`` takes every live worker into its group.

Every update takes the fleet's version one further (several
``/update_weights`` inside one start/finish commit the same version).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollout_queue.tasks import control, keys
from rollout_queue.tasks.app import settings as client_settings
from rollout_queue.tasks.errors import InvalidRequest, NoWorkers, SyncRefused, WeightSyncError
from rollout_queue.tasks.registry import connect, fleet_version
from rollout_queue.tasks.schemas import PauseMode, WorkerInfo
from rollout_queue.weight_sync.protocol import (
    HandoffName,
    Manifest,
    Relay,
    SyncAck,
    SyncDecision,
    SyncPlan,
    SyncReport,
    SyncRound,
)
from rollout_queue.weight_sync.sender import WeightSender
from rollout_queue.weight_sync.settings import SyncSettings
from rollout_queue.weight_sync.transports.trainer_group import DEFAULT_PACKED_BUFFER_BYTES, packed_manifest

log = logging.getLogger(__name__)

TRANSPORT = "vllm"
# In-flight requests freeze and continue on the new weights, as in a vLLM
# server whose engine is busy in the update.
PAUSE: PauseMode = "keep"
# Seconds the workers wait for every rank of the trainer's group to join.
JOIN_TIMEOUT_S = 120.0


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TransferInit(_Message):
    """vLLM's ``NCCLWeightTransferInitInfo``, as ``/init_weight_transfer_engine`` takes it."""

    master_address: str | None = None
    master_port: int | None = Field(default=None, ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=1)
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: int = Field(default=DEFAULT_PACKED_BUFFER_BYTES, ge=1)
    packed_num_buffers: int = Field(default=2, ge=1)


class TransferUpdate(_Message):
    """vLLM's ``NCCLWeightTransferUpdateInfo``, as ``/update_weights`` takes it
    (``packed``: clients of vLLM before 0.28 send it here)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = None


@dataclass
class TrainerGroup:
    """The trainer's group as the fleet joined it."""

    group_round: SyncRound  # the round init opened: names the group in every update's decision
    init: TransferInit
    offsets: dict[str, int]  # node -> its first rank
    ranks: dict[str, int]  # node -> its engine ranks
    pool: str
    started: dict[str, float]  # node -> its process's start (a restarted one left the group)
    version: int | None = None  # the open update's version
    fenced: dict[str, str] = field(default_factory=dict)  # the last round's workers that did not commit


class TrainerGroupRounds(WeightSender):
    """The sender's phases with the trainer's group as transport: the manifest is
    what the trainer announced, and the bytes leave from the trainer, not from here
    (and, to the workers outside its group, from a member's engine: the relay)."""

    def __init__(self, settings: SyncSettings, group: TrainerGroup) -> None:
        super().__init__(settings, group.pool)
        self.group = group
        self._in_group: set[str] = set()  # this round's members of the trainer's group

    def in_group(self, worker: WorkerInfo) -> bool:
        """Whether ``worker``'s engine is in the trainer's group (the process that joined it)."""
        return worker.node in self.group.offsets and worker.started_at == self.group.started[worker.node]

    def membership(self) -> list[WorkerInfo]:
        """1. The live workers of the pool; at least one must be in the trainer's group."""
        live = super().membership()
        if not any(self.in_group(w) for w in live):
            raise NoWorkers(
                f"no worker of the trainer's group ({', '.join(sorted(self.group.offsets))}) is alive; "
                "call /init_weight_transfer_engine again", phase="membership")
        return live

    def catching_up(self, live: list[WorkerInfo], version: int) -> list[WorkerInfo]:
        """The live workers outside the trainer's group that are behind ``version`` and
        can take part (an engine still starting answers no trigger)."""
        return [w for w in live
                if not self.in_group(w) and w.weight_version < version and w.state not in ("starting", "stopping")]

    def decide(self, plan: SyncPlan, ready: list[str], acks: dict[str, SyncAck]) -> SyncDecision:
        """The trainer's group as the base decides it; the ready workers outside it
        take the chunks from the first ready member's engine (none ready: they sit out)."""
        members = [node for node in ready if node in self._in_group]
        decision = super().decide(plan, members, acks)
        targets = [node for node in ready if node not in self._in_group]
        if targets and members:
            offsets: dict[str, int] = {}
            rank = 1
            for node in targets:
                offsets[node] = rank
                rank += plan.members[node]
            decision.relay = Relay(source=members[0], offsets=offsets, world=rank)
            log.info("round %s: %s forwards the trainer's chunks to %s (catching up to version %d)",
                     plan.round, members[0], ", ".join(targets), plan.weight_version)
        return decision

    def choose_handoffs(self, members: list[WorkerInfo], backend: str) -> dict[str, HandoffName]:
        return {}

    def round(self, manifest: Manifest, version: int, timeout: float) -> tuple[SyncReport, dict[str, str]]:
        """One sync round; the report and the workers that did not commit (fenced)."""
        with self._lock:
            started = time.monotonic()
            deadline = started + timeout
            phases: dict[str, float] = {}
            t = time.monotonic()
            live = self.membership()
            members = [w for w in live if self.in_group(w)] + self.catching_up(live, version)
            self._in_group = {w.node for w in members if self.in_group(w)}
            phases["membership"] = time.monotonic() - t
            self.transport(TRANSPORT).group_round = self.group.group_round  # type: ignore[attr-defined]
            self._planned = (("vllm", id(manifest)), manifest, *manifest.wire())
            outcome = self.run_round(members, manifest, version, PAUSE, TRANSPORT, {}, deadline, {},
                                     phases=phases)
            # The bytes leave from the trainer's own process: they move while this
            # side waits for the commit.
            report = outcome.report(manifest, time.monotonic() - started, moving=("transfer", "commit"))
            return report, {**outcome.silent, **outcome.failed}


class FleetWeightTransfer:
    """vLLM's weight-transfer engine for the whole fleet (one per gateway).

    ``workers``: the live workers serving the gateway's queue, read now.
    Calls are serialized; each blocks (run them off the event loop).
    """

    def __init__(self, settings: SyncSettings, workers: Callable[[], list[WorkerInfo]]) -> None:
        self.settings = settings
        self.workers = workers
        self.group: TrainerGroup | None = None
        self.rounds: TrainerGroupRounds | None = None
        self._lock = threading.Lock()

    def config(self) -> dict[str, Any]:
        """``weight_transfer_config`` of ``/server_info``: vLLM's NCCL engine (gloo on CPU)."""
        return {"backend": "nccl"}

    # ------------------------------------------------------------ the routes

    def init(self, init: TransferInit) -> dict[str, Any]:
        """Hand each live worker its ranks and have every engine rank join the trainer's group."""
        if init.nccl_unique_id_b64:
            raise InvalidRequest("this fleet joins the trainer's group by master_address and master_port; "
                                 "nccl_unique_id_b64 is not served")
        if init.master_address is None or init.master_port is None:
            raise InvalidRequest("init_info needs master_address and master_port (the trainer's group store)")
        if not init.packed:
            raise InvalidRequest("this fleet takes vLLM's packed layout only (TRL sends packed=true); "
                                 "set packed to true")
        with self._lock:
            workers = sorted((w for w in self.workers() if w.state != "stopping"), key=lambda w: w.node)
            if not workers:
                raise NoWorkers("no live worker serves this gateway's queue: nobody can join the trainer's group",
                                phase="membership")
            ranks = sum(w.ranks for w in workers)
            if init.rank_offset + ranks != init.world_size:
                raise SyncRefused(
                    f"the trainer's group has world_size {init.world_size} with the engines from rank "
                    f"{init.rank_offset}: {init.world_size - init.rank_offset} engine ranks, but "
                    f"{len(workers)} workers with {ranks} engine ranks serve this queue now (GET "
                    "/get_world_size); ask for the world size again and retry", phase="membership")
            pools = {w.pool for w in workers}
            if len(pools) > 1:
                raise SyncRefused(f"the workers of this queue are in several pools {sorted(pools)}: one "
                                  "trainer's weights go to one pool", phase="membership")
            offsets: dict[str, int] = {}
            rank = init.rank_offset
            for worker in workers:
                offsets[worker.node] = rank
                rank += worker.ranks
            self._forget()
            group_round = SyncRound.new(int(connect(client_settings()).incr(keys.SYNC_EPOCH)))
            group = TrainerGroup(group_round, init, offsets, {w.node: w.ranks for w in workers},
                                 pools.pop(), {w.node: w.started_at for w in workers})
            args = {
                "group_round": group.group_round, "master_address": init.master_address,
                "master_port": init.master_port, "world_size": init.world_size, "offsets": offsets,
                "packed_buffer_size_bytes": init.packed_buffer_size_bytes, "timeout_s": JOIN_TIMEOUT_S,
            }
            started = time.monotonic()
            control.engine_command("transfer_join", args, workers=list(offsets), timeout=JOIN_TIMEOUT_S + 30.0)
            log.info("trainer's group %s at %s:%s joined in %.2fs: %s", group.group_round, init.master_address,
                     init.master_port, time.monotonic() - started, offsets)
            self.group = group
            self.rounds = TrainerGroupRounds(self.settings, group)
            return {"message": "Weight transfer initialized", "group": group.group_round, "ranks": offsets}

    def start(self) -> dict[str, Any]:
        """Open an update: it will commit the fleet's version + 1."""
        with self._lock:
            group = self._joined("/start_weight_update")
            assert self.rounds is not None
            # Read again even if an update is open (its finish never came: the trainer
            # gave it up): its version may have been committed by some workers.
            group.version = fleet_version(self.rounds.client, group.pool) + 1
            return {"message": "Weight update started", "weight_version": group.version}

    def update(self, update: TransferUpdate) -> dict[str, Any]:
        """One sync round: the workers receive the trainer's chunks, load and commit."""
        group = self._joined("/update_weights")
        if update.packed is False:
            raise InvalidRequest("this fleet takes vLLM's packed layout only; send packed=true")
        try:
            manifest = packed_manifest(update.names, update.dtype_names, update.shapes,
                                       group.init.packed_buffer_size_bytes)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        with self._lock:
            if group.version is None:  # an update without /start_weight_update: it opens one
                assert self.rounds is not None
                group.version = fleet_version(self.rounds.client, group.pool) + 1
            assert self.rounds is not None
            timeout = self.settings.timeouts.ready + self.settings.timeouts.transfer + self.settings.timeouts.commit
            report, fenced = self.rounds.round(manifest, group.version, timeout)
            # A worker of the queue this round did not bring to its version (one still
            # starting): fenced by the fleet's version until a later round reaches it.
            for worker in self.workers():
                if (worker.node not in report.workers and worker.node not in fenced
                        and worker.weight_version < group.version and worker.state != "stopping"):
                    fenced[worker.node] = (f"at version {worker.weight_version} ({worker.state}), not in this "
                                           "round; it catches up in a later update")
            group.fenced = fenced
        (log.warning if fenced else log.info)(
            "update to version %d: %d tensors, %d bytes in %.2fs (%s); committed %s%s", report.version,
            report.tensors, report.bytes, report.seconds,
            ", ".join(f"{phase} {seconds:.2f}s" for phase, seconds in report.phases.items()),
            ", ".join(report.workers) or "none",
            "; fenced: " + "; ".join(f"{node} ({why})" for node, why in sorted(fenced.items())) if fenced else "")
        if not report.workers:
            raise WeightSyncError(
                f"no worker took the update to version {group.version}: "
                + "; ".join(f"{node} ({why})" for node, why in sorted(fenced.items()))
                + "; they keep their weights (fenced when changed half-way)", phase="commit", workers=fenced)
        return {"message": "Weights updated", "weight_version": report.version, "workers": report.workers,
                "fenced": fenced, "tensors": report.tensors, "bytes": report.bytes,
                "seconds": round(report.seconds, 3)}

    def finish(self) -> dict[str, Any]:
        """Close the update; the next one takes the version after."""
        with self._lock:
            group = self._joined("/finish_weight_update")
            version, group.version = group.version, None
            return {"message": "Weight update finished", "weight_version": version, "fenced": group.fenced}

    def shutdown(self) -> dict[str, Any]:
        """Every member leaves the trainer's group."""
        with self._lock:
            left = list(self.group.offsets) if self.group is not None else []
            self._forget()
            return {"message": "Weight transfer shut down", "workers": left}

    # -------------------------------------------------------------- helpers

    def _joined(self, route: str) -> TrainerGroup:
        if self.group is None:
            raise SyncRefused(f"{route} before /init_weight_transfer_engine: the fleet is in no trainer's "
                              "group; call /init_weight_transfer_engine first", phase="init")
        return self.group

    def _forget(self) -> None:
        """Drop the current group: its members leave (best effort: a gone worker left already)."""
        group, self.group = self.group, None
        if self.rounds is not None:
            self.rounds.close()
            self.rounds = None
        if group is None:
            return
        try:
            control.engine_command("transfer_leave", workers=list(group.offsets), timeout=30.0)
        except Exception:  # noqa: BLE001, S110  a member gone or cut off: its group died with it
            pass


__all__ = ["FleetWeightTransfer", "TrainerGroup", "TrainerGroupRounds", "TransferInit", "TransferUpdate"]
