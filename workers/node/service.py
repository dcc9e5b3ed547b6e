"""``GenerationService``: what a ``generate`` task does on a worker.

Parses the task's wire arguments (the one place they are parsed), refuses
work this worker must not serve (fenced, paused or asleep: the host's
``NodeState`` says why; weights older than the task's
``min_weight_version``), runs the prompts on the ``EngineHost`` and builds
the ``GenerationResult``.

It also stores the task's ``STARTED`` state (``track_started``), which
Celery would store on the task's thread before the task body, a read and a
write of the result backend in its way (1.3 ms of a 1-prompt task's
latency on the CPU test machine, docs/BENCHMARKS.md): here it is stored
once the task's requests are in the engine, by a thread of its own, while
they generate; the task waits for that write before it ends (a ``STARTED``
written late would replace the final state Celery stores next). A task that
fails before its requests reach the engine goes from ``PENDING`` to its
final state.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Task, states
from celery.exceptions import Ignore
from pydantic import ValidationError

from rollout_queue.tasks import keys, trace
from rollout_queue.tasks.errors import InvalidRequest, Requeue
from rollout_queue.tasks.generate import (
    FIRST_PROMPT_HEADER,
    ON_NEW_WEIGHTS_HEADER,
    SENT_AT_HEADER,
    SIGNATURE_HEADER,
)
from rollout_queue.tasks.schemas import (
    GenerateRequest,
    GenerationResult,
    PromptOutput,
    Timing,
    Usage,
    validation_summary,
)
from rollout_queue.tasks.signature import signature
from rollout_queue.tasks.streaming import STREAM_HEADER
from rollout_queue.workers.engine.progress import ProgressStore, SampleKey, SampleProgress, TaskCheckpointer
from rollout_queue.workers.engine.protocols import GenerationHost
from rollout_queue.workers.engine.run import RunOptions
from rollout_queue.workers.engine.streaming import DeltaPublisher, TaskStream
from rollout_queue.workers.engine.tools import ToolStream
from rollout_queue.workers.queue.handed_on import HandedOn

log = logging.getLogger(__name__)


def time_limit(timelimit: Any, soft_default: float, hard_default: float) -> float:
    """Seconds a task may run: the tighter of its soft and hard limits.

    ``timelimit`` is the task message's ``[hard, soft]`` header: Celery fills
    it from ``apply_async(soft_time_limit=..., time_limit=...)``, else from the
    producer's ``task_soft_time_limit`` / ``task_time_limit``. The threads pool
    enforces neither, so the service does: at this limit the engine requests
    are aborted and the task fails with ``GenerationTimeout``. (On this pool a
    hard limit cannot kill anything more than the soft one does; the hard
    value only matters when it is the smaller one or the only one given.)
    """
    hard, soft = (list(timelimit) + [None, None])[:2] if timelimit else (None, None)
    given = [float(v) for v in (soft, hard) if v]
    return min(given) if given else min(soft_default, hard_default)


def first_prompt(headers: dict[str, Any]) -> int:
    """Index of the task's first prompt in its call (``rq_first_prompt``; 0 unless split)."""
    try:
        return max(0, int(headers.get(FIRST_PROMPT_HEADER) or 0))
    except (TypeError, ValueError):
        return 0


