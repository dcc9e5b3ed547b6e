"""Checkpointed partial generations: save each sample's progress, resume from it.

While a ``generate`` task runs, every ``RQ_CHECKPOINT_TOKENS`` generated tokens
its unfinished samples are written to Redis, one pipelined write per task per
interval, in the hash ``rq:progress:<task_id>`` (the key expires). Each write
appends: field ``<prompt>:<sample>:<start>`` holds the tokens generated since
the sample's last write (a :class:`SampleProgress` as JSON whose token ids and
logprobs start at token ``start``, with the whole sample's weight-version and
worker spans and its finish state), so what a sample costs to checkpoint grows
with its length, not with its length squared: a 16k-token sample at 64-token
intervals writes 16k tokens, not 2M. :func:`read_progress` joins a sample's
chunks back in order of ``start``, each one continuing the one before
(its worker spans extend the chain's); a chunk that does not (a worker
declared dead that still wrote) ends the sample there. When the task comes
back (the reaper, a SIGTERM hand-off, a ``pause="abort"`` sync), the worker
that takes it reads the hash and plans one engine request per unfinished
sample with progress: prompt + generated tokens as its prompt, the remaining
``max_tokens``, ``n=1``. It then joins each sample's saved part and new part
into one ``Sample``: contiguous token ids and logprobs, the weight-version
spans of both parts, and ``workers`` spans naming the node of each part.

The parts:

- :class:`SampleProgress` — one sample's tokens so far and their provenance;
- :class:`ProgressStore` — the Redis hash of a task (load, save, drop);
- :class:`Unit` and :func:`plan_units` — the engine requests of a task run;
- :class:`TaskCheckpointer` — watches a task's requests (called from the
  engine loop for every output), writes when a sample crossed an interval,
  on one writer thread shared by the worker (never on the engine loop).

Resumed sampling is not bit-identical to an uninterrupted run: the new
request samples from its own random stream (a seeded request gets a seed
derived from the sample and its length), and presence/frequency penalties
and ``min_tokens`` count from the resume point. Structured-output requests
are never resumed mid-way (the grammar would restart inside the output);
they restart from scratch.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis

from rollout_queue.tasks import keys
from rollout_queue.tasks.schemas import Sample, SamplingParams
from rollout_queue.workers.engine.logprobs import sample_logprobs

log = logging.getLogger(__name__)

# A number type msgspec does not know (a numpy scalar from some vLLM) is
# written as a float, as json.dumps wrote its float subclasses.
_ENCODE = msgspec.json.Encoder(enc_hook=float).encode
SampleKey = tuple[int, int]  # (prompt index in the task, sample index in the prompt)
ChunkKey = tuple[int, int, int]  # (prompt, sample, index of the chunk's first token in the sample)


@dataclass
class SampleProgress:
    """What one sample has generated so far, and which weights and nodes made it."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    workers: list[tuple[int, str]] = field(default_factory=list)
    finish_reason: str | None = None  # set: the sample is complete
    stop_reason: str | int | None = None

    def to_json(self) -> bytes:
        # msgspec, not json: a checkpoint encodes every generated token and
        # logprob on the worker's Python, beside vLLM's output handling (16x
        # faster than json.dumps on 64-token chunks; the same JSON).
        return _ENCODE({
            "t": self.token_ids, "lp": self.logprobs, "top": self.top_logprobs,
            "v": self.weight_versions, "w": self.workers,
            "f": self.finish_reason, "s": self.stop_reason,
        })

    @classmethod
    def from_json(cls, raw: str | bytes) -> SampleProgress:
        data = json.loads(raw)
        top = data.get("top")
        return cls(
            token_ids=[int(t) for t in data["t"]],
            logprobs=data.get("lp"),
            top_logprobs=None if top is None else [[(int(a), float(b)) for a, b in pos] for pos in top],
            weight_versions=[(int(a), int(b)) for a, b in data["v"]],
            workers=[(int(a), str(b)) for a, b in data["w"]],
            finish_reason=data.get("f"),
            stop_reason=data.get("s"),
        )

    @property
    def last_version(self) -> int | None:
        return self.weight_versions[-1][1] if self.weight_versions else None

    def continues(self, start: int, chain: SampleProgress) -> bool:
        """Whether this chunk (first token ``start``) follows on from ``chain``: it
        starts where the chain ends and was written by the chain's workers."""
        return start == len(chain.token_ids) and [span for span in self.workers if span[0] < start] == chain.workers

    def extend(self, chunk: SampleProgress) -> None:
        """Append ``chunk``'s tokens; its spans and finish state are the sample's now."""
        self.token_ids.extend(chunk.token_ids)
        self.logprobs = _joined(self.logprobs, chunk.logprobs)
        self.top_logprobs = _joined(self.top_logprobs, chunk.top_logprobs)
        self.weight_versions, self.workers = chunk.weight_versions, chunk.workers
        self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason


