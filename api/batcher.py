"""``SignatureBatcher``: concurrent requests with one sampling signature share one task.

A request arrives with its prompts, their kind (text, chat, tokens) and its
validated ``SamplingParams``. Its batch key is ``(kind, signature(params))``:
one task carries one prompt kind and one signature, so requests with
different signatures (or kinds) never share a task. The first request of a
key opens a batch and starts a timer of ``batch_window_ms``; requests with
the same key join it until the timer fires or it holds
``max_batch_prompts`` prompts; then the batch is sent as ONE ``generate``
task and each request gets back its own slice of the result's ``outputs``.
A request with more prompts than the cap travels alone, never split.

Bound: open batches plus tasks awaiting results never exceed
``max_inflight_tasks``. A request that would open one more batch past it is
refused at once with ``GatewaySaturated``; a request that joins an open
batch adds no task and is always admitted.

Sending (a Redis round trip in kombu) runs in a worker thread; results come
back through ``ResultWatcher`` on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api.metrics import GatewayMetrics
from api.results import ResultWatcher
from tasks.errors import GatewaySaturated
from tasks.schemas import GenerationResult, PromptKind, PromptOutput, SamplingParams
from tasks.signature import signature

log = logging.getLogger("rollout_queue.api")

# (prompts, params, task_id, expires_s) -> None; sends one generate task.
Sender = Callable[[list[Any], SamplingParams, str, float], None]


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


@dataclass
class _Batch:
    kind: PromptKind
    signature: str
    params: SamplingParams
    waiters: list[_Waiter] = field(default_factory=list)
    prompts: int = 0
    timer: asyncio.TimerHandle | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.signature)


class SignatureBatcher:
    def __init__(
        self,
        send: Sender,
        watcher: ResultWatcher,
        metrics: GatewayMetrics,
        *,
        window_s: float,
        max_batch_prompts: int,
        max_inflight_tasks: int,
        timeout_s: float,
    ) -> None:
        self._send = send
        self._watcher = watcher
        self._metrics = metrics
        self.window_s = window_s
        self.max_batch_prompts = max_batch_prompts
        self.max_inflight_tasks = max_inflight_tasks
        self.timeout_s = timeout_s
        self._open: dict[tuple[str, str], _Batch] = {}
        self._inflight = 0  # tasks sent (or being sent) and not yet answered
        self._running: set[asyncio.Task[None]] = set()

    @property
    def inflight_tasks(self) -> int:
        return self._inflight

    @property
    def open_batches(self) -> int:
        return len(self._open)

    async def submit(self, kind: PromptKind, prompts: list[Any], params: SamplingParams) -> Share:
        """Queue ``prompts`` with ``params``; returns this request's outputs, in order."""
        sig = signature(params)
        key = (kind, sig)
        batch = self._open.get(key)
        if batch is not None and batch.prompts + len(prompts) > self.max_batch_prompts:
            self._flush(batch)
            batch = None
        if batch is None:
            if self._inflight + len(self._open) >= self.max_inflight_tasks:
                self._metrics.rejected.labels(reason="saturated").inc()
                raise GatewaySaturated(
                    f"the gateway has {self.max_inflight_tasks} generate tasks in flight "
                    "(API_MAX_INFLIGHT_TASKS); retry later"
                )
            batch = _Batch(kind=kind, signature=sig, params=params)
            self._open[key] = batch
            loop = asyncio.get_running_loop()
            batch.timer = loop.call_later(self.window_s, self._flush, batch)
            self._update_gauges()
        waiter = _Waiter(prompts=prompts, future=asyncio.get_running_loop().create_future())
        batch.waiters.append(waiter)
        batch.prompts += len(prompts)
        if batch.prompts >= self.max_batch_prompts:
            self._flush(batch)
        return await waiter.future

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
        prompts = [p for w in batch.waiters for p in w.prompts]
        task_id = self._watcher.new_task_id()
        self._metrics.tasks.labels(kind=batch.kind).inc()
        self._metrics.batch_prompts.observe(len(prompts))
        self._metrics.batch_requests.observe(len(batch.waiters))
        started = time.monotonic()
        try:
            self._watcher.expect(task_id)
            try:
                await asyncio.to_thread(self._send, prompts, batch.params, task_id, self.timeout_s)
            except BaseException:
                self._watcher.forget(task_id)
                raise
            result = await self._watcher.wait(task_id, self.timeout_s)
            self._metrics.task_seconds.observe(time.monotonic() - started)
            self._split(batch, task_id, result, len(prompts))
        except Exception as exc:  # noqa: BLE001 - whatever it is, each waiter must get it
            self._metrics.failed_tasks.labels(error=type(exc).__name__).inc()
            for waiter in batch.waiters:
                if not waiter.future.done():
                    waiter.future.set_exception(exc)
        finally:
            self._inflight -= 1
            self._update_gauges()

    def _split(self, batch: _Batch, task_id: str, result: GenerationResult, total: int) -> None:
        if len(result.outputs) != total:
            raise RuntimeError(
                f"task {task_id} returned {len(result.outputs)} outputs for {total} prompts"
            )
        offset = 0
        for waiter in batch.waiters:
            part = result.outputs[offset : offset + len(waiter.prompts)]
            offset += len(waiter.prompts)
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
