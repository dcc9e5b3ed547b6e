"""``EngineHost``: one vLLM engine, driven by one background event loop.

Every prompt of every task becomes one engine request on the same
``AsyncLLM``; requests from concurrent tasks join the running batch
(continuous batching). Celery task threads call :meth:`EngineHost.generate`,
which blocks on ``concurrent.futures`` futures resolved by the loop thread.

The host also owns what a weight sync needs from the engine: closing intake,
pausing in one of three modes, RPCs into the engine's worker processes,
prefix-cache reset, the ``weight_version`` stamped on results, and the
per-sample version spans recorded when a ``keep`` sync crosses a request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollout_queue.tasks.errors import EngineError, GenerationTimeout, InvalidRequest, PromptTooLong, Requeue
from rollout_queue.tasks.schemas import GenerateRequest, PauseMode, PromptOutput, Sample, SamplingParams
from rollout_queue.workers.engine import logprobs as lp
from rollout_queue.workers.engine import orphans
from rollout_queue.workers.engine.progress import (
    SampleKey,
    SampleProgress,
    TaskCheckpointer,
    finished_sample,
    join,
    plan_units,
)
from rollout_queue.workers.engine.stats import EngineStats, stat_logger_factory
from rollout_queue.workers.engine.tools import ToolCalls, render
from rollout_queue.workers.settings import EngineSettings
from rollout_queue.workers.state import NodeState

log = logging.getLogger(__name__)
T = TypeVar("T")

EXTENSION_CLS = "rollout_queue.weight_sync.receiver.WeightReceiver"
# How often a running task reads which of its prompts were given up by their
# client, and how long an aborted request may take to hand back its output.
ABORT_POLL_S = 0.2
ABORT_GRACE_S = 10.0


class AbortedForSync(Requeue):
    """In-flight requests were aborted by a ``pause="abort"`` sync: requeue the task."""


class HandedOff(Requeue):
    """The worker is leaving (SIGTERM past its drain deadline): requeue the task at once."""


class EngineLost(Requeue):
    """The engine died or stopped answering: the task goes back to the queue at
    once, for another worker (nothing was wrong with it; the worker leaves)."""


@dataclass
class _Live:
    """A request in the engine, and the weight versions its samples crossed."""

    version: int
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    aborted_for_sync: bool = False
    handed_off: bool = False  # aborted by hand_off(): the task goes back to the queue
    sequences: int = 1  # the request's samples (n): what it holds of max_num_seqs
    finished: bool = False  # its final output is in (the task may still wait for others)
    future: concurrent.futures.Future[Any] | None = None  # its final output; cancelled if the engine is lost


def per_request_stream_interval() -> bool:
    """Whether this vLLM's ``SamplingParams`` take a ``stream_interval`` (0.32 does)."""
    return _takes("stream_interval")


@functools.cache
def _takes(name: str) -> bool:
    """Whether this vLLM's ``SamplingParams`` have the field ``name``."""
    from vllm import SamplingParams as VllmSamplingParams

    return name in getattr(VllmSamplingParams, "__struct_fields__", ())


