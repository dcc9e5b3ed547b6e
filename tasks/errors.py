"""The project's one error tree.

    RolloutError
    ├── InvalidRequest            bad params or prompts (also a ValueError)
    ├── PromptTooLong             a prompt does not fit the worker's max_model_len
    ├── EngineError               the engine refused or failed a request
    ├── GenerationTimeout         a task ran past its time limit; its requests were aborted
    ├── Requeue                   not this worker's to serve now; back to the queue
    ├── BrokerUnavailable         Redis could not be reached before the deadline
    │   └── BrokerFull            Redis refused the task: used memory is past its maxmemory
    ├── RedisMayEvict             Redis's maxmemory-policy is not noeviction: it may drop queued tasks
    ├── SettingsFileError         a ``RQ_*_FILE`` secret file cannot be read
    ├── RedeliveryLimitReached    the task's worker died too often while holding it
    ├── PoisonMessage             a queue item no worker can decode; dead-lettered
    ├── DeadLetterNotFound        no dead letter with that id (``rollout-queue dead-letters``)
    ├── ControlError              a control command (sleep, pause, stats...) failed
    │   ├── ControlTimeout        workers did not answer in time
    │   ├── ControlFailed         workers answered with an error
    │   └── ControlRefused        (worker side) unsigned, wrongly signed, expired or replayed command
    ├── StreamInterrupted         a streamed task's tokens stopped: its worker died or the stream broke
    ├── BatchIncomplete           tasks of a generate_many batch failed or did not finish
    ├── StaleRollouts             a trainer got samples from weights outside its step's versions
    ├── LocalStackError           the quickstart or a benchmark could not start Redis or a worker
    ├── GatewayError              the HTTP gateway refused or gave up on a request
    │   ├── BadRequest            an OpenAI request it cannot serve; names the param (400)
    │   ├── RequestTooLarge       a body or prompt past the gateway's size limits (413)
    │   ├── Unauthorized          missing or wrong bearer token (401)
    │   ├── ModelNotFound         the request names a model the gateway does not serve (404)
    │   ├── GatewaySaturated      the gateway's bound on in-flight tasks is reached (429)
    │   ├── ResultTimeout         no result before the gateway's request timeout (504), or
    │   │                         before the timeout of a streamed or awaited call (tasks.aio)
    │   └── ClientDisconnected    the client went away first; its prompts were aborted (499)
    └── WeightSyncError           a weight sync failed; names the phase and workers
        ├── NoWorkers             the registry lists no live worker
        ├── RendezvousTimeout     a worker did not join the process group in time
        │   └── RendezvousUnreachable  a worker cannot reach RQ_RENDEZVOUS_HOST (wrong address)
        ├── ManifestMismatch      a worker refused the manifest (name, shape, dtype)
        ├── SyncRefused           a worker refused the command (signature, state)
        ├── WorkerLost            a worker stopped answering mid-sync
        └── BrokerLost            Redis stopped answering the trainer mid-sync

Errors from redis, vLLM and torch are mapped at the boundary with
``raise ... from exc``. Errors raised inside a Celery task travel to the
producer by class name and ``args`` (JSON result backend), so every message
says what happened and what to do. A weight-sync error crosses the sync's
processes as a kind and a message, mapped to its class by ``SYNC_ERRORS``.

Celery rebuilds a task's error on the producer as ``cls(*args)`` (pickle does
the same), so every class here keeps ``args`` equal to its constructor's
arguments, JSON values, with the message first where the constructor takes
one; ``str()`` is the message.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal


class RolloutError(Exception):
    """Base of every error this project raises on purpose."""

    def __str__(self) -> str:
        # args[0] is the message; further args are the fields after it.
        return str(self.args[0]) if self.args else ""


class InvalidRequest(RolloutError, ValueError):
    """Params or prompts were refused before anything was enqueued."""


class PromptTooLong(RolloutError, ValueError):
    """A prompt is longer than the engine can hold."""


class EngineError(RolloutError):
    """The engine refused or failed a request."""


class GenerationTimeout(RolloutError, TimeoutError):
    """A task ran past its time limit; its engine requests were aborted."""


class Requeue(RolloutError):
    """Not this worker's to serve now (weights too old, fenced, sync abort)."""

    def __init__(self, message: str, countdown: float = 0.5) -> None:
        self.countdown = countdown
        super().__init__(message, countdown)


