"""``GatewayMetrics``: the gateway's Prometheus metrics, in a registry of its own.

One registry per app (not the process-global one), so two gateways in one
process (tests) never collide; ``GET /metrics`` renders it.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_PROMPT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "rq_api_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "rq_api_request_seconds", "Time to answer a request", ["endpoint"], registry=r
        )
        self.tasks = Counter(
            "rq_api_tasks", "generate tasks sent (one per signature batch)", ["kind"], registry=r
        )
        self.failed_tasks = Counter(
            "rq_api_failed_tasks", "generate tasks that ended in an error", ["error"], registry=r
        )
        self.batch_prompts = Histogram(
            "rq_api_batch_prompts", "Prompts per generate task", buckets=_PROMPT_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "rq_api_batch_requests", "Requests per generate task", buckets=_PROMPT_BUCKETS, registry=r
        )
        self.task_seconds = Histogram(
            "rq_api_task_seconds", "From sending a task to its result", registry=r
        )
        self.inflight_tasks = Gauge(
            "rq_api_inflight_tasks", "Tasks sent and not yet answered", registry=r
        )
        self.open_batches = Gauge(
            "rq_api_open_batches", "Batches collecting requests, not yet sent", registry=r
        )
        self.rejected = Counter(
            "rq_api_rejected", "Requests refused before a task was sent", ["reason"], registry=r
        )
        self.aborted = Counter(
            "rq_api_aborted_requests",
            "Requests whose client went away after their task was sent; their prompts were aborted",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