def _joined(values: list[Any] | None, more: list[Any] | None) -> list[Any] | None:
    if values is None or more is None:
        return None
    values.extend(more)
    return values


def read_progress(raw: dict[Any, Any]) -> dict[SampleKey, SampleProgress]:
    """The samples of a progress hash (field → JSON chunk, as Redis returns it)."""
    chunks: dict[SampleKey, list[tuple[int, SampleProgress]]] = {}
    for name, value in raw.items():
        try:
            parts = [int(part) for part in (name.decode() if isinstance(name, bytes) else str(name)).split(":")]
            prompt, sample, start = parts if len(parts) == 3 else (*parts, 0)  # a whole sample: one chunk
            chunks.setdefault((prompt, sample), []).append((start, SampleProgress.from_json(value)))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring an unreadable checkpoint entry %r: %s", name, exc)
    saved: dict[SampleKey, SampleProgress] = {}
    for key, pieces in chunks.items():
        chain = SampleProgress(token_ids=[], logprobs=[], top_logprobs=[])
        for start, chunk in sorted(pieces, key=lambda piece: piece[0]):
            if not chunk.continues(start, chain):
                break
            chain.extend(chunk)
        saved[key] = chain
    return saved


def _join_spans(first: list[tuple[int, Any]], offset: int, second: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Spans of ``first`` then ``second`` shifted by ``offset``; a span that repeats
    the value before it is merged into it."""
    spans = list(first)
    for start, value in second:
        start += offset
        if spans and spans[-1][0] == start:
            spans[-1] = (start, value)
        elif not spans or spans[-1][1] != value:
            spans.append((start, value))
    return spans


def join(prefix: SampleProgress | None, sample: Sample, node: str, decode: Callable[[list[int]], str]) -> Sample:
    """The saved part ``prefix`` followed by ``sample`` (generated after it on ``node``)."""
    if prefix is None:
        return sample.model_copy(update={"workers": [(0, node)]})
    offset = len(prefix.token_ids)
    token_ids = prefix.token_ids + sample.token_ids
    logprobs = None
    if prefix.logprobs is not None and sample.logprobs is not None:
        logprobs = prefix.logprobs + sample.logprobs
    top = None
    if prefix.top_logprobs is not None and sample.top_logprobs is not None:
        top = prefix.top_logprobs + sample.top_logprobs
    return Sample(
        text=decode(token_ids),
        token_ids=token_ids,
        logprobs=logprobs,
        top_logprobs=top,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
        weight_versions=_join_spans(prefix.weight_versions, offset, sample.weight_versions),
        workers=_join_spans(prefix.workers, offset, [(0, node)]),
    )


def finished_sample(progress: SampleProgress, decode: Callable[[list[int]], str]) -> Sample:
    """A sample that was complete in its checkpoint: nothing left to generate."""
    return Sample(
        text=decode(progress.token_ids),
        token_ids=progress.token_ids,
        logprobs=progress.logprobs,
        top_logprobs=progress.top_logprobs,
        finish_reason=progress.finish_reason,
        stop_reason=progress.stop_reason,
        weight_versions=progress.weight_versions,
        workers=progress.workers,
    )


class ProgressStore:
    """The progress hashes of tasks, on the worker's Redis client."""

    def __init__(self, client: redis.Redis, ttl_s: float) -> None:
        self.client = client
        self.ttl_s = max(1, int(ttl_s))
        # One writer for the worker: writes leave the engine loop at once and
        # go out in order; a slow Redis delays checkpoints, never generation.
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")

    def load(self, task_id: str) -> dict[SampleKey, SampleProgress]:
        """The task's saved samples; empty when none (or Redis cannot say: start over)."""
        try:
            raw = self.client.hgetall(keys.progress_key(task_id))
        except redis.RedisError as exc:
            log.warning("could not read the checkpoint of task %s (%s); generating from scratch", task_id, exc)
            return {}
        return read_progress(raw)  # type: ignore[arg-type]

    def save(self, task_id: str, chunks: dict[ChunkKey, SampleProgress]) -> bool:
        """Append each sample's new chunk to the task's hash; False if Redis did not take them."""
        if not chunks:
            return True
        key = keys.progress_key(task_id)
        mapping: dict[Any, Any] = {f"{p}:{s}:{start}": chunk.to_json() for (p, s, start), chunk in chunks.items()}
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(key, mapping=mapping)
            pipe.expire(key, self.ttl_s)
            pipe.execute()
        except redis.RedisError as exc:  # the chunks stay unsaved: the next interval writes them
            log.warning("checkpoint of task %s not written: %s", task_id, exc)
            return False
        return True

    def drop(self, task_id: str) -> None:
        try:
            self.client.delete(keys.progress_key(task_id))
        except redis.RedisError as exc:  # expires on its own
            log.warning("could not delete the checkpoint of task %s: %s", task_id, exc)

    def close(self) -> None:
        self.writer.shutdown(wait=True)


@dataclass
class Unit:
    """One engine request of a task run: a prompt's ``n`` samples, or one resumed sample."""

    prompt: int
    samples: list[int]  # completion index i of the request is sample samples[i]
    engine_prompt: list[int]
    params: SamplingParams
    prefix: SampleProgress | None = None


def resumable(params: SamplingParams) -> bool:
    """Whether a sample of these params can continue from saved tokens."""
    structured = (params.json_schema, params.regex, params.choice, params.grammar)
    return all(value is None for value in structured) and not params.json_object


def _resumed_params(params: SamplingParams, sample: int, generated: int) -> SamplingParams:
    update: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_tokens - generated,
        "min_tokens": max(0, params.min_tokens - generated),
    }
    if params.seed is not None:
        # Its own stream, still reproducible for the same resume point.
        update["seed"] = (params.seed + 1_000_003 * (sample + 1) + generated) % 2**63
    return params.model_copy(update=update)


