"""The sending end of the weight sync (the trainer): push new weights into every worker.

    report = sync_weights.broadcast(model, version=7, pause="wait")   # weight_sync.sync_weights

The protocol, in the order :meth:`WeightSender.sync` runs it::

    trainer (rank 0)                              each worker (ranks offset … offset+TP·PP-1)
    ────────────────                              ──────────────────────────────────────────
    1 membership  live workers of the pool
                  from the Redis registry
    2 rendezvous  host a TCPStore at
                  RQ_RENDEZVOUS_HOST:PORT (kept)
    3 trigger     manifest (names/dtypes/shapes   accept: HMAC; manifest by digest (kept,
                  + bucket/piece plan) into Redis  or read from Redis and hashed) vs
                  by digest, once per layout;      checkpoint (names, shapes, dtype)
                  one broadcast control ────────► → "accepted" ack (ok or refused, Redis list)
                  message: SyncPlan (round,        pause: close intake, pause engine if busy
                  weight_version, pause, store,    (wait | keep | abort) → "ready" ack (same list)
                  members, manifest digest, the
                  workers' deadlines, HMAC)
      ready       wait for "ready" acks; drop the
                  silent; decision → TCPStore ───► read the decision (roster, offsets, world,
                                                   the round whose process group serves)
    4 transfer    per transport of the plan     ◄──► rq_update(UpdateRequest), one engine
                  (weight_sync.transports):         call (weight_sync.receiver): the
                  handoffs (shm, cuda_ipc) pack     worker's transport takes each bucket
                  each bucket once into mappable    (joins the group and receives in
                  memory and name it in the store;  place or into pooled buffers; or
                  the group (gloo on CPU, NCCL on   maps the handed-over buffer) and
                  CUDA) broadcasts the buckets in   loads it (layerwise or direct);
                  pieces (both ends walk            check every entry arrived,
                  wire.iter_buckets)                finalize → UpdateResult
    5 commit      wait for "done" acks; set the ◄─ reset prefix cache, new weight_version,
                  pool's fleet version              resume, open intake → "done" ack

This module is the coordinator: membership, trigger, acks, decision,
commit (Redis, Celery, the store). How the bytes travel is the transports'
(``weight_sync.transports``), chosen per worker: a worker started with
``--colocated`` on this host (CPU) or this GPU (CUDA, by device UUID) is
handed the weights (``shm``, ``cuda_ipc``), the others share a process group
(``gloo``, ``nccl``); ``SyncSettings.transport`` can force one.

A round of one member handed the weights (the one-GPU colocated set-up:
a trainer and its engine) is *decided* by its plan (``SyncPlan.decided``):
the trainer announces a packed handoff (4) while the trigger (3) travels (a
handoff of its own storages is named in the plan itself: ``SyncPlan.layouts``,
stored before the trigger), and the worker, once paused, claims the round by writing the go decision into the
store itself (a compare-and-set: a trainer giving the round up writes its
no-go the same way, and the first write stands), then loads and acks
"done". No "ready" ack, no decision to wait for: the all-accepted check has
one member to ask, and the round costs two hops fewer. Its worker then waits on
a key of the trainer's store, named in its "done" ack (``SyncAck.listening``,
``workers.node.listener``): the next decided round's trigger is written there
instead of broadcast, and broadcast after all when the key is not taken within
``TRIGGER_TAKEN_S`` (a worker restarted since).

A round has one name, its ``SyncRound`` (``<epoch>-<nonce>``, the epoch from
``keys.SYNC_EPOCH``): the plan and every ack carry it, log lines and errors
print it, and its Redis and store names derive from it (``keys.sync_*``).

Every phase has a deadline: the trainer's in ``SyncTimeouts``, the workers'
(``WorkerTimeouts``) in the plan. A worker's failure travels as a kind and a
message (``SyncFailure``), raised here as its class of ``tasks.errors``. A
worker that is silent or fails is named in the ``WeightSyncError`` the
trainer raises once the others have committed; it fences itself until a
later sync catches it up. The process group is kept between syncs while the
roster is unchanged.

``SyncReport.phases`` times each phase above, and the trainer's two other
steps: ``prepare`` (the tensors listed, cast and planned into the manifest,
the version and each worker's transport chosen) and ``close`` (the round
marked over); together they are the whole sync but for the report's own
building. ``worker_phases`` are the slowest worker's steps, the engine
call's way in and out (``call_in``, ``call_out``; ``line_in``, ``line_out``
over the update line) among them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from rollout_queue.tasks import keys
from rollout_queue.tasks.app import app
from rollout_queue.tasks.app import settings as client_settings
from rollout_queue.tasks.auth import signed_arguments
from rollout_queue.tasks.errors import (
    BrokerLost,
    BrokerUnavailable,
    ManifestMismatch,
    NoWorkers,
    RendezvousTimeout,
    RendezvousUnreachable,
    SyncRefused,
    WeightSyncError,
    WorkerLost,
)
from rollout_queue.tasks.pipelined import SentPipeline
from rollout_queue.tasks.registry import connect, fleet_version, live_workers, read_entries, workers_of
from rollout_queue.tasks.schemas import PauseMode, WorkerInfo
from rollout_queue.weight_sync import transports, wire
from rollout_queue.weight_sync.locality import host_id
from rollout_queue.weight_sync.protocol import (
    HandoffName,
    Manifest,
    SyncAck,
    SyncDecision,
    SyncPlan,
    SyncReport,
    SyncRound,
)
from rollout_queue.weight_sync.settings import SyncSettings
from rollout_queue.weight_sync.transports.base import SendJob, TransportSender

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The acks' Redis client gives up on a silent Redis after these seconds (a
# read outlasts the 1 s BLPOP); the phase's deadline bounds the retries.
ACK_CONNECT_S = 2.0
ACK_READ_S = 5.0
# The pool's version is written this long after the sync's deadline at most
# (the last ack read, then one SET): what a worker that missed the round waits.
OUTCOME_GRACE_S = 10.0
# A decided round's trigger written to the key its worker listens on is broadcast
# as well when the key is still there this long after (its listener gone: the
# worker restarted); the trigger's nonce makes the two one command.
TRIGGER_TAKEN_S = 0.05

# Gloo buckets travel in pieces of this size (SyncSettings.chunk_bytes = None).
GLOO_CHUNK_BYTES = 128 << 20

Weights = Any  # torch.nn.Module | Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]


@dataclass(frozen=True)
class TensorList:
    """One sync's tensors, by checkpoint name (tied ones once), and ``layout``:
    where each lies and in what form (name, dtype, shape, device, contiguity,
    address, its storage's address and size). Two syncs with equal layouts send
    from the same memory in the same form, as a trainer that updates its
    parameters in place does every step: the second reuses what the first
    planned (its manifest, a handoff's storages layout) without walking the
    tensors again.

    ``given``: each tensor as the caller gave it (by name, a weak reference,
    its address, shape, strides and dtype then) and ``kept``: the indices of
    those in ``pairs`` (tied ones once); what :meth:`again` checks."""

    pairs: list[tuple[str, torch.Tensor]]
    layout: tuple[tuple[Any, ...], ...]
    given: tuple[tuple[str, Any, tuple[Any, ...]], ...] = ()
    kept: tuple[int, ...] = ()

    def again(self, pairs: list[tuple[str, Any]]) -> TensorList | None:
        """This list for ``pairs`` when they are the tensors it was made from, lying as
        they lay: the same objects under the same names, each at the same address with
        the same shape, strides and dtype (a parameter updated in place; one whose
        ``.data`` was replaced lies elsewhere); None otherwise. A third of a full
        listing's time per tensor."""
        if len(pairs) != len(self.given):
            return None
        for (name, value), (was_name, was, form) in zip(pairs, self.given):
            if was() is not value or name != was_name or _form(value) != form:
                return None
        return TensorList([(pairs[i][0], _detached(pairs[i][1])) for i in self.kept], self.layout, self.given,
                          self.kept)

    def skeleton(self) -> TensorList:
        """This list without its tensors, for :meth:`again`: the caller's tensors are
        only weakly held between syncs (a model the trainer drops is freed)."""
        return TensorList([], self.layout, self.given, self.kept)


def _form(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach() if tensor.requires_grad else tensor


def list_tensors(weights: Weights, last: TensorList | None = None) -> TensorList:
    """``weights`` as a :class:`TensorList`: one pass over the tensors, or ``last``
    again when they are still the tensors it was made from, lying as they lay
    (:meth:`TensorList.again`: a trainer syncs its parameters, updated in place, every step)."""
    import torch

    pairs: list[tuple[str, Any]]
    if isinstance(weights, torch.nn.Module):
        pairs = list(weights.named_parameters())
    elif isinstance(weights, Mapping):
        pairs = list(weights.items())
    else:
        pairs = list(weights)
    if last is not None:
        listed = last.again(pairs)
        if listed is not None:
            return listed
    seen: set[tuple[Any, ...]] = set()
    unique: list[tuple[str, torch.Tensor]] = []
    layout: list[tuple[Any, ...]] = []
    kept: list[int] = []
    for index, (name, value) in enumerate(pairs):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(value).__name__}, not a tensor")
        tensor = _detached(value)
        storage = tensor.untyped_storage()
        # (torch.Size hashes as the tuple it is: a steady sync lists hundreds of tensors)
        ident = (storage.data_ptr(), tensor.storage_offset(), tensor.shape)
        if ident in seen and tensor.numel():
            continue  # tied weights (e.g. lm_head = embed_tokens): the checkpoint holds one
        seen.add(ident)
        unique.append((name, tensor))
        kept.append(index)
        layout.append((name, tensor.dtype, tensor.shape, tensor.device, tensor.is_contiguous(),
                       tensor.data_ptr(), ident[0], storage.nbytes()))
    if not unique:
        raise ValueError("no tensors to sync")
    given = tuple((name, weakref.ref(value), _form(value)) for name, value in pairs)
    return TensorList(unique, tuple(layout), given, tuple(kept))


def named_tensors(weights: Weights) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with checkpoint names; tied tensors are sent once."""
    return list_tensors(weights).pairs


@dataclass
class RoundOutcome:
    """What one round's phases 2-5 left: its plan and decision, who was silent or
    failed (and why), the transfer's break if any, who committed, the seconds."""

    plan: SyncPlan
    decision: SyncDecision
    silent: dict[str, str]
    failed: dict[str, str]
    broken: WeightSyncError | None
    committed: list[str]
    worker_phases: dict[str, float]
    phases: dict[str, float]

    def report(self, manifest: Manifest, seconds: float, moving: tuple[str, ...] = ("transfer",)) -> SyncReport:
        """The round's report; ``moving``: the phases the bytes took (their rate)."""
        return SyncReport(
            version=self.plan.weight_version,
            epoch=self.plan.round.epoch,
            round=self.plan.round,
            workers=sorted(self.committed),
            tensors=len(manifest.tensors),
            bytes=manifest.total_bytes,
            seconds=seconds,
            gb_per_s=manifest.total_bytes / max(sum(self.phases[p] for p in moving), 1e-9) / 1e9,
            backend="+".join(self.plan.transports()),
            reused_group=self.decision.reuses_group(self.plan.round),
            phases=self.phases,
            worker_phases=self.worker_phases,
        )


class WeightSender:
    """The trainer's end of the protocol: rank 0, host of the rendezvous store."""

    def __init__(self, settings: SyncSettings | None = None, pool: str = keys.DEFAULT_POOL) -> None:
        self.settings = settings or SyncSettings()
        self.pool = pool
        self.client = connect(client_settings())
        # Read in a loop up to each phase's deadline: no retries of its own.
        self.acks_client = connect(client_settings(), connect_timeout=ACK_CONNECT_S, read_timeout=ACK_READ_S,
                                   give_up_at_once=True)
        self.store: Any = None
        self.store_port = 0
        # The trainer's end of each transport used so far, by name (a group, buffers: kept).
        self._transports: dict[str, TransportSender] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="weight-send")
        self._lock = threading.Lock()
        # The acks of the current sync read so far, by phase: waiting for one
        # phase can read another's ("accepted" and "ready" share a list).
        self._acks: dict[str, dict[str, SyncAck]] = {}
        # The last layout planned: its key, manifest, and the manifest's JSON and digest.
        self._planned: tuple[Any, Manifest, str, str] | None = None
        # The tensors of the last sync, as listed, without them (the next sync's listing
        # finds the same ones again, or lists anew).
        self._listed: TensorList | None = None
        # What the last sync of the caller's own tensors was planned from, and its manifest.
        self._steady: tuple[tuple[Any, ...], Manifest] | None = None
        # The current sync's epoch, taken with its membership (``_read_round``), and the
        # digest of the manifest whose key that round trip refreshed (None: none was).
        self._taken: tuple[int, str | None] | None = None
        # By worker, the key of this sender's store its trigger listener waits on, as
        # its last decided round's "done" ack named it (used once: the next names it again).
        self._listening: dict[str, str] = {}

    # ------------------------------------------------------------------ sync

    def sync(
        self,
        weights: Weights,
        version: int | None = None,
        timeout: float = 120.0,
        pause: PauseMode = "wait",
        *,
        stale_only: bool = False,
    ) -> SyncReport:
        if stale_only and version is None:
            raise ValueError("stale_only syncs need the version to bring workers to")
        with self._lock:
            started = time.monotonic()
            deadline = started + timeout
            phases: dict[str, float] = {}
            asked = self._ask_round(version)  # Redis answers while the tensors are listed
            try:
                listed = list_tensors(weights, self._listed)
                self._listed = listed.skeleton()
            except BaseException:
                asked[0].drop()
                raise

            t = t_members = time.monotonic()
            try:
                members, version = self._read_round(asked, version)
                if stale_only:
                    members = [w for w in members if w.weight_version < version]
                    if not members:
                        raise NoWorkers(f"no worker of pool {self.pool!r} is behind version {version}",
                                        phase="membership")
                phases["membership"] = time.monotonic() - t
                return self._sync(listed, members, version, pause, deadline, started, t_members, phases)
            finally:
                self._taken = None

    def _sync(self, listed: TensorList, members: list[WorkerInfo], version: int, pause: PauseMode,
              deadline: float, started: float, t_members: float, phases: dict[str, float]) -> SyncReport:
        """``sync`` once its members and version are read: plan, run the round, report."""
        t = time.monotonic()
        backend = self.choose_backend(listed.pairs, members)
        handoffs = self.choose_handoffs(members, backend)
        manifest, tensors_by_name, own = self.plan_manifest(listed, members, backend)
        phases["prepare"] = time.monotonic() - t + (t_members - started)
        outcome = self.run_round(members, manifest, version, pause, backend, handoffs, deadline,
                                 tensors_by_name, own=own, phases=phases)
        plan, silent, failed, broken = outcome.plan, outcome.silent, outcome.failed, outcome.broken
        report = outcome.report(manifest, time.monotonic() - started)
        lost = {**silent, **failed}
        if lost:
            error = WorkerLost(
                f"weight sync round {plan.round} to version {version}: "
                + "; ".join(f"{node} ({why})" for node, why in sorted(lost.items()))
                + (f"; the transfer failed: {broken}" if broken is not None else "")
                + f". {len(outcome.committed)} worker(s) committed; the others are fenced until the next sync",
                phase="transfer" if broken is not None else "ready" if not failed else "commit",
                workers=lost,
            )
            error.report = report  # type: ignore[attr-defined]
            raise error
        return report

    def run_round(
        self, members: list[WorkerInfo], manifest: Manifest, version: int, pause: PauseMode, backend: str,
        handoffs: dict[str, HandoffName], deadline: float, tensors: dict[str, torch.Tensor], *,
        own: tuple[tuple[Any, ...], ...] | None = None, phases: dict[str, float] | None = None,
    ) -> RoundOutcome:
        """Phases 2-5 of one round, each timed into ``phases``: rendezvous, trigger,
        ready, transfer, commit, then ``close`` (the round marked over). A transfer
        that breaks does not end the round: the workers that got every bucket still
        commit, and the break is in the outcome.

        A round of one member handed the weights is decided by its plan
        (``SyncPlan.decided``): rendezvous, trigger, transfer (the handoff
        announced while the trigger travels), commit, close; the worker claims
        the round itself. ``own``: the layout of ``tensors`` when they are the
        caller's own (``TensorList.layout``), None when some were made for this sync."""
        phases = {} if phases is None else phases
        t = time.monotonic()
        self.rendezvous()
        phases["rendezvous"] = time.monotonic() - t

        decided = len(members) == 1 and members[0].node in (handoffs or {})
        t = time.monotonic()
        plan = self.plan_round(members, manifest, version, pause, backend, deadline, handoffs, decided=decided)
        if own is not None:
            self._announce_layouts(plan, tensors, own)
        planned = time.monotonic() - t
        try:
            if decided:
                return self._run_decided(plan, deadline, tensors, own, phases)
            t = time.monotonic()
            silent = self.trigger(plan, deadline)
            phases["trigger"] = time.monotonic() - t
            return self._run_triggered(plan, silent, deadline, tensors, own, phases)
        finally:
            # The plan (and the layouts it names) is the trigger's first step.
            phases["trigger"] = phases.get("trigger", 0.0) + planned
            t = time.monotonic()
            self._mark_over(plan)
            phases["close"] = time.monotonic() - t

    def _announce_layouts(self, plan: SyncPlan, tensors: dict[str, torch.Tensor],
                          own: tuple[tuple[Any, ...], ...]) -> None:
        """Before the trigger: each handoff of the plan that can name the caller's own
        storages stores that layout and the plan names its digest (``SyncPlan.layouts``):
        its engine loads as soon as it has the plan, nothing is announced later."""
        for name in plan.transports():
            try:
                digest = self.transport(name).announce_layout(plan, tensors, own, self.store)
            except Exception as exc:  # nothing published yet: no worker has changed a weight
                raise WeightSyncError(f"could not store the {name} handoff's layout for sync round "
                                      f"{plan.round}: {type(exc).__name__}: {exc}; no worker was told of the round",
                                      phase="transfer") from exc
            if digest is not None:
                plan.layouts[name] = digest

    def _mark_over(self, plan: SyncPlan) -> None:
        """The round has ended and the pool's version is final for it (``keys.sync_over``)."""
        try:
            self.client.set(keys.sync_over(plan.round), 1, ex=3600)
        except redis.RedisError as exc:  # the workers that missed it wait for its deadline instead
            log.warning("could not mark sync round %s over: %s", plan.round, exc)

    def _run_triggered(
        self, plan: SyncPlan, silent: dict[str, str], deadline: float, tensors: dict[str, torch.Tensor],
        own: tuple[tuple[Any, ...], ...] | None, phases: dict[str, float],
    ) -> RoundOutcome:
        """Phases 3-5 of a round whose trigger went out: ready, transfer, commit."""
        t = time.monotonic()
        decision, not_ready = self.await_ready(plan, set(plan.members) - set(silent), deadline)
        silent.update(not_ready)
        phases["ready"] = time.monotonic() - t

        t = time.monotonic()
        try:
            self.transfer(plan, decision, tensors, deadline, own=own)
            broken: WeightSyncError | None = None
        except WeightSyncError as exc:
            # One peer gone (a link cut mid-transfer) fails the collective here,
            # while the others may have received every bucket: their acks say.
            broken = exc
        phases["transfer"] = time.monotonic() - t

        t = time.monotonic()
        try:
            committed, failed, worker_phases = self.await_commit(plan, decision, deadline)
        except BrokerLost as exc:
            # Who joined the group, and who committed, is unknown here.
            self._reset_transports()
            if broken is None:
                raise
            raise BrokerLost(f"{exc}; the transfer had failed too: {broken}", phase=exc.phase,
                             workers=exc.workers) from exc
        phases["commit"] = time.monotonic() - t
        if broken is not None and not committed:
            raise broken
        return RoundOutcome(plan, decision, silent, failed, broken, committed, worker_phases, phases)

    def _run_decided(
        self, plan: SyncPlan, deadline: float, tensors: dict[str, torch.Tensor],
        own: tuple[tuple[Any, ...], ...] | None, phases: dict[str, float],
    ) -> RoundOutcome:
        """A decided round: trigger, announce the handoff while the trigger travels
        (the worker's engine reads it when it gets there), wait for the one worker's
        "done". No "ready" phase: the worker claims the round once it has paused. A
        worker that refuses, or is silent until the trigger's or the sync's deadline
        and has not claimed the round, is left on its old weights (the trainer claims
        the no-go); the errors are the usual ones."""
        (node,) = plan.members
        decision = SyncDecision.handed(node)
        t = time.monotonic()
        arguments = self._signed_trigger(plan)
        written = self._write_trigger(node, arguments)
        if written is None:
            self._broadcast(plan, arguments)
        timeout = self._trigger_timeout(deadline)
        published = time.monotonic()
        phases["trigger"] = published - t
        broken: WeightSyncError | None = None
        try:
            try:
                self.transfer(plan, decision, tensors, deadline, own=own)
            except WeightSyncError as exc:  # announced as failed: an engine waiting for it fails at once
                broken = exc
            phases["transfer"] = time.monotonic() - published

            t = time.monotonic()
            if written is not None:
                answers = self._collect(plan, "accepted", {node}, published + min(TRIGGER_TAKEN_S, timeout))
                if node not in answers and self._untaken(written):
                    log.info("weight sync round %s: %s did not take the trigger from the store; broadcasting it",
                             plan.round, node)
                    self._broadcast(plan, arguments)
            answers = self._collect(plan, "accepted", {node}, published + timeout)
            phases["trigger"] += time.monotonic() - t
            self._refused(plan, answers)
            if node not in answers and self._call_off(plan, "did not answer the trigger"):
                if broken is not None:
                    raise broken
                self._no_answer({node}, timeout)
            if broken is not None and self._call_off(plan, "the trainer's handoff failed"):
                raise broken

            t = time.monotonic()
            # The worker pauses, then loads, within this wait: the ready phase's time and the commit's.
            committed, failed, worker_phases = self.await_commit(
                plan, decision, deadline, within=self.settings.timeouts.ready + self.settings.timeouts.commit)
            phases["commit"] = time.monotonic() - t
            done = self._acks.get("done", {}).get(node)
            if done is not None and done.ok and done.listening is not None:
                self._listening[node] = done.listening
        finally:
            self.transport(plan.handoffs[node]).finished(plan)  # the announced keys leave the store
        silent = node not in self._acks.get("done", {})
        if silent and not self._call_off(plan, "no commit ack before the deadline"):
            log.warning("weight sync round %s: %s took the round and has not acked it by the deadline",
                        plan.round, node)
        if broken is not None and not committed:
            raise broken
        return RoundOutcome(plan, decision, {}, failed, broken, committed, worker_phases, phases)

    def _call_off(self, plan: SyncPlan, reason: str) -> bool:
        """Give a decided round up unless its worker has claimed it; whether it was given up."""
        stood = SyncDecision(go=False, reason=reason).claim(self.store, plan.round)
        return not stood.go

    # --------------------------------------------------------------- phases

    def membership(self) -> list[WorkerInfo]:
        """1. Live workers of the pool, from the registry."""
        return self._members(live_workers(self.client, self.pool))

    def _members(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """The members of a round among the pool's live ``workers``: those not stopping."""
        members = [w for w in workers if w.state != "stopping"]
        if not members:
            raise NoWorkers(
                f"no live worker in pool {self.pool!r}; start one with `rollout-queue worker`",
                phase="membership",
            )
        return members

    def _ask_round(self, version: int | None) -> tuple[SentPipeline, str | None]:
        """1. The round trip that reads the round's members and version (``version``,
        or the fleet's next), takes the round's epoch and refreshes the key of the
        last manifest planned (a trainer syncs the same layout every step, and its
        plan then needs no other: ``_take_epoch``), sent now and read by
        ``_read_round``, with the digest of that manifest. Running it twice takes two
        epochs, harmlessly."""
        digest = self._planned[3] if self._planned is not None else None
        pipe = self.client.pipeline(transaction=False)
        read_entries(pipe)
        pipe.incr(keys.SYNC_EPOCH)
        if version is None:
            pipe.get(keys.fleet_version(self.pool))
        if digest is not None:
            pipe.expire(keys.sync_manifest(digest), keys.MANIFEST_TTL_S)
        return SentPipeline(pipe), digest

    def _read_round(self, asked: tuple[SentPipeline, str | None], version: int | None) -> tuple[
            list[WorkerInfo], int]:
        """The round's members and version, from the round trip ``_ask_round`` sent."""
        sent, digest = asked
        try:
            entries, epoch, *rest = sent.answers()
        except redis.RedisError as exc:
            raise BrokerUnavailable(f"could not read the worker registry: {exc}") from exc
        if version is None:
            current, *rest = rest
            version = int(current or 0) + 1
        kept = digest is not None and bool(rest[0])
        self._taken = (int(epoch), digest if kept else None)
        return self._members(workers_of(entries, self.pool)), int(version)

    def next_version(self) -> int:
        current = fleet_version(self.client, self.pool)
        return current + 1

    def choose_backend(self, tensors: list[tuple[str, torch.Tensor]], members: list[WorkerInfo]) -> str:
        on_cuda = {w.device == "cuda" for w in members}
        if len(on_cuda) > 1:
            raise SyncRefused("the pool mixes CPU and CUDA workers; sync them as separate pools",
                              phase="membership")
        if on_cuda == {True}:
            return "nccl"
        return "gloo"

    def choose_handoffs(self, members: list[WorkerInfo], backend: str) -> dict[str, HandoffName]:
        """The members handed the weights in place instead of the group: with
        ``transport="auto"``, the ``--colocated`` workers on this host (CPU: shm)
        or on this process's GPU (CUDA: cuda_ipc, by device UUID)."""
        chosen = self.settings.transport
        if chosen in transports.GROUP_TRANSPORTS:
            return {}
        handoff: HandoffName = "cuda_ipc" if backend == "nccl" else "shm"
        if chosen != "auto" and chosen != handoff:
            raise SyncRefused(f"transport {chosen!r} cannot reach this pool's {backend} workers",
                              phase="membership")
        here = self._locality(backend)
        picked: dict[str, HandoffName] = {
            w.node: handoff for w in members
            if (w.colocated or chosen != "auto") and self._colocated(w, here, backend)
        }
        if chosen != "auto" and len(picked) < len(members):
            far = sorted({w.node for w in members} - set(picked))
            raise SyncRefused(
                f"transport {chosen!r} needs every worker on this {'GPU' if handoff == 'cuda_ipc' else 'host'}; "
                f"{', '.join(far)} are not: leave RQ_TRANSPORT at auto", phase="membership")
        return picked

    @staticmethod
    def _locality(backend: str) -> str:
        """This process's host id (CPU) or the UUID of its current GPU (CUDA)."""
        if backend == "nccl":
            from rollout_queue.weight_sync.transports.cuda_ipc import device_uuid

            return device_uuid()
        return host_id()

    @staticmethod
    def _colocated(worker: WorkerInfo, here: str, backend: str) -> bool:
        if backend == "nccl":
            return worker.device_uuids == [here]  # one engine rank, on this very GPU
        return worker.host_id == here

    def transport(self, name: str) -> TransportSender:
        """The trainer's end of transport ``name`` (built once, kept between syncs)."""
        if name not in self._transports:
            self._transports[name] = transports.sender_class(name)(name, self.settings)
        return self._transports[name]

    def _reset_transports(self) -> None:
        for end in self._transports.values():
            end.reset()

    def manifest(
        self, tensors: TensorList | list[tuple[str, torch.Tensor]], members: list[WorkerInfo], backend: str
    ) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """Cast floating tensors to the workers' dtype; plan the buckets."""
        listed = tensors if isinstance(tensors, TensorList) else list_tensors(tensors)
        manifest, by_name, _ = self.plan_manifest(listed, members, backend)
        return manifest, by_name

    def plan_manifest(
        self, listed: TensorList, members: list[WorkerInfo], backend: str
    ) -> tuple[Manifest, dict[str, torch.Tensor], tuple[tuple[Any, ...], ...] | None]:
        """``manifest``, and ``listed``'s layout when no tensor was cast or moved
        (the tensors sent are the caller's own), else None.

        A trainer syncs the same tensors every step: a sync whose layout, dtype,
        device and bucket settings equal the last one's, which sent the caller's
        own tensors, reuses its manifest as it is."""
        dtypes = {w.dtype for w in members}
        if len(dtypes) > 1:
            raise SyncRefused(f"the pool's workers run different dtypes {sorted(dtypes)}", phase="membership")
        target = wire.torch_dtype(dtypes.pop())
        device = self.transport(backend).device()
        chunk = self.settings.chunk_bytes
        if chunk is None:  # gloo's default; NCCL sends whole buckets
            chunk = GLOO_CHUNK_BYTES if backend == "gloo" else 0
        buckets = (self.settings.bucket_bytes, chunk, self.settings.direct_bytes)
        steady = (listed.layout, target, device, buckets)
        if self._steady is not None and self._steady[0] == steady and self._planned is not None \
                and self._planned[1] is self._steady[1]:
            return self._planned[1], dict(listed.pairs), listed.layout
        by_name: dict[str, torch.Tensor] = {}
        for name, tensor in listed.pairs:
            if tensor.is_floating_point() and tensor.dtype != target:
                tensor = tensor.to(target)
            if device.type == "cuda" and tensor.device != device:
                tensor = tensor.to(device, non_blocking=True)
            by_name[name] = tensor
        specs = tuple((name, wire.dtype_name(t), tuple(t.shape)) for name, t in by_name.items())
        key = (specs, *buckets)
        if self._planned is None or self._planned[0] != key:  # a trainer syncs the same layout every step
            manifest = wire.plan_buckets(specs, *buckets)
            self._planned = (key, manifest, *manifest.wire())
        own = all(by_name[name] is tensor for name, tensor in listed.pairs)
        self._steady = (steady, self._planned[1]) if own else None
        return self._planned[1], by_name, listed.layout if own else None

    def rendezvous(self) -> None:
        """2. Host the TCPStore (once; it lives on between syncs)."""
        if self.store is not None:
            return
        try:
            self.store = wire.connect_store(
                self.settings.rendezvous_host, self.settings.rendezvous_port,
                self.settings.timeouts.transfer, is_master=True,
            )
        except Exception as exc:  # torch raises RuntimeError/DistNetworkError
            raise RendezvousTimeout(
                f"could not host the rendezvous store at {self.settings.rendezvous_host}:"
                f"{self.settings.rendezvous_port}: {exc}; set RQ_RENDEZVOUS_HOST to an address of "
                "this machine that workers can reach",
                phase="rendezvous",
            ) from exc
        self.store_port = int(self.store.port)

    def plan_round(
        self, members: list[WorkerInfo], manifest: Manifest, version: int, pause: PauseMode,
        backend: str, deadline: float, handoffs: dict[str, HandoffName] | None = None, *, decided: bool = False,
    ) -> SyncPlan:
        """3. The round's plan (its epoch taken, its manifest published)."""
        epoch, digest = self._take_epoch(manifest)
        return SyncPlan(
            round=SyncRound.new(epoch), weight_version=version, pause=pause,
            store_host=self.settings.rendezvous_host, store_port=self.store_port,
            members={w.node: w.ranks for w in members}, backend=backend,  # type: ignore[arg-type]
            handoffs=handoffs or {}, decided=decided,
            manifest_digest=digest, manifest=manifest, issued_at=time.time(),
            # A worker waits for the decision no longer than the trainer may take to
            # write it (its trigger and ready phases): a trainer gone or cut off
            # leaves it resuming on its old weights.
            timeouts=self.settings.timeouts.worker.model_copy(update={
                "decision": min(self.settings.timeouts.trigger + self.settings.timeouts.ready,
                                max(deadline - time.monotonic(), 0.1)),
                # await_commit writes the pool's version once the deadline's acks are in.
                "outcome": max(deadline - time.monotonic(), 0.1) + OUTCOME_GRACE_S,
            }),
        )

    def _publish(self, plan: SyncPlan, deadline: float) -> float:
        """3. The one broadcast control message; the seconds to wait for the answers."""
        self._broadcast(plan, self._signed_trigger(plan))
        return self._trigger_timeout(deadline)

    def _signed_trigger(self, plan: SyncPlan) -> dict[str, Any]:
        """The trigger's control arguments, signed (the plan stamped as issued now)."""
        plan.issued_at = time.time()  # a decided round's handoff went between planning and now
        self._acks = {}
        return signed_arguments(keys.CONTROL_SYNC, {"plan": plan.model_dump(mode="json")},
                                self.settings.weight_sync_secret, destination=list(plan.members))

    def _broadcast(self, plan: SyncPlan, arguments: dict[str, Any]) -> None:
        app.control.broadcast(
            keys.CONTROL_SYNC, arguments=arguments, destination=list(plan.members), reply=False,
        )

    def _trigger_timeout(self, deadline: float) -> float:
        """The seconds to wait for the trigger's answers."""
        return min(self.settings.timeouts.trigger, max(deadline - time.monotonic(), 0.1))

    def _write_trigger(self, node: str, arguments: dict[str, Any]) -> str | None:
        """A decided round's trigger, written to the key of the store ``node``'s listener
        waits on (``workers.node.listener``); the key, or None when it waits on none
        (or the write failed: the trigger is broadcast)."""
        key = self._listening.pop(node, None)
        if key is None:
            return None
        try:
            self.store.set(key, json.dumps(arguments))
        except Exception as exc:  # noqa: BLE001  torch raises RuntimeError kinds: the broadcast is the way
            log.warning("could not write the sync trigger for %s to the store (%s); broadcasting it", node, exc)
            return None
        return key

    def _untaken(self, key: str) -> bool:
        """Whether the trigger written to ``key`` is still there, deleting it (its listener
        is gone); a listener that took it meanwhile has it (the delete finds nothing)."""
        try:
            return bool(self.store.delete_key(key))
        except Exception as exc:  # noqa: BLE001  torch raises RuntimeError kinds: broadcast to be sure
            log.warning("could not delete the untaken sync trigger %s from the store: %s", key, exc)
            return True

    def trigger(self, plan: SyncPlan, deadline: float) -> dict[str, str]:
        """3. Publish the plan; every member answers accepted or refused.

        The answers come as "accepted" acks on the list the "ready" acks follow
        on (one Redis wait, no control-reply round trip). Returns the members
        that did not answer in time.
        """
        t = time.monotonic()
        timeout = self._publish(plan, deadline)
        published = time.monotonic()
        answers = self._collect(plan, "accepted", set(plan.members), time.monotonic() + timeout)
        if os.environ.get("RQ_SYNC_TRACE"):
            log.warning("[rq-sync-trace] trigger: plan dumped and published %.4f, answers %.4f",
                        published - t, time.monotonic() - published)
        self._refused(plan, answers)
        missing = set(plan.members) - set(answers)
        if len(missing) == len(plan.members):
            self._decide(plan, SyncDecision(go=False, reason="no worker answered"))
            self._no_answer(missing, timeout)
        return {node: "did not answer the trigger" for node in missing}

    def _refused(self, plan: SyncPlan, answers: dict[str, SyncAck]) -> None:
        """Raise the refusal among the trigger's ``answers``, if any; nobody changes a weight."""
        refused = {node: a.error for node, a in answers.items() if not a.ok}
        if not refused:
            return
        if not plan.decided:  # release whoever accepted
            self._decide(plan, SyncDecision(go=False, reason="another worker refused the plan"))
        kinds = {failure.kind if failure else "refused" for failure in refused.values()}
        error_cls = ManifestMismatch if "manifest_mismatch" in kinds else SyncRefused
        raise error_cls(
            "weight sync refused before any weight changed: "
            + "; ".join(f"{node}: {why or 'refused'}" for node, why in sorted(refused.items())),
            phase="trigger", workers=refused,
        )

    @staticmethod
    def _no_answer(missing: set[str], timeout: float) -> None:
        """Raise the error of a trigger that ``missing`` (every member) did not answer."""
        raise WorkerLost(
            f"no worker answered the sync trigger within {timeout:.1f}s: {', '.join(sorted(missing))} "
            "(a worker does not answer a trigger that is not signed with its RQ_WEIGHT_SYNC_SECRET: "
            "check that the trainer has the workers' secret)",
            phase="trigger", workers=missing,
        )

    def await_ready(
        self, plan: SyncPlan, accepted: set[str], deadline: float
    ) -> tuple[SyncDecision, dict[str, str]]:
        """3, ready: wait for "ready" acks; write the decision (roster, ranks) to the store."""
        acks = self._collect(plan, "ready", accepted,
                             min(deadline, time.monotonic() + self.settings.timeouts.ready))
        silent = {node: "did not pause in time" for node in accepted - set(acks)}
        failures = {node: ack.error for node, ack in acks.items() if not ack.ok}
        for node, failure in failures.items():
            silent[node] = str(failure or "failed to pause")
        ready = sorted(node for node, ack in acks.items() if ack.ok)
        if not ready:
            self._decide(plan, SyncDecision(go=False, reason="no worker became ready"))
            unreachable = len(failures) == len(silent) and all(
                failure is not None and failure.kind == "rendezvous_unreachable" for failure in failures.values())
            raise (RendezvousUnreachable if unreachable else RendezvousTimeout)(
                f"no worker became ready for sync round {plan.round}: "
                + "; ".join(f"{n} ({w})" for n, w in sorted(silent.items())),
                phase="ready", workers=silent,
            )
        decision = self.decide(plan, ready, acks)
        self._decide(plan, decision)
        return decision, silent

    def decide(self, plan: SyncPlan, ready: list[str], acks: dict[str, SyncAck]) -> SyncDecision:
        """The go decision for the ``ready`` members (sorted): the group's rank
        offsets and the round whose group serves, the members handed the weights."""
        offsets: dict[str, int] = {}
        rank = 1
        for node in ready:
            if plan.transport_of(node) == plan.backend:
                offsets[node] = rank
                rank += plan.members[node]
        group_round = self.transport(plan.backend).group_for(plan.round, offsets) if offsets else None
        moved = sorted(node for node in offsets if acks[node].group_round != group_round)
        if plan.backend in transports.GROUP_TRANSPORTS and group_round not in (None, plan.round) and moved:
            # Another trainer's sync moved these workers into a group of their own
            # since this one formed: waiting for them in the old group would hang.
            log.info("weight sync round %s: %s no longer hold the process group of round %s; forming a new one",
                     plan.round, ", ".join(moved), group_round)
            self.transport(plan.backend).reset()
            group_round = self.transport(plan.backend).group_for(plan.round, offsets)
        return SyncDecision(go=True, offsets=offsets, world=rank, group_round=group_round,
                            handoff=[node for node in ready if node in plan.handoffs])

    def transfer(self, plan: SyncPlan, decision: SyncDecision, tensors: dict[str, torch.Tensor],
                 deadline: float, *, own: tuple[tuple[Any, ...], ...] | None = None) -> None:
        """4. Each transport of the plan delivers the buckets to its workers:
        the handoffs first (they only announce), then the group. ``own``: the
        layout of ``tensors`` when they are the caller's own, not copies made for
        this sync (``TensorList.layout``)."""
        assert plan.manifest is not None  # attached by trigger(); never serialized
        failed: WeightSyncError | None = None
        for name in plan.transports():
            nodes = sorted(node for node in decision.roster if plan.transport_of(node) == name)
            if not nodes:
                continue
            job = SendJob(plan=plan, decision=decision, manifest=plan.manifest, tensors=tensors,
                          store=self.store, nodes=nodes, deadline=deadline, executor=self._pool,
                          own=own)
            try:
                self.transport(name).send(job)
            except WeightSyncError as exc:
                # The other transports' workers are waiting for their buckets: serve them.
                failed = failed or exc
        if failed is not None:
            raise failed

    def await_commit(
        self, plan: SyncPlan, decision: SyncDecision, deadline: float, within: float | None = None,
    ) -> tuple[list[str], dict[str, str], dict[str, float]]:
        """5. Wait for "done" acks (for ``within`` seconds at most; default: the commit
        phase's timeout); move the pool's fleet version forward."""
        within = self.settings.timeouts.commit if within is None else within
        acks = self._collect(plan, "done", decision.roster, min(deadline, time.monotonic() + within))
        committed = sorted(node for node, ack in acks.items() if ack.ok)
        failed = {node: str(ack.error or "failed") for node, ack in acks.items() if not ack.ok}
        for node in decision.roster - set(acks):
            failed[node] = "no commit ack before the deadline"
        for node, ack in acks.items():  # an engine's copies may still run: what comes next waits
            if ack.released:
                self.transport(plan.transport_of(node)).released(ack.released)
        if committed:
            self.client.set(keys.fleet_version(self.pool), plan.weight_version)
        for name in plan.transports():
            self.transport(name).finished(plan)
        if failed:
            self._reset_transports()
        slowest: dict[str, float] = {}
        for ack in acks.values():
            for step, seconds in ack.seconds.items():
                slowest[step] = max(slowest.get(step, 0.0), seconds)
        return committed, failed, slowest

    # -------------------------------------------------------------- helpers

    def _take_epoch(self, manifest: Manifest) -> tuple[int, str]:
        """A new round's epoch, and the digest of ``manifest``, stored where workers
        read it by digest: one round trip.

        The manifest is stored once per layout: a later round with the same one
        only refreshes the key's expiry (and stores it again if it is gone, e.g.
        Redis was flushed: a second round trip).
        """
        assert self._planned is not None and self._planned[1] is manifest  # planned by manifest()
        text, digest = self._planned[2:]
        key = keys.sync_manifest(digest)
        taken, self._taken = self._taken, None
        if taken is not None:  # taken with the membership (_read_round)
            epoch, refreshed = taken
            if refreshed != digest:
                self.client.set(key, text, ex=keys.MANIFEST_TTL_S)
            return epoch, digest
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(keys.SYNC_EPOCH)
        pipe.expire(key, keys.MANIFEST_TTL_S)
        epoch, kept = pipe.execute()
        if not kept:
            self.client.set(key, text, ex=keys.MANIFEST_TTL_S)
        return int(epoch), digest

    def _decide(self, plan: SyncPlan, decision: SyncDecision) -> None:
        self.store.set(keys.sync_decision(plan.round), decision.model_dump_json())

    def _collect(self, plan: SyncPlan, phase: str, expected: set[str], deadline: float) -> dict[str, SyncAck]:
        """The ``phase`` acks of ``expected`` members, once all are in or at the deadline.

        Acks of another phase read meanwhile are kept for their own wait.
        """
        got = self._acks.setdefault(phase, {})
        name = keys.sync_acks(plan.round, phase)
        unreachable: redis.RedisError | None = None  # the last read, when it failed
        while not expected <= set(got) and (remaining := deadline - time.monotonic()) > 0:
            try:
                item = self.acks_client.blpop([name], timeout=max(0.1, min(remaining, 1.0)))
            except redis.RedisError as exc:
                # Retried until the phase's deadline: a Redis restart is ridden out.
                unreachable = exc
                time.sleep(min(0.2, max(remaining, 0.0)))
                continue
            unreachable = None
            if item is None:
                continue
            ack = SyncAck.model_validate_json(item[1])
            if ack.round == plan.round and ack.node in plan.members:
                self._acks.setdefault(ack.phase, {})[ack.node] = ack
        if unreachable is not None and not expected <= set(got):
            # The trainer's link to Redis broke: its pooled connections are dead
            # (a command sent on one after the link is back fails at once with
            # "Broken pipe", seen in CI as the next sync's BrokerUnavailable).
            self._disconnect_redis()
            raise BrokerLost(
                f"sync round {plan.round} to version {plan.weight_version}: Redis at {client_settings().redacted_url} "
                f"stopped answering the trainer while it waited for the {phase!r} acks "
                f"({type(unreachable).__name__}: {unreachable}); it cannot tell what "
                f"{', '.join(sorted(expected - set(got)))} did. A worker that never read the trainer's "
                "decision resumes on its old weights; check the trainer host's network, then sync again "
                "(catch_up brings any worker left behind)",
                phase=phase, workers=expected - set(got),
            ) from unreachable
        return {node: ack for node, ack in got.items() if node in expected}

    def catch_up(self, weights: Weights, timeout: float = 120.0, pause: PauseMode = "wait") -> SyncReport | None:
        """Bring the workers behind the fleet's version (they missed a sync, or joined
        later, and are fenced) to it with ``weights``, which must be that version's;
        the workers already there are not paused. ``None`` when none is behind."""
        version = fleet_version(self.client, self.pool)
        if not any(w.weight_version < version for w in self.membership()):
            return None
        return self.sync(weights, version=version, timeout=timeout, pause=pause, stale_only=True)

    def status(self) -> dict[str, int]:
        return {w.node: w.weight_version for w in live_workers(self.client, self.pool)}

    def close(self) -> None:
        """Drop the process group and the store, and disconnect from Redis; the
        next sync builds new ones (and reconnects)."""
        for end in self._transports.values():
            end.close()
        self._transports = {}
        self.store = None
        self.store_port = 0
        self._disconnect_redis()

    def _disconnect_redis(self) -> None:
        """Close both clients' pooled connections; the next command connects afresh."""
        for client in (self.client, self.acks_client):
            client.connection_pool.disconnect()


__all__ = ["GLOO_CHUNK_BYTES", "TensorList", "WeightSender", "Weights", "list_tensors", "named_tensors"]
