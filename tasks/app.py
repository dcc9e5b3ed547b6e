"""The Celery app shared by producers and workers, and its configuration.

The app object exists at import time; its configuration is built from
``ClientSettings`` the first time Celery needs it (or earlier, when a CLI
calls :func:`configure`), so importing ``tasks`` never reads the environment.
"""

from __future__ import annotations

import math
import ssl
from typing import Any

from celery import Celery
from kombu import Queue

from rollout_queue.tasks import broker, keys
from rollout_queue.tasks.settings import ClientSettings

app = Celery("rollout_queue")

_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}

_settings: ClientSettings | None = None


def retry_policy(seconds: float) -> dict[str, float]:
    """A kombu/Celery retry policy that gives up after about ``seconds``."""
    return {
        "max_retries": max(1, math.ceil(seconds)),
        "interval_start": 0.0,
        "interval_step": 0.5,
        "interval_max": 1.0,
    }


# redis-py tries each new connection twice before it reports a failure to Celery.
ATTEMPTS_PER_CONNECT = 2
# The longest pause between two of the result subscription's retries.
SUBSCRIBE_RETRY_INTERVAL_S = 0.5


def connect_budget(deadline: float) -> tuple[float, dict[str, float]]:
    """The socket connect timeout and the result subscription's retry policy that
    make a producer give up within ``deadline`` seconds, whatever Redis does.

    Redis that refuses connections (stopped) fails each attempt at once: the
    retries then span the deadline, riding out a restart. Redis that cannot be
    reached (a link down) lets each attempt run to its connect timeout, and
    Celery subscribes to the task's result before it publishes: its first
    subscription (one connect), the retries that start before the policy's
    ``timeout``, one last pause and the last retry (one connect) must all fit
    in the deadline. A connect is one eighth of it (0.2 s to 5 s), so the two
    connects take half, the retries' window the rest.
    """
    connect_timeout = min(5.0, max(0.2, deadline / 8))
    one_connect = ATTEMPTS_PER_CONNECT * connect_timeout
    window = max(0.01, deadline - 2 * one_connect - SUBSCRIBE_RETRY_INTERVAL_S)
    policy = {**retry_policy(deadline), "interval_max": SUBSCRIBE_RETRY_INTERVAL_S, "timeout": window}
    return connect_timeout, policy


def redis_tls_options(settings: ClientSettings) -> dict[str, Any] | None:
    """redis-py SSL parameters for a ``rediss://`` URL (None for ``redis://``).

    Celery and kombu take the same dict (``broker_use_ssl`` /
    ``redis_backend_use_ssl``); the registry client takes it as keywords.
    """
    if not settings.redis_url.get_secret_value().startswith("rediss://"):
        return None
    options: dict[str, Any] = {"ssl_cert_reqs": _CERT_REQS[settings.redis_tls_cert_reqs]}
    if settings.redis_tls_ca_file:
        options["ssl_ca_certs"] = settings.redis_tls_ca_file
    if settings.redis_tls_certfile:
        options["ssl_certfile"] = settings.redis_tls_certfile
    if settings.redis_tls_keyfile:
        options["ssl_keyfile"] = settings.redis_tls_keyfile
    return options


def celery_config(settings: ClientSettings) -> dict[str, Any]:
    """Configuration of a producer (trainer, API): fail fast when Redis is down."""
    url = settings.redis_url.get_secret_value()
    deadline = settings.broker_connect_timeout
    connect_timeout, subscribe_policy = connect_budget(deadline)
    broker_transport = {
        "visibility_timeout": settings.visibility_timeout,
        # Connection set-up (kombu ``ensure_connection``): give up after
        # about ``broker_connect_timeout`` seconds.
        **retry_policy(deadline),
        "socket_connect_timeout": connect_timeout,
        "socket_timeout": 30,
        "retry_on_timeout": True,
        "health_check_interval": 10,
    }
    backend_transport = {
        # Subscribing to a result (before the publish) and reading it: the
        # same deadline, held even when each connect runs to its timeout.
        "retry_policy": subscribe_policy,
    }
    tls = redis_tls_options(settings)
    config: dict[str, Any] = {
        "broker_url": url,
        # kombu's Redis transport, one Redis client per pool (tasks/broker.py).
        "broker_transport": broker.TRANSPORT,
        "result_backend": url,
        "broker_transport_options": broker_transport,
        "result_backend_transport_options": backend_transport,
        "broker_connection_timeout": connect_timeout,
        "redis_socket_connect_timeout": connect_timeout,
        "redis_socket_timeout": 30,
        "redis_retry_on_timeout": True,
        "redis_backend_health_check_interval": 10,
        # Publishing: retried, then ``BrokerUnavailable`` (GenerateTask maps it).
        "task_publish_retry": True,
        "task_publish_retry_policy": retry_policy(deadline),
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,  # workers: reconnect for ever
        # JSON only: a pickle payload pushed into the queue is refused.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        "result_compression": "gzip",
        "result_expires": settings.result_expires,
        # Not extended: a result would hold the task's prompts (args) a second
        # time, next to the outputs that already carry their token ids.
        "result_extended": False,
        # Delivery: ack after the result is stored; one task prefetched at a
        # time per thread. A worker that dies is handled by the reaper
        # (workers/queue/reaper.py): the threads pool has no child to lose, and
        # kombu alone would only restore its messages after visibility_timeout.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_track_started": True,
        # Sent with every task (``timelimit`` header) unless apply_async
        # overrides them; enforced by the worker's GenerationService (the
        # threads pool has no time limits of its own).
        "task_soft_time_limit": settings.task_soft_time_limit,
        "task_time_limit": settings.task_time_limit,
        # Monitoring: Flower sees every task, from the producer on.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_default_queue": keys.GENERATE_QUEUE,
        "task_queues": [Queue(keys.GENERATE_QUEUE)],
        "task_routes": {keys.GENERATE_TASK: {"queue": keys.GENERATE_QUEUE}},
        "worker_hijack_root_logger": False,
        "broker_pool_limit": 32,
        # Read by GenerateTask before its first send (tasks.registry.check_eviction_policy).
        "rq_allow_evicting_redis": settings.allow_evicting_redis,
    }
    if tls is not None:
        config["broker_use_ssl"] = tls
        config["redis_backend_use_ssl"] = tls
    return config


def worker_config(settings: ClientSettings) -> dict[str, Any]:
    """What a worker changes: ride out a Redis outage instead of failing fast.

    A finished task's result is retried for ``result_store_timeout`` seconds
    (a Redis restart must not turn a good result into a failure); the broker
    connection is retried for ever (``broker_connection_max_retries``).
    """
    store = retry_policy(settings.result_store_timeout)
    return {
        "result_backend_transport_options": {"retry_policy": store},
        "result_backend_always_retry": True,
        "result_backend_max_retries": store["max_retries"],
    }


def _defaults() -> dict[str, Any]:
    return celery_config(settings())


app.add_defaults(_defaults)


def settings() -> ClientSettings:
    """The client settings in force (read from the environment on first use)."""
    global _settings
    if _settings is None:
        _settings = ClientSettings()
    return _settings


def configure(new: ClientSettings, *, worker: bool = False) -> Celery:
    """Use these settings instead of the environment's (CLIs, tests).

    ``worker=True``: a worker node's configuration (see :func:`worker_config`).
    """
    global _settings
    _settings = new
    app.conf.update(celery_config(new))
    if worker:
        app.conf.update(worker_config(new))
    return app
