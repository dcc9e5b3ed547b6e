"""Names both sides agree on: Celery task and queue names, Redis keys.

Every Redis key the project touches is built here, so a key never drifts
between the producer, the worker and the trainer.
"""

from __future__ import annotations

import hashlib

GENERATE_TASK = "rollout_queue.generate"
GENERATE_QUEUE = "generate"

# Remote-control commands (celery.worker.control) registered by workers.
CONTROL_SYNC = "rq_weight_sync"
CONTROL_ENGINE = "rq_engine"

PREFIX = "rq"

# Worker registry: one hash-like JSON value per worker node, with a TTL
# refreshed by the worker's heartbeat, and the set of the nodes that wrote one
# (readers take it instead of a SCAN of the keyspace, which grows with every
# task result: 18 ms at 50,000 keys). A name stays in the set after its entry
# expires, until a reaper's sweep prunes it (or the node deletes it at stop).
WORKER_KEY_PREFIX = f"{PREFIX}:worker:"
WORKERS = f"{PREFIX}:workers"

DEFAULT_POOL = "default"
# Monotonic counter of weight-sync rounds: each round's epoch, the first part
# of its name (``weight_sync.protocol.SyncRound``, ``<epoch>-<nonce>``).
SYNC_EPOCH = f"{PREFIX}:sync:epoch"


def worker_key(node: str) -> str:
    return f"{WORKER_KEY_PREFIX}{node}"


def fleet_version(pool: str) -> str:
    """The pool's current weight version: set by the trainer when a sync commits."""
    return f"{PREFIX}:fleet:{pool}:weight_version"


# Delivery tags of the messages a worker holds (received, not yet acked):
# one set per node, read by the reaper when the node's registry key expires.
INFLIGHT_KEY_PATTERN = f"{PREFIX}:inflight:*"
# kombu's Redis transport keeps delivered-but-unacked messages here
# (``Channel.unacked_key`` / ``unacked_index_key``; we keep kombu's defaults).
KOMBU_UNACKED = "unacked"
KOMBU_UNACKED_INDEX = "unacked_index"


def inflight_key(node: str) -> str:
    return f"{PREFIX}:inflight:{node}"


def node_of_inflight_key(key: str) -> str:
    return key.removeprefix(f"{PREFIX}:inflight:")


# A streamed task's token stream: bounded (approximate MAXLEN, in events; a
# reader that falls this far behind sees a gap and stops with an error) and
# expiring (refreshed by every write) so an unread stream never lingers.
TOKEN_STREAM_MAXLEN = 10_000
TOKEN_STREAM_TTL_S = 600


def token_stream(task_id: str) -> str:
    """Redis Stream of a streamed ``generate`` task's ``StreamEvent`` entries."""
    return f"{PREFIX}:stream:{task_id}"


def abort_key(task_id: str) -> str:
    """Prompt indices of a running ``generate`` task whose requester went away.

    The gateway adds to this set when a client disconnects; the worker serving
    the task reads it while it generates and aborts those prompts' requests.
    """
    return f"{PREFIX}:abort:{task_id}"


# Messages a worker has taken off a queue but not yet recorded in kombu's
# unacked hash (the atomic fetch of workers/queue/reliable_redis.py): a list per node.
PROCESSING_KEY_PATTERN = f"{PREFIX}:processing:*"


def processing_key(node: str) -> str:
    return f"{PREFIX}:processing:{node}"


def node_of_processing_key(key: str) -> str:
    return key.removeprefix(f"{PREFIX}:processing:")


# The nodes that may hold a ledger (an in-flight set, a processing list, or
# messages in their own queue): the set the reaper's sweep reads instead of a
# SCAN of the keyspace, which grows with every task result. A node is added
# where those keys are born (at its start, by its fetch, by its ledger's
# MULTI) and removed only once none of them exists
# (workers/queue/ledger_index.py). Not WORKERS: that set is pruned as
# registry entries expire, before a dead node is reaped.
LEDGER_NODES = f"{PREFIX}:ledger-nodes"


# Queue items no worker could decode (workers/queue/poison.py): one list per queue,
# newest first, bounded. Items whose queue cannot be read from them (a dead
# node's processing list holds no queue name) go under UNKNOWN_QUEUE.
DEAD_LETTERS_KEY_PATTERN = f"{PREFIX}:dead:*"
UNKNOWN_QUEUE = "(unknown)"


def dead_letters(queue: str) -> str:
    return f"{PREFIX}:dead:{queue}"


def queue_of_dead_letters_key(key: str) -> str:
    return key.removeprefix(f"{PREFIX}:dead:")


# One reaper of the fleet sweeps for dead nodes at a time: its node name,
# renewed every pass, expiring a few passes after it stops (workers/queue/reaper.py).
REAPER_SWEEP_LEASE = f"{PREFIX}:reaper:sweep-lease"


