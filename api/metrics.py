"""``GatewayMetrics``: the gateway's Prometheus metrics, in a registry of its own.

One registry per app (not the process-global one), so two gateways in one
process (tests) never collide; ``GET /metrics`` renders it. Names share the
workers' prefix (``rollout_queue_api_``); the time histograms reach 30 min,
past the longest request (``RQ_API_REQUEST_TIMEOUT_S``, 600 s by default).
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

PREFIX = "rollout_queue_api"
_PROMPT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# The workers' task-latency buckets (workers/node/metrics.py): 50 ms to 30 min.
_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.request_seconds = Histogram(
            f"{PREFIX}_request_seconds", "Time to answer a request", ["endpoint"],
            buckets=_SECONDS_BUCKETS, registry=r
        )
        self.tasks = Counter(
            f"{PREFIX}_tasks", "generate tasks sent (one per signature batch)", ["kind"], registry=r
        )
        self.failed_tasks = Counter(
            f"{PREFIX}_failed_tasks", "generate tasks that ended in an error", ["error"], registry=r
        )
        self.batch_prompts = Histogram(
            f"{PREFIX}_batch_prompts", "Prompts per generate task", buckets=_PROMPT_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            f"{PREFIX}_batch_requests", "Requests per generate task", buckets=_PROMPT_BUCKETS, registry=r
        )
        self.task_seconds = Histogram(
            f"{PREFIX}_task_seconds", "From sending a task to its result", buckets=_SECONDS_BUCKETS, registry=r
        )
        self.inflight_tasks = Gauge(
            f"{PREFIX}_inflight_tasks", "Tasks sent and not yet answered", registry=r
        )
        self.open_batches = Gauge(
            f"{PREFIX}_open_batches", "Batches collecting requests, not yet sent", registry=r
        )
        self.session_turns = Counter(
            f"{PREFIX}_session_turns",
            "Requests with a session key, by route: sticky (its worker's queue), shared (that worker "
            "gone, busy or not sticky), new (no earlier turn known)", ["route"], registry=r,
        )
        self.rejected = Counter(
            f"{PREFIX}_rejected", "Requests refused before a task was sent", ["reason"], registry=r
        )
        self.aborted = Counter(
            f"{PREFIX}_aborted_requests",
            "Requests whose client went away after their task was sent; their prompts were aborted",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
