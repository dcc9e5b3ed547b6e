"""The ``generate`` task: producer-side validation, worker-side execution hook.

Producers call ``generate.delay(prompts, params)``. Prompts and params are
validated here, in the producer, before anything reaches Redis; the task
message carries the canonical params and the signature (also as a header,
so Flower and routers see it without parsing args). Monitors show a one-line
summary (:func:`task_summary`) where the args go, never the prompts.

A call with more than ``RQ_TASK_MAX_PROMPTS`` prompts, or more than
``RQ_TASK_MAX_SEQUENCES`` sequences (prompts x n; ``ClientSettings``), is
split into several such tasks and returns a ``tasks.split.SplitResult``
whose ``.get()`` joins them into one result; smaller calls (and calls that
name their ``task_id``) are one task, as always. A call asking for more than
``RQ_CALL_MAX_SEQUENCES`` sequences is refused (``InvalidRequest``).

Results are ``GenerationResult`` dicts (``.get()``); ``.result_model()`` returns
the ``GenerationResult`` itself. ``await generate.async_(prompts, params)`` is
the asyncio form (``tasks.aio``).

On a worker, :attr:`GenerateTask.executor` is installed at boot
(``workers.node.service.GenerationService``); the task body only hands over.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, Literal, Protocol, overload

from celery import Task, signals
from celery.exceptions import Reject
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult
from kombu.exceptions import OperationalError
from redis.exceptions import OutOfMemoryError, RedisError

from rollout_queue.tasks import keys, trace
from rollout_queue.tasks.app import app, settings
from rollout_queue.tasks.errors import (
    BrokerFull,
    BrokerUnavailable,
    EngineError,
    InvalidRequest,
    PromptTooLong,
    Requeue,
    RolloutError,
)
from rollout_queue.tasks.registry import check_eviction_policy
from rollout_queue.tasks.schemas import GenerateRequest, GenerationResult, SamplingParams
from rollout_queue.tasks.settings import redact_url
from rollout_queue.tasks.signature import signature
from rollout_queue.tasks.split import SplitResult, plan_parts, prompts_per_task

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "rq_signature"
SENT_AT_HEADER = "rq_sent_at"
MIN_VERSION_HEADER = "rq_min_weight_version"
# Prompts x n: what the task holds of an engine's running batch (workers.queue.intake).
SEQUENCES_HEADER = "rq_sequences"
# A part of a split call: the index of its first prompt in the whole call, so
# errors name prompts by their index in what the caller sent.
FIRST_PROMPT_HEADER = "rq_first_prompt"
# What a task resumed after a pause="abort" sync does with the samples its
# previous run generated on older weights: "resume" (the default) continues
# them on the new weights, "restart" generates them again from scratch.
ON_NEW_WEIGHTS_HEADER = "rq_on_new_weights"
ON_NEW_WEIGHTS = ("resume", "restart")
# The brokers (URLs) whose eviction policy this process has checked and accepted.
_EVICTION_CHECKED: set[str] = set()
# Follow-up tasks Celery would send from the worker: refused (workers.queue.delivery).
LINK_OPTIONS = ("link", "link_error", "chain", "chord")
# Requeues (weights too old, fenced, sync abort) are not failures: allow many.
REQUEUE_LIMIT = 100_000
# How often a waiting ``.get()`` reads the result's key itself (GenerationAsyncResult).
NOTICE_CHECK_S = 5.0


class GenerationAsyncResult(AsyncResult):  # type: ignore[misc]
    """A ``generate`` task's ``AsyncResult``: ``.get()`` returns the result as a dict
    (as always), :meth:`result_model` as a ``GenerationResult``. A traced task's
    result gets its ``read`` stamp as ``.get()`` returns it (``tasks.trace``).

    While ``.get()`` waits for the result's notice (Redis pub/sub), it also reads the
    result's key every ``NOTICE_CHECK_S`` seconds, as the asyncio client's watcher
    does (``tasks.results``): a notice published while the subscription is being made
    again is lost. Seen after a Redis restart: Celery's result consumer reads the keys
    it waits for, then subscribes again, and a result stored between the two was
    never seen, its ``.get()`` timing out although the result sat in Redis. The read
    is Celery's own: each wait it begins reads the key first (its result consumer's
    ``on_wait_for_pending``), so ``.get()`` waits in steps of ``NOTICE_CHECK_S``."""

    def get(self, timeout: float | None = None, *args: Any, **kwargs: Any) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = NOTICE_CHECK_S if deadline is None else min(NOTICE_CHECK_S, deadline - time.monotonic())
            try:
                result = super().get(max(left, 0.0), *args, **kwargs)
                break
            except CeleryTimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
        if isinstance(result, dict) and result.get("trace") is not None:
            trace.stamp(result["trace"], "read")
        return result

    def result_model(self, timeout: float | None = None, **options: Any) -> GenerationResult:
        """``.get(timeout, **options)`` parsed into a ``GenerationResult``."""
        return GenerationResult.model_validate(self.get(timeout=timeout, **options))


class Executor(Protocol):
    def execute(self, task: Task, prompts: Any, params: Any) -> dict[str, Any]: ...


def build_request(prompts: Any, params: SamplingParams | Mapping[str, Any] | None) -> GenerateRequest:
    """Validate prompts and params; raises ``pydantic.ValidationError`` naming the field."""
    if params is None:
        params = {}
    elif isinstance(params, SamplingParams):
        params = params.canonical()
    elif isinstance(params, Mapping):
        params = dict(params)
    # Anything else goes to pydantic as is: its error names ``params``.
    return GenerateRequest.model_validate({"prompts": prompts, "params": params})


def check_sequences(request: GenerateRequest, limit: int) -> None:
    """Refuse a call asking for more than ``limit`` sequences (``RQ_CALL_MAX_SEQUENCES``)."""
    sequences = len(request.prompts) * request.params.n
    if sequences > limit:
        raise InvalidRequest(
            f"this call asks for {sequences} sequences ({len(request.prompts)} prompts x "
            f"n={request.params.n}); a call may ask for at most {limit} (RQ_CALL_MAX_SEQUENCES): "
            "send fewer prompts per call, or use generate_many"
        )


_KIND_WORD = {"text": "text", "chat": "chat", "tokens": "token"}


def task_summary(request: GenerateRequest, signature: str) -> str:
    """The task's ``argsrepr``: what Flower and task events show as its args.

    ``64 text prompts · n=4 · max_tokens=256 · T=1.0 · min_version=3 · signature=…``:
    short enough for a table cell. Celery's default (the args' repr, cut at
    1 KB) showed the first prompts and cut the sampling params off.
    """
    params = request.params
    count = len(request.prompts)
    return " · ".join([
        f"{count} {_KIND_WORD[request.kind]} prompt{'' if count == 1 else 's'}",
        f"n={params.n}",
        f"max_tokens={params.max_tokens}",
        f"T={params.temperature}",
        f"min_version={params.min_weight_version}",
        f"signature={signature}",
    ])


class GenerateTask(Task):
    """Validates in ``apply_async``; runs through the worker's executor."""

    name = keys.GENERATE_TASK
    executor: Executor | None = None
    # Engine failures (a poison request) are retried this often, then fail.
    max_retries = 2
    # STARTED is stored by the worker's service beside the task's run, not by
    # Celery before it (workers.node.service.GenerationService.mark_started).
    track_started = False
    throws = (InvalidRequest, PromptTooLong)  # expected: logged without a traceback

    def delay(self, *args: Any, **kwargs: Any) -> GenerationAsyncResult | SplitResult:
        """``apply_async(args, kwargs)``, as Celery's, with its return type."""
        return self.apply_async(args, kwargs)

    def apply_async(
        self, args: Any = None, kwargs: Any = None, **options: Any
    ) -> GenerationAsyncResult | SplitResult:
        """Celery's, validated first; ``trace=True`` (or ``RQ_TRACE_PHASES``): the result
        carries the task's phase trace (``tasks.trace``)."""
        called = time.time()
        arguments = dict(kwargs or {})
        positional = list(args or ())
        prompts = positional[0] if positional else arguments.pop("prompts", None)
        params = positional[1] if len(positional) > 1 else arguments.pop("params", None)
        if arguments or len(positional) > 2:
            extra = sorted(arguments) or [f"{len(positional)} positional arguments"]
            raise TypeError(f"generate takes (prompts, params); got unexpected {', '.join(extra)}")
        serializer = options.get("serializer")
        if serializer not in (None, "json"):
            raise InvalidRequest(
                f"serializer {serializer!r} refused: tasks travel as JSON only "
                "(workers accept nothing else; pickle would let a message run code)"
            )
        links = sorted(name for name in LINK_OPTIONS if options.get(name))
        if links:
            raise InvalidRequest(
                f"{', '.join(links)} refused: generate tasks run no follow-up task (workers "
                "dead-letter messages that carry one); wait for the result and send the next "
                "task from the caller"
            )
        request = build_request(prompts, params)
        headers = dict(options.pop("headers", None) or {})
        client = settings()
        if options.pop("trace", False) or client.trace_phases:
            _trace_publishes()
            headers[trace.TRACE_HEADER] = {"called": called}
        on_new_weights = options.pop("on_new_weights", None)
        if on_new_weights is not None:
            if on_new_weights not in ON_NEW_WEIGHTS:
                raise InvalidRequest(
                    f"on_new_weights={on_new_weights!r}; use 'resume' (continue partial samples on "
                    "new weights) or 'restart' (generate them again from scratch)"
                )
            headers[ON_NEW_WEIGHTS_HEADER] = on_new_weights
        headers.setdefault(SENT_AT_HEADER, time.time())
        check_sequences(request, client.call_max_sequences)
        limit = prompts_per_task(request.params.n, client.task_max_prompts, client.task_max_sequences)
        if len(request.prompts) <= limit or "task_id" in options:
            # A caller that names the task id watches that task's result
            # itself (the gateway does): never split.
            return self.send(request, headers, options)
        return self._send_split(request, headers, options, limit)

    def AsyncResult(self, task_id: str, **kwargs: Any) -> GenerationAsyncResult:
        """The result handle ``apply_async`` returns (and ``generate.AsyncResult(id)``)."""
        return GenerationAsyncResult(task_id, backend=self.backend, task_name=self.name, app=self._get_app(), **kwargs)

    def send(
        self, request: GenerateRequest, headers: dict[str, Any], options: dict[str, Any]
    ) -> GenerationAsyncResult:
        """Enqueue ``request`` as one task, whatever its size (``generate_many``'s chunks)."""
        headers = dict(headers)
        if trace.TRACE_HEADER in headers:  # each part of a split call has stamps of its own
            headers[trace.TRACE_HEADER] = dict(headers[trace.TRACE_HEADER])
        headers.setdefault(SENT_AT_HEADER, time.time())
        headers[SIGNATURE_HEADER] = signature(request.params)
        headers[MIN_VERSION_HEADER] = request.params.min_weight_version
        headers[SEQUENCES_HEADER] = len(request.prompts) * request.params.n
        options = dict(options)
        # Monitors (Flower, task events) show argsrepr and kwargsrepr where the
        # args and kwargs go; this task's kwargs are always empty, so the
        # signature goes there too (Flower's kwargs column and search).
        options.setdefault("argsrepr", task_summary(request, headers[SIGNATURE_HEADER]))
        options.setdefault("kwargsrepr", repr({"signature": headers[SIGNATURE_HEADER]}))
        wire = request.model_dump(mode="json")
        try:
            self._check_eviction_once()
            return super().apply_async((wire["prompts"], wire["params"]), {}, headers=headers, **options)
        except (OperationalError, RedisError, RuntimeError) as exc:
            # OperationalError: kombu gave up publishing. RuntimeError: Celery's
            # result consumer gave up subscribing to the result (it wraps the
            # redis error); any other RuntimeError is not ours to map.
            if isinstance(exc, RuntimeError) and not isinstance(exc.__cause__, RedisError):
                raise
            raise self._unavailable(exc) from exc

    def _send_split(
        self, request: GenerateRequest, headers: dict[str, Any], options: dict[str, Any], limit: int
    ) -> SplitResult:
        """One task per part of ``plan_parts``, same params, headers and options (time
        limits, queue, expiry apply to each part); ``tasks.split`` joins them."""
        refused = sorted({"group_id"} & set(options))  # links are refused for every call (apply_async)
        if refused:
            raise InvalidRequest(
                f"{', '.join(refused)} cannot be used with a split generate call "
                f"({len(request.prompts)} prompts of n={request.params.n} > {limit} prompts per task, "
                "RQ_TASK_MAX_PROMPTS and RQ_TASK_MAX_SEQUENCES); send at most "
                f"{limit} prompts per call, or raise those settings"
            )
        split_id = str(uuid.uuid4())
        app = self._get_app()
        parts: list[AsyncResult] = []
        with app.producer_or_acquire(options.pop("producer", None)) as producer:
            for index, prompts in enumerate(plan_parts(len(request.prompts), limit)):
                part = request.model_copy(update={"prompts": request.prompts[prompts.start : prompts.stop]})
                parts.append(self.send(
                    part,
                    {**headers, FIRST_PROMPT_HEADER: prompts.start},
                    {**options, "producer": producer, "group_id": split_id, "group_index": index},
                ))
        result = SplitResult(split_id, parts, app=app)
        try:
            result.save()
        except (RedisError, OperationalError) as exc:
            raise self._unavailable(exc) from exc
        return result

    def _unavailable(self, exc: BaseException) -> BrokerUnavailable:
        conf = self._get_app().conf
        url = redact_url(str(conf.broker_url or ""))
        full = _out_of_memory(exc)
        if full is not None:
            return BrokerFull(
                f"could not enqueue the task: Redis at {url} is full ({self._memory_figures()}) and "
                f"refuses writes ({full}); nothing was enqueued. Free memory (results are kept for "
                "RQ_RESULT_EXPIRES seconds; old dead letters: `rollout-queue dead-letters`) or raise "
                "Redis's maxmemory, then send again"
            )
        # retry_policy(): about one retry per second of broker_connect_timeout.
        waited = conf.task_publish_retry_policy.get("max_retries", "?")
        if isinstance(exc, RuntimeError) and exc.__cause__ is not None:
            exc = exc.__cause__
        return BrokerUnavailable(
            f"could not enqueue the task: Redis at {url} did not answer for about {waited} s "
            f"({type(exc).__name__}: {str(exc).strip()[:200]}); check REDIS_URL and that Redis is up"
        )

    def _check_eviction_once(self) -> None:
        """Before this process's first task to a broker: refuse (``RedisMayEvict``) a
        Redis that may evict keys, unless ``RQ_ALLOW_EVICTING_REDIS``; an unreachable
        Redis raises the RedisError or OperationalError the caller maps."""
        conf = self._get_app().conf
        url = str(conf.broker_url or "")
        if url in _EVICTION_CHECKED:
            return
        with self._get_app().connection_for_write() as conn:
            # Retried as a publish is (about RQ_BROKER_CONNECT_TIMEOUT): a restarting
            # Redis is ridden out here too.
            conn.ensure_connection(**conf.task_publish_retry_policy)
            note = check_eviction_policy(conn.default_channel.client,
                                         allow=bool(conf.get("rq_allow_evicting_redis", False)))
        _EVICTION_CHECKED.add(url)
        if note is not None:
            log.warning("%s", note)

    def _memory_figures(self) -> str:
        """``used_memory 9.9M of maxmemory 10.0M, maxmemory-policy noeviction`` (INFO is
        allowed when Redis is full), or what kept us from reading them."""
        try:
            with self._get_app().connection_for_write() as conn:
                memory = conn.default_channel.client.info("memory")
        except Exception as exc:  # noqa: BLE001  only for the message
            return f"memory figures unavailable: {type(exc).__name__}"
        return (f"used_memory {memory.get('used_memory_human', '?')} of maxmemory "
                f"{memory.get('maxmemory_human', '?')}, maxmemory-policy {memory.get('maxmemory_policy', '?')}")

    def stream(self, prompts: Any, params: Any = None, **options: Any) -> Iterator[Any]:
        """Send one task and yield its tokens as they are generated (``SampleDelta``),
        then its ``GenerationResult``: see ``tasks.streaming.stream``."""
        from rollout_queue.tasks.streaming import stream

        return stream(self, prompts, params, **options)

    @overload
    async def async_(
        self, prompts: Any, params: Any = None, *, timeout: float | None = None,
        typed: Literal[False] = False, queue: str | None = None,
    ) -> dict[str, Any]: ...

    @overload
    async def async_(
        self, prompts: Any, params: Any = None, *, timeout: float | None = None,
        typed: Literal[True], queue: str | None = None,
    ) -> GenerationResult: ...

    @overload
    async def async_(
        self, prompts: Any, params: Any = None, *, timeout: float | None = None,
        typed: bool, queue: str | None = None,
    ) -> dict[str, Any] | GenerationResult: ...

    async def async_(
        self, prompts: Any, params: Any = None, *, timeout: float | None = None,
        typed: bool = False, queue: str | None = None,
    ) -> dict[str, Any] | GenerationResult:
        """Send one call and await its result on the running event loop:
        ``tasks.aio.generate`` on the loop's default client."""
        from rollout_queue.tasks import aio

        return await aio.generate(prompts, params, timeout=timeout, typed=typed, queue=queue)

    def run(self, prompts: Any, params: Any) -> dict[str, Any]:
        if self.executor is None:
            raise RolloutError(
                "this process hosts no engine; generate tasks run on `rollout-queue worker` processes"
            )
        try:
            return self.executor.execute(self, prompts, params)
        except Requeue as exc:
            # Not this worker's to serve now (weights too old, sync abort):
            # back to the queue for any worker, without using up retries.
            raise self._retry(exc, countdown=exc.countdown, max_retries=REQUEUE_LIMIT) from exc
        except EngineError as exc:
            raise self._retry(exc, countdown=1) from exc

    def _retry(self, exc: Exception, **options: Any) -> BaseException:
        """Celery's ``retry``; when Redis refuses the new message (full, or away), the
        task's own message is rejected *with* requeue instead of Celery's dropping it:
        it goes back to its queue, or, Redis refusing that too, stays in ``unacked``,
        where the reaper finds it once no task of this worker holds it."""
        try:
            return self.retry(exc=exc, **options)
        except Reject as rejected:
            if isinstance(rejected.reason, BrokerUnavailable) and not rejected.requeue:
                log.warning("could not requeue task %s (%s); its message goes back to its queue as it is",
                            self.request.id, rejected.reason)
                return Reject(rejected.reason, requeue=True)
            raise


_TRACING_PUBLISHES: list[bool] = []


def _trace_publishes() -> None:
    """Stamp traced messages as they are published (on the first traced call: an untraced
    producer keeps no receiver on Celery's publish signal)."""
    if not _TRACING_PUBLISHES:
        signals.before_task_publish.connect(trace.on_before_publish, sender=keys.GENERATE_TASK, weak=False)
        _TRACING_PUBLISHES.append(True)


def _out_of_memory(exc: BaseException | None) -> OutOfMemoryError | None:
    """The ``OutOfMemoryError`` (Redis full) ``exc`` is or was caused by, if any."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OutOfMemoryError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


generate: GenerateTask = app.register_task(GenerateTask())  # type: ignore[assignment]
