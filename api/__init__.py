"""The OpenAI-compatible HTTP gateway: OpenAI requests in, ``generate`` tasks out.

    rollout-queue api --port 8000        # or: from rollout_queue.api import create_app, ApiSettings

Owns the HTTP face: translation of OpenAI requests to tasks and back, batching
by sampling signature, the streaming relay, sticky sessions, tool calls, its
metrics. Imports ``tasks`` and FastAPI; never ``workers``, ``cli`` or vLLM
(a gateway host needs no engine).
"""

from rollout_queue.api.app import create_app
from rollout_queue.api.server import run_api
from rollout_queue.api.settings import ApiSettings

__all__ = ["ApiSettings", "create_app", "run_api"]
