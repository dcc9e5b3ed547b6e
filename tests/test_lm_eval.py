"""lm-evaluation-harness scores a loglikelihood task through the gateway as lm-eval's own vLLM model does.

A 10-item multiple-choice task from a local file (no downloads) runs twice on
the tiny model: lm-eval's ``local-completions`` model against the gateway in
front of the shared worker (``echo`` + ``logprobs``, ``max_tokens: 1``), and
lm-eval's ``vllm`` model (vLLM's offline engine, configured like a worker).
Every choice's loglikelihood must agree within 1e-3, and so must the
accuracy. Skipped only where lm-eval is not installed (the test extra has it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ENGINE_FLAGS, MAX_MODEL_LEN
from tests.procs import Proc, python
from tests.test_api import MODEL, start_gateway

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[test]'")

ITEMS = [
    ("The sky is", "blue", "green"), ("Two plus two is", "four", "five"), ("Water is", "wet", "dry"),
    ("Fire is", "hot", "cold"), ("Snow is", "white", "black"), ("The sun rises in the", "east", "west"),
    ("Cats say", "meow", "woof"), ("Ice is", "cold", "warm"), ("Grass is", "green", "purple"),
    ("Night is", "dark", "bright"),
]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _task(folder: Path) -> Path:
    folder.mkdir()
    data = folder / "items.jsonl"
    data.write_text("".join(
        json.dumps({"question": q, "choices": [f" {a}", f" {b}"], "answer": i % 2}) + "\n"
        for i, (q, a, b) in enumerate(ITEMS)
    ))
    (folder / "rq_tiny.yaml").write_text(
        "task: rq_tiny\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    return folder


def _lm_eval(name: str, model: str, model_args: str, tasks: Path, out: Path) -> Proc:
    argv = [python(), "-m", "tests.lm_eval_run", "--model", model, "--model_args", model_args,
            "--tasks", "rq_tiny", "--include_path", str(tasks), "--log_samples", "--output_path", str(out)]
    return Proc(name, argv, env=OFFLINE)


def _finish(proc: Proc, timeout: float) -> None:
    try:
        code = proc.popen.wait(timeout)
    finally:
        proc.stop()
    assert code == 0, f"{proc.name} exited {code}:\n{proc.tail()}"


def _scores(out: Path) -> tuple[dict[int, list[float]], float]:
    """Per item, each choice's loglikelihood; and the task's accuracy."""
    [samples] = out.rglob("samples_rq_tiny_*.jsonl")
    [results] = out.rglob("results_*.json")
    per_item = {}
    for line in samples.read_text().splitlines():
        sample: dict[str, Any] = json.loads(line)
        per_item[sample["doc_id"]] = [float(resp[0][0]) for resp in sample["resps"]]
    return per_item, float(json.loads(results.read_text())["results"]["rq_tiny"]["acc,none"])


def test_lm_eval_local_completions_scores_equal_lm_evals_vllm_model(
    redis_url: str, gen_worker: Proc, model_a: Path, tmp_path: Path,
) -> None:
    tasks = _task(tmp_path / "tasks")
    engine = ",".join([f"pretrained={model_a}", "dtype=float32", f"max_model_len={MAX_MODEL_LEN}",
                       "gpu_memory_utilization=0.1",
                       *(["enforce_eager=True"] if "--enforce-eager" in ENGINE_FLAGS else [])])
    # The offline engine starts (tens of seconds) while the gateway run goes on.
    offline = _lm_eval("lm-eval-vllm", "vllm", engine, tasks, tmp_path / "vllm")
    gateway = start_gateway("api-lm-eval-gateway", redis_url, {})
    try:
        remote = _lm_eval(
            "lm-eval-gateway", "local-completions",
            f"model={MODEL},base_url={gateway.base}/v1/completions,tokenizer={model_a},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=4,max_retries=1",
            tasks, tmp_path / "gateway",
        )
        _finish(remote, 300)
    finally:
        gateway.proc.stop()
    _finish(offline, 300)
    through_gateway, gateway_acc = _scores(tmp_path / "gateway")
    reference, reference_acc = _scores(tmp_path / "vllm")
    assert sorted(through_gateway) == sorted(reference) == list(range(len(ITEMS)))
    for doc, expected in reference.items():
        assert through_gateway[doc] == pytest.approx(expected, abs=1e-3), f"item {doc}"
    assert gateway_acc == reference_acc
    delta = max(abs(a - b) for d in reference for a, b in zip(reference[d], through_gateway[d]))
    print(f"lm-eval rq_tiny: acc {gateway_acc:.2f} through the gateway and from vLLM; "
          f"max |delta loglikelihood| {delta:.2e}")
