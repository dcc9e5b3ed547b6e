"""The handed-on check (workers/queue/handed_on.py) on the real Redis: a task's
check reads nothing while the heartbeat vouches that nothing of this node was
handed on, and reads again once it cannot."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import redis as redis_lib
from celery.exceptions import Ignore

from rollout_queue.tasks import keys
from rollout_queue.workers.queue.handed_on import HandedOn

NODE = "handed-on@tests"


class CountingRedis(redis_lib.Redis):
    """A Redis client that counts the commands it sends (pipelines included)."""

    commands = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        CountingRedis.commands += 1
        return super().execute_command(*args, **options)


@pytest.fixture
def client(redis_url: str) -> CountingRedis:
    client = CountingRedis.from_url(redis_url, decode_responses=True)
    client.delete(keys.handed_on(NODE), keys.worker_key(NODE))
    CountingRedis.commands = 0
    return client


def task(tag: str) -> Any:
    return SimpleNamespace(request=SimpleNamespace(id=f"task-{tag}", properties={"delivery_tag": tag}))


def test_a_task_check_reads_nothing_while_the_heartbeat_vouches_for_it(client: CountingRedis) -> None:
    client.set(keys.worker_key(NODE), "{}", px=10_000)  # the registry entry, alive
    handed_on = HandedOn(client, NODE, forget_on_ack=lambda tag: None)
    handed_on.notice()
    before = CountingRedis.commands
    handed_on.check(task("t1"), wait=False)
    handed_on.check(task("t1"), wait=True)
    assert CountingRedis.commands == before


def test_a_task_check_reads_the_set_without_a_live_registry_entry(client: CountingRedis) -> None:
    handed_on = HandedOn(client, NODE, forget_on_ack=lambda tag: None)
    handed_on.notice()  # no registry entry: the node may be declared dead any time
    before = CountingRedis.commands
    handed_on.check(task("t1"), wait=False)
    assert CountingRedis.commands > before


def test_a_task_handed_on_is_ignored_once_the_heartbeat_sees_the_set(client: CountingRedis) -> None:
    client.set(keys.worker_key(NODE), "{}", px=10_000)
    handed_on = HandedOn(client, NODE, forget_on_ack=lambda tag: None)
    handed_on.notice()
    client.sadd(keys.handed_on(NODE), "t2")  # the fleet declared the node dead meanwhile
    handed_on.notice()
    assert handed_on.seen == 1
    with pytest.raises(Ignore):
        handed_on.check(task("t2"), wait=True)
    assert not client.sismember(keys.handed_on(NODE), "t2")


def test_a_task_check_reads_the_set_before_the_first_heartbeat(client: CountingRedis) -> None:
    client.sadd(keys.handed_on(NODE), "t3")
    with pytest.raises(Ignore):
        HandedOn(client, NODE, forget_on_ack=lambda tag: None).check(task("t3"), wait=False)