class BrokerUnavailable(RolloutError, ConnectionError):
    """Redis did not answer before the deadline."""


class BrokerFull(BrokerUnavailable):
    """Redis refused to enqueue: its used memory is past ``maxmemory`` (policy
    ``noeviction``). Nothing was enqueued; it passes once Redis has room."""


class RedisMayEvict(RolloutError):
    """Redis's ``maxmemory-policy`` is not ``noeviction``: when full it would drop
    queued tasks, ``unacked`` entries or results. Refused unless
    ``RQ_ALLOW_EVICTING_REDIS=1`` (``--allow-evicting-redis``); nothing was enqueued."""


class SettingsFileError(RolloutError):
    """A secret named by ``RQ_<SETTING>_FILE`` (``RQ_WEIGHT_SYNC_SECRET_FILE``,
    ``RQ_API_TOKEN_FILE``...) could not be read."""


class ControlError(RolloutError):
    """A control command sent to workers failed (or found no worker to send to)."""


class ControlRefused(ControlError):
    """A worker refused a control command: unsigned, wrongly signed, expired, replayed,
    addressed to other workers, or a Celery built-in this worker has disabled."""


class RedeliveryLimitReached(RolloutError):
    """The reaper put this task back in its queue too often; it fails for good.

    A task whose worker dies (``kill -9``, OOM killer, lost host) is redelivered
    by another worker's reaper; one that keeps killing its workers is failed
    with this error after ``task_max_redeliveries`` redeliveries.
    """


class PoisonMessage(RolloutError):
    """A queue item a worker cannot decode into a task (``workers.queue.poison``).

    ``kind`` is the short reason (``not-json``, ``no-delivery-tag``,
    ``content-refused``...), used as a metric label; the message says what
    was wrong with the item.
    """

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        # args = what the constructor takes: Celery rebuilds errors as cls(*args).
        super().__init__(kind, message)

    def __str__(self) -> str:
        return str(self.args[1])


class DeadLetterNotFound(RolloutError, LookupError):
    """No dead-letter entry has the id given to ``rollout-queue dead-letters``."""


class ControlTimeout(ControlError, TimeoutError):
    """Some workers did not answer a control command before the deadline."""

    def __init__(self, command: str, missing: Iterable[str]) -> None:
        self.command = command
        self.missing = sorted(missing)
        super().__init__(command, self.missing)

    def __str__(self) -> str:
        return (
            f"{self.command}: no reply from {', '.join(self.missing)} before the deadline; "
            "check that these workers are alive (`rollout-queue status`)"
        )


class ControlFailed(ControlError):
    """Workers answered a control command with an error. ``errors``: node → message."""

    def __init__(self, command: str, errors: dict[str, str], replies: dict[str, object]) -> None:
        self.command = command
        self.errors = dict(sorted(errors.items()))
        self.replies = replies  # the workers that succeeded: node → result
        super().__init__(command, self.errors, replies)

    def __str__(self) -> str:
        detail = "; ".join(f"{node}: {error}" for node, error in self.errors.items())
        return f"{self.command} failed on {len(self.errors)} worker(s): {detail}"


class StreamInterrupted(RolloutError):
    """A streamed generation cannot go on: its worker stopped mid-stream, the task
    restarted after tokens were delivered, or the reader fell behind the stream's bound."""


class BatchIncomplete(RolloutError):
    """Tasks of a ``generate_many`` batch failed or did not finish in time.

    ``failed``: task id → error; ``unfinished``: ids of tasks still pending at
    the deadline; ``indices``: the prompt indices without a result.
    """

    def __init__(self, failed: dict[str, str], unfinished: Iterable[str], indices: Iterable[int]) -> None:
        self.failed = dict(failed)
        self.unfinished = sorted(unfinished)
        self.indices = sorted(indices)
        super().__init__(self.failed, self.unfinished, self.indices)

    def __str__(self) -> str:
        parts = []
        if self.failed:
            shown = "; ".join(f"{tid}: {err}" for tid, err in list(self.failed.items())[:5])
            more = f" (and {len(self.failed) - 5} more)" if len(self.failed) > 5 else ""
            parts.append(f"{len(self.failed)} task(s) failed: {shown}{more}")
        if self.unfinished:
            parts.append(f"{len(self.unfinished)} task(s) unfinished at the deadline: "
                         f"{', '.join(self.unfinished[:5])}{' ...' if len(self.unfinished) > 5 else ''}")
        return (
            f"{'; '.join(parts)}; {len(self.indices)} prompt(s) have no result "
            "(their indices are in .indices; resubmit those)"
        )


