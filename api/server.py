"""``run_api``: the ``rollout-queue api`` process. Settings → app → uvicorn."""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

from pydantic import SecretStr

from rollout_queue.api.settings import ApiSettings
from rollout_queue.tasks.app import configure
from rollout_queue.tasks.errors import BrokerUnavailable, RedisMayEvict
from rollout_queue.tasks.logs import configure_logging
from rollout_queue.tasks.registry import preflight
from rollout_queue.tasks.settings import ClientSettings


def run_api(
    host: str | None = None,
    port: int | None = None,
    redis_url: str | None = None,
    client_overrides: dict[str, Any] | None = None,
    **overrides: Any,
) -> int:
    """Serve the gateway until interrupted. Flags win over ``RQ_API_*`` / ``REDIS_URL``.

    ``overrides``: ``ApiSettings`` fields; ``client_overrides``: ``ClientSettings``
    fields (``allow_evicting_redis``). Redis unreachable, or one that may evict
    keys: one line on stderr, exit code 2, before uvicorn starts."""
    import uvicorn

    from rollout_queue.api.app import create_app

    given = {"host": host, "port": port, **overrides}
    settings = ApiSettings(**{k: v for k, v in given.items() if v is not None})
    client_given = {**(client_overrides or {}), "redis_url": SecretStr(redis_url) if redis_url else None}
    client = ClientSettings(**{k: v for k, v in client_given.items() if v is not None})
    try:
        redis_note = preflight(client)
    except (BrokerUnavailable, RedisMayEvict) as exc:
        print(f"rollout-queue api: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format, f"gateway@{socket.gethostname()}",
                      "%(asctime)s %(levelname)s %(name)s %(message)s")
    if redis_note is not None:
        logging.getLogger("rollout_queue.api").warning("%s", redis_note)
    configure(client)
    logging.getLogger("rollout_queue.api").info(
        "gateway on %s:%d, queue %r, broker %s, auth %s",
        settings.host, settings.port, settings.queue, client.redacted_url,
        "on (bearer token)" if settings.bearer_token() else
        "OFF: RQ_API_TOKEN is unset or empty, anyone who reaches the port can generate",
    )
    uvicorn.run(
        create_app(settings, client),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=settings.access_log,
        # JSON lines: uvicorn's loggers go through the root handler set above.
        log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
    )
    return 0
