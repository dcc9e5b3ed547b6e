"""A pipeline written now and read later (``tasks.pipelined``), against real Redis."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from rollout_queue.tasks.pipelined import SentPipeline


def _queued(client: redis.Redis, key: str) -> Any:
    pipe = client.pipeline(transaction=False)
    pipe.incr(f"{key}:count")
    pipe.get(f"{key}:name")
    pipe.eval("return {KEYS[1], ARGV[1]}", 1, f"{key}:name", "argument")
    pipe.expire(f"{key}:name", 60)
    return pipe


def test_a_pipeline_read_after_other_work_answers_as_execute_does(redis_client: Any) -> None:
    key = f"sent-{time.time()}"
    redis_client.set(f"{key}:name", "held")
    sent = SentPipeline(_queued(redis_client, key))
    time.sleep(0.05)  # the caller's own work, while the replies wait in the socket
    assert sent.answers() == [1, "held", [f"{key}:name", "argument"], True]
    assert _queued(redis_client, key).execute() == [2, "held", [f"{key}:name", "argument"], True]


def test_a_connection_cut_between_write_and_read_runs_the_pipeline_again(redis_client: Any, redis_url: str) -> None:
    key = f"cut-{time.time()}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.client_setname(key)
    sent = SentPipeline(_queued(client, key))
    time.sleep(0.05)
    killed = [c for c in redis_client.client_list() if c.get("name") == key]
    assert killed, "the pipeline's connection is the client's one pooled connection"
    redis_client.client_kill_filter(_id=killed[0]["id"])
    count, name, _, _ = sent.answers()
    # Redis may have run the commands before the cut: they ran again, on a new connection.
    assert count in (1, 2) and name is None and int(redis_client.get(f"{key}:count")) == count


def test_an_error_reply_is_raised_and_the_connection_serves_the_next_command(redis_client: Any) -> None:
    key = f"error-{time.time()}"
    redis_client.set(f"{key}:count", "not a number")
    sent = SentPipeline(_queued(redis_client, key))
    with pytest.raises(redis.ResponseError, match="not an integer"):
        sent.answers()
    # Every reply was read: the pooled connection answers the next command, not a stale reply.
    assert redis_client.get(f"{key}:count") == "not a number"
    assert redis_client.ping()


def test_replies_nobody_wants_close_their_connection(redis_url: str) -> None:
    key = f"dropped-{time.time()}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    sent = SentPipeline(_queued(client, key))
    sent.drop()
    assert client.get(f"{key}:name") is None  # not the INCR's reply left in a reused connection
    assert client.incr(f"{key}:count") == 2