def reaper_lock(node: str) -> str:
    """Held by the one reaper restoring a dead node's messages."""
    return f"{PREFIX}:reaper:lock:{node}"


def control_nonce(node: str, nonce: str) -> str:
    """A signed control command's nonce, once ``node`` accepted it; expires with the
    signature's window (``tasks.auth.CommandVerifier``: a replay after a restart is refused)."""
    return f"{PREFIX}:nonce:{node}:{nonce}"


def handed_on(node: str) -> str:
    """Set of delivery tags the reaper took from ``node`` (declared dead) and put
    back in their queues: if ``node`` still runs one, it neither stores its
    result nor acks it (``workers.queue.handed_on``)."""
    return f"{PREFIX}:handed-on:{node}"


def redeliveries(task_id: str) -> str:
    """How many times the reaper put this task back in its queue."""
    return f"{PREFIX}:redeliveries:{task_id}"


# A weight-sync round's names: each derived from the round's one name
# (``str(SyncRound)``, ``<epoch>-<nonce>``) by one function.


def sync_acks(sync_round: str, phase: str) -> str:
    """List the trainer BLPOPs for one phase's acknowledgements of one round.

    "accepted" acks share the "ready" list: the trainer reads both in one wait.
    """
    return f"{PREFIX}:sync:{sync_round}:{'ready' if phase == 'accepted' else phase}"


def sync_over(sync_round: str) -> str:
    """Set by the trainer when a round has ended, after the pool's version is
    written (whether or not anyone committed): the pool's version is then final
    for that round. A worker that missed the round waits for it (or its deadline)
    before the heartbeat may read itself as caught up."""
    return f"{PREFIX}:sync:{sync_round}:over"


def sync_decision(sync_round: str) -> str:
    """Key of the trainer's decision for a round in its rendezvous store."""
    return f"rq/decision/{sync_round}"


def sync_trigger(node: str, token: str) -> str:
    """Key, in a trainer's rendezvous store, that worker ``node``'s trigger listener
    (``token``: one listener's) waits on: a decided round's signed trigger is
    written there instead of broadcast (``workers.node.listener``)."""
    return f"rq/trigger/{node}/{token}"


def sync_handoff(sync_round: str, transport: str, bucket: int) -> str:
    """Key, in the trainer's rendezvous store, of where bucket ``bucket`` of a
    handoff transport waits for the colocated workers (set once it is packed)."""
    return f"rq/handoff/{sync_round}/{transport}/{bucket}"


def sync_handoff_layout(transport: str, digest: str) -> str:
    """Key, in the trainer's rendezvous store, of a handoff's storages layout (the
    trainer's own storages, named for mapping), stored once per layout: a round's
    ``sync_handoff`` key names it by ``digest``."""
    return f"rq/handoff-layout/{transport}/{digest}"


def sync_group(sync_round: str) -> str:
    """Namespace, in the trainer's rendezvous store, of the process group that
    round ``sync_round`` formed (later rounds reuse it while the roster holds)."""
    return f"rq/group/{sync_round}"


def sync_relay(sync_round: str) -> str:
    """Namespace, in the coordinator's rendezvous store, of the group round
    ``sync_round`` relays the trainer's bytes over (``SyncDecision.relay``)."""
    return f"rq/relay/{sync_round}"


MANIFEST_TTL_S = 24 * 3600  # refreshed by every sync that uses it


def sync_manifest(digest: str) -> str:
    """The JSON of the manifest a sync plan names by digest (``Manifest.wire``)."""
    return f"{PREFIX}:sync:manifest:{digest}"


def progress_key(task_id: str) -> str:
    """A running ``generate`` task's checkpointed samples (workers/engine/progress.py):
    a hash of ``<prompt>:<sample>`` → the sample's tokens so far; expires."""
    return f"{PREFIX}:progress:{task_id}"


# Sticky sessions (api/sessions.py): each worker also consumes a queue of its
# own, which the gateway sends a session's next turn to; a session key names
# the worker that served its last turn. A message in a dead worker's own queue
# goes to the queue in its FALLBACK_QUEUE_HEADER (workers/queue/reaper.py).
NODE_QUEUE_PREFIX = "rq.node."
NODE_QUEUE_PATTERN = f"{NODE_QUEUE_PREFIX}*"
FALLBACK_QUEUE_HEADER = "rq_fallback_queue"
SESSION_TTL_S = 3600


def node_queue(node: str) -> str:
    return f"{NODE_QUEUE_PREFIX}{node}"


def node_of_queue(queue: str) -> str:
    return queue.removeprefix(NODE_QUEUE_PREFIX)


def session_key(session: str) -> str:
    digest = hashlib.sha256(session.encode()).hexdigest()[:32]  # any client string, bounded
    return f"{PREFIX}:session:{digest}"
