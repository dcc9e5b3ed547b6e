"""Names both sides agree on: Celery task and queue names, Redis keys.

Every Redis key the project touches is built here, so a key never drifts
between the producer, the worker and the trainer.
"""

from __future__ import annotations

GENERATE_TASK = "rollout_queue.generate"
GENERATE_QUEUE = "generate"

# Remote-control commands (celery.worker.control) registered by workers.
CONTROL_SYNC = "rq_weight_sync"
CONTROL_ENGINE = "rq_engine"

PREFIX = "rq"

# Worker registry: one hash-like JSON value per worker node, with a TTL
# refreshed by the worker's heartbeat.
WORKER_KEY_PATTERN = f"{PREFIX}:worker:*"

DEFAULT_POOL = "default"
# Monotonic counter for weight-sync epochs.
SYNC_EPOCH = f"{PREFIX}:sync:epoch"


def worker_key(node: str) -> str:
    return f"{PREFIX}:worker:{node}"


def fleet_version(pool: str) -> str:
    """The pool's current weight version: set by the trainer when a sync commits."""
    return f"{PREFIX}:fleet:{pool}:weight_version"


def sync_acks(epoch: int, phase: str) -> str:
    """List the trainer BLPOPs for one phase's acknowledgements of one epoch."""
    return f"{PREFIX}:sync:{epoch}:{phase}"
