"""Publishing a streamed task's incremental outputs to its Redis Stream.

The engine loop hands each delta output of a streamed task's requests to
:meth:`TaskStream.on_output`, which turns it into a ``StreamEvent`` (JSON)
and queues it; one publisher thread per worker writes queued events in
pipelined ``XADD`` s (``MAXLEN ~`` bound, expiry refreshed), so the engine
loop never waits on Redis. ``start`` opens each attempt; ``end`` is written,
and waited for, before the task returns, so a reader sees every delta and
the end before the result appears in the result backend.

Readers: ``tasks.streaming`` (Python producers) and ``api.streaming`` (the gateway).
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from typing import Any

import redis

from rollout_queue.tasks import keys
from rollout_queue.tasks.schemas import SampleDelta, StreamEvent
from rollout_queue.workers.engine.logprobs import sample_logprobs
from rollout_queue.workers.engine.tools import ToolStream

log = logging.getLogger(__name__)

# How long a task waits for its end event to reach Redis before returning
# anyway (readers then end on the stored result).
END_WRITE_TIMEOUT_S = 5.0


class DeltaPublisher:
    """The worker's one stream writer: a thread draining a queue into Redis pipelines."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._queue: queue.SimpleQueue[tuple[str, str, threading.Event | None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def open(
        self, task_id: str, worker: str, logprobs: int | None,
        tools: Callable[[int], ToolStream | None] | None = None,
    ) -> TaskStream:
        """``tools``: a prompt's tool-call parser for each of its samples (chat with tools), or None."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="delta-publisher", daemon=True)
                self._thread.start()
        stream = TaskStream(self, keys.token_stream(task_id), worker, logprobs, tools)
        stream.emit("start")
        return stream

    def put(self, key: str, event: str, written: threading.Event | None = None) -> None:
        self._queue.put((key, event, written))

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(batch)
            except redis.RedisError as exc:
                # Readers then end on the stored result (or see a gap): the
                # generation itself goes on.
                log.warning("could not publish %d stream events: %s", len(batch), exc)
            except Exception:  # this thread must outlive any one bad batch
                log.exception("could not publish %d stream events", len(batch))
            finally:
                for _, _, written in batch:
                    if written is not None:
                        written.set()

    def _write(self, batch: list[tuple[str, str, threading.Event | None]]) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            for key, event, _ in batch:
                pipe.xadd(key, {"event": event}, maxlen=keys.TOKEN_STREAM_MAXLEN, approximate=True)
            for key in {key for key, _, _ in batch}:
                pipe.expire(key, keys.TOKEN_STREAM_TTL_S)
            pipe.execute()


class TaskStream:
    """One attempt of one streamed task: numbers its events and converts engine outputs."""

    def __init__(
        self, publisher: DeltaPublisher, key: str, worker: str, logprobs: int | None,
        tools: Callable[[int], ToolStream | None] | None = None,
    ) -> None:
        self._publisher = publisher
        self._key = key
        self._worker = worker
        self._logprobs = logprobs
        self._tools = tools
        self._parsers: dict[tuple[int, int], ToolStream | None] = {}
        self._attempt = uuid.uuid4().hex[:12]
        self._seq = 0
        self._lock = threading.Lock()  # outputs come from the engine loop, start/end from the task

    def emit(
        self, kind: str, deltas: list[SampleDelta] | None = None, written: threading.Event | None = None
    ) -> None:
        with self._lock:
            event = StreamEvent(
                kind=kind,  # type: ignore[arg-type]
                attempt=self._attempt, seq=self._seq, worker=self._worker, deltas=deltas or [],
            )
            self._seq += 1
            self._publisher.put(self._key, event.model_dump_json(), written)

    def on_output(self, prompt: int, output: Any) -> None:
        """A delta ``RequestOutput`` of the task's prompt ``prompt`` (engine loop; must not block)."""
        deltas = []
        for comp in output.outputs:
            token_ids = list(comp.token_ids)
            if not token_ids and comp.finish_reason is None:
                continue
            logprobs = top = None
            if self._logprobs is not None and comp.logprobs is not None:
                logprobs, top = sample_logprobs(comp.logprobs, token_ids, self._logprobs)
            delta = SampleDelta(
                prompt=prompt, sample=comp.index, text=comp.text, token_ids=token_ids,
                logprobs=logprobs, top_logprobs=top, finish_reason=comp.finish_reason,
                stop_reason=comp.stop_reason,
            )
            if self._tools is not None:
                key = (prompt, comp.index)
                if key not in self._parsers:
                    self._parsers[key] = self._tools(prompt)
                parser = self._parsers[key]
                if parser is not None:
                    parser.feed(delta)
            deltas.append(delta)
        if deltas:
            self.emit("delta", deltas)

    def end(self) -> None:
        """Write the end event and wait (bounded) until it is in Redis."""
        written = threading.Event()
        self.emit("end", written=written)
        if not written.wait(END_WRITE_TIMEOUT_S):
            log.warning("the end of %s was not written within %.0f s", self._key, END_WRITE_TIMEOUT_S)
