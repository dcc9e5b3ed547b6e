"""Reference outputs from vLLM's offline ``LLM`` on a worker's engine config.

Run as a script (vLLM spawns processes, so never inside pytest's process)::

    python tests/offline_reference.py REQUEST.json OUT.json

REQUEST: ``{"model", "max_model_len", "cases": {name: {"kind", "prompts", "params"}}}``
with ``kind`` one of text, tokens, chat and ``params`` plain ``vllm.SamplingParams``
keywords (built here straight from vLLM, not through the project's conversion).
OUT: ``{name: [{"prompt_token_ids": [...], "samples": [[token ids], ...]}, ...]}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main(request_path: str, out_path: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rollout_queue.cli.offline import offline_llm, shutdown
    from rollout_queue.workers.settings import EngineSettings

    with open(request_path) as handle:
        request = json.load(handle)
    settings = EngineSettings(
        model=request["model"], device="cpu", dtype="float32",
        max_model_len=request["max_model_len"], gpu_memory_utilization=0.1,
        enforce_eager=True,  # as the tests' workers (tests.conftest.ENGINE_FLAGS)
    )
    llm = offline_llm(settings)
    results: dict[str, Any] = {}
    try:
        for name, case in request["cases"].items():
            params = SamplingParams(**case["params"])
            if case["kind"] == "chat":
                outs = llm.chat(case["prompts"], params, use_tqdm=False)
            elif case["kind"] == "tokens":
                prompts = [TokensPrompt(prompt_token_ids=ids) for ids in case["prompts"]]
                outs = llm.generate(prompts, params, use_tqdm=False)
            else:
                outs = llm.generate(case["prompts"], params, use_tqdm=False)
            results[name] = [
                {
                    "prompt_token_ids": list(out.prompt_token_ids),
                    "samples": [list(c.token_ids) for c in sorted(out.outputs, key=lambda c: c.index)],
                }
                for out in outs
            ]
    finally:
        shutdown(llm)
    with open(out_path, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
