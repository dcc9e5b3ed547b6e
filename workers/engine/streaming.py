"""Publishing a streamed task's incremental outputs to its Redis Stream.

The engine loop hands each delta output of a streamed task's requests to
:meth:`TaskStream.on_output`, which turns it into ``SampleDelta`` s and adds
them to the stream's pending list; the first delta since the stream's last
flush also asks the publisher for one. One publisher thread per worker serves those
requests in order: a flush turns every delta then pending for the stream
into one ``delta`` event (``StreamEvent``, JSON), numbered there, and the
events of a round go to Redis in one pipeline of ``XADD`` s (``MAXLEN ~``
bound, expiry refreshed). So the engine loop never waits on Redis or on
JSON, and a task's stream grows by about one event per publisher write, not
one per prompt per engine step. (It was one event per output: a 512-prompt
task on an H200 wrote 512 events a step, its reader fell more than the
stream's bound, ``keys.TOKEN_STREAM_MAXLEN``, behind and failed with
``StreamInterrupted``.)

An event holds the deltas of several prompts and samples, in the order the
engine produced them (one sample may appear more than once); readers hand
them on one by one, as before. ``start`` opens each attempt; ``end`` is
written, and waited for, before the task returns: its request first flushes
what is pending, so a reader sees every delta and then the end, with
consecutive ``seq`` numbers, before the result appears in the result backend.
Every ``seq`` is taken on the publisher thread, in the order its requests
were queued, so numbers and stream order always agree.

Readers: ``tasks.streaming`` (Python producers) and ``api.streaming`` (the gateway).
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from typing import Any, Literal

import redis

from rollout_queue.tasks import keys
from rollout_queue.tasks.schemas import SampleDelta, StreamEvent
from rollout_queue.workers.engine.logprobs import sample_logprobs
from rollout_queue.workers.engine.tools import ToolStream

log = logging.getLogger(__name__)

# How long a task waits for its end event to reach Redis before returning
# anyway (readers then end on the stored result).
END_WRITE_TIMEOUT_S = 5.0

# What a stream asks of the publisher: write its pending deltas (marker None),
# with a start event before them or an end event after them.
Marker = Literal["start", "end"]
Request = tuple["TaskStream", Marker | None, threading.Event | None]


class DeltaPublisher:
    """The worker's one stream writer: a thread turning streams' requests into Redis pipelines."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._queue: queue.SimpleQueue[Request] = queue.SimpleQueue()
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

    def request(self, stream: TaskStream, marker: Marker | None = None, written: threading.Event | None = None) -> None:
        """Queue ``stream``'s pending deltas (and ``marker``) for the next write; never blocks."""
        self._queue.put((stream, marker, written))

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write([entry for stream, marker, _ in batch for entry in stream.take(marker)])
            except redis.RedisError as exc:
                # Readers then end on the stored result (or see a gap): the
                # generation itself goes on.
                log.warning("could not publish %d stream requests: %s", len(batch), exc)
            except Exception:  # this thread must outlive any one bad batch
                log.exception("could not publish %d stream requests", len(batch))
            finally:
                for _, _, written in batch:
                    if written is not None:
                        written.set()

    def _write(self, entries: list[tuple[str, str]]) -> None:
        if not entries:
            return
        with self.client.pipeline(transaction=False) as pipe:
            for key, event in entries:
                pipe.xadd(key, {"event": event}, maxlen=keys.TOKEN_STREAM_MAXLEN, approximate=True)
            for key in {key for key, _ in entries}:
                pipe.expire(key, keys.TOKEN_STREAM_TTL_S)
            pipe.execute()


class TaskStream:
    """One attempt of one streamed task: converts engine outputs, gathers them, numbers its events."""

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
        self._seq = 0  # the publisher thread's alone
        # Deltas from the engine loop, taken by the publisher thread.
        self._lock = threading.Lock()
        self._pending: list[SampleDelta] = []
        self._flush_requested = False

    def emit(self, marker: Marker, written: threading.Event | None = None) -> None:
        """Write ``marker`` (``written``: set once it is in Redis); ``end`` goes after every delta given so far."""
        self._publisher.request(self, marker, written)

    def take(self, marker: Marker | None) -> list[tuple[str, str]]:
        """(key, event JSON) for the publisher: one event of the pending deltas, if any, after
        ``start`` (the stream's first request: deltas may have gathered before it is served)
        and before ``end``.

        Publisher thread only: the ``seq`` numbers follow the order of its requests."""
        with self._lock:
            deltas, self._pending, self._flush_requested = self._pending, [], False
        kinds: list[tuple[str, list[SampleDelta]]] = [("start", [])] if marker == "start" else []
        if deltas:
            kinds.append(("delta", deltas))
        if marker == "end":
            kinds.append(("end", []))
        entries = []
        for kind, carried in kinds:
            event = StreamEvent(
                kind=kind,  # type: ignore[arg-type]
                attempt=self._attempt, seq=self._seq, worker=self._worker, deltas=carried,
            )
            self._seq += 1
            entries.append((self._key, event.model_dump_json()))
        return entries

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
        if not deltas:
            return
        with self._lock:
            self._pending += deltas
            request, self._flush_requested = not self._flush_requested, True
        if request:  # one queued flush per stream at a time: it takes whatever is pending by then
            self._publisher.request(self)

    def end(self) -> None:
        """Write the pending deltas and the end event, and wait (bounded) until they are in Redis."""
        written = threading.Event()
        self.emit("end", written=written)
        if not written.wait(END_WRITE_TIMEOUT_S):
            log.warning("the end of %s was not written within %.0f s", self._key, END_WRITE_TIMEOUT_S)
