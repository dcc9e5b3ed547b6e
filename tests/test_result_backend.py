"""The worker's result backend (workers/queue/result_backend.py) on the real Redis:
no other state replaces a task's SUCCESS, whatever lands between a write's read
and the write, and whatever retries that write."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib
from celery import Celery, states

from rollout_queue.workers.queue.result_backend import ResultBackend, backend_url


@pytest.fixture
def backend(redis_url: str) -> Iterator[ResultBackend]:
    # Not the process's current app: later tests' results are read through theirs.
    app = Celery("result-backend-tests", broker=redis_url, backend=backend_url(redis_url), set_as_current=False)
    app.conf.result_compression = "gzip"  # as tasks.app configures every app
    found = app.backend
    assert isinstance(found, ResultBackend)
    yield found
    app.close()


@pytest.fixture
def other(backend: ResultBackend) -> Iterator[Any]:
    """The backend of the worker a task was handed to (Celery's own)."""
    app = Celery("other-worker", backend=backend.url, set_as_current=False)
    yield app.backend
    app.close()


def stored_state(backend: ResultBackend, task_id: str) -> str:
    return str(backend.get_task_meta(task_id, cache=False)["status"])


class Interleaved:
    """The backend's client, whose first write sees ``between`` run just before it
    reaches Redis (another worker's write landing after this one's read) and then,
    when ``fails`` is given, fails with that error (its connection lost as it wrote)."""

    def __init__(self, client: redis_lib.Redis, between: Any, fails: Exception | None = None) -> None:
        self.client, self.between, self.fails = client, between, fails
        self.writes = 0

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self.client.pipeline(*args, **kwargs)
        execute = pipe.execute

        def interleaved_execute(*args: Any, **kwargs: Any) -> Any:
            self.writes += 1
            if self.writes == 1:
                self.between()
                if self.fails is not None:
                    pipe.reset()
                    raise self.fails
            return execute(*args, **kwargs)

        pipe.execute = interleaved_execute
        return pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_no_state_replaces_a_stored_success(backend: ResultBackend) -> None:
    task_id = uuid.uuid4().hex
    backend.store_result(task_id, {"outputs": [1, 2]}, states.SUCCESS)
    for state, result in ((states.STARTED, {"pid": 1}), (states.RETRY, ValueError("again")),
                          (states.FAILURE, ValueError("late"))):
        backend.store_result(task_id, result, state)
        assert stored_state(backend, task_id) == states.SUCCESS, state
    assert backend.get_task_meta(task_id, cache=False)["result"] == {"outputs": [1, 2]}


def test_states_before_a_success_replace_each_other_as_in_celery(backend: ResultBackend) -> None:
    task_id = uuid.uuid4().hex
    backend.store_result(task_id, {"pid": 1}, states.STARTED)
    assert stored_state(backend, task_id) == states.STARTED
    backend.store_result(task_id, ValueError("engine lost"), states.FAILURE)
    assert stored_state(backend, task_id) == states.FAILURE
    backend.store_result(task_id, {"outputs": []}, states.SUCCESS)
    assert stored_state(backend, task_id) == states.SUCCESS


def test_a_success_stored_between_a_started_writes_read_and_its_write_stays(
    backend: ResultBackend, other: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    task_id = uuid.uuid4().hex
    backend.store_result(task_id, {"pid": 1}, states.STARTED)  # read as STARTED below

    interleaved = Interleaved(backend.client, lambda: other.store_result(task_id, {"outputs": [7]}, states.SUCCESS))
    monkeypatch.setattr(backend, "client", interleaved)
    backend.store_result(task_id, {"pid": 2}, states.STARTED)
    assert interleaved.writes == 1  # its EXEC failed on the changed key; read again, not written
    assert stored_state(backend, task_id) == states.SUCCESS
    assert backend.get_task_meta(task_id, cache=False)["result"] == {"outputs": [7]}


def test_a_write_retried_after_its_connection_failed_reads_the_state_again(
    backend: ResultBackend, other: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cut-off worker's case: its STARTED write failed with the link; meanwhile the
    task's new holder stored SUCCESS; the write's retry (the backend's ``ensure``)
    must not put STARTED back over it (Celery's own retry resends the bare SET)."""
    task_id = uuid.uuid4().hex
    interleaved = Interleaved(backend.client, lambda: other.store_result(task_id, {"outputs": [9]}, states.SUCCESS),
                              fails=redis_lib.ConnectionError("link down"))
    monkeypatch.setattr(backend, "client", interleaved)
    monkeypatch.setattr(backend, "retry_policy", {**backend.retry_policy, "interval_start": 0, "interval_step": 0})
    backend.store_result(task_id, {"pid": 3}, states.STARTED)
    assert interleaved.writes == 1  # the retry read SUCCESS and wrote nothing
    assert stored_state(backend, task_id) == states.SUCCESS
