"""The index of nodes that may hold a ledger: where the reaper's sweep looks for the dead.

A node holds messages in its processing list ``rq:processing:<node>``, its
in-flight set ``rq:inflight:<node>`` (``workers.queue.reliable_redis``) and its
own queue ``rq.node.<node>`` (sticky sessions, at every priority). The sweep
found them with SCANs of the whole keyspace, task results included (a day of
them at 100 tasks/s is 8.6 M keys), every pass. Now it reads the set
``keys.LEDGER_NODES``:

* a node's name goes in where those keys are born: at the worker's start,
  before it consumes (:func:`enlist`; its own queue is written to only while
  its registry entry says it serves), in the fetch script, in the same step
  as its move into the processing list, and in the ledger's ``MULTI``
  (``QoS.append``, which also follows each blocking ``BLMOVE`` fetch);
* it comes out only through :data:`PRUNE_SCRIPT`, which checks in one step
  that none of the node's keys (its registry entry included) exists any
  more: after a reap, or once a worker that stopped cleanly left nothing;
* every :data:`SAFETY_SCAN_EVERY` sweeps the keyspace is still walked as
  before (:func:`scan`) and what it finds is added. Workers of a version
  from before this index write no name, and a node cut off long enough to be
  pruned whose blocking fetch lands before its ledger's ``MULTI`` re-adds it
  would be missed: a mixed-version fleet and such a race are still reaped,
  minutes later instead of seconds.
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str

from rollout_queue.tasks import keys

# Sweeps between two walks of the keyspace (the safety net above): 5 min at a
# 2 s heartbeat, so a walk of a day's results costs the fleet's one sweeper
# 1/150 of what it did every pass.
SAFETY_SCAN_EVERY = 150

# KEYS[1]: the index; then ARGV[1] keys per node (its registry entry, in-flight
# set, processing list, own queue at each priority), for the nodes ARGV[2..] in
# order. Drops each node none of whose keys exists, in one step, and returns
# their names: a node that writes one of them again re-adds its name with it
# (or after it, from its ledger's MULTI), so none is left out.
PRUNE_SCRIPT = """
local per = tonumber(ARGV[1])
local pruned = {}
for i = 2, #ARGV do
  local first = 2 + (i - 2) * per
  if redis.call('EXISTS', unpack(KEYS, first, first + per - 1)) == 0 then
    redis.call('SREM', KEYS[1], ARGV[i])
    table.insert(pruned, ARGV[i])
  end
end
return pruned
"""


def enlist(client: redis.Redis, node: str) -> None:
    """Name ``node`` in the index: at a worker's start, before it consumes."""
    client.sadd(keys.LEDGER_NODES, node)


def listed(client: redis.Redis) -> set[str]:
    """The nodes the index names."""
    return {bytes_to_str(node) for node in client.smembers(keys.LEDGER_NODES)}


def scan(client: redis.Redis) -> set[str]:
    """The safety net: every node with a ledger or an own queue, by a walk of the
    keyspace, added to the index."""
    nodes = {keys.node_of_inflight_key(bytes_to_str(k))
             for k in client.scan_iter(match=keys.INFLIGHT_KEY_PATTERN, count=500)}
    nodes |= {keys.node_of_processing_key(bytes_to_str(k))
              for k in client.scan_iter(match=keys.PROCESSING_KEY_PATTERN, count=500)}
    # A worker's own queue, priority suffixes aside (kombu's "\x06\x16" separator).
    nodes |= {keys.node_of_queue(bytes_to_str(k).split("\x06\x16", 1)[0])
              for k in client.scan_iter(match=keys.NODE_QUEUE_PATTERN, count=500)}
    if nodes:
        client.sadd(keys.LEDGER_NODES, *nodes)
    return nodes


def ledger_keys(node: str, own_queues: list[str]) -> list[str]:
    """Every key whose existence keeps ``node`` in the index; ``own_queues``: its
    own queue's list at each priority (kombu's ``Channel._q_for_pri``)."""
    return [keys.worker_key(node), keys.inflight_key(node), keys.processing_key(node), *own_queues]


def prune(client: redis.Redis, nodes_keys: dict[str, list[str]]) -> set[str]:
    """Drop from the index the nodes (of ``nodes_keys``: node → :func:`ledger_keys`)
    none of whose keys exists; those dropped."""
    if not nodes_keys:
        return set()
    per = {len(found) for found in nodes_keys.values()}
    if len(per) != 1:
        raise ValueError(f"every node needs as many keys to check; got {sorted(per)}")
    flat: list[Any] = [key for found in nodes_keys.values() for key in found]
    pruned = client.eval(PRUNE_SCRIPT, 1 + len(flat), keys.LEDGER_NODES, *flat, per.pop(), *nodes_keys)
    return {bytes_to_str(node) for node in pruned}