def plan_units(
    prompt_ids: list[list[int]], params: SamplingParams, saved: dict[SampleKey, SampleProgress],
) -> tuple[list[Unit], dict[SampleKey, SampleProgress]]:
    """The engine requests for a task run, and the samples already complete.

    A prompt without saved samples is one request of ``n`` samples, as
    always; a prompt with some is one request per unfinished sample (those
    with progress continue from it). (A prompt whose client left starts and
    is aborted at once: ``workers.engine.run`` reads the abort set after submitting.)
    """
    if not resumable(params):
        saved = {}
    units: list[Unit] = []
    complete: dict[SampleKey, SampleProgress] = {}
    for prompt, ids in enumerate(prompt_ids):
        mine = {s: p for (i, s), p in saved.items() if i == prompt and 0 <= s < params.n}
        if not mine:
            units.append(Unit(prompt, list(range(params.n)), ids, params))
            continue
        for sample in range(params.n):
            progress = mine.get(sample)
            if progress is None or not progress.token_ids:
                units.append(Unit(prompt, [sample], ids, params.model_copy(update={"n": 1})))
                continue
            generated = len(progress.token_ids)
            if progress.finish_reason is not None or generated >= params.max_tokens:
                if progress.finish_reason is None:
                    progress.finish_reason = "length"
                complete[(prompt, sample)] = progress
                continue
            units.append(Unit(
                prompt, [sample], ids + progress.token_ids,
                _resumed_params(params, sample, generated), progress,
            ))
    return units, complete


