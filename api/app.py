"""``create_app(settings)``: the FastAPI app of the OpenAI-compatible gateway.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``GET /v1/models``, ``GET /health``,
``GET /metrics``; ``/docs``, ``/redoc`` and ``/openapi.json`` only with
``RQ_API_DOCS``. Those and the ``/v1`` routes need ``Authorization: Bearer
<RQ_API_TOKEN>`` when a token is set; ``/health`` and ``/metrics`` are open
(probes, scrapers).

A request is translated (``api.translate``), checked alone (``api.checks``),
handed to the signature batcher (``api.batcher``), which sends one
``generate`` task per batch and waits on the results (``api.results``)
without blocking the loop. Meanwhile the route listens for the client's
disconnect: a client that goes away has its prompts aborted. A ``stream:
true`` request is a task of its own whose worker publishes its tokens as
they are generated (``api.streaming``); each delta is relayed as an SSE
chunk when it arrives (``api.stream_chunks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from kombu.exceptions import OperationalError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_queue.api import checks, errors, translate
from rollout_queue.api import tokenize as token_routes
from rollout_queue.api.batcher import Share, SignatureBatcher
from rollout_queue.api.checks import LimitsReader
from rollout_queue.api.metrics import GatewayMetrics
from rollout_queue.api.middleware import BodyLimit, RequestMetrics
from rollout_queue.api.results import ResultWatcher
from rollout_queue.api.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from rollout_queue.api.sessions import Sessions
from rollout_queue.api.settings import ApiSettings
from rollout_queue.api.stream_chunks import chat_events, completion_events
from rollout_queue.api.streaming import StreamRelay
from rollout_queue.api.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from rollout_queue.api.tokens import TokenNamer
from rollout_queue.api.vllm_server import WEIGHT_TRANSFER_ROUTES, vllm_server_routes
from rollout_queue.tasks import keys
from rollout_queue.tasks.app import app as celery_app
from rollout_queue.tasks.app import settings as client_settings_in_force
from rollout_queue.tasks.errors import (
    BrokerUnavailable,
    ClientDisconnected,
    ModelNotFound,
    RolloutError,
    Unauthorized,
)
from rollout_queue.tasks.generate import generate
from rollout_queue.tasks.registry import connect, live_workers
from rollout_queue.tasks.schemas import PromptKind, SamplingParams, WorkerInfo
from rollout_queue.tasks.settings import ClientSettings
from rollout_queue.tasks.streaming import STREAM_HEADER
from rollout_queue.weight_sync.settings import SyncSettings
from rollout_queue.weight_sync.vllm_transfer import FleetWeightTransfer

T = TypeVar("T")

log = logging.getLogger("rollout_queue.api")

_ENDPOINTS = {
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
    "/detokenize", "/version", "/server_info", "/get_world_size", "/reset_prefix_cache", *WEIGHT_TRANSFER_ROUTES,
}
try:
    _VERSION = importlib.metadata.version("rollout-queue")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    _VERSION = "unknown"


class Gateway:
    """What the routes share: settings, batcher, watcher, metrics, token namer."""

    def __init__(self, settings: ApiSettings, client: ClientSettings) -> None:
        self.settings = settings
        self.client = client
        self.metrics = GatewayMetrics()
        self.started = int(time.time())
        self.watcher = ResultWatcher(
            client.redis_url.get_secret_value(), celery_app.backend, settings.result_poll_s,
            # A task may start up to request_timeout_s after it is sent, then run its time limit.
            abandoned_ttl_s=settings.request_timeout_s + max(client.task_soft_time_limit, client.task_time_limit),
        )
        self.batcher = SignatureBatcher(
            self.send,
            self.abort,
            self.watcher,
            self.metrics,
            window_s=settings.batch_window_ms / 1000.0,
            max_batch_prompts=settings.max_batch_prompts,
            max_inflight_tasks=settings.max_inflight_tasks,
            timeout_s=settings.request_timeout_s,
            max_task_sequences=client.task_max_sequences,
        )
        self.relay = StreamRelay(
            client.redis_url.get_secret_value(), self.send_streamed, self.abort, self.watcher,
            timeout_s=settings.request_timeout_s, max_streams=settings.max_inflight_tasks,
        )
        self.namer = TokenNamer(None)
        self.id_namer = TokenNamer(None, as_ids=True)  # for return_tokens_as_token_ids
        self._registry = connect(client)
        self.limits = LimitsReader(self._live_workers, settings.queue, None, settings.limits_refresh_s)
        self._redis: aioredis.Redis | None = None  # abort sets
        self.sessions = Sessions(client.redis_url.get_secret_value(), settings.queue)
        # vLLM's weight-transfer routes (api.vllm_server); RQ_RENDEZVOUS_HOST: where
        # the workers reach this gateway's store for a round's decision.
        self.weight_transfer = FleetWeightTransfer(
            SyncSettings(weight_sync_secret=client.weight_sync_secret), self._queue_workers)

    def send(
        self, prompts: list[Any], params: SamplingParams, task_id: str, expires_s: float,
        queue: str | None = None, headers: dict[str, Any] | None = None,
    ) -> None:
        """Enqueue one generate task (runs in a worker thread: kombu blocks). ``queue``: a
        sticky session's worker queue (the reaper moves it back to ours if that worker dies)."""
        headers = dict(headers or {})
        if queue is not None and queue != self.settings.queue:
            headers[keys.FALLBACK_QUEUE_HEADER] = self.settings.queue
        generate.apply_async(
            (prompts, params), task_id=task_id, queue=queue or self.settings.queue, expires=expires_s,
            headers=headers,
        )

    def send_streamed(
        self, prompts: list[Any], params: SamplingParams, task_id: str, expires_s: float, queue: str | None = None,
    ) -> None:
        """Enqueue one task whose worker publishes its tokens as they come (``tasks.streaming``)."""
        self.send(prompts, params, task_id, expires_s, queue, {STREAM_HEADER: True})

    async def route(self, request: Request, body: Any) -> tuple[str | None, str | None]:
        """A request's session (``X-Session-ID``, else ``user``) and the queue its turn goes to."""
        session = request.headers.get("x-session-id") or getattr(body, "user", None)
        queue, route = await self.sessions.queue_for(session)
        if session:
            self.metrics.session_turns.labels(route=route).inc()
        return session, (None if queue == self.settings.queue else queue)

    async def remembering(self, session: str | None, items: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """A streamed task's items, unchanged; the session's worker is recorded from the last."""
        async for item in items:
            if isinstance(item, Share):
                await self.sessions.served(session, item.worker)
            yield item

    async def abort(self, task_id: str, indices: list[int]) -> None:
        """Ask the task's worker to abort these prompts (their client went away)."""
        if self._redis is None:
            self._redis = aioredis.from_url(
                self.client.redis_url.get_secret_value(), socket_connect_timeout=5
            )
        key = keys.abort_key(task_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.sadd(key, *indices)
            pipe.expire(key, int(self.settings.request_timeout_s) + 60)
            await pipe.execute()

    def _live_workers(self) -> list[Any]:
        return live_workers(self._registry)

    def _queue_workers(self) -> list[WorkerInfo]:
        return [w for w in live_workers(self._registry) if self.settings.queue in w.queues]

    async def admit(
        self, body: BaseModel, kind: PromptKind, prompts: list[Any], params: SamplingParams
    ) -> None:
        """Every check a request passes alone before it may share a task (``api.checks``)."""
        settings = self.settings
        param = "messages" if kind == "chat" else "prompt"
        checks.check_sequences(len(prompts), params.n, settings.max_request_sequences, param)
        limits = await self.limits.current()
        checks.check_prompts(
            kind, prompts, limits, settings.max_prompt_chars, settings.max_prompt_tokens,
        )
        for regex in ("regex", "guided_regex"):
            checks.check_regex(getattr(body, regex), regex)
        structured = getattr(body, "structured_outputs", None)
        if structured is not None:
            checks.check_regex(structured.regex, "structured_outputs.regex")
        checks.check_logprobs(params, limits, "top_logprobs" if kind == "chat" else "logprobs")
        checks.check_task(kind, prompts, params, param)

    async def start(self) -> None:
        await self.watcher.start()
        self.namer = await asyncio.to_thread(TokenNamer.load, self.settings.tokenizer)
        self.id_namer = TokenNamer(self.namer.tokenizer, as_ids=True)
        self.limits = LimitsReader(
            self._live_workers, self.settings.queue, self.namer.vocab_size,
            self.settings.limits_refresh_s,
        )
        try:  # open the broker connection now, not on the first request
            await asyncio.to_thread(self._warm_broker)
        except (OperationalError, OSError) as exc:  # Redis may come up later; requests say so
            log.warning("could not reach the broker at start-up: %s", exc)

    def _warm_broker(self) -> None:
        with celery_app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)

    async def close(self) -> None:
        await self.batcher.close()
        await self.relay.close()
        await self.watcher.close()
        await self.sessions.close()
        if self._redis is not None:
            await self._redis.aclose()

    async def spread(self, prompts: int, queue: str | None) -> int:
        """How many workers a completion request of ``prompts`` prompts is split over: one
        part per serving worker, each of at least ``RQ_API_SPREAD_MIN_PROMPTS`` (1: not split;
        a sticky session's turn stays on its worker)."""
        least = self.settings.spread_min_prompts
        if queue is not None or least <= 0:
            return 1
        workers = (await self.limits.current()).workers
        return max(1, min(workers, prompts // least))

    def namer_for(self, body: Any) -> TokenNamer:
        """How this request's logprob tokens are spelled."""
        return self.id_namer if getattr(body, "return_tokens_as_token_ids", False) else self.namer

    def check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise ModelNotFound(
                f"the model {model!r} does not exist here; this gateway serves "
                f"{self.settings.model_name!r} (see GET /v1/models)"
            )

    def serving_nodes(self) -> list[str]:
        """The live workers consuming the gateway's queue (control commands' targets)."""
        return sorted(w.node for w in live_workers(self._registry) if self.settings.queue in w.queues)

    def serving_workers(self) -> int:
        workers = live_workers(self._registry)
        return sum(1 for w in workers if self.settings.queue in w.queues and w.state == "serving")


def create_app(settings: ApiSettings, client: ClientSettings | None = None) -> FastAPI:
    """The gateway app. ``client``: the queue settings (default: those in force)."""
    gateway = Gateway(settings, client or client_settings_in_force())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    # The generated docs are off unless asked for, then behind the token (below).
    app = FastAPI(
        title="rollout-queue gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
        openapi_url=None,
    )
    app.state.gateway = gateway
    _install_error_handlers(app, settings)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=gateway.metrics, endpoints=_ENDPOINTS)

    token = settings.bearer_token()

    async def authorized(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise Unauthorized("missing bearer token: send the header 'Authorization: Bearer <RQ_API_TOKEN>'")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise Unauthorized("wrong API token")

    auth = [Depends(authorized)]

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gateway.check_model(body.model)
        checks.check_unicode(body.model_dump(exclude_defaults=True))
        ignored = _ignored_fields(body)
        kind, prompts = translate.completion_prompts(body)
        params = translate.completion_params(body)
        await gateway.admit(body, kind, prompts, params)
        session, queue = await gateway.route(request, body)
        if body.stream:
            items = gateway.remembering(session, gateway.relay.relay(kind, prompts, params, queue))
            first = await _unless_disconnected(request, anext(items))
            return _sse(completion_events(
                body, first, items, gateway.namer_for(body), translate.new_id("cmpl"), translate.now(), params.n
            ), ignored)
        spread = await gateway.spread(len(prompts), queue)
        share = await _unless_disconnected(request, gateway.batcher.submit(kind, prompts, params, queue, spread))
        await gateway.sessions.served(session, share.worker)
        result = translate.completion_response(
            body, share, gateway.namer_for(body), translate.new_id("cmpl"), translate.now()
        )
        return JSONResponse(translate.to_json(result), headers=ignored)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gateway.check_model(body.model)
        checks.check_unicode(body.model_dump(exclude_defaults=True))
        ignored = _ignored_fields(body)
        prompts = translate.chat_prompts(body)
        params = translate.chat_params(body, settings.default_max_tokens)
        await gateway.admit(body, "chat", prompts, params)
        session, queue = await gateway.route(request, body)
        if body.stream:
            items = gateway.remembering(session, gateway.relay.relay("chat", prompts, params, queue))
            first = await _unless_disconnected(request, anext(items))
            return _sse(chat_events(
                body, first, items, gateway.namer_for(body), translate.new_id("chatcmpl"), translate.now(), params.n
            ), ignored)
        share = await _unless_disconnected(request, gateway.batcher.submit("chat", prompts, params, queue))
        await gateway.sessions.served(session, share.worker)
        result = translate.chat_response(
            body, share, gateway.namer_for(body), translate.new_id("chatcmpl"), translate.now()
        )
        return JSONResponse(translate.to_json(result), headers=ignored)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        limits = await gateway.limits.current()
        return ModelList(data=[ModelCard(
            id=settings.model_name, created=gateway.started, max_model_len=limits.max_model_len
        )])

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        if body.model is not None:
            gateway.check_model(body.model)
        limits = await gateway.limits.current()
        return await asyncio.to_thread(token_routes.tokenize, gateway.namer.tokenizer, body, limits.max_model_len)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        if body.model is not None:
            gateway.check_model(body.model)
        return await asyncio.to_thread(token_routes.detokenize, gateway.namer.tokenizer, body)

    app.include_router(vllm_server_routes(gateway, auth, gateway.weight_transfer))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _VERSION}

    @app.get("/health")
    async def health() -> JSONResponse:
        body: dict[str, Any] = {
            "queue": settings.queue,
            "inflight_tasks": gateway.batcher.inflight_tasks,
            "open_batches": gateway.batcher.open_batches,
        }
        try:
            workers = await asyncio.to_thread(gateway.serving_workers)
        except BrokerUnavailable as exc:
            return JSONResponse({"status": "redis_unavailable", "error": str(exc), **body}, 503)
        status = "ok" if workers else "no_workers"
        return JSONResponse({"status": status, "workers": workers, **body})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=gateway.metrics.content_type)

    if settings.docs:
        @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
        async def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

        @app.get("/docs", dependencies=auth, include_in_schema=False)
        async def docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

        @app.get("/redoc", dependencies=auth, include_in_schema=False)
        async def redoc() -> HTMLResponse:
            return get_redoc_html(openapi_url="/openapi.json", title=app.title)

    return app


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled.

    Cancelling the batcher's ``submit`` takes the request out of its batch,
    or aborts its prompts in the task already sent.
    """
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not job.done():
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job
        gone.cancel()
    if job.cancelled():
        raise ClientDisconnected("the client closed its connection; its prompts were aborted")
    return job.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is already read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(events: Any, headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers}
    )


IGNORED_FIELDS_HEADER = "X-Ignored-Fields"


def _ignored_fields(body: BaseModel) -> dict[str, str]:
    """Unknown top-level fields: logged, then named in a response header (as vLLM, ignored)."""
    unknown = sorted(body.model_extra or {})
    if not unknown:
        return {}
    # Names are the client's JSON keys: only plain ones go into a header.
    shown = [n if _PLAIN_NAME.fullmatch(n) else "(unprintable)" for n in unknown]
    log.warning("ignored unknown request fields: %s", ", ".join(shown))
    return {IGNORED_FIELDS_HEADER: ", ".join(shown)}


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _install_error_handlers(app: FastAPI, settings: ApiSettings) -> None:
    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return errors.from_validation(exc)

    async def on_rollout_error(_: Request, exc: Exception) -> JSONResponse:
        return errors.from_exception(exc, settings.saturated_status)

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return errors.error_response(exc.status_code, str(exc.detail), kind)

    # Other exceptions become a 500 in api.middleware.RequestMetrics (a handler
    # for Exception would sit in ServerErrorMiddleware, which closes the connection).
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(RolloutError, on_rollout_error)
    app.add_exception_handler(StarletteHTTPException, on_http)
