"""One worker node: a Celery consumer and one vLLM engine in one process.

Owns what runs on a GPU (or CPU) host: the engine host (``engine``), the task
service (``service``), the intake gate (``intake``), the node's state
(``state``), heartbeat and registry entry (``runtime``), redelivery
(``reliable_redis``, ``reaper``, ``handed_on``, ``dedup``, ``poison``),
control commands (``control``), the worker host's part of a weight sync
(``sync``), checkpoints (``progress``), streaming, what results keep of
vLLM's logprobs (``logprobs``), tool-call parsing and
metrics. Started by ``rollout-queue worker`` (``workers.main``).

Imports ``tasks``, ``weight_sync``, vLLM and torch; never ``api`` or ``cli``.
"""

__all__: list[str] = []
