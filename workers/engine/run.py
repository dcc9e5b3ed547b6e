"""One generation run: a task's prompts through the engine host, to its outputs.

A run tokenizes the prompts, plans its engine requests (``plan_units``: a
prompt's ``n`` samples as one request, or one request per sample resumed
from a checkpoint), submits them through the host, waits for them (aborting
those whose client went away, or all at the deadline) and assembles one
``PromptOutput`` per prompt. A plain run is a plan of whole units, so plain,
streamed and checkpointed runs take the same road; they differ only in the
sinks that see each request's outputs as they come:

- :class:`StreamSink` — a streamed task's hook, fed each delta output;
- :class:`CheckpointSink` — the task's checkpointer, fed each sample as it grows.

A request with no sink asks vLLM for its final output only.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_queue.tasks.errors import GenerationTimeout, InvalidRequest, PromptTooLong
from rollout_queue.tasks.schemas import GenerateRequest, PromptOutput, Sample, SamplingParams
from rollout_queue.tasks.trace import stamp
from rollout_queue.workers.engine import logprobs as lp
from rollout_queue.workers.engine.errors import AbortedForSync, EngineLost, HandedOff
from rollout_queue.workers.engine.progress import (
    SampleKey,
    SampleProgress,
    TaskCheckpointer,
    Unit,
    finished_sample,
    join,
    plan_units,
)
from rollout_queue.workers.engine.sampling import to_vllm_params
from rollout_queue.workers.engine.tools import ToolCalls, render

log = logging.getLogger(__name__)

# How often a running task reads which of its prompts were given up by their
# client, and how long an aborted request may take to hand back its output.
ABORT_POLL_S = 0.2
ABORT_GRACE_S = 10.0

Futures = list[concurrent.futures.Future[Any]]


@dataclass(frozen=True)
class RunOptions:
    """How one task's run goes, besides its request.

    ``aborted``: the indices of prompts nobody waits for any more (their
    client went away), read once the requests are in the engine and every
    ``ABORT_POLL_S`` while generating; those prompts' requests are aborted,
    and their outputs end with ``finish_reason="abort"``.
    ``on_submitted``: called once every request is in the engine.
    ``first_index``: where this task's prompts start in its caller's call (a
    part of a split call), so errors name a prompt as the caller knows it.
    ``checkpoint``: save the samples' progress as they grow, and continue
    those in ``saved`` from their saved tokens (``workers.engine.progress``).
    ``on_output``: a streamed task's hook (``workers.engine.streaming``), called
    on the engine loop with the prompt's index and each delta output.
    ``trace``: a traced task's stamps (``tasks.trace``): the run adds ``submit``,
    ``added``, ``first_token`` and ``last_output``; None: untraced.
    """

    deadline: float
    aborted: Callable[[], set[int]] | None = None
    on_submitted: Callable[[], None] | None = None
    first_index: int = 0
    checkpoint: TaskCheckpointer | None = None
    saved: Mapping[SampleKey, SampleProgress] = field(default_factory=dict)
    on_output: Callable[[int, Any], None] | None = None
    trace: dict[str, Any] | None = None


class LiveRequest(Protocol):
    """What a run reads of a request the host tracks (``host.LiveRequest``)."""

    version: int
    spans: dict[int, list[tuple[int, int]]]
    aborted_for_sync: bool
    handed_off: bool


Drain = Callable[[str, Any], Any]  # (rid, output queue) -> a coroutine giving the final output


class RunHost(Protocol):
    """What a run uses of the engine host."""

    weight_version: int
    tokenizer: Any
    tool_calls: ToolCalls
    vocab_size: int
    max_model_len: int

    def submit(
        self, rids: list[str], prompt_ids: list[list[int]], samplings: list[Any], deadline: float,
        on_submitted: Callable[[], None] | None, drain: Drain,
    ) -> Futures: ...

    def abort(self, rids: list[str]) -> None: ...

    def live(self, rids: list[str]) -> Mapping[str, LiveRequest]: ...

    def release(self, rids: list[str]) -> None: ...

    def engine_error(self, exc: BaseException | None) -> Exception: ...

    def raise_if_lost(self) -> None: ...

    def count_finished(self, tokens: int) -> None: ...


class Sink(Protocol):
    """Sees a request's outputs as they come (on the engine loop)."""

    def delta(self, rid: str, out: Any) -> None:
        """Each output as it comes, before it is merged into the ones before."""

    def grown(self, rid: str, completion: Any) -> None:
        """A sample the output touched, all its tokens so far."""


