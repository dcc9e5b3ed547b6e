"""Settings and the CLI: prefixed variables, one-line errors, help, --version, node names,
and vLLM's own engine arguments on the worker command line."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollout_queue.api.settings import ApiSettings
from rollout_queue.cli import command
from rollout_queue.cli.localstack import LocalStack, WorkerSpec, free_port
from rollout_queue.cli.zygote import Zygote
from rollout_queue.tasks.errors import LocalStackError
from rollout_queue.tasks.settings import ClientSettings, redact_url
from rollout_queue.workers.settings import WorkerSettings
from tests.conftest import zygote_env


def test_unprefixed_variables_that_systems_set_do_not_change_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"NAME": "mylaptop", "MODEL": "other", "DEVICE": "cpu", "SEED": "9",
                        "QUEUES": '["x"]', "POOL": "p", "LOG_LEVEL": "DEBUG", "DTYPE": "half"}.items():
        monkeypatch.setenv(name, value)
    settings = WorkerSettings()
    assert settings.name == f"worker@{socket.gethostname()}"
    assert (settings.model, settings.device, settings.seed, settings.queues, settings.pool,
            settings.log_level, settings.dtype) == ("", "cuda", 0, ["generate"], "default", "INFO", "auto")


def test_settings_read_rq_prefixed_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RQ_NAME", "gpu3@box")
    monkeypatch.setenv("RQ_MAX_INFLIGHT", "7")
    monkeypatch.setenv("RQ_WEIGHT_SYNC_SECRET", "s3")
    monkeypatch.setenv("RQ_ENGINE_ARGS", '{"quantization": "fp8"}')
    monkeypatch.setenv("RQ_API_PORT", "8123")
    settings = WorkerSettings()
    assert (settings.name, settings.max_inflight, settings.control_secret()) == ("gpu3@box", 7, "s3")
    assert settings.engine_args == {"quantization": "fp8"}
    assert ApiSettings().port == 8123


def test_redis_url_is_a_documented_alias_and_the_prefixed_name_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RQ_REDIS_URL", raising=False)  # the session's redis_url fixture sets it
    monkeypatch.setenv("REDIS_URL", "redis://from-alias:6379/1")
    assert ClientSettings().redacted_url == "redis://from-alias:6379/1"
    monkeypatch.setenv("RQ_REDIS_URL", "redis://from-prefixed:6379/2")
    assert ClientSettings().redacted_url == "redis://from-prefixed:6379/2"


def test_node_names_expand_host_placeholders_as_celery_does() -> None:
    host = socket.gethostname()
    assert WorkerSettings(name="gpu0@%h").name == f"gpu0@{host}"
    assert WorkerSettings(name="w-%n@%h").name == f"w-{host.split('.')[0]}@{host}"


def test_a_bad_flag_value_is_one_line_naming_the_field_and_range_with_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert command.main(["worker", "--model", "m", "--gpu-memory-utilization", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "--gpu-memory-utilization / RQ_GPU_MEMORY_UTILIZATION = 2.0" in err
    assert "> 0.0 and <= 1.0" in err


def test_a_bad_environment_value_names_its_variable_and_choices(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("RQ_DEVICE", "tpu")
    monkeypatch.setenv("RQ_MAX_INFLIGHT", "0")
    assert command.main(["worker", "--model", "m"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert any("RQ_DEVICE = 'tpu': allowed: one of cpu, cuda" in line for line in lines)
    assert any("RQ_MAX_INFLIGHT = '0': allowed: an integer >= 1" in line for line in lines)


def _worker_parser() -> argparse.ArgumentParser:
    sub = next(a for a in command.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["worker"]


def test_every_worker_flag_has_help_with_its_default_and_variable() -> None:
    flags = [a for a in _worker_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 20
    for action in flags:
        assert action.help and "env RQ_" in action.help, action.option_strings
        if action.dest != "model":
            assert "(default: " in action.help, action.option_strings
    text = " ".join(_worker_parser().format_help().split())
    assert "(default: 0.9; env RQ_GPU_MEMORY_UTILIZATION)" in text
    assert "(default: redis://localhost:6379/0; env RQ_REDIS_URL or REDIS_URL or RQ_REDIS_URL_FILE)" in text


def test_version_flag_prints_the_package_and_engine_versions(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        command.main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("rollout-queue 0.1.0 (") and "vllm" in out


def test_unknown_worker_flags_are_parsed_by_vllms_own_engine_argument_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rollout_queue.workers.engine.args import parse_engine_args

    given = parse_engine_args(["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--trust-remote-code",
                               "--revision", "v1", "--enable-lora", "--max-loras", "2"])
    assert given == {"quantization": "fp8", "kv_cache_dtype": "fp8", "trust_remote_code": True,
                     "revision": "v1", "enable_lora": True, "max_loras": 2}
    # vLLM's choices and names are checked by vLLM's parser: argparse's exit 2.
    with pytest.raises(SystemExit) as exited:
        parse_engine_args(["--kv-cache-dtype", "int3"])
    assert exited.value.code == 2 and "kv-cache-dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_engine_args(["--no-such-engine-option", "1"])


def test_a_bad_variable_read_when_the_app_is_built_is_one_line_too() -> None:
    # Importing tasks/ builds the Celery app's settings: a fresh process shows that path.
    import subprocess

    from tests.procs import ROOT, python

    run = subprocess.run([python(), "-m", "rollout_queue.cli", "worker", "--model", "m"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "RQ_TASK_MAX_PROMPTS": "0"}, check=False)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == "rollout-queue worker: RQ_TASK_MAX_PROMPTS = '0': allowed: an integer >= 1"


@pytest.mark.slow  # its workers import vLLM before they fail
def test_a_local_stack_worker_uses_the_stacks_redis_whatever_rq_redis_url_says_and_a_wait_names_both(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, tmp_path: Path, zygote: Callable[[], Zygote | None],
) -> None:
    # Another Redis named in the caller's environment: nothing listens there.
    elsewhere = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setenv("RQ_REDIS_URL", elsewhere)
    for name, value in zygote_env(zygote).items():  # the workers forked, as a bench's are (~7 s of imports less each)
        monkeypatch.setenv(name, value)
    not_a_model = tmp_path / "not-a-model"  # the worker exits at its engine's start, after naming its broker
    not_a_model.mkdir()
    with LocalStack(tmp_path, prefix="url-test") as stack:
        stack.ensure_redis(redis_url)
        with pytest.raises(LocalStackError) as exited:
            stack.start_worker(WorkerSpec(not_a_model), timeout=120)
        log = (tmp_path / "worker-0.log").read_text(errors="replace")
        assert f"(broker {redact_url(redis_url)})" in log, "the exported RQ_REDIS_URL won in the worker"
        assert "exited with code" in str(exited.value) and "connected to Redis at" not in str(exited.value)
        # A worker told to use another Redis, where nothing answers: it exits once its wait for
        # Redis ends (exit 2, before any engine; 1 s here instead of the default 10), and the
        # stack's error names both (the log tail and its own URL).
        unanswered = {"RQ_REDIS_URL": elsewhere, "RQ_BROKER_CONNECT_TIMEOUT": "1"}
        with pytest.raises(LocalStackError) as elsewhere_exit:
            stack.start_worker(WorkerSpec(not_a_model, env=unanswered), index=1, timeout=120)
        message = str(elsewhere_exit.value)
        assert "exited with code 2" in message and f"Redis at {elsewhere} did not answer" in message
        assert redact_url(redis_url) in message


def test_the_gateway_reads_its_saturation_status_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RQ_API_SATURATED_STATUS", "503")
    assert ApiSettings().saturated_status == 503
    monkeypatch.setenv("RQ_API_SATURATED_STATUS", "504")
    with pytest.raises(ValidationError, match="429 or 503"):
        ApiSettings()
