"""vLLM's server routes besides OpenAI's, as the fleet answers them.

A client written for ``vllm serve`` (TRL's ``VLLMClient``) asks the server
what it runs and steers it through these:

- ``GET /server_info?config_format=json``: ``{"vllm_config": {...}}`` with the
  parts such clients read: ``model_config`` (``max_model_len``,
  ``max_logprobs``, ``logprobs_mode`` of the serving workers, from the
  registry), ``parallel_config`` (the fleet's engine ranks) and
  ``weight_transfer_config``: null, the fleet has no vLLM weight-transfer
  engine (below);
- ``GET /get_world_size``: the engine ranks of the workers serving the
  gateway's queue, read from the registry now (vLLM: TP x PP x DP of its one
  engine; the workers are the fleet's data parallelism);
- ``POST /reset_prefix_cache``: the fleet's ``reset_prefix_cache`` control
  command (``tasks.control``, signed with ``RQ_WEIGHT_SYNC_SECRET``) to every
  live worker of the queue; ``{"success": true}`` when every engine reset;
- vLLM's weight-transfer routes (``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
  ``/shutdown_weight_transfer_engine``) answer 501 naming what to use instead:
  vLLM's NCCL form makes each engine rank join the trainer's process group,
  and the fleet's workers take new weights through the project's own sync
  (``tasks.sync_weights``, ``weight_sync/``). 501 on purpose: TRL's client
  retries 500, 502 and 503, which would repeat a transfer step.

The routes sit behind the gateway's bearer token like ``/v1``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query
from fastapi.params import Depends
from fastapi.responses import JSONResponse

from rollout_queue.api import errors
from rollout_queue.api.checks import ModelLimits
from rollout_queue.tasks import control
from rollout_queue.tasks.errors import ControlError

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


def vllm_server_routes(gateway: Any, auth: list[Depends]) -> APIRouter:
    """``gateway``: ``api.app.Gateway`` (its settings, limits and worker registry)."""
    router = APIRouter(dependencies=auth)

    @router.get("/server_info")
    async def server_info(config_format: str = Query("text")) -> dict[str, Any]:
        limits = await gateway.limits.current()
        config = server_config(gateway.settings.model_name, limits, None)
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

    async def weight_transfer_not_served() -> JSONResponse:
        return errors.error_response(
            501,
            "this fleet has no vLLM weight-transfer engine: its workers take new weights through "
            "rollout-queue's own sync (rollout_queue.tasks.sync_weights.broadcast(model), or "
            "weight_sync.sender for a trainer process), which versions, fences and recovers the fleet",
            "not_implemented_error", code="weight_transfer_unsupported",
        )

    for path in WEIGHT_TRANSFER_ROUTES:
        router.add_api_route(path, weight_transfer_not_served, methods=["POST"])
    return router
