"""An engine core that dies with its worker, and the stale engines a starting worker names.

vLLM runs an ``AsyncLLM``'s engine core in a child process (titled
``VLLM::EngineCore``; on a CPU worker and on a one-GPU worker the model runs
in it). vLLM stops it when the worker shuts down, but a worker that dies
without shutting down (SIGKILL, the OOM killer, SIGTERM while the engine
loads, before Celery's handlers exist) left it running, re-parented to PID 1,
holding its memory (seen: 1.9 GB RSS 73 s after a ``kill -9``; on a GPU, the
memory the restarted worker needs). vLLM's own watch of its parent covers only
the mp executor's model processes (their death pipe), not the engine core.

* :func:`tie_engine_core` (before the engine is created) makes each engine
  core this process starts ask the kernel, first thing in the child, for
  SIGKILL when its parent dies (``PR_SET_PDEATHSIG``); a parent already gone
  by then (the race the kernel cannot close) is seen by ``getppid`` and the
  child exits at once.
* :func:`stale_engines` lists what a worker that died before this fix, or
  on a host without it, left: engine cores re-parented to PID 1, and on CUDA
  the GPU's compute processes; :func:`report_stale_engines` names them in the
  starting worker's log.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
from typing import Any

import psutil

log = logging.getLogger(__name__)

# The worker's pid, for its engine cores to check their parent against.
PARENT_ENV = "RQ_ENGINE_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ENGINE_CORE_TITLE = "::EngineCore"  # vLLM's "<VLLM_PROCESS_NAME_PREFIX>::EngineCore[_DP<n>]"

# vLLM's EngineCoreProc.run_engine_core as it was before tie_engine_core
# replaced it (None in a spawned child, where the class is not patched).
_original_run: Any = None


def tie_engine_core() -> None:
    """Make the engine cores this process starts from now on die with it.

    vLLM starts them with ``multiprocessing`` (fork or spawn) running
    ``EngineCoreProc.run_engine_core``: that target is replaced with
    :func:`run_engine_core_tied`, a module-level function, so a spawned child
    finds it by name too. The kernel sends the signal when the *thread* that
    started the child ends: here the engine host's loop thread, which lives as
    long as the engine (it ends at ``EngineHost.shutdown``, after the engine)."""
    global _original_run
    if not sys.platform.startswith("linux"):
        log.warning("engine cores are not tied to this worker (no PR_SET_PDEATHSIG on %s): a worker "
                    "that dies may leave its engine core running", sys.platform)
        return
    from vllm.v1.engine.core import EngineCoreProc

    if _original_run is not None:
        return
    _original_run = EngineCoreProc.run_engine_core
    os.environ[PARENT_ENV] = str(os.getpid())
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core_tied)  # type: ignore[method-assign]


def run_engine_core_tied(*args: Any, **kwargs: Any) -> None:
    """vLLM's ``run_engine_core``, in a child that dies with its parent."""
    die_with_parent(int(os.environ.get(PARENT_ENV) or 0))
    run = _original_run
    if run is None:  # spawned: this process imported vLLM afresh, unpatched
        from vllm.v1.engine.core import EngineCoreProc

        run = EngineCoreProc.run_engine_core
    run(*args, **kwargs)


def die_with_parent(expected_parent: int) -> None:
    """Ask for SIGKILL when this process's parent dies; exit now if it already has
    (``expected_parent``: its pid; 0: not known, only the signal is armed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("engine core %d: prctl(PR_SET_PDEATHSIG) failed (errno %d); it may outlive its "
                    "worker", os.getpid(), ctypes.get_errno())
    if expected_parent and os.getppid() != expected_parent:
        # Re-parented before the signal was armed: the worker is gone already.
        os._exit(1)


def stale_engines(device: str) -> list[str]:
    """What an earlier worker left holding memory on this host: engine cores
    whose parent is PID 1 (their worker died), and on ``cuda`` every compute
    process on the GPUs (this worker's engine does not exist yet). One line each."""
    found = []
    for proc in psutil.process_iter(["pid", "ppid", "name", "cmdline", "memory_info"]):
        info = proc.info
        title = " ".join(arg for arg in info["cmdline"] or [] if arg) or info["name"] or ""
        if info["ppid"] == 1 and ENGINE_CORE_TITLE in title:
            rss = info["memory_info"].rss / 2**30 if info["memory_info"] else 0.0
            found.append(f"pid {info['pid']} ({title.strip()}, orphaned, {rss:.1f} GiB RSS)")
    if device == "cuda":
        found += [f"GPU compute process {line}" for line in gpu_compute_processes()]
    return found


def gpu_compute_processes() -> list[str]:
    """``pid, process name, used memory`` of each process using a GPU, as nvidia-smi says."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not list the GPU's compute processes (nvidia-smi): %s", exc)
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def report_stale_engines(device: str) -> list[str]:
    """Name, in this worker's log, the stale engines :func:`stale_engines` finds; returns them."""
    stale = stale_engines(device)
    if stale:
        log.warning("found %d engine process(es) left on this host before this worker's engine loads; "
                    "they hold memory it may need (stop them, e.g. kill -9 <pid>, if no live worker "
                    "owns them): %s", len(stale), "; ".join(stale))
    return stale
