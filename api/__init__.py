"""The OpenAI-compatible HTTP gateway: OpenAI requests in, ``generate`` tasks out.

    rollout-queue api --port 8000        # or: from api import create_app, ApiSettings
"""

from api.app import create_app
from api.server import run_api
from api.settings import ApiSettings

__all__ = ["ApiSettings", "create_app", "run_api"]
