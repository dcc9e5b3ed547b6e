"""The asyncio client: ``generate`` calls awaited on an event loop, no thread per pending task.

    from rollout_queue.tasks import aio, generate
    result = await generate.async_(["2+2="], {"max_tokens": 64}, timeout=60)   # a GenerationResult dict
    typed = await aio.generate(["2+2="], {"max_tokens": 64}, typed=True)       # a GenerationResult
    async for index, result in aio.as_completed([[p] for p in prompts], params, timeout=600):
        rollouts[index] = result["outputs"][0]["samples"]

A call is validated as ``generate.delay`` validates it (``pydantic.ValidationError``
or ``InvalidRequest`` before anything is sent), split as ``generate.delay``
splits it (``RQ_TASK_MAX_PROMPTS``, ``RQ_TASK_MAX_SEQUENCES``; the parts are
joined into one result, ``tasks.split.join_results``) and sent as ordinary
``generate`` tasks. Kombu's publish blocks, so a send runs in a thread
(``asyncio.to_thread``) while it publishes; the wait for the result is on the
event loop, through one ``tasks.results.ResultWatcher`` per client (one
pattern subscription for all its tasks). A failed task raises the error its
``.get()`` raises (``PromptTooLong``, ``EngineError``, ``GenerationTimeout``
... from ``tasks.errors``); Redis unreachable raises ``BrokerUnavailable``; no
result within ``timeout`` seconds raises ``ResultTimeout`` (a ``TimeoutError``).
The timeout counts from the call, its send included: a result read by then
is returned (also while a held-up send still runs), one read later is not.
A call given up (timed out, or its awaiting task cancelled) costs the workers
no more: its task expires (a worker that has not started it drops it) and a
running one's prompts are aborted in the engine (``keys.abort_key``, as the
gateway does for a client that went away); its result is deleted when it comes.

:class:`AsyncClient` is the client with an explicit life (``async with``);
the module's functions use one default client per event loop, started on
first use and closed by :func:`close` (or with its loop).
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, Literal, Self, overload

from rollout_queue.tasks.app import app, settings
from rollout_queue.tasks.errors import InvalidRequest, ResultTimeout
from rollout_queue.tasks.generate import FIRST_PROMPT_HEADER, build_request, check_sequences
from rollout_queue.tasks.generate import generate as generate_task
from rollout_queue.tasks.results import ResultWatcher
from rollout_queue.tasks.schemas import GenerateRequest, GenerationResult, SamplingParams
from rollout_queue.tasks.split import join_results, plan_parts, prompts_per_task

__all__ = ["AsyncClient", "as_completed", "close", "generate"]

Params = SamplingParams | Mapping[str, Any] | None
# as_completed: one params for every call, or a list of one per call.
CallsParams = Params | list[SamplingParams | Mapping[str, Any]] | tuple[SamplingParams | Mapping[str, Any], ...]
Result = dict[str, Any] | GenerationResult


class AsyncClient:
    """Sends ``generate`` calls and awaits their results on the running event loop.

    ``queue``: where calls go by default (the ``generate`` task's route if None).
    ``abandoned_ttl_s``: how long a result nobody waits for any more (its wait
    timed out or was cancelled) is watched for, to be deleted when it arrives.
    """

    def __init__(self, *, queue: str | None = None, poll_s: float = 1.0, abandoned_ttl_s: float = 3600.0) -> None:
        self.queue = queue
        self._watcher = ResultWatcher(
            settings().redis_url.get_secret_value(), app.backend, poll_s, abandoned_ttl_s,
            namespace="aio", timeout_hint="the task expires unserved if no worker started it; check that "
            "workers consume its queue (`rollout-queue status`) or pass a longer timeout",
        )
        self._abandoned_ttl_s = abandoned_ttl_s
        self._started: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Subscribe to this client's results (done by the first call otherwise)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._watcher.start())
        try:
            await asyncio.shield(self._started)
        except BaseException:
            if self._started.done():  # it failed: the next call tries again
                self._started = None
            raise

    async def close(self) -> None:
        await self._watcher.close()
        self._started = None

    @property
    def abandoned(self) -> int:
        """Calls given up whose results are still to come (to be deleted when they do)."""
        return self._watcher.abandoned

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    @overload
    async def generate(
        self, prompts: Any, params: Params = None, *, timeout: float | None = None,
        typed: Literal[False] = False, queue: str | None = None,
    ) -> dict[str, Any]: ...

    @overload
    async def generate(
        self, prompts: Any, params: Params = None, *, timeout: float | None = None,
        typed: Literal[True], queue: str | None = None,
    ) -> GenerationResult: ...

    @overload
    async def generate(
        self, prompts: Any, params: Params = None, *, timeout: float | None = None,
        typed: bool, queue: str | None = None,
    ) -> Result: ...

    async def generate(
        self, prompts: Any, params: Params = None, *, timeout: float | None = None,
        typed: bool = False, queue: str | None = None,
    ) -> Result:
        """One call's ``GenerationResult``: a dict (as ``.get()`` returns), or the
        model with ``typed=True``. ``timeout``: seconds (None: as long as it takes)."""
        result = await self._run(self._request(prompts, params), timeout, queue)
        return result if typed else result.model_dump(mode="json")

    @overload
    def as_completed(
        self, calls: Iterable[Any], params: CallsParams = None, *, timeout: float | None = None,
        typed: Literal[False] = False, queue: str | None = None, return_exceptions: bool = False,
    ) -> AsyncIterator[tuple[int, dict[str, Any]]]: ...

    @overload
    def as_completed(
        self, calls: Iterable[Any], params: CallsParams = None, *, timeout: float | None = None,
        typed: Literal[True], queue: str | None = None, return_exceptions: bool = False,
    ) -> AsyncIterator[tuple[int, GenerationResult]]: ...

    @overload
    def as_completed(
        self, calls: Iterable[Any], params: CallsParams = None, *, timeout: float | None = None,
        typed: bool, queue: str | None = None, return_exceptions: bool = False,
    ) -> AsyncIterator[tuple[int, Any]]: ...

    def as_completed(
        self, calls: Iterable[Any], params: CallsParams = None, *, timeout: float | None = None,
        typed: bool = False, queue: str | None = None, return_exceptions: bool = False,
    ) -> AsyncIterator[tuple[int, Any]]:
        """Send one call per item of ``calls`` (each item is one call's prompts) with
        ``params`` (one for all, or a list of one per call); yield
        ``(call_index, result)`` in completion order.

        Every call is validated before any is sent. ``timeout``: seconds for each
        call, all sent at once (so also for the whole). A failed call raises its
        error from the iterator and the calls still running are given up (their
        results are deleted when they arrive); ``return_exceptions=True`` yields
        ``(call_index, error)`` in its place instead and goes on.
        """
        calls = list(calls)
        per_call = list(params) if isinstance(params, (list, tuple)) else [params] * len(calls)
        if len(per_call) != len(calls):
            raise InvalidRequest(
                f"{len(per_call)} params for {len(calls)} calls: give one params for every call, "
                "or a list of one per call"
            )
        requests = [self._request(prompts, call_params) for prompts, call_params in zip(calls, per_call)]
        return self._as_completed(requests, timeout, typed, queue, return_exceptions)

    async def _as_completed(
        self, requests: list[GenerateRequest], timeout: float | None, typed: bool, queue: str | None,
        return_exceptions: bool,
    ) -> AsyncIterator[tuple[int, Any]]:
        async def indexed(index: int, request: GenerateRequest) -> tuple[int, Any]:
            try:
                result = await self._run(request, timeout, queue)
            except Exception as exc:
                if not return_exceptions:
                    raise
                return index, exc
            return index, result if typed else result.model_dump(mode="json")

        calls = [asyncio.ensure_future(indexed(i, request)) for i, request in enumerate(requests)]
        try:
            for next_done in asyncio.as_completed(calls):
                yield await next_done
        finally:
            for call in calls:
                call.cancel()  # a call left running (an error, or the caller stopped reading)
            await asyncio.gather(*calls, return_exceptions=True)

    def _request(self, prompts: Any, params: Params) -> GenerateRequest:
        request = build_request(prompts, params)
        check_sequences(request, settings().call_max_sequences)
        return request

    async def _run(self, request: GenerateRequest, timeout: float | None, queue: str | None) -> GenerationResult:
        """Send ``request`` (split as ``generate.delay`` splits it) and await its result."""
        await self.start()
        client = settings()
        limit = prompts_per_task(request.params.n, client.task_max_prompts, client.task_max_sequences)
        parts = plan_parts(len(request.prompts), limit)
        waits = [
            self._run_part(
                request.model_copy(update={"prompts": request.prompts[part.start : part.stop]}),
                {FIRST_PROMPT_HEADER: part.start} if len(parts) > 1 else {},
                timeout, queue or self.queue,
            )
            for part in parts
        ]
        if len(waits) == 1:
            return await waits[0]
        running = [asyncio.ensure_future(wait) for wait in waits]
        try:
            return join_results(await asyncio.gather(*running))
        finally:
            for part in running:
                part.cancel()  # a failed part fails the call: the others are given up

    async def _run_part(
        self, request: GenerateRequest, headers: dict[str, Any], timeout: float | None, queue: str | None
    ) -> GenerationResult:
        task_id = self._watcher.new_task_id()
        options: dict[str, Any] = {"task_id": task_id}
        if queue is not None:
            options["queue"] = queue
        if timeout is not None:
            options["expires"] = timeout  # a task nobody will read is not started
        try:
            result = await self._watcher.sent(
                task_id, functools.partial(generate_task.send, request, headers, options), timeout
            )
        except (ResultTimeout, asyncio.CancelledError):
            # Given up (timed out, or the caller cancelled): its worker stops
            # generating it; its result is deleted when it comes.
            self._watcher.abort(task_id, len(request.prompts), self._abandoned_ttl_s)
            raise
        return GenerationResult.model_validate(result)


# One default client per event loop: a watcher's connections and tasks belong to one loop.
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncClient] = weakref.WeakKeyDictionary()


def default_client() -> AsyncClient:
    """The running loop's default client (made on first use)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = AsyncClient()
    return client


async def close() -> None:
    """Close the running loop's default client (a later call opens a new one)."""
    client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.close()


@overload
async def generate(
    prompts: Any, params: Params = None, *, timeout: float | None = None,
    typed: Literal[False] = False, queue: str | None = None,
) -> dict[str, Any]: ...


@overload
async def generate(
    prompts: Any, params: Params = None, *, timeout: float | None = None,
    typed: Literal[True], queue: str | None = None,
) -> GenerationResult: ...


@overload
async def generate(
    prompts: Any, params: Params = None, *, timeout: float | None = None,
    typed: bool, queue: str | None = None,
) -> Result: ...


async def generate(
    prompts: Any, params: Params = None, *, timeout: float | None = None,
    typed: bool = False, queue: str | None = None,
) -> Result:
    """:meth:`AsyncClient.generate` on the running loop's default client."""
    return await default_client().generate(prompts, params, timeout=timeout, typed=typed, queue=queue)


@overload
def as_completed(
    calls: Iterable[Any], params: CallsParams = None, *, timeout: float | None = None,
    typed: Literal[False] = False, queue: str | None = None, return_exceptions: bool = False,
) -> AsyncIterator[tuple[int, dict[str, Any]]]: ...


@overload
def as_completed(
    calls: Iterable[Any], params: CallsParams = None, *, timeout: float | None = None,
    typed: Literal[True], queue: str | None = None, return_exceptions: bool = False,
) -> AsyncIterator[tuple[int, GenerationResult]]: ...


@overload
def as_completed(
    calls: Iterable[Any], params: CallsParams = None, *, timeout: float | None = None,
    typed: bool, queue: str | None = None, return_exceptions: bool = False,
) -> AsyncIterator[tuple[int, Any]]: ...


def as_completed(
    calls: Iterable[Any], params: CallsParams = None, *, timeout: float | None = None,
    typed: bool = False, queue: str | None = None, return_exceptions: bool = False,
) -> AsyncIterator[tuple[int, Any]]:
    """:meth:`AsyncClient.as_completed` on the running loop's default client."""
    return default_client().as_completed(
        calls, params, timeout=timeout, typed=typed, queue=queue, return_exceptions=return_exceptions
    )
