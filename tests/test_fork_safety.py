"""No torch CPU work in a process before vLLM forks its EngineCore from it.

On CUDA, vLLM starts its EngineCore with ``fork`` (unless CUDA is already
initialised there). A process whose OpenMP pool has started (any torch CPU op
big enough to run in parallel) cannot be forked safely: the child inherits
libgomp's idea of a thread team whose threads it does not have, and deadlocks
at its first parallel op (seen on an H200: the benches' offline engine hung
in ``InputBatch.__init__ -> torch.zeros -> libgomp`` under ``ForkProcess``).
The libgomp pool is per thread: the fork is unsafe when the *forking* thread
ran parallel torch CPU ops before (the benches: ``LLM(...)`` on the main
thread after building the model there). The worker forks from its
engine-loop thread, so its main thread's pool would not hang it today; the
probe holds it to more than that.

A CPU worker forks its engine core too (``workers.engine.host.fork_cpu_engine_core``:
vLLM's CPU platform would spawn it), so the CPU suite's workers would show
the hang; these tests also probe for it where it would happen, on either
device, in a fresh interpreter that runs the real code up to the point where
vLLM forks:
- fork from that very thread, as vLLM does, and run a parallel torch CPU op
  in the child: it finishes in well under a second, or hangs for good if the
  thread had started an OpenMP pool;
- list the OS threads that Python did not start and that were not there
  right after the imports (an OpenMP pool of any thread shows up there;
  numpy's OpenBLAS server thread, fork-safe, is there from the imports on).

Each probe runs in a fresh interpreter (``python -m tests.test_fork_safety``),
since pytest's own process has long since imported and run torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.procs import ROOT, python

# Each probe imports vLLM and starts an engine process.
pytestmark = pytest.mark.slow

PROBE_TIMEOUT_S = 180
FORKED_OP_TIMEOUT_S = 8.0  # the op takes ~0.1 s on 2 cores (80x, for a loaded machine); a libgomp deadlock never ends


def forked_torch_op() -> str:
    """Fork as vLLM does, run a parallel torch CPU op in the child: 'finished' or 'hung'."""
    import torch

    pid = os.fork()
    if pid == 0:
        torch.ones(1 << 24).exp_()  # large enough for at::parallel_for to use every OpenMP thread
        os._exit(0)
    deadline = time.monotonic() + FORKED_OP_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "finished" if os.waitstatus_to_exitcode(status) == 0 else f"failed ({status})"
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def native_threads() -> set[int]:
    """This process's OS threads that Python's ``threading`` did not start."""
    python_tids = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python_tids


def probe_worker(report: Path, device: str, model: str, torch_work_first: bool, redis_url: str) -> int:
    """Run ``rollout-queue worker`` until it would start the engine; fork-test the process there.

    The engine's start (``AsyncLLM.from_vllm_config``) is replaced by a probe
    that writes the report and raises, so the worker exits (code 3) without
    loading anything; everything before that point is the real worker path,
    the engine's config built from ``model`` included, but on ``cuda``: this
    machine has no GPU to build a CUDA config for, so a stand-in says the
    device, and the model is never read.
    """
    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from rollout_queue.cli.command import main

    baseline = native_threads()

    def at_engine_start(cls: type, *args: object, **kwargs: object) -> None:
        if torch_work_first:  # on the thread that forks
            torch.ones(1 << 24).exp_()
        report.write_text(json.dumps({
            "thread": threading.current_thread().name,
            "forked_torch_op": forked_torch_op(),
            "new_native_threads": sorted(native_threads() - baseline),
        }))
        raise RuntimeError("fork-safety probe: stopped where the engine would start")

    AsyncLLM.from_vllm_config = classmethod(at_engine_start)  # type: ignore[method-assign, assignment]
    if device == "cuda":
        def cuda_config(args: object, *_: object) -> SimpleNamespace:
            return SimpleNamespace(device_config=SimpleNamespace(device_type="cuda"),
                                   parallel_config=SimpleNamespace(distributed_executor_backend="uni"))

        AsyncEngineArgs.create_engine_config = cuda_config  # type: ignore[method-assign, assignment]
    if torch_work_first:  # the hazard, on purpose: proves each check sees it
        torch.ones(1 << 24).exp_()

    # A Redis that answers: the worker checks it before it loads its engine.
    return main(["worker", "--model", model, "--device", device, "--insecure-control",
                 "--redis-url", redis_url, "--name", f"fork-probe-{device}-{os.getpid()}@tests"])


def probe_bench_model_build(report: Path, models_dir: Path) -> int:
    """Build a tiny model the way the benchmarks do; fork-test the process afterwards."""
    import torch  # noqa: F401  (its imports' threads belong to the baseline)

    sys.path.insert(0, str(ROOT / "bench"))
    import benchlib

    baseline = native_threads()
    path = benchlib.build_model(models_dir, "llama", seed=1)
    report.write_text(json.dumps({
        "forked_torch_op": forked_torch_op(),  # from the main thread, where the benches build LLM(...)
        "new_native_threads": sorted(native_threads() - baseline),
        "built": (path / "model.safetensors").exists(),
    }))
    return 0


def run_probe(tmp_path: Path, *argv: str) -> dict[str, object]:
    report = tmp_path / "report.json"
    done = subprocess.run(
        [python(), "-m", "tests.test_fork_safety", str(report), *argv],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
    )
    assert report.exists(), f"the probe wrote no report (exit {done.returncode}):\n{done.stderr[-3000:]}"
    result: dict[str, object] = json.loads(report.read_text())
    result["exit_code"] = done.returncode
    return result


# The probes, each a fresh interpreter that mostly imports (and the hazard's
# waits out its hung child): all four run at once from one module fixture,
# each test waits for its own; one after the other they took ~100-170 s.
PROBES: dict[str, list[str]] = {
    "worker-cuda": ["worker", "cuda", "clean"],
    "worker-cpu": ["worker", "cpu", "clean"],
    "worker-torch-first": ["worker", "cuda", "torch-work-first"],
    "bench-build": ["bench-build"],
}


@pytest.fixture(scope="module")
def probes(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, model_a: Path
) -> Iterator[dict[str, Future[dict[str, object]]]]:
    def argv(name: str, folder: Path) -> list[str]:
        what, *rest = PROBES[name]
        if what == "bench-build":
            return [what, str(folder / "models")]
        device, mode = rest
        return [what, device, str(model_a if device == "cpu" else folder / "no-model-needed"), mode, redis_url]

    with ThreadPoolExecutor(len(PROBES), thread_name_prefix="fork-probe") as pool:
        runs = {}
        for name in PROBES:
            folder = tmp_path_factory.mktemp(name)
            runs[name] = pool.submit(run_probe, folder, *argv(name, folder))
        yield runs


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_fork_of_the_worker_where_its_engine_starts_can_run_torch_cpu_ops(
    probes: dict[str, Future[dict[str, object]]], device: str
) -> None:
    # vLLM forks on cuda, the worker on cpu; the probe stops before any device is touched.
    seen = probes[f"worker-{device}"].result()
    assert seen["thread"] == "engine-loop", seen  # where EngineHost starts vLLM: the thread that forks
    assert seen["forked_torch_op"] == "finished", (
        f"a fork of the {device} worker, taken where vLLM forks its EngineCore, {seen['forked_torch_op']} "
        "in a torch CPU op: the engine-loop thread ran torch on the CPU before the engine started"
    )
    assert seen["new_native_threads"] == [], (
        f"the {device} worker started native threads (an OpenMP pool? torch CPU work) before its engine: "
        f"{seen['new_native_threads']}; keep torch CPU work out of the worker until vLLM has forked"
    )
    assert seen["exit_code"] == 3  # the worker reported the engine start failing, and exited


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: torch starts no OpenMP pool to inherit")
def test_the_probe_catches_torch_cpu_work_done_in_the_worker_before_its_engine(
    probes: dict[str, Future[dict[str, object]]],
) -> None:
    seen = probes["worker-torch-first"].result()
    assert seen["forked_torch_op"] == "hung", seen
    assert seen["new_native_threads"], seen


def test_a_fork_of_a_benchmark_that_built_its_model_can_run_torch_cpu_ops(
    probes: dict[str, Future[dict[str, object]]],
) -> None:
    seen = probes["bench-build"].result()
    assert seen["built"] is True
    assert seen["forked_torch_op"] == "finished", seen
    assert seen["new_native_threads"] == [], seen


if __name__ == "__main__":
    out, what, *rest = sys.argv[1:]
    if what == "worker":
        device, model, mode, url = rest
        sys.exit(probe_worker(Path(out), device, model, torch_work_first=mode == "torch-work-first", redis_url=url))
    sys.exit(probe_bench_model_build(Path(out), Path(rest[0])))
