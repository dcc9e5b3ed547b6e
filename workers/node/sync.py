"""The worker's side of a weight sync, driven from the host process.

The trigger arrives as a remote-control command (``workers.node.control``), which
checks its signature (``tasks.auth``) and calls :meth:`SyncParticipant.accept`
in Celery's consumer loop: it checks the plan and the manifest, answers at
once, and hands the rest to a thread (:meth:`SyncParticipant.sync`), which
reports through Redis (the protocol: ``weight_sync``; its phases are drawn
in ``weight_sync.sender``):

    accept   (HMAC checked before) protocol, membership,
             manifest names/shapes/dtype                       → push "accepted" ack
    probe    connect to the trainer's store (RQ_RENDEZVOUS_HOST): unreachable
             → push a failed "ready" ack at once, never a hang
    pause    close intake, pause the engine (wait|keep|abort)  → push "ready" ack
             (an idle engine is not paused; its prefix-cache reset starts here)
    decide   wait for the trainer's decision in its TCPStore; in a decided
             round (one member, handed the weights: ``SyncPlan.decided``) no
             "ready" ack and no wait: claim the round by writing the go decision
             there unless the trainer has called it off
    update   rq_update(UpdateRequest) on every engine rank, one call
             (``weight_sync.receiver``; to an idle single-rank engine over the
             update line, ``weight_sync.update_line``): join (or reuse) the
             group, receive the buckets over gloo / NCCL and load them, check
             every entry arrived, finalize; an UpdateResult per rank
    commit   reset prefix cache, new version, resume, open intake → push "done" ack

Log lines, acks and errors name the round by its one name (``SyncRound``,
``plan.round``); a newer round (a later epoch) displaces the one in hand.

Every wait has the plan's deadline (``WorkerTimeouts``); a failure is acked
as a kind and a message (``SyncFailure``). A worker left out of a sync, or
whose sync failed, is fenced (takes no tasks) until a later sync brings it
to the fleet's version.

A worker the decision has catch up through a relay (``SyncDecision.relay``:
it is outside a trainer's own group) takes the round's version only once the
rounds of that version have brought every tensor of its checkpoint
(``weight_files.whole_model``); until then it acks "done" refused, saying how
many arrived, and stays fenced (half-loaded).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import redis

from rollout_queue.tasks import keys
from rollout_queue.tasks.auth import CommandVerifier
from rollout_queue.tasks.errors import (
    ControlRefused,
    ManifestMismatch,
    RendezvousTimeout,
    RendezvousUnreachable,
    SyncRefused,
    WeightSyncError,
)
from rollout_queue.weight_sync import transports, wire
from rollout_queue.weight_sync.protocol import (
    PROTOCOL_VERSION,
    Manifest,
    SyncAck,
    SyncDecision,
    SyncFailure,
    SyncPlan,
    SyncRound,
    UpdateRequest,
    UpdateResult,
)
from rollout_queue.workers.engine.protocols import SyncHost
from rollout_queue.workers.node.listener import TriggerListener
from rollout_queue.workers.node.weight_files import checkpoint_shapes, whole_model
from rollout_queue.workers.state import Fence, FenceReason, NodeState

log = logging.getLogger(__name__)

# A call on the trainer's store under way (``SyncParticipant._ask_store``), and its deadline.
StoreCall = tuple[Future[SyncDecision], float]

# Seconds waited for the decision past the plan's ``timeouts.decision`` (the
# store's own round trips, a trainer slow to write it).
DECISION_GRACE_S = 5.0
# A decided round's "accepted" ack is pushed this much later, off the consumer
# thread: nobody waits for it on the way to the engine's first copy (the trainer
# reads it after announcing the handoff), while the claim and the hand-over to
# the sync thread, which are on that way, would wait for its interpreter time.
ACCEPTED_AFTER_S = 0.005
# How long the consumer's thread waits for a decided round's early claim
# (``SyncParticipant._claim_early``): a trainer's store answers in well under 1 ms.
EARLY_CLAIM_S = 0.05


class SyncParticipant:
    def __init__(
        self,
        host: SyncHost,
        node: str,
        client: redis.Redis,
        state: NodeState,
        verifier: CommandVerifier | None = None,
    ) -> None:
        self.host = host
        self.node = node
        self.client = client
        self.state = state
        # Checks each trigger's signature (``accept_signed``); None: triggers come checked
        # (``accept``) and no trigger listener is started.
        self.verifier = verifier
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        # Reads of the decision: a store read to a silent trainer outlives its
        # timeout (giving up is one more round trip), so each is waited for here
        # and, past its deadline, left to end when its connection does.
        self._decision_reads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sync-decision")
        # Pushes the acks nobody on the way to the engine waits for, a little later.
        self._courier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sync-acks")
        self._current: Future[None] | None = None  # the last sync submitted, and its round
        self._current_round: SyncRound | None = None
        self._lock = threading.Lock()
        self._shapes: dict[str, list[int]] | None = None
        self._shapes_loaded = False
        # The last manifest that passed the check, as (digest, backend): a steady sync
        # sends the same one again, checked in one comparison.
        self._checked: tuple[str, str] | None = None
        # Catching up through a relay: the version, and the tensors its rounds brought so far.
        self._catching_up: tuple[int, set[str]] | None = None
        self._manifests: dict[str, Manifest] = {}  # by digest, the last few seen
        self._engine_digest: str | None = None  # of the manifest the engine holds
        # Per transport, the round whose process group the engine holds (told in
        # the "ready" ack): set when a sync through it committed, dropped when one failed.
        self._groups: dict[str, SyncRound] = {}
        self._store: Any = None
        self._store_address: tuple[str, int] | None = None
        # Waits in the store of the trainer whose decided round committed last for its
        # next trigger (``workers.node.listener``).
        self._listener: TriggerListener | None = None
        self.last_error: str | None = None
        # Called with each completed sync's seconds (the metrics histogram).
        self.on_synced: list[Callable[[float], None]] = []

    # ---------------------------------------------------------------- accept

    def accept_signed(self, raw_plan: Any, auth: dict[str, Any] | None, way: str = "delivery") -> dict[str, Any]:
        """Check the trigger's signature (``self.verifier``), then :meth:`accept` it;
        ``way``: the name its delivery is timed under ("delivery": a broadcast,
        "store_delivery": through the trainer's store, ``workers.node.listener``)."""
        assert self.verifier is not None
        try:
            self.verifier.verify(keys.CONTROL_SYNC, {"plan": raw_plan}, auth, what="weight sync")
        except ControlRefused as exc:
            # No "accepted" ack for a command we cannot trust: a forger replaying a
            # real sync's round must not be able to drop a worker from that sync.
            log.warning("weight sync round %s refused: %s", round_named(raw_plan), exc)
            return {"ok": False, "node": self.node, "error": f"ControlRefused: {exc}"}
        return self.accept(raw_plan, way)

    def accept(self, raw_plan: Any, way: str = "delivery") -> dict[str, Any]:
        """Validate the trigger and start the sync thread; the answer is immediate.

        Called with a plan whose signature has been checked (``accept_signed``);
        ``way``: the name its delivery is timed under.

        The answer goes to the trainer as an "accepted" ack (ok=False: refused),
        in the list its "ready" acks follow on. Returns the control command's
        reply (``{"ok", "node", "error"}``, as ``rq_engine`` answers), which only
        a sender asking for replies reads (an operator, the tests).
        """
        arrived = time.time()
        named = round_named(raw_plan)
        plan: SyncPlan | None = None
        try:
            plan = SyncPlan.model_validate(raw_plan)
            if plan.protocol != PROTOCOL_VERSION:
                raise SyncRefused(f"protocol {plan.protocol}; this worker speaks {PROTOCOL_VERSION}")
            if self.node not in plan.members:
                raise SyncRefused(f"{self.node} is not a member of sync round {plan.round}")
            plan.manifest = self._manifest(plan.manifest_digest)
            self._check_manifest(plan)
            with self._lock:
                current = self._current_round
                running = self._current is not None and not self._current.done()
                if running and current is not None and current.epoch >= plan.round.epoch:
                    if current == plan.round:  # the trigger heard twice: its acks stand
                        log.warning("weight sync round %s: trigger heard again, ignored", plan.round)
                        return {"ok": False, "node": self.node, "error": f"already in sync round {plan.round}"}
                    raise SyncRefused(f"{self.node} is already in sync round {current}")
                # A newer round while an older one still runs: the trainer gave that one up (a
                # trigger heard late, a failed sync still acking). The older one ends soon, as
                # a trainer that gives up a sync writes a decision that leaves the late worker
                # out; this one runs after it (one sync thread), its "ready" ack inside the
                # trainer's ready deadline.
                if not plan.decided:
                    self._ack(plan, "accepted", True)
                claim = self._claim_early(plan, running)
                # From the trainer's publish to this handler (one clock when both share a host),
                # and this handler's own time.
                timing = {way: max(arrived - plan.issued_at, 0.0), "accept": time.time() - arrived}
                self._current = self._pool.submit(self.sync, plan, timing, submitted_at=time.monotonic(),
                                                  claim=claim)
                self._current_round = plan.round
                if plan.decided:  # the sync goes on meanwhile: nobody waits for this ack
                    self._courier.submit(self._ack_later, plan, "accepted")
        except Exception as exc:  # noqa: BLE001  every refusal is answered, never raised into Celery
            log.warning("weight sync round %s refused: %s", named, exc)
            failure = SyncFailure.of(exc)
            if plan is not None:
                self._ack(plan, "accepted", False, error=failure)
            return {"ok": False, "node": self.node, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True, "node": self.node}

    def _manifest(self, digest: str) -> Manifest:
        """The manifest a plan names: from the last few seen, or from Redis."""
        if digest in self._manifests:
            return self._manifests[digest]
        text = self.client.get(keys.sync_manifest(digest))
        if text is None:
            raise SyncRefused(f"the plan's manifest {digest[:12]} is not in Redis (expired, or another Redis)")
        manifest = Manifest.from_wire(text, digest)
        self._manifests[digest] = manifest
        while len(self._manifests) > 4:
            self._manifests.pop(next(iter(self._manifests)))
        return manifest

    def _check_manifest(self, plan: SyncPlan) -> None:
        if self._checked == (plan.manifest_digest, plan.backend):
            return
        if not self._shapes_loaded:
            self._shapes = checkpoint_shapes(self.host.settings.model)
            self._shapes_loaded = True
        problems: list[str] = []
        assert plan.manifest is not None
        for spec in plan.manifest.tensors:
            if spec.dtype != self.host.dtype and plan.backend not in transports.CONVERTING_TRANSPORTS:
                problems.append(f"{spec.name}: dtype {spec.dtype}, engine runs {self.host.dtype}")
            if self._shapes is not None:
                shape = self._shapes.get(spec.name)
                if shape is None:
                    problems.append(f"{spec.name}: not a tensor of this model's checkpoint")
                elif list(shape) != list(spec.shape):
                    problems.append(f"{spec.name}: shape {spec.shape}, checkpoint has {shape}")
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise ManifestMismatch("manifest refused: " + "; ".join(problems[:3]) + more, phase="trigger")
        self._checked = (plan.manifest_digest, plan.backend)

    # ------------------------------------------------------------------ sync

    def sync(self, plan: SyncPlan, timing: dict[str, float] | None = None, *,
             submitted_at: float | None = None, claim: StoreCall | None = None) -> None:
        """The sync after ``accept``, phase by phase (the module docstring's);
        ``timing``: the trigger's seconds, reported with the rest; ``submitted_at``:
        when ``accept`` handed it to this thread (``start``: the hand-over's seconds);
        ``claim``: a decided round's claim ``accept`` sent already (``_claim_early``)."""
        t_start = time.monotonic()
        seconds: dict[str, float] = dict(timing or {})
        if submitted_at is not None:
            seconds["start"] = t_start - submitted_at
        changed = False
        paused = False
        ready = False
        # Whether the trainer may still commit the round for others: not when the
        # wait for its decision is what failed (a trainer gone or cut off).
        trainer_lives = True
        try:
            self.state.begin_update()
            seconds["begin"] = time.monotonic() - t_start
            if not self._store_kept(plan):
                self._check_rendezvous(plan)  # a kept store client has reached it already
            if self.host.weights_asleep():  # loading into sleeping weights crashes vLLM
                self.host.wake_up(["weights"])
            t = time.monotonic()
            paused = True  # from here a failure resumes: pause() closes intake first and may fail after
            self.host.pause(plan.pause, timeout=plan.timeouts.pause)
            seconds["pause"] = time.monotonic() - t
            trainer_lives = False
            if plan.decided:  # no "ready" ack: the round is this worker's once it claims it
                ready = True
                t = time.monotonic()
                decision = self._claim(plan, claim)
                seconds["claim"] = time.monotonic() - t
            else:
                self._ack(plan, "ready", True, seconds=seconds,
                          group_round=self._groups.get(plan.transport_of(self.node)))
                ready = True
                decision = self._await_decision(plan)
            trainer_lives = True
            if not decision.go or self.node not in decision.roster:
                reason = decision.reason or "left out of the roster"
                raise SyncRefused(f"trainer called off round {plan.round} for {self.node}: {reason}")
            t = time.monotonic()
            changed = True  # until the engine says no weight changed
            stats, released, way = self._update_engine(plan, decision)
            if released:
                self.host.weights_loading()
            if decision.group_round is not None and not decision.relayed(self.node):
                self._groups[plan.transport_of(self.node)] = decision.group_round
            returned = time.monotonic()
            seconds["update"] = returned - t
            for step in ("join", "receive", "wire", "load", "resolve", "issue", "finish"):  # the slowest rank's
                if any(f"{step}_s" in s for s in stats):
                    seconds[step] = max(s.get(f"{step}_s", 0.0) for s in stats)
            seconds.update(_call_ways(stats, t, returned, way))
            missing = self._incomplete(plan, decision)
            if missing is not None:
                self._stay_fenced(plan, missing, seconds, released)
                return
            self.host.weights_restored()
            t = time.monotonic()
            self.host.resume(plan.weight_version, timeout=plan.timeouts.resume)
            paused = False
            seconds["commit"] = time.monotonic() - t
            t = time.monotonic()
            self.state.finish_update()  # a sleeping engine's KV cache stays asleep
            seconds["settle"] = time.monotonic() - t
            self.last_error = None
            for observe in self.on_synced:
                observe(time.monotonic() - t_start)
            self._ack(plan, "done", True, seconds=seconds, released=released,
                      listening=self._listen(plan) if plan.decided else None)
            log.info("weight sync round %s: now at version %d", plan.round, plan.weight_version)
        except Exception as exc:  # noqa: BLE001  any failure fences this worker; the trainer is told
            failure = SyncFailure.of(exc)
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("weight sync round %s failed: %s", plan.round, self.last_error)
            self._recover(changed, paused, plan, trainer_lives)
            if not ready:  # the trainer waits for "ready" first: tell it there at once
                self._ack(plan, "ready", False, error=failure, seconds=seconds)
            self._ack(plan, "done", False, error=failure, seconds=seconds)

    def _incomplete(self, plan: SyncPlan, decision: SyncDecision) -> str | None:
        """Why the weights are not whole after this update (None: they are): a catch-up
        through a relay, and an update into weights a level-2 sleep dropped, must bring
        every tensor of the model (the rest would be stale, or whatever that memory holds)."""
        if decision.relayed(self.node):
            missing = self._still_missing(plan)
            relay = f"catches up to version {plan.weight_version} through a relay"
            return None if missing is None else f"{relay}; {missing}"
        if not self.host.weights_dropped():
            return None
        if self._shapes is None:  # nothing to tell a whole model by: the trainer's word stands
            log.warning("weight sync round %s loads weights a level-2 sleep dropped; with no local checkpoint "
                        "to check them against, every tensor the engine has is taken as sent", plan.round)
            return None
        missing = self._still_missing(plan)
        return None if missing is None else f"slept at level 2 (its weights dropped); {missing}"

    def _still_missing(self, plan: SyncPlan) -> str | None:
        """What the rounds of the plan's version have not brought yet of the whole model
        (None: nothing, take the version)."""
        assert plan.manifest is not None
        arrived = {spec.name for spec in plan.manifest.tensors}
        if self._catching_up is not None and self._catching_up[0] == plan.weight_version:
            arrived |= self._catching_up[1]
        self._catching_up = (plan.weight_version, arrived)
        if self._shapes is None:
            return "this worker has no local checkpoint to tell a whole model by"
        required = whole_model(self.host.settings.model, self._shapes)
        missing = sorted(required - arrived)
        if not missing:
            self._catching_up = None
            return None
        return (f"the update has not brought {len(missing)} of its checkpoint's {len(required)} tensors, "
                f"e.g. {', '.join(missing[:3])}")

    def _stay_fenced(self, plan: SyncPlan, missing: str, seconds: dict[str, float], released: list[str]) -> None:
        """The engine loaded part of the plan's version: resume on it fenced (half-loaded)
        and tell the coordinator why, in the "done" ack (with what the engine's copies end
        with: the trainer waits for them all the same)."""
        message = f"{self.node} {missing}: it stays fenced until an update brings the whole model"
        self.host.resume(None, timeout=plan.timeouts.resume)
        self.state.fail_update(Fence(FenceReason.HALF_LOADED, message))
        self.last_error = message
        log.warning("weight sync round %s: %s", plan.round, message)
        self._ack(plan, "done", False, error=SyncFailure(kind="refused", message=message), seconds=seconds,
                  released=released)

    def _update_engine(self, plan: SyncPlan, decision: SyncDecision) -> tuple[
            list[dict[str, float]], list[str], str]:
        """The engine's part, one call on every rank (``UpdateRequest``); each rank's
        seconds, what its copies end with where they may still run
        (``UpdateResult.released``), and the way the call took (``EngineHost.update_engine``:
        "line" or "call"), or its failure raised as the error it stands for."""
        assert plan.manifest is not None
        # The engine keeps the last manifest it was sent: only a new layout travels.
        sent = None if self._engine_digest == plan.manifest_digest else plan.manifest.model_dump_json()
        self._engine_digest = None  # until this call has succeeded
        request = UpdateRequest(plan=plan, decision=decision, node=self.node, manifest=sent)
        answers, way = self.host.update_engine(request.model_dump(mode="json"), plan.timeouts.update)
        results = [UpdateResult.model_validate(answer) for answer in answers]
        failed = next((r.failure for r in results if r.failure is not None), None)
        if failed is not None:
            raise failed.error(phase="transfer", workers=[self.node])
        self._engine_digest = plan.manifest_digest
        return [result.seconds for result in results], [r.released for r in results if r.released is not None], way

    def _check_rendezvous(self, plan: SyncPlan) -> None:
        """Fail before pausing when the trainer's store cannot be reached from here
        (a ``RQ_RENDEZVOUS_HOST`` of 127.0.0.1 seen from another host: refused at once)."""
        try:
            wire.check_reachable(plan.store_host, plan.store_port, plan.timeouts.probe)
        except OSError as exc:
            hint = (f"{plan.store_host} is this worker's own loopback, not the trainer's host"
                    if _is_loopback(plan.store_host)
                    else "check the address, routes and firewalls between the hosts")
            raise self._store_failure(
                RendezvousUnreachable, plan, "cannot reach", f"{exc}",
                f"{hint}; set RQ_RENDEZVOUS_HOST on the trainer to an address of the trainer that every worker "
                "host can reach") from exc

    def _recover(self, changed: bool, paused: bool, plan: SyncPlan, trainer_lives: bool) -> None:
        self._groups.pop(plan.transport_of(self.node), None)  # a failed collective leaves no group
        if changed:
            try:
                changed = any(self.host.collective_rpc("rq_abort_update", plan.timeouts.abort))
            except Exception:
                log.exception("rq_abort_update failed")
        if paused:
            try:
                self.host.resume(None, timeout=plan.timeouts.resume)
            except Exception:
                log.exception("resume after a failed sync failed")
        if changed:
            self.state.fail_update(
                Fence(FenceReason.HALF_LOADED, f"weights half-loaded by failed sync round {plan.round}"))
        elif plan.weight_version > self.host.weight_version:
            missed = f"missed sync to version {plan.weight_version}"
            if trainer_lives:
                # The others may still commit: held until the trainer has written
                # the round's outcome, or the heartbeat would read the old version
                # as current. A trainer whose decision never came (gone, cut off)
                # commits no one: the next heartbeat lifts it.
                self.state.fail_update(Fence(FenceReason.MISSED_SYNC, missed,
                                             until=time.monotonic() + plan.timeouts.outcome, round=plan.round))
            else:
                self.state.fail_update(Fence(FenceReason.MISSED_SYNC, missed))
        else:
            self.state.fail_update(None)

    def _await_decision(self, plan: SyncPlan) -> SyncDecision:
        """Read the trainer's decision from its store (the client is kept between syncs),
        waiting no longer than the plan's ``timeouts.decision`` (and a grace)."""
        key = keys.sync_decision(plan.round)
        return self._from_store(plan, "got no decision for sync round", lambda store: (
            SyncDecision.model_validate_json(store.get(key))))

    def _claim(self, plan: SyncPlan, sent: StoreCall | None = None) -> SyncDecision:
        """A decided round (``SyncPlan.decided``): write its go decision in the trainer's
        store unless the trainer has called the round off; the decision that stands.
        ``sent``: the claim already on its way (``_claim_early``)."""
        return self._store_answer(plan, "could not claim sync round", sent or self._send_claim(plan))

    def _send_claim(self, plan: SyncPlan) -> StoreCall:
        mine = SyncDecision.handed(self.node)
        return self._ask_store(plan, lambda store: mine.claim(store, plan.round))

    def _claim_early(self, plan: SyncPlan, running: bool) -> StoreCall | None:
        """A decided round's claim, sent as the trigger is accepted when nothing stands
        between it and the engine call: no request in the engine (the pause is
        nothing), its weights awake, the trainer's store client kept from an earlier
        sync, no older round still running. Its answer is waited for here, up to
        ``EARLY_CLAIM_S``: this thread then leaves the interpreter to the claim's
        (left to run on, the consumer's work kept it waiting, and the sync thread
        then waited for it: 0.3-0.6 ms on an H100 host). A claim not answered by then
        is the sync thread's to wait for, as any (a store read to a silent trainer
        outlives its timeout: never waited for on this thread). None: the sync thread
        claims after pausing (so a trainer tired of a long pause can still call the
        round off)."""
        if (not plan.decided or running or not self._store_kept(plan) or self.host.inflight_requests()
                or self.host.weights_asleep()):
            return None
        sent = self._send_claim(plan)
        with contextlib.suppress(Exception):  # not answered yet, or failed: the sync thread says so
            sent[0].result(timeout=EARLY_CLAIM_S)
        return sent

    def _ack_later(self, plan: SyncPlan, phase: str) -> None:
        """The courier's job: ``phase``'s ok ack, ``ACCEPTED_AFTER_S`` from now (a failure
        is logged here: nobody reads this job's future)."""
        time.sleep(ACCEPTED_AFTER_S)
        try:
            self._ack(plan, phase, True)
        except Exception:  # the trainer's wait for it ends at its deadline
            log.exception("could not push the %s ack of round %s", phase, plan.round)

    def _from_store(self, plan: SyncPlan, what: str, call: Callable[[Any], SyncDecision]) -> SyncDecision:
        """``call`` on the trainer's store (the client is kept between syncs), for no
        longer than the plan's ``timeouts.decision`` (and a grace)."""
        return self._store_answer(plan, what, self._ask_store(plan, call))

    def _ask_store(self, plan: SyncPlan, call: Callable[[Any], SyncDecision]) -> StoreCall:
        """``call`` sent to the trainer's store from a thread of its own, with its deadline
        (the plan's ``timeouts.decision`` and a grace, from now)."""
        from torch.distributed import DistNetworkError

        deadline = time.monotonic() + plan.timeouts.decision + DECISION_GRACE_S

        def read() -> SyncDecision:
            try:
                return call(self._decision_store(plan, deadline))
            except DistNetworkError:
                self._store = None  # the trainer's store restarted: reconnect once
                if time.monotonic() >= deadline:
                    raise
                return call(self._decision_store(plan, deadline))

        return self._decision_reads.submit(read), deadline

    def _store_answer(self, plan: SyncPlan, what: str, asked: StoreCall) -> SyncDecision:
        """The answer of a call ``_ask_store`` sent, waited for up to its deadline (and
        a second); a failure raised as the ready phase's error, saying ``what`` failed."""
        from torch.distributed import DistError

        future, deadline = asked
        waited = plan.timeouts.decision + DECISION_GRACE_S
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.1) + 1.0)
        except (DistError, OSError, FutureTimeout) as exc:
            # A client that timed out may still get the late answer: never reuse it.
            self._store = None
            why = str(exc).strip()[:200] or "no answer in time"
            raise self._store_failure(
                RendezvousTimeout, plan, f"{what} {plan.round} within {waited:.0f}s from",
                f"{type(exc).__name__}: {why}", "the trainer is gone or cut off; resuming on the weights held",
            ) from exc

    def _store_failure(self, error: type[WeightSyncError], plan: SyncPlan, what: str, why: str,
                       advice: str) -> WeightSyncError:
        """This worker's failure with the trainer's rendezvous store before the
        transfer (the "ready" phase): ``what`` it did not get from the store,
        ``why``, and what to do."""
        return error(f"{self.node} {what} the trainer's rendezvous store at {plan.store_host}:{plan.store_port} "
                     f"({why}): {advice}", phase="ready", workers=[self.node])

    def _store_kept(self, plan: SyncPlan) -> bool:
        """Whether the store client kept from an earlier sync is connected to this plan's store."""
        return self._store is not None and self._store_address == (plan.store_host, plan.store_port)

    def _decision_store(self, plan: SyncPlan, deadline: float) -> Any:
        address = (plan.store_host, plan.store_port)
        remaining = max(deadline - time.monotonic(), 0.1)
        if not self._store_kept(plan):
            # TCPStore's own connect to a host gone silent outlasts its timeout
            # (the kernel's SYN retries, minutes): a bounded probe goes first.
            wire.check_reachable(plan.store_host, plan.store_port, min(plan.timeouts.probe, remaining))
            self._store = wire.connect_store(
                plan.store_host, plan.store_port, min(plan.timeouts.store_connect, remaining)
            )
            self._store_address = address
        self._store.set_timeout(datetime.timedelta(seconds=remaining))
        return self._store

    def _listen(self, plan: SyncPlan) -> str | None:
        """The key this worker's trigger listener waits on in the plan's store, a
        listener started there if none waits on it (the one on another store ended);
        None without a verifier to check what comes that way."""
        if self.verifier is None:
            return None
        with self._lock:
            listener = self._listener
            if listener is None or not listener.waits_on(plan.store_host, plan.store_port):
                if listener is not None:
                    listener.stop()
                listener = self._listener = TriggerListener(
                    self.node, plan.store_host, plan.store_port,
                    lambda arguments: self.accept_signed(arguments.get("plan"), arguments.get("auth"),
                                                         way="store_delivery"))
            return listener.key

    def close(self) -> None:
        """End the trigger listener, if one waits."""
        with self._lock:
            if self._listener is not None:
                self._listener.stop()
                self._listener = None

    def _ack(self, plan: SyncPlan, phase: str, ok: bool, error: SyncFailure | None = None,
             seconds: dict[str, float] | None = None, group_round: SyncRound | None = None,
             released: list[str] | None = None, listening: str | None = None) -> None:
        ack = SyncAck(node=self.node, round=plan.round, phase=phase,  # type: ignore[arg-type]
                      ok=ok, error=error, seconds=seconds or {}, group_round=group_round,
                      released=released or [], listening=listening)
        name = keys.sync_acks(plan.round, phase)
        try:
            pipe = self.client.pipeline(transaction=False)  # one round trip
            pipe.rpush(name, ack.model_dump_json())
            pipe.expire(name, 3600)
            pipe.execute()
        except redis.RedisError:
            log.exception("could not push the %s ack of round %s", phase, plan.round)

    def busy(self) -> bool:
        with self._lock:
            return self._current is not None and not self._current.done()


def round_named(raw_plan: Any) -> str:
    """The round an unchecked plan names, for a log line ("?" when it names none)."""
    return str(raw_plan.get("round", "?")) if isinstance(raw_plan, dict) else "?"


def _call_ways(stats: list[dict[str, float]], called: float, returned: float, way: str) -> dict[str, float]:
    """The engine call's way in (``call_in``: the call made here to the engine method's
    start) and out (``call_out``: its end to the answer here), the slowest rank's, from
    the ranks' stamps (``entered_at``, ``left_at``) on this host's monotonic clock;
    none where a rank's stamps fall outside the call (a rank on another host). Named
    ``line_in`` and ``line_out`` when the call took the update line (``way``)."""
    ways = [(s["entered_at"] - called, returned - s["left_at"]) for s in stats if "entered_at" in s]
    if not ways or not all(0.0 <= w <= returned - called for pair in ways for w in pair):
        return {}
    return {f"{way}_in": max(w for w, _ in ways), f"{way}_out": max(w for _, w in ways)}


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
