"""The Celery app shared by producers and workers, and its configuration.

The app object exists at import time; its configuration is built from
``ClientSettings`` the first time Celery needs it (or earlier, when a CLI
calls :func:`configure`), so importing ``tasks`` never reads the environment.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Queue

from tasks import keys
from tasks.settings import ClientSettings

app = Celery("rollout_queue")

_settings: ClientSettings | None = None


def celery_config(settings: ClientSettings) -> dict[str, Any]:
    url = settings.redis_url.get_secret_value()
    transport = {
        "visibility_timeout": settings.visibility_timeout,
        # Producers: fail fast and clearly when Redis is down, never hang.
        "max_retries": 3,
        "interval_start": 0.2,
        "interval_step": 0.5,
        "interval_max": 2.0,
        "socket_connect_timeout": 5,
        "socket_timeout": 30,
        "retry_on_timeout": True,
        "health_check_interval": 10,
    }
    return {
        "broker_url": url,
        "result_backend": url,
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "redis_socket_connect_timeout": 5,
        "redis_socket_timeout": 30,
        "redis_retry_on_timeout": True,
        "redis_backend_health_check_interval": 10,
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
        "result_extended": True,
        # Delivery: ack after the result is stored; one task prefetched at a
        # time per thread; a task whose worker died goes back to the queue.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_track_started": True,
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


def configure(new: ClientSettings) -> Celery:
    """Use these settings instead of the environment's (CLIs, tests)."""
    global _settings
    _settings = new
    app.conf.update(celery_config(new))
    return app