class GenerationService:
    def __init__(
        self,
        host: GenerationHost,
        node: str,
        soft_time_limit: float,
        hard_time_limit: float | None = None,
        client: redis.Redis | None = None,
        handed_on: HandedOn | None = None,
    ) -> None:
        self.host = host
        # Reads the prompts a task's requester gave up on (keys.abort_key); None: never.
        self.client = client
        # Writes streamed tasks' deltas (workers.engine.streaming); None: no Redis, no streaming.
        self.streams = None if client is None else DeltaPublisher(client)
        self.node = node
        self.soft_time_limit = soft_time_limit
        self.hard_time_limit = hard_time_limit if hard_time_limit is not None else soft_time_limit
        # Tasks the fleet handed on while this worker was cut off: not stored, not acked.
        self.handed_on = handed_on
        self.inflight_tasks = 0
        self.completed_tasks = 0
        self.failed_tasks = 0
        self._lock = threading.Lock()
        self.on_finished: list[Any] = []  # callbacks (metrics): (result | None, seconds)
        # Called with the task id once its requests are in the engine (workers.queue.intake).
        self.on_submitted: Callable[[str], None] | None = None
        # Checkpoints of partial generations (workers.engine.progress); None: off.
        self.progress: ProgressStore | None = None
        self.checkpoint_tokens = 0
        # Running tasks' prompt counts, and the tasks revoked with terminate=True
        # (terminate()): their prompts are aborted, they end REVOKED.
        self._running: dict[str, int] = {}
        self._terminated: set[str] = set()
        # Running tasks' STARTED writes (mark_started); the task waits for its own before it ends.
        self._marks = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="started-mark")
        self._marking: dict[str, concurrent.futures.Future[None]] = {}

    def terminate(self, task_ids: set[str]) -> list[str]:
        """``revoke(terminate=True)`` of tasks this worker runs (``workers.node.control``):
        their prompts are aborted in the engine the way a gone client's are
        (``keys.abort_key``, read by the running task), and the task ends
        REVOKED; returns the ids of those already generating."""
        generating = []
        with self._lock:
            self._terminated |= task_ids
            running = {task_id: self._running[task_id] for task_id in task_ids if task_id in self._running}
        for task_id, prompts in sorted(running.items()):
            self._abort_prompts(task_id, prompts)
            generating.append(task_id)
        return generating

    def _abort_prompts(self, task_id: str, prompts: int) -> None:
        if self.client is None:
            return
        key = keys.abort_key(task_id)
        with self.client.pipeline() as pipe:
            pipe.sadd(key, *range(prompts))
            pipe.expire(key, int(self.hard_time_limit) + 60)  # the task's longest possible run
            pipe.execute()
        log.warning("task %s revoked with terminate: aborting its %d prompt(s) in the engine", task_id, prompts)

    def mark_started(self, task: Task) -> None:
        """Store ``task``'s STARTED state beside its generation, as Celery's
        ``track_started`` would before the task (``GenerateTask.track_started`` is off)."""
        task_id = task.request.id
        if not task_id or task.request.is_eager:
            return
        meta = {"pid": os.getpid(), "hostname": task.request.hostname}

        def store() -> None:
            task.backend.store_result(task_id, meta, states.STARTED, request=task.request)

        with self._lock:
            self._marking[task_id] = self._marks.submit(store)

    def _started_marked(self, task_id: str | None) -> None:
        """Wait for the task's STARTED write (before anything else is stored for it)."""
        with self._lock:
            mark = self._marking.pop(task_id, None) if task_id else None
        if mark is None:
            return
        try:
            mark.result()  # the backend's own retries bound it (RQ_RESULT_STORE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001  the state is informational; the result is not
            log.warning("could not store the STARTED state of task %s: %s", task_id, exc)

    def _end_if_terminated(self, task: Task) -> None:
        """Raise ``Ignore`` (Celery keeps the REVOKED state stored here) if ``task``
        was revoked with terminate while it ran."""
        task_id = task.request.id
        with self._lock:
            if task_id not in self._terminated:
                return
            self._terminated.discard(task_id)
        self._started_marked(task_id)
        task.backend.mark_as_revoked(task_id, "terminated", request=task.request)
        raise Ignore(f"task {task_id} revoked with terminate=True: its prompts were aborted in the engine")

    def _check_vocabulary(self, request: GenerateRequest) -> None:
        """Token ids in params must exist in this model (vLLM would refuse them later)."""
        vocab = self.host.vocab_size
        bad = [t for t in request.params.stop_token_ids or [] if vocab and t >= vocab]
        if bad:
            raise InvalidRequest(
                f"stop_token_ids has {bad[0]}; this model's vocabulary has {vocab} tokens "
                f"(ids 0..{vocab - 1})"
            )

    def _aborted_reader(self, task_id: str | None) -> Any:
        """A callable giving the indices of this task's prompts nobody waits for (or None)."""
        client = self.client
        if client is None or not task_id:
            return None
        key = keys.abort_key(task_id)

        def aborted() -> set[int]:
            try:
                members = client.smembers(key)
            except redis.RedisError as exc:  # keep generating; the next poll retries
                log.warning("could not read %s: %s", key, exc)
                return set()
            return {int(m) for m in members if str(m).isdigit()}  # type: ignore[union-attr]

        return aborted

    def _checkpoint(
        self, task_id: str | None, headers: dict[str, Any]
    ) -> tuple[TaskCheckpointer | None, dict[SampleKey, SampleProgress]]:
        """The task's checkpointer and the progress a previous run saved (if any)."""
        if self.progress is None or not task_id or self.checkpoint_tokens <= 0:
            return None, {}
        saved = self.progress.load(task_id)
        if saved and headers.get(ON_NEW_WEIGHTS_HEADER) == "restart":
            current = self.host.weight_version
            kept = {k: p for k, p in saved.items() if all(v == current for _, v in p.weight_versions)}
            if len(kept) < len(saved):
                log.info("task %s: %d saved samples came from older weights; restarting them on "
                         "version %d", task_id, len(saved) - len(kept), current)
            saved = kept
        if saved:
            tokens = sum(len(p.token_ids) for p in saved.values())
            log.info("task %s resumes %d samples from their checkpoint (%d tokens kept)",
                     task_id, len(saved), tokens)
        checkpointer = TaskCheckpointer(
            self.progress, task_id, self.node, self.checkpoint_tokens, self.host.spans_of
        )
        return checkpointer, saved

    def _tool_stream(self, request: GenerateRequest, prompt: int) -> ToolStream | None:
        """A streamed chat sample's incremental tool-call parser (None: not parsed)."""
        return self.host.tool_calls.streamer(request.conversation(prompt))

    def execute(self, task: Task, prompts: Any, params: Any) -> dict[str, Any]:
        try:
            return self._execute(task, prompts, params)
        finally:
            self._started_marked(task.request.id)

    def _execute(self, task: Task, prompts: Any, params: Any) -> dict[str, Any]:
        started = time.time()
        headers = task.request.headers or {}
        traced = trace.requested(headers)  # tasks.trace: None unless the producer asked
        trace.stamp(traced, "started", started)
        request = parse_request(prompts, params)
        self._admit(task, request)
        deadline = started + time_limit(task.request.timelimit, self.soft_time_limit, self.hard_time_limit)
        outputs, version, checkpointed = self._tracked(task, request, headers, deadline, traced)
        if self.handed_on is not None:
            # Handed on while cut off: the new holder's run counts (its
            # checkpoint included), this one is dropped unstored.
            self.handed_on.check(task, wait=True)
        if checkpointed and self.progress is not None:
            # After any write still queued on the writer thread.
            self.progress.writer.submit(self.progress.drop, task.request.id)
        self._finish_samples(request, outputs)
        done = time.time()
        result = self._result(task, request, outputs, version, started, done)
        for callback in self.on_finished:
            callback(result, done - started)
        body = result.model_dump(mode="json")
        if traced is not None:
            trace.stamp(traced, "returned")
            body["trace"] = traced  # the backend adds "storing" (workers.queue.result_backend)
        return body

    def _result(
        self, task: Task, request: GenerateRequest, outputs: list[PromptOutput], version: int,
        started: float, done: float,
    ) -> GenerationResult:
        headers = task.request.headers or {}
        sent_at = float(headers.get(SENT_AT_HEADER) or getattr(task.request, SENT_AT_HEADER, None) or started)
        return GenerationResult(
            signature=headers.get(SIGNATURE_HEADER) or signature(request.params),
            weight_version=version,
            worker=self.node,
            outputs=outputs,
            usage=Usage(
                prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
                completion_tokens=sum(len(s.token_ids) for o in outputs for s in o.samples),
            ),
            timing=Timing(queued_s=max(0.0, started - sent_at), generate_s=done - started),
        )

    def _admit(self, task: Task, request: GenerateRequest) -> None:
        """Refuse a task this worker must not serve now (requeued) or at all."""
        refusal = self.host.state.refusal()
        if refusal is not None:
            raise Requeue(f"{self.node} is fenced ({refusal}); requeued", countdown=1.0)
        needed = request.params.min_weight_version
        if needed > self.host.weight_version:
            raise Requeue(
                f"task needs weight_version >= {needed}; {self.node} has {self.host.weight_version}",
                countdown=1.0,
            )
        self._check_vocabulary(request)
        if self.handed_on is not None:
            self.handed_on.check(task, wait=False)

    def _tracked(
        self, task: Task, request: GenerateRequest, headers: dict[str, Any], deadline: float,
        traced: dict[str, Any] | None = None,
    ) -> tuple[list[PromptOutput], int, bool]:
        """:meth:`_generate`, counted in the worker's task counters while it runs."""
        task_id = task.request.id
        with self._lock:
            self.inflight_tasks += 1
            if task_id:
                self._running[task_id] = len(request.prompts)
        ok = False
        try:
            generated = self._generate(task, request, headers, deadline, traced)
            ok = True
            return generated
        finally:
            with self._lock:
                self._running.pop(task_id, None)
                self._terminated.discard(task_id)
                self.inflight_tasks -= 1
                self.completed_tasks += ok
                self.failed_tasks += not ok

    def _generate(
        self, task: Task, request: GenerateRequest, headers: dict[str, Any], deadline: float,
        traced: dict[str, Any] | None = None,
    ) -> tuple[list[PromptOutput], int, bool]:
        """Run the task's prompts: outputs, final version, whether it was checkpointed."""
        task_id = task.request.id
        stream = self._open_stream(task_id, request, headers)
        self._end_if_terminated(task)  # revoked while it waited to start
        if self.progress is not None:
            # A task requeued by a pause="abort" sync comes back while the sync
            # still runs: decide what to keep against the weights it will run on.
            self.host.wait_for_intake(deadline)
        # A streamed task is not checkpointed: its client reads the tokens as they come.
        checkpoint, saved = (None, {}) if stream is not None else self._checkpoint(task_id, headers)
        callback = self.on_submitted

        def submitted() -> None:
            if callback is not None and task_id:
                callback(task_id)
            self.mark_started(task)

        options = RunOptions(
            deadline=deadline,
            aborted=self._aborted_reader(task_id),
            on_submitted=submitted,
            first_index=first_prompt(headers),
            checkpoint=checkpoint,
            saved=saved,
            on_output=None if stream is None else stream.on_output,
            trace=traced,
        )
        outputs, version = self.host.generate(request, options)
        self._end_if_terminated(task)
        if stream is not None:
            stream.end()
        return outputs, version, checkpoint is not None

    def _open_stream(self, task_id: str | None, request: GenerateRequest, headers: dict[str, Any]) -> TaskStream | None:
        """The task's stream of deltas, when its producer asked for one."""
        if not headers.get(STREAM_HEADER) or self.streams is None or not task_id:
            return None
        tools = functools.partial(self._tool_stream, request) if request.kind == "chat" else None
        return self.streams.open(task_id, self.node, request.params.logprobs, tools)

    def _finish_samples(self, request: GenerateRequest, outputs: list[PromptOutput]) -> None:
        """Name this node on samples it made whole, and parse chat samples' tool calls."""
        for index, output in enumerate(outputs):
            conversation = request.conversation(index) if request.kind == "chat" else None
            for sample in output.samples:
                if not sample.workers:
                    sample.workers = [(0, self.node)]
                if conversation is not None:
                    self.host.tool_calls.parse(conversation, sample)


def parse_request(prompts: Any, params: Any) -> GenerateRequest:
    """The task's wire arguments, parsed (the one place they are)."""
    try:
        return GenerateRequest.model_validate({"prompts": prompts, "params": params})
    except ValidationError as exc:
        # Sent around the producer's checks (send_task, another client):
        # refused with what was wrong, not pydantic's error (which Celery
        # cannot rebuild on the producer, so its message was lost).
        raise InvalidRequest(f"generate task refused: {validation_summary(exc)}") from exc
