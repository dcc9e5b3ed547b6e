"""One worker node: a Celery consumer and one vLLM engine in one process.

Three rooms and a ground floor; an arrow only ever points down:

- ``node``: the node assembled and run (``main``, ``runtime``: heartbeat,
  registry entry, fences), the task service (``service``), control commands
  (``control``), the worker host's part of a weight sync (``sync``, with the
  checkpoint headers it checks manifests against, ``weight_files``), metrics.
  Imports ``engine`` and ``queue``.
- ``engine``: one vLLM engine and what it makes (``host``: the engine host;
  ``args``: vLLM's flags; ``stats``, ``liveness``, ``orphans``; a sample's
  ``logprobs``, ``tools``, ``streaming``, checkpoints in ``progress``).
  Never imports ``node`` or ``queue``.
- ``queue``: what comes from and goes back to Redis (``reliable_redis``:
  a fetch that cannot lose a message; ``reaper``, ``handed_on``, ``dedup``,
  ``poison`` and its dead letters, ``delivery``: the task's strategy,
  ``intake``: fetch by engine room, ``result_backend``). Never imports
  ``node`` or ``engine``.
- ground: ``state`` (the node's state and fences) and ``settings``; they
  import only ``tasks``.

Started by ``rollout-queue worker`` (``workers.node.main``). Imports
``tasks``, ``weight_sync``, vLLM and torch; never ``api`` or ``cli``.
"""

__all__: list[str] = []
