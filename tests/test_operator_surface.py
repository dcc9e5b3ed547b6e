"""What an operator meets first: the refusal of an evicting Redis, every setting in
``--help``, one-line errors for a missing extra or an unreachable Redis, JSON logs,
secrets from files. No engine starts here: each CLI stops before one would load."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
from pydantic_settings import BaseSettings

from rollout_queue.api.settings import ApiSettings
from rollout_queue.cli import command
from rollout_queue.cli.localstack import free_port
from rollout_queue.tasks.errors import BrokerUnavailable, RedisMayEvict, SettingsFileError
from rollout_queue.tasks.registry import check_eviction_policy, preflight
from rollout_queue.tasks.settings import ClientSettings, redis_url_env
from rollout_queue.workers.settings import WorkerSettings
from tests.private_redis import RedisServer, client_app
from tests.procs import ROOT, python

EVICTING = ["--maxmemory-policy", "allkeys-lru"]


@pytest.fixture(scope="module")
def evicting_redis() -> Iterator[RedisServer]:
    server = RedisServer("evicting", options=EVICTING).start()
    yield server
    server.stop()


def run_cli(*argv: str, env: dict[str, str] | None = None, blocked: tuple[str, ...] = (),
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``rollout-queue argv`` in a fresh process; ``blocked`` modules import as if not installed."""
    code = (f"import sys; sys.modules.update(dict.fromkeys({list(blocked)!r})); "
            "from cli.command import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([python(), "-c", code, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, check=False)


def one_line(run: subprocess.CompletedProcess[str]) -> str:
    err = run.stderr.strip()
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ----------------------------------------------------------- evicting Redis


def test_the_worker_cli_refuses_an_evicting_redis_in_one_line_naming_the_policy_and_the_override(
    evicting_redis: RedisServer,
) -> None:
    run = run_cli("worker", "--model", "no-model-loaded", "--device", "cpu", "--insecure-control",
                  env=evicting_redis.settings_env())
    line = one_line(run)
    assert line.startswith("rollout-queue worker: Redis's maxmemory-policy is allkeys-lru")
    assert "RQ_ALLOW_EVICTING_REDIS=1" in line and "--allow-evicting-redis" in line


def test_the_gateway_cli_refuses_an_evicting_redis_in_one_line(evicting_redis: RedisServer) -> None:
    line = one_line(run_cli("api", "--port", str(free_port()), env=evicting_redis.settings_env()))
    assert line.startswith("rollout-queue api: Redis's maxmemory-policy is allkeys-lru")


def test_a_producer_refuses_an_evicting_redis_and_enqueues_nothing_unless_allowed(
    evicting_redis: RedisServer,
) -> None:
    client = evicting_redis.client()
    client.delete("nobody")
    _, task = client_app(evicting_redis.url)
    with pytest.raises(RedisMayEvict, match="allkeys-lru.*RQ_ALLOW_EVICTING_REDIS=1"):
        task.apply_async((["x"], {"max_tokens": 1}), queue="nobody")
    assert client.llen("nobody") == 0
    _, allowed = client_app(evicting_redis.url, allow_evicting_redis=True)
    allowed.apply_async((["x"], {"max_tokens": 1}), queue="nobody")
    assert client.llen("nobody") == 1


def test_a_producers_first_task_with_redis_down_still_gets_broker_unavailable_after_the_retries() -> None:
    # The eviction check comes first and connects first: retried as the publish would be.
    _, task = client_app(f"redis://127.0.0.1:{free_port()}/0", broker_connect_timeout=3)
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="did not answer for about 3 s"):
        task.apply_async((["x"], {"max_tokens": 1}), queue="nobody")
    assert 1.0 < time.monotonic() - started < 3 + 10  # retried (not at once), within the deadline's margin


def test_the_start_check_goes_on_with_the_override_and_says_why(evicting_redis: RedisServer) -> None:
    from pydantic import SecretStr

    settings = ClientSettings(redis_url=SecretStr(evicting_redis.url))
    with pytest.raises(RedisMayEvict):
        preflight(settings)
    note = preflight(settings.model_copy(update={"allow_evicting_redis": True}))
    assert note is not None and "allkeys-lru" in note and "RQ_ALLOW_EVICTING_REDIS" in note


def test_a_redis_that_hides_its_policy_is_not_blocked_and_the_note_says_so() -> None:
    # A managed Redis may disable INFO and CONFIG: go on, and say the policy is unknown.
    server = RedisServer("no-config", options=["--rename-command", "CONFIG", "",
                                              "--rename-command", "INFO", ""]).start()
    try:
        note = check_eviction_policy(server.client(), allow=False)
    finally:
        server.stop()
    assert note is not None and note.startswith("could not read Redis's maxmemory-policy")


def test_a_noeviction_redis_passes_without_a_note(redis_url: str) -> None:
    assert check_eviction_policy(redis_lib.Redis.from_url(redis_url), allow=False) is None


# ----------------------------------------------------------------- --help


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in command.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize(("name", "model"), [("worker", WorkerSettings), ("api", ApiSettings),
                                             ("api", ClientSettings)])
def test_every_setting_appears_in_the_commands_help_with_its_variable(
    name: str, model: type[BaseSettings],
) -> None:
    text = " ".join(_subparser(name).format_help().split())
    prefix = str(model.model_config.get("env_prefix"))
    for field in model.model_fields:
        assert f"{prefix}{field.upper()}" in text, f"{name} --help does not list {field}"


def test_the_gateways_help_shows_each_flags_default_and_the_tokens_file_variable() -> None:
    text = " ".join(_subparser("api").format_help().split())
    assert "(default: 5.0; env RQ_API_BATCH_WINDOW_MS)" in text
    assert "--model-name" in text and "--allow-evicting-redis" in text
    assert "RQ_API_TOKEN or RQ_API_TOKEN_FILE (default: none)" in text
    assert re.search(r"--token\b", text) is None  # a flag would show the token in the process list


