"""vLLM's server routes besides OpenAI's, as the fleet answers them.

A client written for ``vllm serve`` (TRL's ``VLLMClient``) asks the server
what it runs and steers it through these:

- ``GET /server_info?config_format=json``: ``{"vllm_config": {...}}`` with the
  parts such clients read: ``model_config`` (``max_model_len``,
  ``max_logprobs``, ``logprobs_mode`` of the serving workers, from the
  registry), ``parallel_config`` (the fleet's engine ranks) and
  ``weight_transfer_config`` (``{"backend": "nccl"}``: the routes below);
- ``GET /get_world_size``: the engine ranks of the workers serving the
  gateway's queue, read from the registry now (vLLM: TP x PP x DP of its one
  engine; the workers are the fleet's data parallelism);
- ``POST /reset_prefix_cache``: the fleet's ``reset_prefix_cache`` control
  command (``tasks.control``, signed with ``RQ_WEIGHT_SYNC_SECRET``) to every
  live worker of the queue; ``{"success": true}`` when every engine reset;
- vLLM's weight-transfer routes (``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
  ``/shutdown_weight_transfer_engine``): the fleet as one vLLM NCCL
  weight-transfer engine (``weight_sync.vllm_transfer``): every engine rank
  joins the trainer's group, each update is one sync round of the project's
  (pause, receive, load, commit, fencing), in which a worker outside the
  trainer's group (started or restarted since its init) catches up from a
  member's relay; it is reported under ``fenced`` until it has the whole
  model. Their errors answer 400 (the
  request) or 409 (the fleet's state, a worker, a deadline), never 5xx:
  TRL's client retries 500, 502 and 503, which would repeat a transfer step
  while the trainer's broadcast is under way.

The routes sit behind the gateway's bearer token like ``/v1``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Query
from fastapi.params import Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from rollout_queue.api import errors
from rollout_queue.api.checks import ModelLimits
from rollout_queue.tasks import control
from rollout_queue.tasks.errors import BadRequest, ControlError, InvalidRequest, ManifestMismatch, RolloutError
from rollout_queue.weight_sync.vllm_transfer import FleetWeightTransfer, TransferInit, TransferUpdate

M = TypeVar("M", bound=BaseModel)

__all__ = ["WEIGHT_TRANSFER_ROUTES", "vllm_server_routes"]

WEIGHT_TRANSFER_ROUTES = (
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
    "/shutdown_weight_transfer_engine",
)


def server_config(model: str, limits: ModelLimits, weight_transfer: dict[str, Any] | None) -> dict[str, Any]:
    """The parts of vLLM's ``VllmConfig`` (JSON form) that describe the fleet."""
    return {
        "model_config": {
            "model": model,
            "served_model_name": model,
            "max_model_len": limits.max_model_len,
            "max_logprobs": limits.max_logprobs,
            "logprobs_mode": limits.logprobs_mode,
        },
        "parallel_config": {"world_size": limits.engine_ranks, "world_size_across_dp": limits.engine_ranks},
        "weight_transfer_config": weight_transfer,
    }


def weight_transfer_error(exc: Exception) -> JSONResponse:
    """A weight-transfer route's error: 400 for the request, 409 for the rest, never 5xx."""
    if isinstance(exc, ValidationError):
        problems = exc.errors()
        where = ".".join(str(part) for part in problems[0]["loc"]) if problems else ""
        message = str(problems[0]["msg"]).removeprefix("Value error, ") if problems else "invalid value"
        return errors.error_response(400, f"{where}: {message}" if where else message, "invalid_request_error",
                                     where or None)
    if isinstance(exc, BadRequest):
        return errors.error_response(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, InvalidRequest):
        return errors.error_response(400, str(exc), "invalid_request_error", code="invalid_weight_update")
    if isinstance(exc, ManifestMismatch):
        return errors.error_response(400, str(exc), "invalid_request_error", code="manifest_mismatch")
    if isinstance(exc, RolloutError):
        code = "weight_transfer_" + type(exc).__name__.lower()
        return errors.error_response(409, str(exc), "conflict_error", code=code)
    return errors.error_response(409, f"{type(exc).__name__}: {exc}", "conflict_error",
                                 code="weight_transfer_failed")


def vllm_server_routes(gateway: Any, auth: list[Depends], transfer: FleetWeightTransfer) -> APIRouter:
    """``gateway``: ``api.app.Gateway`` (its settings, limits and worker registry);
    ``transfer``: the fleet's weight-transfer engine."""
    router = APIRouter(dependencies=auth)

    @router.get("/server_info")
    async def server_info(config_format: str = Query("text")) -> dict[str, Any]:
        limits = await gateway.limits.current()
        config = server_config(gateway.settings.model_name, limits, transfer.config())
        return {"vllm_config": config if config_format == "json" else str(config)}

    @router.get("/get_world_size")
    async def get_world_size() -> dict[str, int]:
        limits = await gateway.limits.refreshed()
        return {"world_size": limits.engine_ranks}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        nodes = await asyncio.to_thread(gateway.serving_nodes)
        if not nodes:
            raise ControlError(
                f"no live worker serves the queue {gateway.settings.queue!r}: there is no prefix cache to reset"
            )
        replies = await asyncio.to_thread(control.reset_prefix_cache, nodes)
        return {"success": all(bool(ok) for ok in replies.values())}

    async def answer(step: Callable[[], dict[str, Any]]) -> JSONResponse:
        try:
            return JSONResponse(await asyncio.to_thread(step))
        except Exception as exc:  # noqa: BLE001  every error answers 400 or 409 (module docstring)
            return weight_transfer_error(exc)

    async def answer_parsed(model: type[M], raw: dict[str, Any], step: Callable[[M], dict[str, Any]]) -> JSONResponse:
        try:
            parsed = model.model_validate(raw)
        except ValidationError as exc:
            return weight_transfer_error(exc)
        return await answer(lambda: step(parsed))

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(init_info: Annotated[dict[str, Any], Body(embed=True)]) -> JSONResponse:
        return await answer_parsed(TransferInit, init_info, transfer.init)

    @router.post("/start_weight_update")
    async def start_weight_update() -> JSONResponse:
        return await answer(transfer.start)

    @router.post("/update_weights")
    async def update_weights(update_info: Annotated[dict[str, Any], Body(embed=True)]) -> JSONResponse:
        return await answer_parsed(TransferUpdate, update_info, transfer.update)

    @router.post("/finish_weight_update")
    async def finish_weight_update(weight_version: Annotated[str | None, Body(embed=True)] = None) -> JSONResponse:
        return await answer(transfer.finish)

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> JSONResponse:
        return await answer(transfer.shutdown)

    return router
