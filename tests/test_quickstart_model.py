"""The quickstart's real model answers in words; vLLM engine flags reach the engine;
results do not pile up in Redis."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis as redis_lib

from rollout_queue.cli.quickstart_model import QUICKSTART_MODEL, ensure_quickstart_model
from rollout_queue.tasks import generate, generate_many
from rollout_queue.tasks.app import app
from rollout_queue.tasks.errors import RolloutError
from tests.conftest import MODELS, WorkerStarter
from tests.procs import Proc

# Generous for a loaded 2-core machine: a 135M float32 model answers a few
# short prompts in seconds when alone.
TIMEOUT = 180.0
QUEUE = "smol"
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def smol_worker(start_worker: WorkerStarter) -> Proc:
    """A worker on the converted SmolLM2-135M-Instruct (built by ``make setup``), with a
    vLLM engine flag the worker itself does not know: ``--max-logprobs 2``. Eager:
    compiling its 30 layers took minutes on a loaded 2-core machine."""
    model = ensure_quickstart_model(MODELS)
    # 360 s, not the tiny model's 240: this engine loads and profiles 30 layers;
    # it took 160 s to serve here while the tiny model's took 85 s (load 20).
    return start_worker(model, "smol@tests", queue=QUEUE, pool=QUEUE, max_inflight=4,
                        extra=["--max-logprobs", "2", "--enforce-eager"], timeout=360)


def ask(prompts: list[Any], params: dict[str, Any]) -> dict[str, Any]:
    return generate.apply_async((prompts, params), queue=QUEUE).get(timeout=TIMEOUT)


def test_the_converted_quickstart_model_loads_in_vllm_cpu_and_answers_in_words(smol_worker: Proc) -> None:
    config = json.loads((MODELS / QUICKSTART_MODEL / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vllm-cpu's head_dim
    text = ask(["The capital of France is"], GREEDY)["outputs"][0]["samples"][0]["text"]
    assert "Paris" in text, text
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    answer = ask([chat], {"temperature": 0, "max_tokens": 32})["outputs"][0]["samples"][0]["text"]
    assert "Paris" in answer, answer


def test_a_vllm_engine_flag_on_the_worker_command_line_reaches_the_engine(smol_worker: Proc) -> None:
    assert ask(["Hello"], {**GREEDY, "max_tokens": 2, "logprobs": 2})["outputs"][0]["samples"][0]["logprobs"]
    with pytest.raises(RolloutError, match="max_logprobs|logprobs"):
        ask(["Hello"], {**GREEDY, "max_tokens": 2, "logprobs": 3})


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