class TaskCheckpointer:
    """Watches one task run's engine requests and saves their samples' progress.

    ``observe`` runs on the engine loop for every output of every request (it
    only records the output and compares lengths); writes run on the store's
    writer thread, one pipelined write per task per interval.
    """

    def __init__(
        self, store: ProgressStore, task_id: str, node: str, interval_tokens: int,
        spans_of: Callable[[str, int, int], list[tuple[int, int]]],
    ) -> None:
        self.store = store
        self.task_id = task_id
        self.node = node
        self.interval = interval_tokens
        self.spans_of = spans_of  # (rid, completion index, length) -> version spans
        self.units: dict[str, Unit] = {}
        self._latest: dict[tuple[str, int], Any] = {}  # (rid, completion index) -> CompletionOutput
        self._saved_len: dict[tuple[str, int], int] = {}
        self._pending = False
        self._lock = threading.Lock()
        self.writes = 0

    def watch(self, rid: str, unit: Unit) -> None:
        self.units[rid] = unit

    def observe(self, rid: str, completion: Any) -> None:
        """One sample of a request, all its tokens so far (engine loop; the object
        grows in place as later deltas are merged into it)."""
        key = (rid, completion.index)
        self._latest[key] = completion
        grown = len(completion.token_ids) - self._saved_len.get(key, 0)
        if grown < self.interval and (completion.finish_reason is None or grown <= 0):
            return
        with self._lock:
            if self._pending:
                return
            self._pending = True
        self.store.writer.submit(self._write)

    def _write(self) -> None:
        with self._lock:
            self._pending = False
        self._save(final=False)
        self.writes += 1

    def save_now(self) -> None:
        """Write every sample's progress, finished ones included (before a requeue)."""
        self.store.writer.submit(self._save, True).result(timeout=30)

    def _save(self, final: bool) -> None:
        chunks, lengths = self.chunks(final)
        if self.store.save(self.task_id, chunks):
            self._saved_len.update(lengths)

    def chunks(self, final: bool) -> tuple[dict[ChunkKey, SampleProgress], dict[tuple[str, int], int]]:
        """Each sample's tokens since its last save (``final``: a finished sample
        also without new ones, to record its finish), and the saved lengths once
        they are written. Runs on the writer thread while the engine loop merges
        outputs: a finish is read first, since vLLM sets it after the tokens."""
        chunks: dict[ChunkKey, SampleProgress] = {}
        lengths: dict[tuple[str, int], int] = {}
        for key, completion in list(self._latest.items()):
            rid, index = key
            unit = self.units.get(rid)
            if unit is None:
                continue
            finish_reason, stop_reason = completion.finish_reason, completion.stop_reason
            finished = finish_reason is not None and finish_reason != "abort"
            saved, end = self._saved_len.get(key, 0), len(completion.token_ids)
            if end <= saved and not (final and finished):
                continue
            chunk = self._chunk(unit, rid, index, completion, saved, end)
            if finished and saved + len(chunk.token_ids) == end:
                chunk.finish_reason, chunk.stop_reason = finish_reason, stop_reason
            kept = len(unit.prefix.token_ids) if unit.prefix is not None else 0
            chunks[(unit.prompt, unit.samples[index], kept + saved)] = chunk
            lengths[key] = saved + len(chunk.token_ids)
        return chunks, lengths

    def _chunk(self, unit: Unit, rid: str, index: int, completion: Any, saved: int, end: int) -> SampleProgress:
        """Tokens ``saved:end`` of one request's sample, with the sample's spans so far."""
        params = unit.params
        token_ids = completion.token_ids[saved:end]
        logprobs = top = None
        if params.logprobs is not None and completion.logprobs is not None:
            logprobs, top = sample_logprobs(completion.logprobs, token_ids, params.logprobs, start=saved)
            token_ids = token_ids[: len(logprobs)]  # tokens whose logprobs are not merged yet wait
        length = saved + len(token_ids)
        chunk = SampleProgress(
            token_ids=list(token_ids), logprobs=logprobs, top_logprobs=top,
            weight_versions=self.spans_of(rid, index, length), workers=[(0, self.node)],
        )
        prefix = unit.prefix
        if prefix is not None:
            offset = len(prefix.token_ids)
            chunk.weight_versions = _join_spans(prefix.weight_versions, offset, chunk.weight_versions)
            chunk.workers = _join_spans(prefix.workers, offset, chunk.workers)
        return chunk
