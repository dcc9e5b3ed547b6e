"""No torch CPU work in a process before vLLM forks its EngineCore from it.

On CUDA, vLLM starts its EngineCore with ``fork`` (unless CUDA is already
initialised there). A process whose OpenMP pool has started (any torch CPU op
big enough to run in parallel) cannot be forked safely: the child inherits
libgomp's idea of a thread team whose threads it does not have, and deadlocks
at its first parallel op (seen on an H200: the benches' offline engine hung
in ``InputBatch.__init__ -> torch.zeros -> libgomp`` under ``ForkProcess``).
On CPU, vLLM spawns, so the CPU suite never shows the hang; these tests look
for its cause instead: threads that Python did not start (OpenMP, MKL, rayon
pools) in the process at the moment the engine would start.

Each probe runs in a fresh interpreter (``python -m tests.test_fork_safety``),
since pytest's own process has long since imported and run torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.procs import ROOT, python

PROBE_TIMEOUT_S = 180


def native_threads() -> list[str]:
    """This process's OS threads that Python's ``threading`` did not start."""
    python_tids = {t.native_id for t in threading.enumerate()}
    found = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        if int(tid) not in python_tids:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            found.append(f"{tid} ({comm})")
    return found


def probe_worker(report: Path, device: str, model: str, torch_work_first: bool) -> int:
    """Run ``rollout-queue worker`` until it would start the engine; record the threads then.

    The engine's start (``AsyncLLM.from_engine_args``) is replaced by a probe
    that writes the report and raises, so the worker exits (code 3) without
    loading anything; everything before that point is the real worker path.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    def at_engine_start(cls: type, *args: object, **kwargs: object) -> None:
        report.write_text(json.dumps({
            "native_threads": native_threads(),
            "multiproc_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork (vLLM's default)"),
        }))
        raise RuntimeError("fork-safety probe: stopped where the engine would start")

    AsyncLLM.from_engine_args = classmethod(at_engine_start)  # type: ignore[method-assign, assignment]
    if torch_work_first:  # the hazard, on purpose: proves the probe sees it
        import torch

        torch.ones(1 << 24).exp_().sum()
    from workers.cli import main

    return main(["worker", "--model", model, "--device", device, "--insecure-control",
                 "--redis-url", "redis://127.0.0.1:1/0", "--name", "fork-probe@tests"])


def probe_bench_model_build(report: Path, models_dir: Path) -> int:
    """Build a tiny model the way the benchmarks do; record the threads afterwards."""
    sys.path.insert(0, str(ROOT / "bench"))
    import benchlib

    path = benchlib.build_model(models_dir, "llama", seed=1)
    report.write_text(json.dumps({"native_threads": native_threads(),
                                  "built": (path / "model.safetensors").exists()}))
    return 0


def run_probe(tmp_path: Path, *argv: str) -> dict[str, object]:
    report = tmp_path / "report.json"
    done = subprocess.run(
        [python(), "-m", "tests.test_fork_safety", str(report), *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
    )
    assert report.exists(), f"the probe wrote no report (exit {done.returncode}):\n{done.stderr[-3000:]}"
    result: dict[str, object] = json.loads(report.read_text())
    result["exit_code"] = done.returncode
    return result


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_worker_runs_no_native_thread_pool_before_its_engine_starts(tmp_path: Path, device: str) -> None:
    # cuda is the path that forks; the probe stops before any device is touched.
    seen = run_probe(tmp_path, "worker", device, str(tmp_path / "no-model-needed"), "clean")
    assert seen["native_threads"] == [], (
        f"threads Python did not start (OpenMP? torch CPU work before the engine) in the {device} "
        f"worker just before vLLM would fork its EngineCore: {seen['native_threads']}"
    )
    assert seen["exit_code"] == 3  # the worker reported the engine start failing, and exited


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: torch starts no OpenMP threads to see")
def test_the_probe_sees_the_openmp_pool_of_torch_cpu_work_done_before_the_engine(tmp_path: Path) -> None:
    seen = run_probe(tmp_path, "worker", "cuda", str(tmp_path / "no-model-needed"), "torch-work-first")
    assert seen["native_threads"], "torch CPU work started no thread the probe could see"


def test_the_benchmarks_build_models_without_running_torch_in_their_own_process(tmp_path: Path) -> None:
    seen = run_probe(tmp_path, "bench-build", str(tmp_path / "models"))
    assert seen["built"] is True
    assert seen["native_threads"] == [], seen


if __name__ == "__main__":
    out, what, *rest = sys.argv[1:]
    if what == "worker":
        device, model, mode = rest
        sys.exit(probe_worker(Path(out), device, model, torch_work_first=mode == "torch-work-first"))
    sys.exit(probe_bench_model_build(Path(out), Path(rest[0])))