def to_vllm_params(params: SamplingParams, kind: str = "final", every: int | None = None) -> Any:
    """Our validated params → ``vllm.SamplingParams``. ``kind``: the output
    vLLM sends: ``final`` only, or each step's ``delta`` (streamed tasks,
    checkpoints). ``every``: deltas only each ``every`` tokens (and the
    first and last), where vLLM has per-request ``stream_interval`` (0.32
    does; older versions send every step): a checkpoint reads one output per
    interval, and an output for every request at every step is what
    checkpoints cost (0.70x the throughput on an H200 batch of 1024, with
    cumulative outputs at every step)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kwargs: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "n": params.n,
        "stop": params.stop,
        "stop_token_ids": params.stop_token_ids,
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "ignore_eos": params.ignore_eos,
        "output_kind": {"final": RequestOutputKind.FINAL_ONLY, "delta": RequestOutputKind.DELTA}[kind],
    }
    if params.top_k is not None:
        kwargs["top_k"] = params.top_k
    if (params.logprobs is not None or params.prompt_logprobs is not None) and _takes("flat_logprobs"):
        kwargs["flat_logprobs"] = True  # a few lists per request, not objects per token (workers.engine.logprobs)
    if every is not None and every > 1 and per_request_stream_interval():
        kwargs["stream_interval"] = every
    structured = None
    if params.json_schema is not None:
        structured = StructuredOutputsParams(json=params.json_schema, disable_any_whitespace=True)
    elif params.json_object:
        structured = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    elif params.regex is not None:
        structured = StructuredOutputsParams(regex=params.regex)
    elif params.choice is not None:
        structured = StructuredOutputsParams(choice=params.choice)
    elif params.grammar is not None:
        structured = StructuredOutputsParams(grammar=params.grammar)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    return VllmSamplingParams(**kwargs)


def _merge(whole: Any, out: Any) -> None:
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


def _structured_outputs_config() -> Any:
    from vllm.config import StructuredOutputsConfig

    # vLLM refuses disable_any_whitespace with backend "auto" (it could pick a
    # backend without the option), so name xgrammar: a schema xgrammar cannot
    # compile fails the request instead of falling back to guidance.
    return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)


def engine_kwargs(settings: EngineSettings) -> dict[str, Any]:
    """The engine configuration of a worker, as ``EngineArgs`` keywords.

    One place, so that baselines (``vllm.LLM(**engine_kwargs(s))`` in the
    benchmarks and the tests' offline reference) run exactly the worker's config.
    """
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "dtype": settings.dtype,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "max_model_len": settings.max_model_len,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "seed": settings.seed,
        "load_format": settings.load_format,
        "worker_extension_cls": EXTENSION_CLS,
        "disable_log_stats": False,
        # Compact JSON for json_schema / json_object: vLLM 0.32's xgrammar
        # backend reads this engine-wide flag and ignores the per-request
        # StructuredOutputsParams.disable_any_whitespace (seen: a random-weight
        # model filled objects with whitespace until max_tokens).
        "structured_outputs_config": _structured_outputs_config(),
    }
    if settings.enable_sleep_mode:
        kwargs["enable_sleep_mode"] = True
    # None: vLLM's batch defaults (the worker's engine is created in the
    # LLM_CLASS usage context, like vllm.LLM, so both get the same ones).
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if settings.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.device == "cpu":
        kwargs.update(_whole_prefills(settings))
    kwargs.update(settings.engine_args)  # vLLM's own flags (workers/engine/args.py)
    return kwargs


def _whole_prefills(settings: EngineSettings) -> dict[str, Any]:
    """CPU engines prefill each prompt in one step (no chunked prefill).

    When a prompt is prefilled in chunks, vLLM samples a token for it at each
    chunk, drops it, and rewinds the request's seeded generator by its
    offset; a CPU generator has no offset (``RuntimeError: CPU Generator does
    not use offset``) and the engine core died. A sample resumed from its
    checkpoint (prompt plus its tokens so far) is such a prompt, and so is any
    seeded prompt sharing a step with others past the step's token budget.
    Whole prefills need a step that holds the longest prompt: vLLM then sizes
    ``max_num_batched_tokens`` itself; one given smaller than
    ``max_model_len`` is raised to it."""
    whole: dict[str, Any] = {"enable_chunked_prefill": False}
    given, longest = settings.max_num_batched_tokens, settings.max_model_len
    if given is not None and longest is not None and given < longest:
        log.info("max_num_batched_tokens %d raised to max_model_len %d: CPU engines prefill "
                 "whole prompts", given, longest)
        whole["max_num_batched_tokens"] = longest
    return whole


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


def _aborted_output(prompt_ids: list[int], n: int, version: int) -> PromptOutput:
    """The output of a prompt aborted before the engine produced any: n empty samples."""
    sample = Sample(text="", token_ids=[], finish_reason="abort", weight_versions=[(0, version)])
    return PromptOutput(prompt_token_ids=prompt_ids, samples=[sample] * n)



@functools.cache
def refusal_types() -> tuple[type[Exception], ...]:
    """The exceptions vLLM refuses an invalid request with: ``ValueError``, and
    ``VLLMClientError`` in the vLLM releases that have it (0.24, the release
    run on the GPU, does not: there a refusal is a ``ValueError``)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)

