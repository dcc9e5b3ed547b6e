"""Running and developing rollout-queue: the ``rollout-queue`` command and the local tools.

Owns the command line (``cli.command``: ``rollout-queue``, ``python -m rollout_queue.cli``),
the quickstart (``cli.quickstart``) and its real model (``cli.quickstart_model``),
the local stack of Redis and worker subprocesses that the quickstart, the
benchmarks and the tests start (``cli.localstack``; its CPU workers forked
from a zygote, ``cli.zygote``, where the test suite runs one), the tiny random-weight
models (``cli.tiny_model``) and vLLM's offline engine configured like a worker
(``cli.offline``).

It sits on top of everything else: it imports ``tasks``, ``workers`` and
``api``; ``tasks``, ``workers`` and ``api`` never import it, so a worker or
the gateway runs without the developer tools.
"""

from rollout_queue.cli.command import main

__all__ = ["main"]