def test_the_top_level_help_is_for_operators_and_points_at_each_commands_help() -> None:
    text = " ".join(command.parser().format_help().split())
    assert "`rollout-queue COMMAND --help` lists every setting" in text and "run(settings)" not in text


@pytest.mark.parametrize("name", ["status", "dead-letters", "quickstart"])
def test_the_redis_commands_list_the_connection_variables(name: str) -> None:
    text = _subparser(name).format_help()
    assert "RQ_REDIS_URL" in text and "RQ_REDIS_TLS_CA_FILE" in text


# --------------------------------------------------------- one-line errors


def test_a_worker_without_vllm_is_one_line_naming_the_extra() -> None:
    line = one_line(run_cli("worker", "--model", "m", blocked=("vllm",)))
    assert line == ("rollout-queue worker: vllm is not installed: `rollout-queue worker` needs the cpu or "
                    "gpu extra: pip install 'rollout-queue[cpu]' or pip install 'rollout-queue[gpu]'")


def test_a_gateway_without_fastapi_is_one_line_naming_the_extra() -> None:
    line = one_line(run_cli("api", blocked=("fastapi",)))
    assert "fastapi is not installed" in line and "pip install 'rollout-queue[api]'" in line


@pytest.mark.parametrize("argv", [["worker", "--model", "m", "--insecure-control"], ["api"],
                                  ["dead-letters"], ["status"]])
def test_an_unreachable_redis_is_one_line_with_exit_2(argv: list[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    run = run_cli(*argv, env={**redis_url_env(url), "RQ_BROKER_CONNECT_TIMEOUT": "1"})
    if argv == ["status"]:  # rich's console prints it on stdout
        assert run.returncode == 2 and "Traceback" not in run.stderr + run.stdout
        return
    line = one_line(run)
    assert line.startswith(f"rollout-queue {argv[0]}: ") and "127.0.0.1" in line, line


# -------------------------------------------------------- secrets from files


def test_secrets_are_read_from_the_files_their_file_variables_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    (tmp_path / "secret").write_text("from-a-file\n")
    (tmp_path / "token").write_text("token-from-a-file")
    monkeypatch.setenv("RQ_WEIGHT_SYNC_SECRET", "from-the-environment")
    monkeypatch.setenv("RQ_WEIGHT_SYNC_SECRET_FILE", str(tmp_path / "secret"))
    monkeypatch.setenv("RQ_API_TOKEN_FILE", str(tmp_path / "token"))
    assert WorkerSettings().control_secret() == "from-a-file"  # the file wins; its newline dropped
    assert ApiSettings().bearer_token() == "token-from-a-file"


def test_an_empty_secret_file_leaves_the_variable_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    # compose mounts /dev/null when no file is given: the plain variable must still count.
    monkeypatch.setenv("RQ_API_TOKEN", "from-the-environment")
    monkeypatch.setenv("RQ_API_TOKEN_FILE", os.devnull)
    assert ApiSettings().bearer_token() == "from-the-environment"


def test_compose_runs_valkey_without_eviction_and_mounts_the_secrets_as_files() -> None:
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    redis = compose["services"]["redis"]
    assert redis["image"].startswith("valkey/valkey:8.1")
    assert redis["command"][redis["command"].index("--maxmemory-policy") + 1] == "noeviction"
    assert "--appendonly" in redis["command"]
    for service, secret, variable in [("worker", "weight_sync_secret", "RQ_WEIGHT_SYNC_SECRET_FILE"),
                                      ("worker-cpu", "weight_sync_secret", "RQ_WEIGHT_SYNC_SECRET_FILE"),
                                      ("api", "api_token", "RQ_API_TOKEN_FILE")]:
        spec = compose["services"][service]
        assert secret in spec["secrets"] and spec["environment"][variable] == f"/run/secrets/{secret}"
        assert secret in compose["secrets"]


def test_an_unreadable_secret_file_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RQ_WEIGHT_SYNC_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(SettingsFileError, match="RQ_WEIGHT_SYNC_SECRET_FILE=.*missing: cannot read it"):
        ClientSettings()
    line = one_line(run_cli("worker", "--model", "m",
                            env={"RQ_WEIGHT_SYNC_SECRET_FILE": str(tmp_path / "missing")}))
    assert "RQ_WEIGHT_SYNC_SECRET_FILE=" in line


# ------------------------------------------------------------- JSON logs


def test_the_gateway_logs_one_json_object_per_line_reads_its_token_from_a_file_and_starts_when_allowed(
    evicting_redis: RedisServer, tmp_path: Path,
) -> None:
    # Also the override: on an evicting Redis, --allow-evicting-redis starts it with a warning.
    (tmp_path / "token").write_text("t0ken\n")
    log = tmp_path / "rollout_queue.api.log"
    env = {**os.environ, **evicting_redis.settings_env(), "RQ_API_TOKEN_FILE": str(tmp_path / "token")}
    with log.open("w") as sink:
        proc = subprocess.Popen([python(), "-m", "rollout_queue.cli", "api", "--host", "127.0.0.1", "--port",
                                 str(free_port()), "--log-format", "json", "--allow-evicting-redis"],
                                cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "Application startup complete" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert all(set(r) >= {"time", "level", "logger", "message", "node"} for r in records)
    assert any(r["logger"] == "uvicorn.error" for r in records)
    started = next(r for r in records if r["message"].startswith("gateway on "))
    assert "auth on (bearer token)" in started["message"] and "t0ken" not in log.read_text()
    assert any(r["level"] == "WARNING" and "maxmemory-policy is allkeys-lru" in r["message"] for r in records)
