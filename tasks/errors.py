"""The project's one error tree.

    RolloutError
    ├── InvalidRequest            bad params or prompts (also a ValueError)
    ├── PromptTooLong             a prompt does not fit the worker's max_model_len
    ├── EngineError               the engine refused or failed a request
    ├── GenerationTimeout         a task ran past its time limit; its requests were aborted
    ├── Requeue                   not this worker's to serve now; back to the queue
    ├── BrokerUnavailable         Redis could not be reached before the deadline
    ├── ControlTimeout            workers did not answer a control command in time
    └── WeightSyncError           a weight sync failed; names the phase and workers
        ├── NoWorkers             the registry lists no live worker
        ├── RendezvousTimeout     a worker did not join the process group in time
        ├── ManifestMismatch      a worker refused the manifest (name, shape, dtype)
        ├── SyncRefused           a worker refused the command (signature, state)
        └── WorkerLost            a worker stopped answering mid-sync

Errors from redis, vLLM and torch are mapped at the boundary with
``raise ... from exc``. Errors raised inside a Celery task travel to the
producer by class name and message (JSON result backend), so every message
says what happened and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable


class RolloutError(Exception):
    """Base of every error this project raises on purpose."""


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
        super().__init__(message)


class BrokerUnavailable(RolloutError, ConnectionError):
    """Redis did not answer before the deadline."""


class ControlTimeout(RolloutError, TimeoutError):
    """Some workers did not answer a control command before the deadline."""

    def __init__(self, command: str, missing: Iterable[str]) -> None:
        self.command = command
        self.missing = sorted(missing)
        super().__init__(
            f"{command}: no reply from {', '.join(self.missing)} before the deadline; "
            "check that these workers are alive (`rollout-queue status`)"
        )


class WeightSyncError(RolloutError):
    """A weight sync failed. ``phase`` and ``workers`` say where and who."""

    def __init__(self, message: str, *, phase: str = "", workers: Iterable[str] = ()) -> None:
        self.phase = phase
        self.workers = sorted(workers)
        super().__init__(message)


class NoWorkers(WeightSyncError):
    pass


class RendezvousTimeout(WeightSyncError):
    pass


class ManifestMismatch(WeightSyncError):
    pass


class SyncRefused(WeightSyncError):
    pass


class WorkerLost(WeightSyncError):
    pass