class StreamSink:
    """A streamed task's hook: each delta output, with its prompt's index."""

    def __init__(self, on_output: Callable[[int, Any], None]) -> None:
        self.on_output = on_output

    def delta(self, rid: str, out: Any) -> None:
        try:
            self.on_output(prompt_of(rid), out)
        except Exception:  # a stream's trouble must not fail the generation
            log.exception("could not publish a delta output")

    def grown(self, rid: str, completion: Any) -> None:
        pass


class CheckpointSink:
    """The task's checkpointer: each sample as it grows."""

    def __init__(self, checkpoint: TaskCheckpointer) -> None:
        self.checkpoint = checkpoint

    def delta(self, rid: str, out: Any) -> None:
        pass

    def grown(self, rid: str, completion: Any) -> None:
        self.checkpoint.observe(rid, completion)


def version_spans(first: int, changes: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """``[[first_token_index, version], ...]`` with empty spans dropped.

    A change at token ``k`` means tokens ``k…`` came from the new weights; a
    change at 0 (the request had generated nothing yet) replaces the first span.
    """
    spans = [(0, first)]
    for start, version in sorted(changes):
        if start >= length and start > 0:
            break  # nothing generated after the change
        if start == spans[-1][0]:
            spans[-1] = (start, version)
        elif version != spans[-1][1]:
            spans.append((start, version))
    return spans


def prompt_of(rid: str) -> int:
    """The prompt index in a request id (``<batch>.<unit>-<prompt>``: always last)."""
    return int(rid.rsplit("-", 1)[1])


def merge(whole: Any, out: Any) -> None:
    """``whole.add(out, aggregate=True)`` (vLLM's merge of a delta output), with
    flat logprobs appended list by list (``workers.engine.logprobs.extend``) rather
    than by vLLM's ``FlatLogprobs.extend``, which builds a dict per position."""
    mine = {completion.index: completion for completion in whole.outputs}
    for completion in out.outputs:
        into = mine.get(completion.index)
        if into is not None and lp.is_flat(into.logprobs) and lp.is_flat(completion.logprobs):
            lp.extend(into.logprobs, completion.logprobs)
            completion.logprobs = None  # merged: vLLM's add skips it
    whole.add(out, aggregate=True)


def first_token_at(out: Any) -> float | None:
    """When vLLM's ``AsyncLLM`` processed the request's first token (unix time), from the
    output's request stats (vLLM keeps them while stats are logged); None without them."""
    metrics = getattr(out, "metrics", None)
    arrival = getattr(metrics, "arrival_time", 0.0) or 0.0  # wall clock, at add_request
    latency = getattr(metrics, "first_token_latency", 0.0) or 0.0
    if arrival and latency:
        return float(arrival + latency)
    first = getattr(metrics, "first_token_ts", 0.0) or 0.0  # the engine core's monotonic clock
    return float(time.time() - time.monotonic() + first) if first else None


def _stamp_outputs(trace: dict[str, Any], first_seen: float, whole: Any) -> None:
    """A finished request's ``added`` (vLLM's arrival time: ``add_request`` entered),
    ``first_token`` and ``last_output`` stamps: the earliest, earliest and latest over a
    task's requests (on the engine loop; without vLLM's stats, the run's own ``added``
    and the first output's arrival stand in)."""
    now = time.time()
    arrival = getattr(getattr(whole, "metrics", None), "arrival_time", 0.0) or 0.0
    if arrival:
        trace["added"] = min(arrival, trace.get("added", arrival))
    first = first_token_at(whole) or first_seen
    trace["first_token"] = min(first, trace.get("first_token", first))
    trace["last_output"] = max(now, trace.get("last_output", now))


async def collect(queue: Any, rid: str, sinks: Sequence[Sink], trace: dict[str, Any] | None = None) -> Any:
    """The request's final output (as ``AsyncLLM.generate`` drains its queue).

    With sinks the request sends deltas (every checkpoint interval where
    vLLM can: ``to_vllm_params``' ``every``), each merged into the first
    output. Deltas, not cumulative outputs: vLLM copies a cumulative
    output's whole token list at each output, quadratic in its length.
    ``trace``: a traced task's stamps (``tasks.trace``).
    """
    whole = None
    first_seen = 0.0
    while True:
        out = queue.get_nowait() or await queue.get()
        if trace is not None and not first_seen:
            first_seen = time.time()
        for sink in sinks:
            sink.delta(rid, out)
        if whole is None:
            whole = out
        else:
            merge(whole, out)
        if sinks:
            by_index = {completion.index: completion for completion in whole.outputs}
            for completion in out.outputs:
                for sink in sinks:
                    sink.grown(rid, by_index[completion.index])
        if out.finished:
            whole.outputs.sort(key=lambda completion: completion.index)
            if trace is not None:
                _stamp_outputs(trace, first_seen, whole)
            return whole


def tokenize(host: RunHost, request: GenerateRequest, first_index: int = 0) -> list[list[int]]:
    """Tokenize (chat template for conversations) and check every prompt fits.

    Errors name a prompt by its index in the caller's call: ``first_index``
    is where this task's prompts start in it (a part of a split call)."""
    ids: list[list[int]] = []
    for i, prompt in enumerate(request.prompts, start=first_index):
        if request.kind == "text":
            tokens = list(host.tokenizer(prompt).input_ids)
        elif request.kind == "chat":
            conversation = request.conversation(i - first_index)
            host.tool_calls.check(conversation)
            text = render(host.tokenizer, conversation)
            tokens = list(host.tokenizer(text, add_special_tokens=False).input_ids)
        else:
            tokens = list(prompt)  # type: ignore[arg-type]  # kind "tokens": ids already
            _check_vocabulary(host, i, tokens)
        _check_length(host, i, tokens)
        ids.append(tokens)
    return ids


def _check_vocabulary(host: RunHost, index: int, tokens: list[int]) -> None:
    bad = [t for t in tokens if t >= host.vocab_size]
    if bad:
        raise InvalidRequest(
            f"prompt {index} has token id {bad[0]}; this model's vocabulary has "
            f"{host.vocab_size} tokens (ids 0..{host.vocab_size - 1})"
        )


def _check_length(host: RunHost, index: int, tokens: list[int]) -> None:
    if not tokens:
        raise InvalidRequest(f"prompt {index} tokenizes to nothing; send at least one token")
    if len(tokens) >= host.max_model_len:
        raise PromptTooLong(
            f"prompt {index} has {len(tokens)} tokens; this worker's max_model_len is "
            f"{host.max_model_len} (prompt plus at least one generated token must fit)"
        )


class GenerationRun:
    """One task's prompts, from tokens to outputs, on one engine host."""

    def __init__(self, host: RunHost, request: GenerateRequest, options: RunOptions) -> None:
        self.host = host
        self.request = request
        self.options = options
        self.checkpoint = options.checkpoint
        self.sinks: list[Sink] = []
        if options.on_output is not None:
            self.sinks.append(StreamSink(options.on_output))
        if self.checkpoint is not None:
            self.sinks.append(CheckpointSink(self.checkpoint))

    def result(self) -> tuple[list[PromptOutput], int]:
        """Run every unit as one engine request; the outputs and the final version."""
        prompt_ids = tokenize(self.host, self.request, self.options.first_index)
        saved = dict(self.options.saved) if self.checkpoint is not None else {}
        units, complete = plan_units(prompt_ids, self.request.params, saved)
        batch = uuid.uuid4().hex[:12]
        rids = [f"{batch}.{k}-{unit.prompt}" for k, unit in enumerate(units)]  # prompt_of(rid)
        try:
            futures, stopped = self._generate(units, rids)
            outputs = self._assemble(prompt_ids, units, rids, futures, complete)
        except (AbortedForSync, HandedOff, EngineLost):
            if self.checkpoint is not None:
                self.checkpoint.save_now()  # the next run continues from here
            raise
        finally:
            self.host.release(rids)
        if stopped:
            log.info("aborted %d of %d prompts: their client went away or the task was revoked",
                     len(stopped), len(prompt_ids))
        return outputs, max(v for o in outputs for s in o.samples for _, v in s.weight_versions)

    def _samplings(self, units: list[Unit]) -> list[Any]:
        """vLLM's params of each unit: deltas when a sink reads them (every
        checkpoint interval where vLLM can), else the final output only."""
        kind = "delta" if self.sinks else "final"
        every = self.checkpoint.interval if self.checkpoint is not None else None
        made: dict[int, Any] = {}  # one per params object: whole units share the request's
        for unit in units:
            if id(unit.params) not in made:
                made[id(unit.params)] = to_vllm_params(unit.params, kind, every)
        return [made[id(unit.params)] for unit in units]

    def _generate(self, units: list[Unit], rids: list[str]) -> tuple[Futures, set[int]]:
        """Submit and wait for every unit; the futures, and the prompts stopped on the way."""
        futures = self._submit(units, rids) if units else []
        stopped = self._wait([unit.prompt for unit in units], rids, futures)
        self._check(futures, rids)
        return futures, stopped

    def _submit(self, units: list[Unit], rids: list[str]) -> Futures:
        """Every unit into the engine, its outputs drained into the run's sinks."""
        if self.checkpoint is not None:
            for rid, unit in zip(rids, units):
                self.checkpoint.watch(rid, unit)
        sinks = self.sinks
        traced = self.options.trace

        def drain(rid: str, queue: Any) -> Any:
            return collect(queue, rid, sinks, traced)

        samplings = self._samplings(units)
        stamp(traced, "submit")
        futures = self.host.submit(
            rids, [unit.engine_prompt for unit in units], samplings,
            self.options.deadline, self.options.on_submitted, drain,
        )
        if traced is not None:  # vLLM's arrival time replaces it when its stats are on
            traced.setdefault("added", time.time())
        return futures

    def _check(self, futures: Futures, rids: list[str]) -> None:
        """Raise what ended the requests other than their own finish: an engine
        error, a lost engine, a sync's abort, the worker's leaving."""
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
        if errors:
            raise self.host.engine_error(errors[0])
        self.host.raise_if_lost()
        lives = self.host.live(rids).values()
        if any(live.aborted_for_sync for live in lives):
            raise AbortedForSync("in-flight requests were aborted by a weight sync; requeue")
        if any(live.handed_off for live in lives):
            raise HandedOff("this worker is leaving; the task goes back to the queue (its samples' "
                            "progress saved where it is checkpointed)", countdown=0.0)

    def _wait(self, indices: list[int], rids: list[str], futures: Futures) -> set[int]:
        """Wait for every request, aborting those ``aborted`` names; returns their indices.

        Raises at the first failed request, or ``GenerationTimeout`` at the
        deadline (every request still running is aborted first).
        """
        by_prompt: dict[int, list[tuple[str, concurrent.futures.Future[Any]]]] = {}
        for index, rid, future in zip(indices, rids, futures):
            by_prompt.setdefault(index, []).append((rid, future))
        stopped: set[int] = set()
        stopped_at = 0.0
        pending = set(futures)
        while pending:
            # Read first here, with the requests in the engine, not before submitting:
            # a Redis round trip off every task's way to its first token. A prompt given
            # up while its task was queued is aborted as it starts: its output still
            # ends "abort", with what the engine made meanwhile.
            if self.options.aborted is not None:
                stopped_at = self._stop_aborted(self.options.aborted, by_prompt, stopped, stopped_at)
            pending = self._wait_once(pending, rids)
        return stopped

    def _stop_aborted(
        self, aborted: Callable[[], set[int]],
        by_prompt: dict[int, list[tuple[str, concurrent.futures.Future[Any]]]],
        stopped: set[int], stopped_at: float,
    ) -> float:
        """Abort the requests of prompts newly given up (added to ``stopped``);
        returns when the last ones were."""
        newly = {i for i in aborted() if i in by_prompt and i not in stopped}
        if newly:
            self.host.abort([rid for i in newly for rid, _ in by_prompt[i]])
            stopped |= newly
            return time.time()
        if stopped and time.time() - stopped_at > ABORT_GRACE_S:
            # vLLM answers an abort with a final output; should one never
            # come, stop waiting for it rather than hold the task.
            for _, future in (request for i in stopped for request in by_prompt[i]):
                future.cancel()
        return stopped_at

    def _wait_once(
        self, pending: set[concurrent.futures.Future[Any]], rids: list[str]
    ) -> set[concurrent.futures.Future[Any]]:
        """Wait one poll (or to the deadline); the requests still pending."""
        remaining = self.options.deadline - time.time()
        if remaining <= 0:
            self.host.abort(rids)
            raise GenerationTimeout(
                f"{len(pending)} of {len(rids)} prompts unfinished at the task's time limit; "
                "their engine requests were aborted"
            )
        poll = min(remaining, ABORT_POLL_S) if self.options.aborted else remaining
        done, still = concurrent.futures.wait(pending, timeout=poll, return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = [f for f in done if not f.cancelled() and f.exception() is not None]
        if failed:
            self.host.abort(rids)
            raise self.host.engine_error(failed[0].exception())
        return still

    def _assemble(
        self, prompt_ids: list[list[int]], units: list[Unit], rids: list[str], futures: Futures,
        complete: dict[SampleKey, SampleProgress],
    ) -> list[PromptOutput]:
        """One output per prompt: its samples in order, each joined to its saved
        part; a sample with no output (its prompt aborted first) is empty."""
        samples = {key: finished_sample(p, self._decode) for key, p in complete.items()}
        prompt_lps: dict[int, PromptOutput] = {}  # each prompt's logprobs, from its first request
        lives = self.host.live(rids)
        for rid, unit, future in zip(rids, units, futures):
            if future.cancelled():
                continue
            out = self._output(future.result(), lives[rid], unit.params, len(prompt_ids[unit.prompt]))
            prompt_lps.setdefault(unit.prompt, out)
            for index, sample in enumerate(out.samples):
                samples[(unit.prompt, unit.samples[index])] = self._joined(unit, sample)
        version = self.host.weight_version
        missing = Sample(text="", token_ids=[], finish_reason="abort", weight_versions=[(0, version)])
        n = self.request.params.n
        return [
            PromptOutput(
                prompt_token_ids=ids,
                prompt_logprobs=prompt_lps[i].prompt_logprobs if i in prompt_lps else None,
                prompt_top_logprobs=prompt_lps[i].prompt_top_logprobs if i in prompt_lps else None,
                prompt_ranks=prompt_lps[i].prompt_ranks if i in prompt_lps else None,
                samples=[samples.get((i, s), missing) for s in range(n)],
            )
            for i, ids in enumerate(prompt_ids)
        ]

    def _joined(self, unit: Unit, sample: Sample) -> Sample:
        """A unit's sample after the part saved before (resumed units only)."""
        if unit.prefix is None or self.checkpoint is None:
            return sample  # the service names the node of a whole sample
        return join(unit.prefix, sample, self.checkpoint.node, self._decode)

    def _output(self, out: Any, live: LiveRequest, params: SamplingParams, prompt_length: int) -> PromptOutput:
        """One request's final output as ours: samples with their logprobs and
        version spans; prompt logprobs of the prompt's own tokens (a resumed
        request's prompt also holds the tokens generated before)."""
        samples = []
        for comp in out.outputs:
            token_ids = list(comp.token_ids)
            logprobs = top = None
            if params.logprobs is not None and comp.logprobs is not None:
                logprobs, top = lp.sample_logprobs(comp.logprobs, token_ids, params.logprobs)
            samples.append(Sample(
                text=comp.text, token_ids=token_ids, logprobs=logprobs, top_logprobs=top,
                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                weight_versions=version_spans(live.version, live.spans.get(comp.index, []), len(token_ids)),
            ))
        self.host.count_finished(sum(len(sample.token_ids) for sample in samples))
        prompt_ids = list(out.prompt_token_ids or [])[:prompt_length]
        prompt_lps = prompt_top = prompt_ranks = None
        if params.prompt_logprobs is not None and out.prompt_logprobs is not None:
            prompt_lps, prompt_top = lp.prompt_logprobs(out.prompt_logprobs, prompt_ids, params.prompt_logprobs)
            prompt_ranks = lp.prompt_ranks(out.prompt_logprobs, prompt_ids)
        return PromptOutput(
            prompt_token_ids=prompt_ids, prompt_logprobs=prompt_lps, prompt_top_logprobs=prompt_top,
            prompt_ranks=prompt_ranks, samples=samples,
        )

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.host.tokenizer.decode(token_ids, skip_special_tokens=True))
