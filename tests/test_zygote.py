"""The zygote (``cli.zygote``) seen from another process, over its socket.

The suite forks its workers over the zygote's stdin (``tests/conftest.py``);
the benches it smoke-runs connect to its socket (``RQ_LOCAL_ZYGOTE``,
``tests/test_bench_smoke.py``) and see their children's exit codes there. A
bench that dies leaves nobody to stop its workers: the zygote kills what a
closed connection started and left running.
"""

from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from rollout_queue.cli.zygote import Zygote, ZygoteClient
from rollout_queue.tasks.settings import redis_url_env
from tests.procs import ROOT, free_port, python


@pytest.fixture
def connection(zygote: Callable[[], Zygote | None]) -> ZygoteClient:
    forks = zygote()
    if forks is None:
        pytest.skip("RQ_TEST_ZYGOTE=0: the suite runs no zygote")
    return ZygoteClient.connect(forks.address)


def test_a_child_forked_over_the_socket_reports_its_exit_code_there(
    connection: ZygoteClient, redis_url: str, tmp_path: Path
) -> None:
    # `status --node` exits 1 when the worker is not live: a code of the child's own.
    argv = [python(), "-m", "rollout_queue.cli", "status", "--node", "nobody@nowhere", "--redis-url", redis_url]
    try:
        child = connection.fork(argv, dict(os.environ), ROOT, tmp_path / "status.log")
        assert child.wait(60) == 1, (tmp_path / "status.log").read_text()
        assert "nobody@nowhere" in (tmp_path / "status.log").read_text()
    finally:
        connection.close()


def test_a_script_forked_from_the_zygote_runs_as_the_interpreter_would_run_it(
    connection: ZygoteClient, tmp_path: Path
) -> None:
    # As `python SCRIPT.py ARGS` (the bench smoke's runs): __main__, its argv, its
    # folder first on sys.path (a bench imports benchlib beside it), its exit code.
    (tmp_path / "helper.py").write_text("WORD = 'beside'\n")
    (tmp_path / "script.py").write_text(textwrap.dedent("""
        import sys
        import helper
        assert __name__ == "__main__"
        print("ran", sys.argv[1:], helper.WORD, "torch" in sys.modules)
        sys.exit(3)
    """))
    log = tmp_path / "script.log"
    try:
        child = connection.fork([python(), str(tmp_path / "script.py"), "a", "b"], dict(os.environ), ROOT, log)
        assert child.wait(60) == 3, log.read_text()
        # Run from the zygote's memory: torch is imported already, and nothing imported it here.
        assert "ran ['a', 'b'] beside True" in log.read_text()
        refused = connection.fork([python(), "-c", "print(1)"], dict(os.environ), ROOT, tmp_path / "refused.log")
        assert refused.wait(60) == 2
        assert "not [" in (tmp_path / "refused.log").read_text()
    finally:
        connection.close()


def test_a_closed_connection_takes_the_children_it_left_running_with_it(
    connection: ZygoteClient, redis_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "gateway.log"
    argv = [python(), "-m", "rollout_queue.cli", "api", "--host", "127.0.0.1", "--port", str(free_port())]
    try:
        child = connection.fork(argv, {**os.environ, **redis_url_env(redis_url)}, ROOT, log)
        deadline = time.monotonic() + 90
        while "Application startup complete" not in (log.read_text() if log.exists() else ""):
            assert child.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        connection.close()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(child.pid):  # killed, then reaped by the zygote
        assert time.monotonic() < deadline, f"pid {child.pid} still running after its connection closed"
        time.sleep(0.1)


def test_a_fork_given_up_on_is_killed_when_it_comes_and_the_next_fork_gets_its_own_child(
    connection: ZygoteClient, tmp_path: Path
) -> None:
    # Seen on a loaded host: a fork that timed out came up later and served on,
    # stopped by nobody (and the next fork would have taken its pid for its own).
    (tmp_path / "late.py").write_text(textwrap.dedent(f"""
        import os, time
        open({str(tmp_path / "late.pid")!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    """))
    (tmp_path / "next.py").write_text("import sys; print('next ran'); sys.exit(3)\n")
    try:
        with pytest.raises(RuntimeError, match="did not fork within 0s"):
            connection.fork([python(), str(tmp_path / "late.py")], dict(os.environ), ROOT, tmp_path / "late.log",
                            timeout=0)
        child = connection.fork([python(), str(tmp_path / "next.py")], dict(os.environ), ROOT, tmp_path / "next.log")
        assert child.wait(60) == 3, (tmp_path / "next.log").read_text()
        assert "next ran" in (tmp_path / "next.log").read_text()
    finally:
        connection.close()
    # Killed as it came: before or after it wrote its pid.
    pid_file = tmp_path / "late.pid"
    if pid_file.exists():
        late = int(pid_file.read_text())
        deadline = time.monotonic() + 30
        while psutil.pid_exists(late) and psutil.Process(late).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"the given-up child {late} still runs"
            time.sleep(0.1)