class StaleRollouts(RolloutError):
    """A trainer's step got samples generated on weights outside the versions it accepts
    (``min_weight_version`` fencing failed, or another trainer synced the pool)."""


class LocalStackError(RolloutError):
    """A local Redis or worker started by the quickstart or a benchmark failed; names its log."""


class GatewayError(RolloutError):
    """The HTTP gateway (``api/``) refused or gave up on a request."""


class BadRequest(GatewayError, InvalidRequest):
    """An OpenAI request the gateway cannot serve as asked. ``param``: the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message, param)


class RequestTooLarge(GatewayError):
    """A body or prompt past the gateway's size limits (``RQ_API_MAX_BODY_BYTES``...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class ClientDisconnected(GatewayError):
    """The client closed its connection before its answer was ready."""


class Unauthorized(GatewayError):
    """The request carries no bearer token, or the wrong one."""


class ModelNotFound(GatewayError, LookupError):
    """The request names a model this gateway does not serve."""


class GatewaySaturated(GatewayError):
    """The gateway's bound on in-flight tasks is reached; the client should retry later."""


class ResultTimeout(GatewayError, TimeoutError):
    """No result arrived before the gateway's request timeout, or the timeout of a call
    awaited with ``tasks.aio`` or streamed; the task expires unserved."""


class WeightSyncError(RolloutError):
    """A weight sync failed. ``phase`` and ``workers`` say where and who."""

    def __init__(self, message: str, phase: str = "", workers: Iterable[str] = ()) -> None:
        self.phase = phase
        self.workers = sorted(workers)
        super().__init__(message, phase, self.workers)


class NoWorkers(WeightSyncError):
    pass


class RendezvousTimeout(WeightSyncError):
    pass


class RendezvousUnreachable(RendezvousTimeout):
    """A worker could not open a connection to the trainer's rendezvous store."""


class ManifestMismatch(WeightSyncError):
    pass


class SyncRefused(WeightSyncError):
    pass


class WorkerLost(WeightSyncError):
    pass


class BrokerLost(WeightSyncError):
    """Redis stopped answering the trainer mid-sync: it cannot read the workers' acks.

    ``workers``: those whose acks it was waiting for. A worker that did not get
    the trainer's decision resumes on its old weights once its wait for it ends.
    """


# How a weight-sync error crosses a process (engine rank → worker host →
# trainer): as a kind and a message (``weight_sync.protocol.SyncFailure``),
# mapped back to its class here; "failed" stands for anything else.
SyncErrorKind = Literal[
    "no_workers", "rendezvous_timeout", "rendezvous_unreachable", "manifest_mismatch", "refused",
    "worker_lost", "broker_lost", "failed",
]
SYNC_ERRORS: dict[SyncErrorKind, type[WeightSyncError]] = {
    "no_workers": NoWorkers,
    "rendezvous_timeout": RendezvousTimeout,
    "rendezvous_unreachable": RendezvousUnreachable,
    "manifest_mismatch": ManifestMismatch,
    "refused": SyncRefused,
    "worker_lost": WorkerLost,
    "broker_lost": BrokerLost,
    "failed": WeightSyncError,
}


def sync_error_kind(exc: BaseException) -> SyncErrorKind:
    """The kind ``exc`` travels as: that of the nearest class in ``SYNC_ERRORS`` it
    derives from (a ``RendezvousUnreachable`` is not a mere ``RendezvousTimeout``)."""
    for cls in type(exc).__mro__:
        for kind, known in SYNC_ERRORS.items():
            if cls is known:
                return kind
    return "failed"
