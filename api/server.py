"""``run_api``: the ``rollout-queue api`` process. Settings → app → uvicorn."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import SecretStr

from rollout_queue.api.settings import ApiSettings
from rollout_queue.tasks.app import configure
from rollout_queue.tasks.settings import ClientSettings


def run_api(
    host: str | None = None,
    port: int | None = None,
    redis_url: str | None = None,
    **overrides: Any,
) -> int:
    """Serve the gateway until interrupted. Flags win over ``API_*`` / ``REDIS_URL``."""
    import uvicorn

    from rollout_queue.api.app import create_app

    given = {"host": host, "port": port, **overrides}
    settings = ApiSettings(**{k: v for k, v in given.items() if v is not None})
    client = ClientSettings(redis_url=SecretStr(redis_url)) if redis_url else ClientSettings()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
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
    )
    return 0
