"""The gateway's ``ResultWatcher``: ``tasks.results.ResultWatcher`` with the gateway's
task names (``api-<instance>-<uuid>``), its timeout advice, and typed results."""

from __future__ import annotations

from typing import Any

from rollout_queue.tasks import results
from rollout_queue.tasks.schemas import GenerationResult

__all__ = ["ResultWatcher"]


class ResultWatcher(results.ResultWatcher):
    def __init__(
        self, redis_url: str, backend: Any, poll_s: float = 1.0, abandoned_ttl_s: float = 3600.0
    ) -> None:
        super().__init__(
            redis_url, backend, poll_s, abandoned_ttl_s, namespace="api",
            timeout_hint="the task expires unserved. Check that workers consume this gateway's queue "
            "(`rollout-queue status`) or raise RQ_API_REQUEST_TIMEOUT_S",
        )

    async def wait(self, task_id: str, timeout: float) -> GenerationResult:
        """The task's result; raises its error, or ``ResultTimeout`` after ``timeout`` s."""
        return GenerationResult.model_validate(await self.result(task_id, timeout))
