"""vLLM's own engine arguments on the worker command line.

``rollout-queue worker --model M --quantization fp8 --kv-cache-dtype fp8``:
every flag the worker's parser does not know is parsed by vLLM's parser
(``AsyncEngineArgs.add_cli_args``), so any engine option works with vLLM's
names, choices and checks, and an unknown or bad one fails the way
``vllm serve`` fails (argparse's message, exit code 2). Only the options given
are kept; they reach ``EngineArgs`` after the worker's own (``engine_kwargs``).
The same dict can come from the environment: ``RQ_ENGINE_ARGS='{"quantization": "fp8"}'``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["parse_engine_args"]


def parse_engine_args(argv: list[str], prog: str = "rollout-queue worker") -> dict[str, Any]:
    """The engine options given in ``argv``, as ``EngineArgs`` keywords."""
    if not argv:
        return {}
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=f"{prog} (vLLM engine arguments)", add_help=False)
    AsyncEngineArgs.add_cli_args(parser)
    given = vars(parser.parse_args(argv))
    defaults = vars(parser.parse_args([]))
    return {name: value for name, value in given.items() if defaults.get(name) != value}