class EngineHost:
    """One vLLM engine in this process's event-loop thread."""

    def __init__(self, settings: EngineSettings, state: NodeState | None = None) -> None:
        self.settings = settings
        # Whether requests may enter the engine (a sync's pause, sleep) is the node's state.
        self.state = state if state is not None else NodeState()
        self.weight_version = 0
        self.tokenizer: Any = None
        # Tool calls parsed out of chat samples (--tool-call-parser); checked before the engine starts.
        self.tool_calls = ToolCalls(settings.tool_call_parser)
        self.max_model_len = 0
        self.vocab_size = 0
        self.dtype = ""
        self.engine: Any = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self._submit_lock = threading.Lock()
        self._pending_counts: dict[tuple[str, int], int] = {}
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._keep_pause = False
        # Set when pause() found the engine idle and left it running: its
        # prefix-cache reset, already under way. None: pause() paused the engine.
        self._early_reset: concurrent.futures.Future[Any] | None = None
        self._handing_off = False  # set by hand_off(): requests added later are aborted too
        self.generated_tokens = 0
        self.finished_requests = 0
        self.stats = EngineStats()  # fed by the engine's stat logger each step
        # Why the engine is lost (died, or stopped answering: lose()); None while it serves.
        self.lost: str | None = None
        self.on_lost: list[Callable[[str], None]] = []  # the runtime: fence, hand back, leave

    # ------------------------------------------------------------------ life

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the engine loop and wait for it (from any thread)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def engine_args(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(**engine_kwargs(self.settings))

    def start(self) -> None:
        """Load the engine (blocking). Raises ``EngineError`` with the reason."""
        from transformers import AutoTokenizer

        if self.settings.enable_sleep_mode:
            problem = self.sleep_mode_problem()
            if problem is not None:
                raise EngineError(problem)
        # An engine core a dead worker left holds memory this one needs: name
        # it; and this worker's own engine core dies with it (workers.engine.orphans).
        orphans.report_stale_engines(self.settings.device)
        orphans.tie_engine_core()
        self._thread.start()

        async def create() -> Any:
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM

            # LLM_CLASS: the batch defaults of vLLM's offline ``LLM`` (larger
            # max_num_seqs / max_num_batched_tokens). The default context here
            # would cap the running batch at 128 sequences and 2048 tokens per
            # step, on CPU and on an H200 alike; rollouts are batch work.
            return AsyncLLM.from_engine_args(
                self.engine_args(), usage_context=UsageContext.LLM_CLASS,
                stat_loggers=[stat_logger_factory(self.stats)],
            )

        try:
            self.engine = self.call(create())
            self.tokenizer = AutoTokenizer.from_pretrained(self.settings.model)
            self.tool_calls.tokenizer = self.tokenizer
        except Exception as exc:  # vLLM raises many kinds; report the reason
            raise EngineError(f"could not load model {self.settings.model!r}: {exc}") from exc
        config = self.engine.model_config
        self.max_model_len = int(config.max_model_len)
        self.vocab_size = int(config.get_vocab_size())
        self.dtype = str(config.dtype).removeprefix("torch.")
        self.call(self.engine.collective_rpc("rq_attach", args=(self.load_mode,)))

    @property
    def load_mode(self) -> str:
        mode = self.settings.weight_load_mode
        if mode == "auto":
            packed = self.settings.device == "cpu" and self.settings.cpu_weights == "packed"
            return "layerwise" if packed else "direct"
        return mode

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine; ``timeout``: seconds its processes get before they are
        killed (None: vLLM's default)."""
        if self.engine is not None:
            try:
                self.engine.shutdown(timeout=timeout)
            except Exception:  # shutting down: nothing left to report to
                log.exception("engine shutdown failed")
        self._loop.call_soon_threadsafe(self._loop.stop)

    # ------------------------------------------------------------ generation

    def prompt_token_ids(self, request: GenerateRequest, first_index: int = 0) -> list[list[int]]:
        """Tokenize (chat template for conversations) and check every prompt fits.

        Errors name a prompt by its index in the caller's call: ``first_index``
        is where this task's prompts start in it (a part of a split call)."""
        tok = self.tokenizer
        ids: list[list[int]] = []
        for i, prompt in enumerate(request.prompts, start=first_index):
            if request.kind == "text":
                tokens = list(tok(prompt).input_ids)
            elif request.kind == "chat":
                conversation = request.conversation(i - first_index)
                self.tool_calls.check(conversation)
                text = render(tok, conversation)
                tokens = list(tok(text, add_special_tokens=False).input_ids)
            else:
                tokens = list(prompt)  # type: ignore[arg-type]
                bad = [t for t in tokens if t >= self.vocab_size]
                if bad:
                    raise InvalidRequest(
                        f"prompt {i} has token id {bad[0]}; this model's vocabulary has "
                        f"{self.vocab_size} tokens (ids 0..{self.vocab_size - 1})"
                    )
            if not tokens:
                raise InvalidRequest(f"prompt {i} tokenizes to nothing; send at least one token")
            if len(tokens) >= self.max_model_len:
                raise PromptTooLong(
                    f"prompt {i} has {len(tokens)} tokens; this worker's max_model_len is "
                    f"{self.max_model_len} (prompt plus at least one generated token must fit)"
                )
            ids.append(tokens)
        return ids

    def wait_for_intake(self, deadline: float) -> None:
        """Block while a weight sync holds intake closed."""
        if not self.state.wait_for_intake(deadline - time.time()):
            raise GenerationTimeout("the task's time limit passed while a weight sync held intake")

    def generate(
        self,
        request: GenerateRequest,
        deadline: float,
        aborted: Callable[[], set[int]] | None = None,
        on_submitted: Callable[[], None] | None = None,
        first_index: int = 0,
        checkpoint: TaskCheckpointer | None = None,
        saved: dict[SampleKey, SampleProgress] | None = None,
        on_output: Callable[[int, Any], None] | None = None,
    ) -> tuple[list[PromptOutput], int]:
        """Run every prompt as one engine request; returns outputs and the final version.

        ``aborted``: the indices of prompts nobody waits for any more (their
        client went away), read before submitting and every ``ABORT_POLL_S``
        while generating. Those prompts are not started, or their engine
        requests are aborted; their outputs end with ``finish_reason="abort"``
        and hold what was generated until then.

        ``on_submitted`` is called once every request is in the engine (the
        worker's intake then counts them there, not as waiting to go in);
        ``first_index``: see :meth:`prompt_token_ids`.

        ``checkpoint``: save the samples' progress as they grow, and continue
        those in ``saved`` from their saved tokens (``workers.engine.progress``).
        ``on_output``: a streamed task's hook (``workers.engine.streaming``), called
        on the engine loop with the prompt's index and each delta output as it
        comes (a streamed task is not checkpointed).
        """
        prompt_ids = self.prompt_token_ids(request, first_index)
        if checkpoint is not None and on_output is None:
            return self._generate_checkpointed(
                request, prompt_ids, deadline, aborted, on_submitted, checkpoint, saved or {}
            )
        sampling = to_vllm_params(request.params, "delta" if on_output is not None else "final")
        batch = uuid.uuid4().hex[:12]
        skipped = {i for i in (aborted() if aborted else set()) if 0 <= i < len(prompt_ids)}
        run = [i for i in range(len(prompt_ids)) if i not in skipped]
        rids = [f"{batch}-{i}" for i in run]
        try:
            futures = (
                self._submit(rids, [prompt_ids[i] for i in run], sampling, deadline, on_submitted, on_output=on_output)
                if run else []
            )
            stopped = self._wait(run, rids, futures, deadline, aborted)
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
            if errors:
                raise self._engine_error(errors[0])
            self._raise_if_lost()
            with self._lock:
                lives = {i: self._live[rid] for i, rid in zip(run, rids)}
            if any(live.aborted_for_sync for live in lives.values()):
                raise AbortedForSync("in-flight requests were aborted by a weight sync; requeue")
            if any(live.handed_off for live in lives.values()):
                raise HandedOff("this worker is leaving; the task goes back to the queue", countdown=0.0)
            finished = {i: f for i, f in zip(run, futures) if not f.cancelled()}
            outputs = [
                self._to_output(finished[i].result(), lives[i], request.params)
                if i in finished
                else _aborted_output(prompt_ids[i], request.params.n, self.weight_version)
                for i in range(len(prompt_ids))
            ]
            if skipped or stopped:
                log.info("aborted %d of %d prompts: their client went away or the task was revoked",
                         len(skipped | stopped), len(prompt_ids))
            version = max(v for o in outputs for s in o.samples for _, v in s.weight_versions)
            return outputs, version
        finally:
            with self._lock:
                for rid in rids:
                    self._live.pop(rid, None)

    def _generate_checkpointed(
        self,
        request: GenerateRequest,
        prompt_ids: list[list[int]],
        deadline: float,
        aborted: Callable[[], set[int]] | None,
        on_submitted: Callable[[], None] | None,
        checkpoint: TaskCheckpointer,
        saved: dict[SampleKey, SampleProgress],
    ) -> tuple[list[PromptOutput], int]:
        """:meth:`generate` with checkpoints: one request per :class:`Unit` of
        ``plan_units`` (a prompt's n samples, or one sample resumed from
        ``saved``); the samples' parts are joined into whole samples."""
        params = request.params
        skipped = {i for i in (aborted() if aborted else set()) if 0 <= i < len(prompt_ids)}
        units, complete = plan_units(prompt_ids, params, saved, skipped)
        batch = uuid.uuid4().hex[:12]
        # "<batch>.<unit>-<prompt>": the prompt index stays last (see _refused).
        rids = [f"{batch}.{k}-{unit.prompt}" for k, unit in enumerate(units)]
        for rid, unit in zip(rids, units):
            checkpoint.watch(rid, unit)
        samplings = [to_vllm_params(unit.params, "delta", checkpoint.interval) for unit in units]
        try:
            futures = (
                self._submit(
                    rids, [unit.engine_prompt for unit in units], samplings, deadline, on_submitted,
                    checkpoint.observe,
                )
                if units else []
            )
            self._wait([unit.prompt for unit in units], rids, futures, deadline, aborted)
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
            if errors:
                raise self._engine_error(errors[0])
            self._raise_if_lost()
            with self._lock:
                lives = {rid: self._live[rid] for rid in rids}
            if any(live.aborted_for_sync for live in lives.values()):
                checkpoint.save_now()  # the next run continues from here, on the new weights
                raise AbortedForSync("in-flight requests were aborted by a weight sync; requeue")
            if any(live.handed_off for live in lives.values()):
                checkpoint.save_now()  # the next worker continues from here
                raise HandedOff(
                    "this worker is leaving; the task goes back to the queue with its samples' "
                    "progress saved", countdown=0.0,
                )
            decode = self._decode
            samples: dict[SampleKey, Sample] = {key: finished_sample(p, decode) for key, p in complete.items()}
            prompt_lps: dict[int, list[float | None] | None] = {}
            for rid, unit, future in zip(rids, units, futures):
                if future.cancelled():
                    continue
                out = self._to_output(future.result(), lives[rid], unit.params)
                if unit.prompt not in prompt_lps and out.prompt_logprobs is not None:
                    prompt_lps[unit.prompt] = out.prompt_logprobs[: len(prompt_ids[unit.prompt])]
                for index, sample in enumerate(out.samples):
                    samples[(unit.prompt, unit.samples[index])] = join(unit.prefix, sample, checkpoint.node, decode)
            missing = Sample(text="", token_ids=[], finish_reason="abort", weight_versions=[(0, self.weight_version)])
            outputs = [
                PromptOutput(
                    prompt_token_ids=ids,
                    prompt_logprobs=prompt_lps.get(i),
                    samples=[samples.get((i, s), missing) for s in range(params.n)],
                )
                for i, ids in enumerate(prompt_ids)
            ]
            version = max(v for o in outputs for s in o.samples for _, v in s.weight_versions)
            return outputs, version
        except EngineLost:
            checkpoint.save_now()  # the next worker continues from here
            raise
        finally:
            with self._lock:
                for rid in rids:
                    self._live.pop(rid, None)

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def spans_of(self, rid: str, index: int, length: int) -> list[tuple[int, int]]:
        """The weight-version spans of a running request's sample ``index``."""
        with self._lock:
            live = self._live.get(rid)
            if live is None:
                return [(0, self.weight_version)]
            return version_spans(live.version, list(live.spans.get(index, [])), length)

    def _wait(
        self,
        indices: list[int],
        rids: list[str],
        futures: list[concurrent.futures.Future[Any]],
        deadline: float,
        aborted: Callable[[], set[int]] | None,
    ) -> set[int]:
        """Wait for every request, aborting those ``aborted`` names; returns their indices.

        Raises at the first failed request, or ``GenerationTimeout`` at the
        deadline (every request still running is aborted first).
        """
        by_index: dict[int, list[tuple[str, concurrent.futures.Future[Any]]]] = {}
        for index, rid, future in zip(indices, rids, futures):
            by_index.setdefault(index, []).append((rid, future))
        stopped: set[int] = set()
        stopped_at = 0.0
        pending = set(futures)
        while pending:
            remaining = deadline - time.time()
            if remaining <= 0:
                self._abort(rids)
                raise GenerationTimeout(
                    f"{len(pending)} of {len(rids)} prompts unfinished at the task's time limit; "
                    "their engine requests were aborted"
                )
            poll = min(remaining, ABORT_POLL_S) if aborted else remaining
            done, pending = concurrent.futures.wait(
                pending, timeout=poll, return_when=concurrent.futures.FIRST_EXCEPTION
            )
            failed = [f for f in done if not f.cancelled() and f.exception() is not None]
            if failed:
                self._abort(rids)
                raise self._engine_error(failed[0].exception())
            if not pending or aborted is None:
                continue
            newly = {i for i in aborted() if i in by_index and i not in stopped}
            if newly:
                self._abort([rid for i in newly for rid, _ in by_index[i]])
                stopped |= newly
                stopped_at = time.time()
            elif stopped and time.time() - stopped_at > ABORT_GRACE_S:
                # vLLM answers an abort with a final output; should one never
                # come, stop waiting for it rather than hold the task.
                for i in stopped:
                    for _, future in by_index[i]:
                        future.cancel()
        return stopped

    def _submit(
        self, rids: list[str], prompt_ids: list[list[int]], sampling: Any, deadline: float,
        on_submitted: Callable[[], None] | None = None,
        observe: Callable[[str, Any], None] | None = None,
        on_output: Callable[[int, Any], None] | None = None,
    ) -> list[concurrent.futures.Future[Any]]:
        """Add every request to the engine while intake is open; returns result futures.

        Adding happens under the submit lock, which a sync's pause also takes:
        a request is either in the engine before the pause (and the pause mode
        decides what happens to it) or waits for the sync to finish, so the
        version stamped on it is always the one that generates it.

        ``sampling``: one ``vllm.SamplingParams`` for all, or a list (one per
        request); ``observe(rid, completion)`` sees each sample of a
        checkpointed request as it grows (see ``_collect``).
        """
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(rids)
        self._raise_if_lost()
        while True:
            self.wait_for_intake(deadline)
            with self._submit_lock:
                if not self.state.intake_open:
                    continue
                with self._lock:
                    for rid, one in zip(rids, samplings):
                        self._live[rid] = _Live(
                            version=self.weight_version, sequences=one.n, handed_off=self._handing_off
                        )
                adds = [
                    asyncio.run_coroutine_threadsafe(self._add(rid, ids, one), self._loop)
                    for rid, ids, one in zip(rids, prompt_ids, samplings)
                ]
                queues = []
                try:
                    for add in adds:
                        queues.append(add.result(timeout=max(1.0, deadline - time.time())))
                except BaseException as exc:
                    self._abort(rids)
                    raise self._refused(rids, len(queues), exc) from exc
                break
        if self._handing_off:  # hand_off() ran while these were being added
            with self._lock:
                for rid in rids:
                    self._live[rid].handed_off = True
            self._abort(rids)
        collected = []
        for rid, queue in zip(rids, queues):
            watch = None if observe is None else functools.partial(observe, rid)
            hook = None if on_output is None else functools.partial(on_output, int(rid.rsplit("-", 1)[1]))
            future = asyncio.run_coroutine_threadsafe(self._collect(queue, watch, hook), self._loop)
            future.add_done_callback(lambda _, rid=rid: self._finished(rid))
            with self._lock:
                self._live[rid].future = future
            collected.append(future)
        if self.lost is not None:  # lost while these were being added: lose() missed them
            for future in collected:
                future.cancel()
        if on_submitted is not None:
            on_submitted()
        return collected

    def _finished(self, rid: str) -> None:
        with self._lock:
            live = self._live.get(rid)
            if live is not None:
                live.finished = True

    def _refused(self, rids: list[str], position: int, exc: BaseException) -> Exception:
        """The error for a request vLLM would not add.

        vLLM refuses a request it finds invalid (a regex its grammar backend
        cannot compile, a token out of range...) with a ``VLLMClientError`` or
        a ``ValueError``: the request's fault, never retried. When earlier prompts of the task were
        accepted, the refusal is about this prompt, and the message names it
        (``prompt <i>``, its index in the task), so a sender that batched
        several requests can tell whose prompt it was.
        """
        if not isinstance(exc, refusal_types()) or isinstance(
            exc, (InvalidRequest, PromptTooLong)
        ):
            return self._engine_error(exc)
        if position == 0:
            return InvalidRequest(f"the engine refused the request: {exc}")
        index = rids[position].rsplit("-", 1)[1]
        return InvalidRequest(f"prompt {index} was refused by the engine: {exc}")

    def _engine_error(self, exc: BaseException | None) -> Exception:
        """The error a task raises for a request that failed with ``exc``: the
        request's own fault as it was, ``EngineLost`` when the engine is dead
        (it fails every request; the task goes to another worker), else
        ``EngineError``."""
        if isinstance(exc, (InvalidRequest, PromptTooLong, EngineError, Requeue)):
            return exc
        # Some vLLM errors carry no message of their own, only a cause.
        detail = str(exc) or repr(getattr(exc, "__cause__", None) or getattr(exc, "__context__", None))
        if self._dead(exc):
            self.lose(f"the engine died ({type(exc).__name__}: {detail[:200]})")
            return self._lost_error()
        return EngineError(f"the engine failed the request: {type(exc).__name__}: {detail}")

    def _dead(self, exc: BaseException | None) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(exc, EngineDeadError) or (self.engine is not None and bool(self.engine.errored))

    def lose(self, reason: str) -> bool:
        """The engine is gone (it died, or stopped answering): every request
        waiting on it stops waiting and its task raises ``EngineLost`` (back to
        the queue, its progress checkpointed), no request enters it any more,
        and ``on_lost`` hears ``reason`` once. False when it was lost already."""
        with self._lock:
            if self.lost is not None:
                return False
            self.lost = reason
            waiting = [live.future for live in self._live.values() if live.future is not None]
        for future in waiting:
            future.cancel()
        for listener in self.on_lost:
            listener(reason)
        return True

    def _lost_error(self) -> EngineLost:
        return EngineLost(f"{self.lost}; the task goes back to the queue for another worker", countdown=0.0)

    def _raise_if_lost(self) -> None:
        if self.lost is not None:
            raise self._lost_error()

    def probe(self) -> concurrent.futures.Future[Any]:
        """Ask the engine core a no-op question (whether it sleeps): answered
        between two of its steps, never by a hung or stopped engine."""
        return asyncio.run_coroutine_threadsafe(self.engine.is_sleeping(), self._loop)

    async def _add(self, rid: str, prompt_ids: list[int], sampling: Any) -> Any:
        from vllm.inputs import TokensPrompt

        return await self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids), sampling)

    @staticmethod
    async def _collect(
        queue: Any,
        observe: Callable[[Any], None] | None = None,
        on_output: Callable[[Any], None] | None = None,
    ) -> Any:
        """The request's final output (as ``AsyncLLM.generate`` drains its queue).

        With ``observe`` (checkpoints) the request sends deltas, every
        checkpoint interval where vLLM can (``to_vllm_params``' ``every``):
        each is merged into the first output, and ``observe`` gets the merged
        sample it touched (its tokens so far). Deltas, not cumulative
        outputs: vLLM copies a cumulative output's whole token list at each
        output, quadratic in its length. With ``on_output`` the request
        streams (delta outputs): each delta goes to it, then is merged the
        same way.
        """
        if observe is not None:
            whole = None
            while True:
                out = queue.get_nowait() or await queue.get()
                if whole is None:
                    whole = out
                else:
                    _merge(whole, out)
                by_index = {completion.index: completion for completion in whole.outputs}
                for completion in out.outputs:
                    observe(by_index[completion.index])
                if out.finished:
                    whole.outputs.sort(key=lambda completion: completion.index)
                    return whole
        merged = None
        while True:
            out = queue.get_nowait() or await queue.get()
            if on_output is not None:
                try:
                    on_output(out)
                except Exception:  # a stream's trouble must not fail the generation
                    log.exception("could not publish a delta output")
                if merged is None:
                    merged = out
                else:
                    _merge(merged, out)
            if out.finished:
                return out if merged is None else merged

    def _abort(self, rids: list[str]) -> None:
        try:
            self.call(self.engine.abort(rids), timeout=10)
        except Exception:  # best effort: the requests may have finished meanwhile
            log.warning("abort of %d requests failed", len(rids), exc_info=True)

    def _to_output(self, out: Any, live: _Live, params: SamplingParams) -> PromptOutput:
        samples = []
        for comp in sorted(out.outputs, key=lambda c: c.index):
            token_ids = list(comp.token_ids)
            logprobs = top = None
            if params.logprobs is not None and comp.logprobs is not None:
                logprobs, top = lp.sample_logprobs(comp.logprobs, token_ids, params.logprobs)
            spans = version_spans(live.version, live.spans.get(comp.index, []), len(token_ids))
            samples.append(
                Sample(
                    text=comp.text,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    top_logprobs=top,
                    finish_reason=comp.finish_reason,
                    stop_reason=comp.stop_reason,
                    weight_versions=spans,
                )
            )
            self.generated_tokens += len(token_ids)
        self.finished_requests += 1
        prompt_ids = list(out.prompt_token_ids or [])
        prompt_lps = prompt_top = prompt_ranks = None
        if params.prompt_logprobs is not None and out.prompt_logprobs is not None:
            prompt_lps, prompt_top = lp.prompt_logprobs(out.prompt_logprobs, prompt_ids, params.prompt_logprobs)
            prompt_ranks = lp.prompt_ranks(out.prompt_logprobs, prompt_ids)
        return PromptOutput(
            prompt_token_ids=prompt_ids, prompt_logprobs=prompt_lps, prompt_top_logprobs=prompt_top,
            prompt_ranks=prompt_ranks, samples=samples,
        )

    # ------------------------------------------------------- sync and control

    def hand_off(self) -> int:
        """Abort every request in the engine, and every one added from now on, so
        that their tasks go back to the queue (their progress checkpointed):
        the worker is leaving. Returns how many requests were aborted."""
        with self._lock:
            self._handing_off = True
            rids = [rid for rid, live in self._live.items() if not live.finished]
            for rid in rids:
                self._live[rid].handed_off = True
        if rids:
            self._abort(rids)
        return len(rids)

    def inflight_requests(self) -> int:
        with self._lock:
            return len(self._live)

    def unfinished_sequences(self) -> int:
        """Sequences (requests x n) in the engine whose final output is not in yet."""
        with self._lock:
            return sum(live.sequences for live in self._live.values() if not live.finished)

    @property
    def max_num_seqs(self) -> int:
        """The engine's running-batch limit (its scheduler's ``max_num_seqs``)."""
        return int(self.engine.vllm_config.scheduler_config.max_num_seqs)

    def pause(self, mode: PauseMode, timeout: float) -> None:
        """Close intake and pause the engine the way ``mode`` says."""
        with self._submit_lock:
            self.state.hold_intake()
        self._keep_pause = mode == "keep"
        if not self.inflight_requests():
            # Intake is closed and no request is in the engine: nothing can run,
            # so the engine needs no pause (vLLM's costs a scheduler round trip
            # and a fixed 20 ms settle). The usual case: syncs between rollouts.
            # Nothing can fill the prefix cache until resume either, so its reset
            # starts now and overlaps the update instead of following it.
            self._early_reset = asyncio.run_coroutine_threadsafe(self.engine.reset_prefix_cache(), self._loop)
            return
        if mode == "abort":
            with self._lock:
                for live in self._live.values():
                    live.aborted_for_sync = True
        self.call(self.engine.pause_generation(mode=mode, clear_cache=False), timeout=timeout)
        if mode != "abort" and self.inflight_requests():
            # "keep" freezes requests mid-generation; "wait" drains running
            # requests but leaves never-scheduled ones queued: both finish on
            # the new weights, from the token count they have now.
            self._pending_counts = self.call(self._generated_counts(), timeout=timeout)

    async def _generated_counts(self) -> dict[tuple[str, int], int]:
        """How many tokens each unfinished request has when the weights change.

        Runs on the engine loop after outputs already produced were processed.
        """
        await asyncio.sleep(0.05)
        states = getattr(getattr(self.engine, "output_processor", None), "request_states", {})
        counts: dict[tuple[str, int], int] = {}
        for state in list(states.values()):
            detok = getattr(state, "detokenizer", None)
            generated = len(getattr(detok, "output_token_ids", []) or [])
            key = (getattr(state, "external_req_id", state.request_id), getattr(state, "request_index", 0))
            counts[key] = generated
        return counts

    def resume(self, new_version: int | None, timeout: float) -> None:
        """Reset the prefix cache, adopt ``new_version`` (if any), resume, open intake."""
        early, self._early_reset = self._early_reset, None
        if early is not None:
            early.result(timeout)
        if new_version is not None:
            # Cached blocks were computed with the old weights: never reuse
            # them. Kept requests are recomputed with the new weights.
            if early is None:
                self.call(
                    self.engine.reset_prefix_cache(reset_running_requests=self._keep_pause),
                    timeout=timeout,
                )
            if self._pending_counts:
                with self._lock:
                    for (rid, index), count in self._pending_counts.items():
                        live = self._live.get(rid)
                        if live is not None:
                            live.spans.setdefault(index, []).append((count, new_version))
            self.weight_version = new_version
        self._pending_counts = {}
        self._keep_pause = False
        if early is None:  # pause() paused the engine
            self.call(self.engine.resume_generation(), timeout=timeout)
        self.state.release_intake()  # a sleeping engine's KV cache stays asleep: no intake

    def collective_rpc(self, method: str, timeout: float, *args: Any) -> list[Any]:
        return self.call(self.engine.collective_rpc(method, args=args), timeout=timeout)

    def reset_prefix_cache(self) -> bool:
        return bool(self.call(self.engine.reset_prefix_cache(), timeout=30))

    def sleep_mode_problem(self) -> str | None:
        """Why this engine cannot sleep, or None when it can."""
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            return (
                f"sleep mode is not supported on this backend: vLLM's "
                f"{current_platform.device_type} platform has no sleep mode (CUDA and ROCm "
                "do); keep this worker awake, or run it on a GPU with --enable-sleep-mode"
            )
        if not self.settings.enable_sleep_mode:
            return "sleep mode is off on this worker; start it with --enable-sleep-mode"
        return None

    def sleep(self, level: int) -> None:
        problem = self.sleep_mode_problem()
        if problem is not None:
            raise EngineError(problem)
        # Even after a sync wakes the weights to load new ones, no request
        # enters until the KV cache wakes.
        self.state.sleep()
        self.call(self.engine.sleep(level), timeout=120)

    def wake_up(self, tags: list[str] | None = None) -> None:
        problem = self.sleep_mode_problem()
        if problem is not None:
            raise EngineError(f"{problem} (nothing to wake)")
        self.call(self.engine.wake_up(tags), timeout=120)
        if tags is None or "kv_cache" in tags:
            self.state.wake()

    def is_sleeping(self) -> bool:
        if not self.settings.enable_sleep_mode:
            return False
        return bool(self.call(self.engine.is_sleeping(), timeout=30))
