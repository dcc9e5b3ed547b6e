"""``generate_many``: one big job as many ``generate`` tasks, results as they come.

    from rollout_queue.tasks.producer import generate_many
    for index, result in generate_many(prompts, {"temperature": 0.7, "max_tokens": 256}):
        rollouts[index] = result["outputs"][0]["samples"]

The prompts are split into chunks of ``chunk_size`` (one task each, so the
workers' engines batch them continuously); every prompt's result is yielded
as soon as its task finishes, in completion order, like NeMo RL's per-sample
async generation. A failed task does not stop the others: once everything
has finished (or ``timeout`` passed), :class:`BatchIncomplete` names the
failed and unfinished task ids and the prompt indices left without a result.
In a terminal a progress bar (rich) shows prompts done.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, ResultSet

from rollout_queue.tasks.errors import BatchIncomplete
from rollout_queue.tasks.generate import build_request, generate
from rollout_queue.tasks.schemas import SamplingParams

__all__ = ["generate_many"]


def per_prompt(result: Mapping[str, Any], offset: int) -> dict[str, Any]:
    """One prompt's slice of a task's ``GenerationResult`` (same shape, one output).

    ``usage`` is that prompt's own token counts; ``timing`` is its task's.
    """
    output = result["outputs"][offset]
    completion = sum(len(sample["token_ids"]) for sample in output["samples"])
    return {
        **result,
        "outputs": [output],
        "usage": {"prompt_tokens": len(output["prompt_token_ids"]), "completion_tokens": completion},
    }


def _error_of(meta: Mapping[str, Any]) -> str:
    failure = meta.get("result")
    if isinstance(failure, Mapping):
        return f"{failure.get('exc_type', 'Error')}: {failure.get('exc_message', '')}"
    return f"{meta.get('status')}: {failure!r}"


class _Progress:
    """A rich progress bar when asked (or on a terminal); otherwise nothing."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        self.bar: Any = None
        if enabled is None:
            enabled = sys.stdout.isatty()
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]generate[/]"), BarColumn(), MofNCompleteColumn(),
                TextColumn("prompts"), TimeElapsedColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[failed]}"),
            )
            self.task = self.bar.add_task("generate", total=total, failed="")
            self.bar.start()

    def advance(self, prompts: int, failed: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=prompts, failed=f"[red]{failed} failed[/]" if failed else "")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def generate_many(
    prompts: Sequence[Any],
    params: SamplingParams | Mapping[str, Any] | None = None,
    *,
    chunk_size: int = 64,
    progress: bool | None = None,
    timeout: float | None = None,
    queue: str | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(prompt_index, result)`` for every prompt, as its task completes.

    ``result`` is a ``GenerationResult`` dict holding that one prompt's output.
    ``progress``: None = a bar when stdout is a terminal. ``timeout``: seconds
    for the whole batch (None: wait as long as it takes). ``queue``: the queue
    to send to (default: the ``generate`` task's route).
    Raises ``pydantic.ValidationError`` before sending anything if the params or
    any chunk's prompts are invalid; :class:`BatchIncomplete` at the end if
    some tasks failed or did not finish.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    prompts = list(prompts)
    if not prompts:
        return
    starts = list(range(0, len(prompts), chunk_size))
    # Validate every chunk first: a bad prompt fails the call, not one task.
    requests = [build_request(prompts[s : s + chunk_size], params) for s in starts]
    options: dict[str, Any] = {"queue": queue} if queue else {}
    sent: dict[str, tuple[int, int]] = {}  # task id → (first index, prompt count)
    results: list[AsyncResult] = []
    for start, request in zip(starts, requests):
        # Each chunk is one task, whatever RQ_TASK_MAX_PROMPTS says: results
        # stream per task here, and chunk_size is the caller's split.
        async_result = generate.send(request, {}, options)
        sent[async_result.id] = (start, len(request.prompts))
        results.append(async_result)

    by_id = {result.id: result for result in results}
    failed: dict[str, str] = {}
    done: set[str] = set()
    bar = _Progress(len(prompts), progress)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        pending = ResultSet(results)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            for task_id, meta in pending.iter_native(timeout=remaining, interval=0.2):
                if task_id in done or task_id not in sent:
                    continue
                done.add(task_id)
                start, count = sent[task_id]
                if meta.get("status") == "SUCCESS":
                    bar.advance(count, len(failed))
                    for offset in range(count):
                        yield start + offset, per_prompt(meta["result"], offset)
                else:
                    failed[task_id] = _error_of(meta)
                    bar.advance(count, len(failed))
                # Read once, kept by the caller: Redis need not hold it until
                # it expires (an RL loop would pile up every step's results).
                by_id[task_id].forget()
        except CeleryTimeoutError:
            pass  # reported below with the unfinished task ids
    finally:
        bar.close()
    unfinished = [tid for tid in sent if tid not in done]
    if failed or unfinished:
        missing = [
            sent[tid][0] + offset
            for tid in list(failed) + unfinished
            for offset in range(sent[tid][1])
        ]
        raise BatchIncomplete(failed, unfinished, missing)
