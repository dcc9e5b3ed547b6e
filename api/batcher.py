"""``SignatureBatcher``: concurrent requests with one sampling signature share one task.

A request arrives with its prompts, their kind (text, chat, tokens) and its
validated ``SamplingParams`` (and, for a sticky session, the queue of its
worker). Its batch key is ``(kind, signature(params), queue)``:
one task carries one prompt kind and one signature, so requests with
different signatures (or kinds) never share a task. The first request of a
key opens a batch and starts a timer of ``batch_window_ms``; requests with
the same key join it until the timer fires or it holds as many prompts as
one task may (``max_batch_prompts``, and no more than ``max_task_sequences``
sequences, prompts x n); then the batch is sent as ONE ``generate`` task and
each request gets back its own slice of the result's ``outputs``. A request
with more prompts than a task may hold, or asked to spread over ``spread``
workers, is split (``tasks.split.plan_parts``):
its parts are submitted like requests of their own, so several workers serve
it, and its answer joins theirs in prompt order (``task_id`` and ``worker``
then name every task and worker, comma-joined).

Bound: open batches plus tasks awaiting results never exceed
``max_inflight_tasks``. A request that would open one more batch past it is
refused at once with ``GatewaySaturated``; a request that joins an open
batch adds no task and is always admitted.

A request's errors stay with it. Requests are checked alone before they
join a batch (``api.checks``); if a task still fails because of one prompt
(the worker's ``InvalidRequest`` / ``PromptTooLong`` name it: ``prompt <i>``),
that prompt's request gets the error and the others are sent again without
it. A shared task that fails for a reason naming no prompt (an engine
error...) is run again once per request, alone, so each gets its own answer.
Timeouts and an unreachable Redis are shared: every request gets them. Such
reruns use the batch's slot; they add no task to the in-flight bound.

A request whose client went away (``submit`` cancelled) leaves its open
batch; once sent, its prompt indices are added to the task's abort set
(``keys.abort_key``), which the worker reads while generating: it aborts
those prompts' engine requests and finishes the others.

Sending (a Redis round trip in kombu) runs in a worker thread; results come
back through ``ResultWatcher`` on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_queue.api.metrics import GatewayMetrics
from rollout_queue.api.results import ResultWatcher
from rollout_queue.tasks.errors import (
    BadRequest,
    BrokerUnavailable,
    GatewaySaturated,
    GenerationTimeout,
    InvalidRequest,
    PromptTooLong,
    ResultTimeout,
)
from rollout_queue.tasks.schemas import GenerationResult, PromptKind, PromptOutput, SamplingParams
from rollout_queue.tasks.signature import signature
from rollout_queue.tasks.split import plan_parts, prompts_per_task

log = logging.getLogger("rollout_queue.api")

# (prompts, params, task_id, expires_s, queue) -> None; sends one generate task
# (queue None: the gateway's own).
Sender = Callable[[list[Any], SamplingParams, str, float, str | None], None]
# (task_id, prompt indices) -> None; asks the task's worker to abort those prompts.
Aborter = Callable[[str, list[int]], Awaitable[None]]

# Failures every request of a task shares: running the requests again alone
# would only repeat them.
_SHARED_FAILURES = (ResultTimeout, GenerationTimeout, BrokerUnavailable)
# How workers name the prompt at fault: "prompt <index in the task> ...".
_PROMPT_AT_FAULT = re.compile(r"^prompt (\d+)\b")


@dataclass(frozen=True)
class Share:
    """One request's part of a task's result."""

    outputs: list[PromptOutput]
    task_id: str
    signature: str
    weight_version: int
    worker: str
    batch_prompts: int


@dataclass
class _Waiter:
    prompts: list[Any]
    future: asyncio.Future[Share]
    task_id: str | None = None  # the task its prompts travel in now
    offset: int = 0  # the index of its first prompt in that task


@dataclass
class _Batch:
    kind: PromptKind
    signature: str
    params: SamplingParams
    queue: str | None = None  # a sticky session's worker queue; None: the gateway's
    waiters: list[_Waiter] = field(default_factory=list)
    prompts: int = 0
    timer: asyncio.TimerHandle | None = None

    @property
    def key(self) -> tuple[str, str, str | None]:
        return (self.kind, self.signature, self.queue)


class SignatureBatcher:
    def __init__(
        self,
        send: Sender,
        abort: Aborter,
        watcher: ResultWatcher,
        metrics: GatewayMetrics,
        *,
        window_s: float,
        max_batch_prompts: int,
        max_inflight_tasks: int,
        timeout_s: float,
        max_task_sequences: int,
    ) -> None:
        self._send = send
        self._abort = abort
        self._watcher = watcher
        self._metrics = metrics
        self.window_s = window_s
        self.max_batch_prompts = max_batch_prompts
        self.max_task_sequences = max_task_sequences
        self.max_inflight_tasks = max_inflight_tasks
        self.timeout_s = timeout_s
        self._open: dict[tuple[str, str, str | None], _Batch] = {}
        self._inflight = 0  # tasks sent (or being sent) and not yet answered
        self._running: set[asyncio.Task[None]] = set()

    @property
    def inflight_tasks(self) -> int:
        return self._inflight

    @property
    def open_batches(self) -> int:
        return len(self._open)

    async def submit(
        self, kind: PromptKind, prompts: list[Any], params: SamplingParams, queue: str | None = None,
        spread: int = 1,
    ) -> Share:
        """Queue ``prompts`` with ``params`` (for ``queue``: a sticky session's worker; None:
        the gateway's); returns this request's outputs, in order. ``spread``: split into at
        least this many parts (one per worker that should share the request)."""
        cap = prompts_per_task(params.n, self.max_batch_prompts, self.max_task_sequences)
        if spread > 1:
            cap = min(cap, -(-len(prompts) // spread))
        if len(prompts) <= cap:
            return await self._submit(kind, prompts, params, queue, cap)
        parts = plan_parts(len(prompts), cap)
        jobs = [
            asyncio.ensure_future(self._submit(kind, prompts[part.start : part.stop], params, queue, cap))
            for part in parts
        ]
        try:
            shares = await asyncio.gather(*jobs)
        except BaseException as exc:
            for job in jobs:
                job.cancel()  # a failed part fails the request: the others' prompts are aborted
                job.add_done_callback(_retrieved)
            failed = next((part for part, job in zip(parts, jobs)
                           if job.done() and not job.cancelled() and job.exception() is exc), None)
            if failed is not None and isinstance(exc, BadRequest):
                raise _renumbered(exc, failed.start) from None
            raise
        return _joined(shares)

    async def _submit(
        self, kind: PromptKind, prompts: list[Any], params: SamplingParams, queue: str | None, cap: int,
    ) -> Share:
        """One request (or part) of at most ``cap`` prompts, in a batch of at most ``cap``."""
        sig = signature(params)
        key = (kind, sig, queue)
        batch = self._open.get(key)
        if batch is not None and batch.prompts + len(prompts) > cap:
            self._flush(batch)
            batch = None
        if batch is None:
            if self._inflight + len(self._open) >= self.max_inflight_tasks:
                self._metrics.rejected.labels(reason="saturated").inc()
                raise GatewaySaturated(
                    f"the gateway has {self.max_inflight_tasks} generate tasks in flight "
                    "(RQ_API_MAX_INFLIGHT_TASKS); retry later"
                )
            batch = _Batch(kind=kind, signature=sig, params=params, queue=queue)
            self._open[key] = batch
            loop = asyncio.get_running_loop()
            batch.timer = loop.call_later(self.window_s, self._flush, batch)
            self._update_gauges()
        waiter = _Waiter(prompts=prompts, future=asyncio.get_running_loop().create_future())
        batch.waiters.append(waiter)
        batch.prompts += len(prompts)
        if batch.prompts >= cap:
            self._flush(batch)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(batch, waiter)
            raise

    def _abandon(self, batch: _Batch, waiter: _Waiter) -> None:
        """The request went away: leave its open batch, or abort its prompts in the task."""
        if self._open.get(batch.key) is batch:
            batch.waiters.remove(waiter)
            batch.prompts -= len(waiter.prompts)
            if not batch.waiters:
                del self._open[batch.key]
                if batch.timer is not None:
                    batch.timer.cancel()
                self._update_gauges()
            return
        if waiter.task_id is not None:
            indices = list(range(waiter.offset, waiter.offset + len(waiter.prompts)))
            self._metrics.aborted.inc()
            self._spawn(self._abort_quietly(waiter.task_id, indices))

    async def _abort_quietly(self, task_id: str, indices: list[int]) -> None:
        try:
            await self._abort(task_id, indices)
        except Exception as exc:  # noqa: BLE001  the task then runs to its end; nothing else breaks
            log.warning("could not abort %d prompts of %s: %s", len(indices), task_id, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _flush(self, batch: _Batch) -> None:
        if self._open.get(batch.key) is not batch:
            return  # already sent (timer raced with the size cap)
        del self._open[batch.key]
        if batch.timer is not None:
            batch.timer.cancel()
        live = [w for w in batch.waiters if not w.future.done()]
        if not live:
            self._update_gauges()
            return
        batch.waiters = live
        self._inflight += 1
        self._update_gauges()
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, batch: _Batch) -> None:
        try:
            await self._serve(batch, batch.waiters, rerun_alone=True)
        finally:
            self._inflight -= 1
            self._update_gauges()

    async def _serve(self, batch: _Batch, waiters: list[_Waiter], *, rerun_alone: bool) -> None:
        """Send ``waiters``' prompts as one task until each waiter has its answer."""
        while True:
            waiters = [w for w in waiters if not w.future.done()]
            if not waiters:
                return
            try:
                task_id, result, total = await self._task(batch, waiters)
                self._split(waiters, task_id, result, total)
                return
            except Exception as exc:  # noqa: BLE001 - whatever it is, some waiter must get it
                self._metrics.failed_tasks.labels(error=type(exc).__name__).inc()
                at_fault = _at_fault(exc, waiters, "messages" if batch.kind == "chat" else "prompt")
                if at_fault is not None:
                    waiter, error = at_fault
                    if not waiter.future.done():
                        waiter.future.set_exception(error)
                    waiters = [w for w in waiters if w is not waiter]
                    continue  # the others, again, without it
                if rerun_alone and len(waiters) > 1 and not isinstance(exc, _SHARED_FAILURES):
                    log.info("a task of %d requests failed (%s); running each alone", len(waiters), exc)
                    await asyncio.gather(*(self._serve(batch, [w], rerun_alone=False) for w in waiters))
                    return
                for waiter in waiters:
                    if not waiter.future.done():
                        waiter.future.set_exception(exc)
                return

    async def _task(
        self, batch: _Batch, waiters: list[_Waiter]
    ) -> tuple[str, GenerationResult, int]:
        """Send one task with every waiter's prompts; its id, result and prompt count."""
        task_id = self._watcher.new_task_id()
        prompts: list[Any] = []
        for waiter in waiters:
            waiter.task_id, waiter.offset = task_id, len(prompts)
            prompts.extend(waiter.prompts)
        self._metrics.tasks.labels(kind=batch.kind).inc()
        self._metrics.batch_prompts.observe(len(prompts))
        self._metrics.batch_requests.observe(len(waiters))
        started = time.monotonic()
        result = GenerationResult.model_validate(await self._watcher.sent(
            task_id, functools.partial(self._send, prompts, batch.params, task_id, self.timeout_s, batch.queue),
            self.timeout_s,
        ))
        self._metrics.task_seconds.observe(time.monotonic() - started)
        return task_id, result, len(prompts)

    def _split(self, waiters: list[_Waiter], task_id: str, result: GenerationResult, total: int) -> None:
        if len(result.outputs) != total:
            raise RuntimeError(
                f"task {task_id} returned {len(result.outputs)} outputs for {total} prompts"
            )
        for waiter in waiters:
            part = result.outputs[waiter.offset : waiter.offset + len(waiter.prompts)]
            if not waiter.future.done():
                waiter.future.set_result(
                    Share(
                        outputs=part,
                        task_id=task_id,
                        signature=result.signature,
                        weight_version=result.weight_version,
                        worker=result.worker,
                        batch_prompts=total,
                    )
                )

    def _update_gauges(self) -> None:
        self._metrics.inflight_tasks.set(self._inflight)
        self._metrics.open_batches.set(len(self._open))

    async def close(self) -> None:
        for batch in list(self._open.values()):
            if batch.timer is not None:
                batch.timer.cancel()
            for waiter in batch.waiters:
                if not waiter.future.done():
                    waiter.future.cancel()
        self._open.clear()
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)


