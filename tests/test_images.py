"""The Dockerfile and the compose file: valid, built the way images should be, and
(where a container engine runs) the CPU image answering the quickstart."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib import resources

import jsonschema
import pytest
import yaml

from tests.procs import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def stage(target: str) -> str:
    """The Dockerfile lines of one build stage."""
    match = re.search(rf"^FROM \S+ AS {target}$(.*?)(?=^FROM |\Z)", DOCKERFILE, re.MULTILINE | re.DOTALL)
    assert match, f"no stage {target}"
    return match.group(1)


def test_compose_file_validates_against_the_compose_specification() -> None:
    # The compose-spec JSON schema as check-jsonschema vendors it (no network).
    schema = json.loads(
        resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text())
    jsonschema.validate(COMPOSE, schema)
    with pytest.raises(jsonschema.ValidationError):  # the schema does check: a misspelt key fails
        jsonschema.validate({"services": {"worker": {"imagee": "x"}}}, schema)


@pytest.mark.parametrize("target", ["light", "gpu", "cpu"])
def test_each_image_installs_dependencies_before_the_sources_and_runs_unprivileged(target: str) -> None:
    lines = stage(target)
    deps = lines.index('pip install ')
    first_source = lines.index("COPY tasks")
    assert deps < first_source, "dependencies must be a layer of their own, before the sources"
    assert re.search(r"^USER rq$", lines, re.MULTILINE), f"{target} runs as root"
    assert "useradd --create-home --uid 1000 rq" in stage("base")


def test_images_install_from_the_lock_that_make_setup_and_ci_use() -> None:
    assert "COPY constraints ./constraints" in stage("base")
    for target in ("light", "gpu"):
        assert "pip install -c constraints/light.txt" in stage(target), target
    cpu = stage("cpu")
    assert "pip install --no-deps" in cpu and "-r constraints/quickstart.txt" in cpu and "scripts/lock.py check" in cpu
    assert "uninstall" not in cpu  # the lock never installs torchvision & co.


def test_engine_images_carry_what_the_engine_needs_at_start() -> None:
    assert re.search(r"apt-get install [^\n]*\bgcc\b", stage("gpu")), "Triton needs a C compiler"
    cpu = stage("cpu")
    assert re.search(r"apt-get install [^\n]*\blibnuma1\b", cpu) and re.search(r"apt-get install [^\n]*\bg\+\+", cpu)
    assert "download.pytorch.org/whl/cpu" in cpu


def test_compose_gpu_worker_runs_one_engine_over_the_gpus_it_reserves() -> None:
    worker = COMPOSE["services"]["worker"]
    command = worker["command"]
    tp = command[command.index("--tensor-parallel-size") + 1]
    count = worker["deploy"]["resources"]["reservations"]["devices"][0]["count"]
    assert tp == count == "${GPU_COUNT:-1}"


def test_compose_healthchecks_name_the_worker_by_hostname() -> None:
    for name in ("worker", "worker-cpu"):
        test = COMPOSE["services"][name]["healthcheck"]["test"]
        assert test == ["CMD-SHELL", "rollout-queue status --node worker@$$HOSTNAME"], name


def _container_engine() -> tuple[str | None, str]:
    """A container engine that answers, or why there is none."""
    for engine in ("podman", "docker"):
        if shutil.which(engine) is None:
            continue
        probe = subprocess.run([engine, "info"], capture_output=True, text=True, timeout=60, check=False)
        if probe.returncode == 0:
            return engine, ""
        return None, f"{engine} info failed: {(probe.stderr or probe.stdout).strip().splitlines()[-1]}"
    return None, "neither podman nor docker is installed"


@pytest.mark.container
def test_the_cpu_image_builds_and_runs_the_quickstart() -> None:
    engine, why = _container_engine()
    if engine is None:
        pytest.skip(f"no container engine can run here: {why}")
    subprocess.run([engine, "build", "--target", "cpu", "-t", "rollout-queue:cpu-test", str(ROOT)],
                   check=True, timeout=3600)
    run = subprocess.run([engine, "run", "--rm", "--shm-size", "2g", "rollout-queue:cpu-test",
                          "rollout-queue", "quickstart"], capture_output=True, text=True, timeout=1800,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout
