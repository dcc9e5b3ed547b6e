"""Split generate calls: one big call as several ``generate`` tasks, joined on ``.get()``.

``generate.delay(prompts, params)`` with more than ``RQ_TASK_MAX_PROMPTS``
prompts (``ClientSettings.task_max_prompts``), or more than
``RQ_TASK_MAX_SEQUENCES`` sequences (prompts x n, :func:`prompts_per_task`),
is sent as ``k`` ordinary ``generate`` tasks (:func:`plan_parts`: consecutive
prompt ranges of nearly equal size, each prompt's ``n`` samples in one task),
so the workers' engines share it. The gateway splits its big requests the
same way (``api.batcher``). The caller gets a :class:`SplitResult`, whose ``.get()`` waits for
every part and returns ONE ``GenerationResult`` dict (:func:`join_results`):

- ``outputs``: every prompt's output in prompt order;
- ``usage``: the parts' sums;
- ``timing``: ``queued_s`` until the first part started, ``generate_s`` from
  then until the last part finished (the parts share one send time);
- ``worker``: the nodes that served the parts, comma-joined, in prompt order,
  each once;
- ``weight_version``: the lowest of the parts' versions (every sample was
  generated with weights at least that new); each sample's
  ``weight_versions`` spans stay exact.

The join runs in the caller's process (nothing runs on the workers but the
parts, which are plain ``generate`` tasks), over the result backend's pub/sub
like a single task's ``.get()``. A failed part fails the call with that
part's error; the parts not finished yet are revoked.

Why not a Celery chord: its join (the chord body) is a task that must run on
a worker. Ours consume only their queues and fetch by engine room
(``workers.queue.intake``), so a join task would wait behind generation for a
free slot, and the Redis backend's chord counter adds writes per part. A
failed part would reach the caller as ``ChordError``, not its own error, and
revoking the chord's result revokes only the body. Joining in the caller
keeps the error class, revokes every part, and changes nothing on workers.
The group is saved in the result backend (``result_expires``, like any
result) so :meth:`SplitResult.restore` finds the call by its id.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from celery import states
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, GroupResult

from rollout_queue.tasks.schemas import GenerationResult, Timing, Usage

__all__ = ["SplitResult", "join_results", "plan_parts", "prompts_per_task"]


def prompts_per_task(n: int, max_prompts: int, max_sequences: int) -> int:
    """The most prompts of ``n`` samples one task holds: ``RQ_TASK_MAX_PROMPTS``, and
    no more than ``RQ_TASK_MAX_SEQUENCES`` sequences (at least one prompt)."""
    return max(1, min(max_prompts, max_sequences // n))


def plan_parts(prompts: int, max_prompts: int) -> list[range]:
    """Consecutive prompt ranges, at most ``max_prompts`` each, sizes within one of each other.

    ``plan_parts(13, 4)`` → ``[range(0, 4), range(4, 7), range(7, 10), range(10, 13)]``:
    four parts of 4, 3, 3, 3 prompts rather than 4, 4, 4, 1 (a tiny last part
    would hold the call's result back no less than a full one).
    """
    if max_prompts < 1:
        raise ValueError(f"max_prompts must be at least 1, got {max_prompts}")
    count = max(1, math.ceil(prompts / max_prompts))
    base, extra = divmod(prompts, count)
    parts, start = [], 0
    for index in range(count):
        size = base + (index < extra)
        parts.append(range(start, start + size))
        start += size
    return parts


def join_results(parts: Sequence[GenerationResult]) -> GenerationResult:
    """The parts' results (in prompt order) as the one result of the call."""
    if not parts:
        raise ValueError("join_results needs at least one part")
    nodes: list[str] = []
    for part in parts:
        for node in part.worker.split(","):
            if node not in nodes:
                nodes.append(node)
    # Every part was sent at the same time (one rq_sent_at), so a part ended
    # queued_s + generate_s after the send.
    first_start = min(part.timing.queued_s for part in parts)
    last_end = max(part.timing.queued_s + part.timing.generate_s for part in parts)
    return GenerationResult(
        signature=parts[0].signature,
        weight_version=min(part.weight_version for part in parts),
        worker=",".join(nodes),
        outputs=[output for part in parts for output in part.outputs],
        usage=Usage(
            prompt_tokens=sum(part.usage.prompt_tokens for part in parts),
            completion_tokens=sum(part.usage.completion_tokens for part in parts),
        ),
        timing=Timing(queued_s=first_start, generate_s=last_end - first_start),
    )


class SplitResult(GroupResult):  # type: ignore[misc]
    """The handle of a split call: a Celery ``GroupResult`` of its parts, in prompt order,
    whose ``get()`` returns the joined ``GenerationResult`` dict.

    What a single task's ``AsyncResult`` offers works the same: ``.id`` (the
    group's id; ``SplitResult.restore(id)`` finds it again in another process
    until ``result_expires``), ``.get(timeout=...)``, ``.ready()``,
    ``.successful()``, ``.failed()``, ``.state``, ``.revoke()`` (every part)
    and ``.forget()``. ``.results`` are the parts' ``AsyncResult`` objects.
    """

    def __init__(self, id: str | None = None, results: Iterable[AsyncResult] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(id, list(results or ()), **kwargs)

    @classmethod
    def restore(cls, id: str, backend: Any = None, app: Any = None) -> SplitResult | None:
        # This project's app by default, not Celery's "current" one (a process
        # may have made others since, e.g. for another Redis).
        if app is None and backend is None:
            from rollout_queue.tasks.app import app as project_app

            app = project_app
        group = super().restore(id, backend=backend, app=app)
        return None if group is None else cls(group.id, group.results, app=group.app)

    @property
    def state(self) -> str:
        """FAILURE or REVOKED once a part is; SUCCESS once all are; STARTED once one
        started (or finished); otherwise PENDING."""
        part_states = [part.state for part in self.results]
        for final in (states.FAILURE, states.REVOKED):
            if final in part_states:
                return final
        if all(state == states.SUCCESS for state in part_states):
            return states.SUCCESS
        if any(state in (states.STARTED, states.RETRY, states.SUCCESS) for state in part_states):
            return states.STARTED
        return states.PENDING

    status = state

    def ready(self) -> bool:
        """Whether ``get()`` would return (or raise) without waiting."""
        return self.state in states.READY_STATES

    def get(  # type: ignore[override]
        self,
        timeout: float | None = None,
        propagate: bool = True,
        interval: float = 0.5,
        **_: Any,
    ) -> Any:
        """The joined ``GenerationResult`` dict, once every part has succeeded.

        A failed part raises its own error (as a single task's ``get()`` does)
        and revokes the parts not finished yet; ``propagate=False`` returns
        that error instead. ``timeout``: seconds for the whole call
        (``celery.exceptions.TimeoutError`` after it).
        """
        order = {part.id: index for index, part in enumerate(self.results)}
        done: dict[int, dict[str, Any]] = {}
        try:
            for task_id, meta in self.iter_native(timeout=timeout, interval=interval):
                index = order.get(task_id)
                if index is None or index in done:
                    continue
                if meta.get("status") == states.SUCCESS:
                    done[index] = meta["result"]
                    continue
                return self._fail(self.results[index], propagate)
        except CeleryTimeoutError:
            raise CeleryTimeoutError(
                f"split generate call {self.id}: {len(self.results) - len(done)} of "
                f"{len(self.results)} parts unfinished after {timeout} s"
            ) from None
        parts = [GenerationResult.model_validate(done[index]) for index in range(len(self.results))]
        return join_results(parts).model_dump(mode="json")

    wait = get

    def result_model(self, timeout: float | None = None, **options: Any) -> GenerationResult:
        """``.get(timeout, **options)`` parsed into a ``GenerationResult``."""
        return GenerationResult.model_validate(self.get(timeout=timeout, **options))

    def _fail(self, failed: AsyncResult, propagate: bool) -> Any:
        others = [part.id for part in self.results if part.id != failed.id and not part.ready()]
        if others:
            self.app.control.revoke(others)
        # The part's own get(): the same error, rebuilt the same way, as a
        # single task's.
        return failed.get(propagate=propagate, disable_sync_subtasks=False)

    def __repr__(self) -> str:
        return f"<SplitResult: {self.id} ({len(self.results)} parts)>"