def _retrieved(job: asyncio.Future[Any]) -> None:
    """Mark a part's outcome as seen: its request already has the first error of its parts."""
    if not job.cancelled():
        job.exception()


def _joined(shares: list[Share]) -> Share:
    """The parts of a split request as one share: outputs in prompt order, every task and
    worker named once (comma-joined), the lowest weight version."""
    tasks = {share.task_id: share.batch_prompts for share in shares}
    workers = dict.fromkeys(node for share in shares for node in share.worker.split(","))
    return Share(
        outputs=[output for share in shares for output in share.outputs],
        task_id=",".join(tasks),
        signature=shares[0].signature,
        weight_version=min(share.weight_version for share in shares),
        worker=",".join(workers),
        batch_prompts=sum(tasks.values()),
    )


def _renumbered(exc: BadRequest, offset: int) -> BadRequest:
    """A part's error naming ``prompt <i>``, naming it by its index in the whole request."""
    found = _PROMPT_AT_FAULT.match(str(exc))
    if found is None:
        return exc
    return BadRequest(f"prompt {int(found.group(1)) + offset}{str(exc)[found.end():]}", exc.param)


def _at_fault(
    exc: Exception, waiters: list[_Waiter], param: str
) -> tuple[_Waiter, Exception] | None:
    """The waiter whose prompt the worker refused, and the error in its own numbering."""
    if not isinstance(exc, (InvalidRequest, PromptTooLong)):
        return None
    message = str(exc)
    found = _PROMPT_AT_FAULT.match(message)
    if found is None:
        return None
    index = int(found.group(1))
    for waiter in waiters:
        if waiter.offset <= index < waiter.offset + len(waiter.prompts):
            return waiter, BadRequest(f"prompt {index - waiter.offset}{message[found.end():]}", param)
    return None
