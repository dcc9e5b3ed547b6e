"""``EngineHost``: one vLLM engine, driven by one background event loop.

Every prompt of every task becomes one engine request on the same
``AsyncLLM``; requests from concurrent tasks join the running batch
(continuous batching). Celery task threads call :meth:`EngineHost.generate`,
which runs a ``GenerationRun`` (``workers.engine.run``: tokenizing, the
requests' plan, waiting, the outputs); the run blocks on
``concurrent.futures`` futures resolved by the loop thread. The host keeps
the engine: its life, submitting and aborting requests, the requests live
in it, and whether it still answers.

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
import os
import shutil
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollout_queue.tasks.errors import EngineError, GenerationTimeout, InvalidRequest, PromptTooLong, Requeue
from rollout_queue.tasks.schemas import GenerateRequest, PauseMode, PromptOutput
from rollout_queue.weight_sync.update_line import MAX_PATH_BYTES, LineUnavailable, UpdateLine, line_directory
from rollout_queue.workers.engine import orphans
from rollout_queue.workers.engine.errors import AbortedForSync, EngineLost, HandedOff
from rollout_queue.workers.engine.run import Drain, GenerationRun, RunOptions, prompt_of, version_spans
from rollout_queue.workers.engine.sampling import per_request_stream_interval, to_vllm_params
from rollout_queue.workers.engine.stats import EngineStats, stat_logger_factory
from rollout_queue.workers.engine.tools import ToolCalls
from rollout_queue.workers.settings import EngineSettings
from rollout_queue.workers.state import NodeState

# Named here too: where the worker, its tests and the benchmarks have long found them.
__all__ = [
    "AbortedForSync", "EngineHost", "EngineLost", "HandedOff", "LiveRequest", "RunOptions",
    "engine_kwargs", "per_request_stream_interval", "refusal_types", "to_vllm_params", "version_spans",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

EXTENSION_CLS = "rollout_queue.weight_sync.receiver.WeightReceiver"


def fork_cpu_engine_core(config: Any) -> None:
    """Start a CPU engine's core by fork where the model runs in the core itself.

    vLLM's CPU platform always asks for ``spawn`` (``VLLM_WORKER_MULTIPROC_METHOD``,
    set while ``config`` was built): its ``mp`` executor sets OpenMP up for a
    model process of its own. A worker whose threads are not bound runs the
    model in the engine core instead (the ``uni`` executor,
    ``workers.node.main.cpu_environment``), where a spawned core only imports
    torch and vLLM afresh: 7-8 s of a 19.6 s start on two cores, 11 s with
    fork. The worker forks from its engine-loop thread, which ran no torch CPU
    op (the libgomp hang of a fork after one: ``tests/test_fork_safety.py``),
    as vLLM itself does on CUDA."""
    if config.device_config.device_type == "cpu" and config.parallel_config.distributed_executor_backend == "uni":
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        eager_logprob_ranks()


def eager_logprob_ranks() -> None:
    """Rank sampled tokens among the logprobs without ``torch.compile`` (CPU engines forked from here).

    vLLM's sampler ranks each returned token with ``batched_count_greater_than``,
    a ``torch.compile``'d ``(x >= values).sum(-1)``; compiled so that a GPU does
    not keep a batch x vocabulary mask in memory. On CPU its first call, a
    request's first logprobs, compiles C++ through inductor: 12.8 s on the
    2-core test machine with an empty inductor cache, 2.9-4 s with a full one,
    in every new engine process (a fresh worker's first task with logprobs, or
    its warm-up). The same expression run eagerly takes 0.3 ms for a small
    batch; its mask (one byte per logprob) is a quarter of the float32
    logprobs it is computed from, which exist already. Set in this process
    before the engine core is forked from it, so the core runs the eager one
    (a CPU worker with bound threads spawns its model process and keeps the
    compiled one)."""
    import torch
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    def batched_count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return (x >= values).sum(-1)

    logprobs.batched_count_greater_than = batched_count_greater_than
    sampler.batched_count_greater_than = batched_count_greater_than  # bound by name at its import


@dataclass
class LiveRequest:
    """A request in the engine, and the weight versions its samples crossed."""

    version: int
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    aborted_for_sync: bool = False
    handed_off: bool = False  # aborted by hand_off(): the task goes back to the queue
    sequences: int = 1  # the request's samples (n): what it holds of max_num_seqs
    finished: bool = False  # its final output is in (the task may still wait for others)
    future: concurrent.futures.Future[Any] | None = None  # its final output; cancelled if the engine is lost


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
        # Whether the engine's weights sleep: only this host puts them to sleep
        # or wakes them, so a sync asks this flag, not the engine (a round trip).
        self._weights_asleep = False
        # Whether a level-2 sleep dropped the weights and no sync has brought a whole
        # model since: waking them alone would serve whatever that memory holds.
        self._weights_dropped = False
        # Whether an engine call returned with copies still running on the device (a
        # CUDA handoff's: ``weights_loading``): a sleep waits for them before vLLM
        # unmaps the memory they write.
        self._copies_running = False
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
        self._live: dict[str, LiveRequest] = {}
        self._lock = threading.Lock()
        self._keep_pause = False
        # Set when pause() found the engine idle and left it running: its
        # prefix-cache reset, already under way. None: pause() paused the engine.
        self._early_reset: concurrent.futures.Future[Any] | None = None
        # Requests ever added, and their count when a prefix-cache reset last
        # succeeded: equal, no request entered since, and a sync has no cached
        # block to drop (syncs back to back; nothing ran since the last sync)
        # and skips the reset, a walk over every KV block in the engine core.
        self._requests_added = 0
        self._reset_at = -1
        self._handing_off = False  # set by hand_off(): requests added later are aborted too
        self.generated_tokens = 0
        self.finished_requests = 0
        self.stats = EngineStats()  # fed by the engine's stat logger each step
        # Why the engine is lost (died, or stopped answering: lose()); None while it serves.
        self.lost: str | None = None
        self.on_lost: list[Callable[[str], None]] = []  # the runtime: fence, hand back, leave
        # The update line to a single-rank engine (``update_engine``), and its directory.
        self._line: UpdateLine | None = None
        self._line_dir: str | None = None

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
            config = self.engine_args().create_engine_config(UsageContext.LLM_CLASS)
            fork_cpu_engine_core(config)
            return AsyncLLM.from_vllm_config(
                config, usage_context=UsageContext.LLM_CLASS, stat_loggers=[stat_logger_factory(self.stats)],
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
        self._attach()

    def _attach(self) -> None:
        """Make the engine ranks' receivers (``rq_attach``); a single-rank engine also
        listens on the update line (``weight_sync.update_line``), at a path in a
        directory of this worker's own."""
        self._line_dir = line_directory()
        path = os.path.join(self._line_dir, "update")
        fits = len(os.fsencode(path)) <= MAX_PATH_BYTES
        if not fits:
            log.info("no update line: its path %s is too long for a Unix socket (TMPDIR)", path)
        answers = self.call(self.engine.collective_rpc("rq_attach", args=(self.load_mode, path if fits else None)))
        if len(answers) == 1 and isinstance(answers[0], dict) and answers[0].get("line"):  # one rank, listening
            self._line = UpdateLine(answers[0]["line"])

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
        if self._line is not None:
            self._line.close()
        if self.engine is not None:
            try:
                self.engine.shutdown(timeout=timeout)
            except Exception:  # shutting down: nothing left to report to
                log.exception("engine shutdown failed")
        if self._line_dir is not None:
            shutil.rmtree(self._line_dir, ignore_errors=True)
        self._loop.call_soon_threadsafe(self._loop.stop)

    # ------------------------------------------------------------ generation

    def wait_for_intake(self, deadline: float) -> None:
        """Block while a weight sync holds intake closed."""
        if not self.state.wait_for_intake(deadline - time.time()):
            raise GenerationTimeout("the task's time limit passed while a weight sync held intake")

    def generate(self, request: GenerateRequest, options: RunOptions) -> tuple[list[PromptOutput], int]:
        """Run every prompt of ``request``; returns outputs and the final version
        (``workers.engine.run``; ``options`` says how)."""
        return GenerationRun(self, request, options).result()

    def spans_of(self, rid: str, index: int, length: int) -> list[tuple[int, int]]:
        """The weight-version spans of a running request's sample ``index``."""
        with self._lock:
            live = self._live.get(rid)
            if live is None:
                return [(0, self.weight_version)]
            return version_spans(live.version, list(live.spans.get(index, [])), length)

    def live(self, rids: list[str]) -> Mapping[str, LiveRequest]:
        """The requests ``rids`` (submitted, not yet released)."""
        with self._lock:
            return {rid: self._live[rid] for rid in rids}

    def release(self, rids: list[str]) -> None:
        """Forget the requests ``rids`` (their run is over)."""
        with self._lock:
            for rid in rids:
                self._live.pop(rid, None)

    def count_finished(self, tokens: int) -> None:
        """A request finished with ``tokens`` generated (the worker's counters)."""
        self.generated_tokens += tokens
        self.finished_requests += 1

    def submit(
        self, rids: list[str], prompt_ids: list[list[int]], samplings: list[Any], deadline: float,
        on_submitted: Callable[[], None] | None, drain: Drain,
    ) -> list[concurrent.futures.Future[Any]]:
        """Add every request to the engine while intake is open; returns their
        final outputs' futures, each ``drain(rid, queue)`` run on the loop.

        Adding happens under the submit lock, which a sync's pause also takes:
        a request is either in the engine before the pause (and the pause mode
        decides what happens to it) or waits for the sync to finish, so the
        version stamped on it is always the one that generates it.
        """
        self.raise_if_lost()
        queues = self._add_all(rids, prompt_ids, samplings, deadline)
        if self._handing_off:  # hand_off() ran while these were being added
            with self._lock:
                for rid in rids:
                    self._live[rid].handed_off = True
            self.abort(rids)
        collected = []
        for rid, queue in zip(rids, queues):
            future = asyncio.run_coroutine_threadsafe(drain(rid, queue), self._loop)
            future.add_done_callback(functools.partial(self._finished, rid))
            with self._lock:
                self._live[rid].future = future
            collected.append(future)
        if self.lost is not None:  # lost while these were being added: lose() missed them
            for future in collected:
                future.cancel()
        if on_submitted is not None:
            on_submitted()
        return collected

    def _add_all(
        self, rids: list[str], prompt_ids: list[list[int]], samplings: list[Any], deadline: float,
    ) -> list[Any]:
        """Add the requests under the submit lock, once intake is open; their output queues."""
        while True:
            self.wait_for_intake(deadline)
            with self._submit_lock:
                if not self.state.intake_open:
                    continue
                self._requests_added += len(rids)
                with self._lock:
                    for rid, one in zip(rids, samplings):
                        self._live[rid] = LiveRequest(
                            version=self.weight_version, sequences=one.n, handed_off=self._handing_off
                        )
                adds = [
                    asyncio.run_coroutine_threadsafe(self._add(rid, ids, one), self._loop)
                    for rid, ids, one in zip(rids, prompt_ids, samplings)
                ]
                queues: list[Any] = []
                try:
                    for add in adds:
                        queues.append(add.result(timeout=max(1.0, deadline - time.time())))
                except BaseException as exc:
                    self.abort(rids)
                    raise self._refused(rids, len(queues), exc) from exc
                return queues

    def _finished(self, rid: str, future: concurrent.futures.Future[Any] | None = None) -> None:
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
            return self.engine_error(exc)
        if position == 0:
            return InvalidRequest(f"the engine refused the request: {exc}")
        return InvalidRequest(f"prompt {prompt_of(rids[position])} was refused by the engine: {exc}")

    def engine_error(self, exc: BaseException | None) -> Exception:
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

    def raise_if_lost(self) -> None:
        if self.lost is not None:
            raise self._lost_error()

    def probe(self) -> concurrent.futures.Future[Any]:
        """Ask the engine core a no-op question (whether it sleeps): answered
        between two of its steps, never by a hung or stopped engine."""
        return asyncio.run_coroutine_threadsafe(self.engine.is_sleeping(), self._loop)

    async def _add(self, rid: str, prompt_ids: list[int], sampling: Any) -> Any:
        """Add one request, its prompt already rendered: vLLM (0.32) sends a raw
        ``TokensPrompt`` through its renderer's thread pool to make this same
        ``TokensInput``, two more thread hops before the request reaches the engine
        core (0.24 renders it on the loop). Its checks (length, vocabulary) run either way."""
        from vllm.inputs.engine import tokens_input

        return await self.engine.add_request(rid, tokens_input(prompt_ids), sampling)

    def abort(self, rids: list[str]) -> None:
        try:
            self.call(self.engine.abort(rids), timeout=10)
        except Exception:  # best effort: the requests may have finished meanwhile
            log.warning("abort of %d requests failed", len(rids), exc_info=True)

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
            self.abort(rids)
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
            # starts now and overlaps the update instead of following it (none
            # when no request ran since the last one).
            if self._reset_at == self._requests_added:
                self._early_reset = concurrent.futures.Future()
                self._early_reset.set_result(True)
            else:
                self._early_reset = asyncio.run_coroutine_threadsafe(self._reset_prefix_cache(), self._loop)
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
                self.call(self._reset_prefix_cache(reset_running_requests=self._keep_pause), timeout=timeout)
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

    def update_engine(self, request: dict[str, Any], timeout: float) -> tuple[list[Any], str]:
        """A sync's engine call (``rq_update``) on every rank: its answers, and the way
        it took. Over the update line ("line") when the engine holds no request (its
        core's loop then waits for input: nothing else touches the weights) and the
        line answers; else through vLLM ("call": ``collective_rpc``)."""
        if self._line is not None and self.inflight_requests() == 0:
            try:
                return [self._line.call(request, timeout)], "line"
            except LineUnavailable as exc:  # nothing was sent: the engine still waits for the call
                log.warning("%s; this update goes through vLLM", exc)
        return self.collective_rpc("rq_update", timeout, request), "call"

    def reset_prefix_cache(self) -> bool:
        return self.call(self._reset_prefix_cache(), timeout=30)

    async def _reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Reset the engine's prefix cache, noting when it succeeded (vLLM refuses
        while blocks are in use, and says so in its return value)."""
        added = self._requests_added
        keep = {"reset_running_requests": True} if reset_running_requests else {}
        done = bool(await self.engine.reset_prefix_cache(**keep))
        if done:
            self._reset_at = added  # requests added meanwhile leave it behind
        return done

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
        if self._copies_running:
            self.collective_rpc("rq_settle", 120)
            self._copies_running = False
        self._weights_asleep = True  # before the call: a sleep that times out may still land
        if level >= 2:
            self._weights_dropped = True
        self.call(self.engine.sleep(level), timeout=120)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine's ``tags`` (None: all).

        Refused (``EngineError``, nothing woken) where requests would run on weights the
        engine does not hold: the KV cache while the weights still sleep, and the KV
        cache of an engine whose weights a level-2 sleep dropped before a sync has
        brought a whole model (the weights alone may wake: a sync then loads them)."""
        problem = self.sleep_mode_problem()
        if problem is not None:
            raise EngineError(f"{problem} (nothing to wake)")
        weights = tags is None or "weights" in tags
        kv_cache = tags is None or "kv_cache" in tags
        if kv_cache and self._weights_dropped:
            raise EngineError(
                "this engine slept at level 2 and dropped its weights: woken without new ones it "
                "would serve whatever that memory holds. Wake it with weights (sync_weights.wake(model): "
                "the sync hands them over, then the KV cache wakes)")
        if kv_cache and not weights and self._weights_asleep:
            raise EngineError(
                "the engine's weights still sleep: wake them before the KV cache, or with new ones "
                "(sync_weights.wake(model)), or both at once (control.wake_up())")
        self.call(self.engine.wake_up(tags), timeout=120)
        if weights:
            self._weights_asleep = False
        if kv_cache:
            self.state.wake()

    def weights_asleep(self) -> bool:
        """Whether this host put the engine's weights to sleep and has not woken them."""
        return self._weights_asleep

    def weights_dropped(self) -> bool:
        """Whether a level-2 sleep dropped the weights and no sync has brought a whole model since."""
        return self._weights_dropped

    def weights_loading(self) -> None:
        """A sync's engine call returned while its copies still run on the device: the
        engine's own work is ordered after them, a sleep must wait for them first."""
        self._copies_running = True

    def weights_restored(self) -> None:
        """A sync loaded a whole model into weights a level-2 sleep had dropped."""
        self._weights_dropped = False

    def device_uuids(self) -> list[str]:
        """The UUID of each engine rank's GPU ("" for a CPU rank): how a colocated
        trainer tells that it shares the GPU (weight_sync/transports/cuda_ipc.py)."""
        return [str(uuid) for uuid in self.collective_rpc("rq_device_uuid", 60)]
