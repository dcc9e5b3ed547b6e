"""Our ``SamplingParams`` as vLLM's: the one translation, for the engine host,
the generation run and the benchmarks' direct engine calls."""

from __future__ import annotations

import functools
from typing import Any

from rollout_queue.tasks.schemas import SamplingParams


def per_request_stream_interval() -> bool:
    """Whether this vLLM's ``SamplingParams`` take a ``stream_interval`` (0.32 does)."""
    return _takes("stream_interval")


@functools.cache
def _takes(name: str) -> bool:
    """Whether this vLLM's ``SamplingParams`` have the field ``name``."""
    from vllm import SamplingParams as VllmSamplingParams

    return name in getattr(VllmSamplingParams, "__struct_fields__", ())


def to_vllm_params(params: SamplingParams, kind: str = "final", every: int | None = None) -> Any:
    """Our validated params → ``vllm.SamplingParams``. ``kind``: the output
    vLLM sends: ``final`` only, or each step's ``delta`` (streamed tasks,
    checkpoints). ``every``: deltas only each ``every`` tokens (and the
    first and last), where vLLM has per-request ``stream_interval`` (0.32
    does; older versions send every step): a checkpoint reads one output per
    interval, and an output for every request at every step is what
    checkpoints cost (0.70x the throughput on an H200 batch of 1024, with
    cumulative outputs at every step)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kwargs: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "n": params.n,
        "stop": params.stop,
        "stop_token_ids": params.stop_token_ids,
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "ignore_eos": params.ignore_eos,
        "output_kind": {"final": RequestOutputKind.FINAL_ONLY, "delta": RequestOutputKind.DELTA}[kind],
    }
    if params.top_k is not None:
        kwargs["top_k"] = params.top_k
    if (params.logprobs is not None or params.prompt_logprobs is not None) and _takes("flat_logprobs"):
        kwargs["flat_logprobs"] = True  # a few lists per request, not objects per token (workers.engine.logprobs)
    if every is not None and every > 1 and per_request_stream_interval():
        kwargs["stream_interval"] = every
    structured = None
    if params.json_schema is not None:
        structured = StructuredOutputsParams(json=params.json_schema, disable_any_whitespace=True)
    elif params.json_object:
        structured = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    elif params.regex is not None:
        structured = StructuredOutputsParams(regex=params.regex)
    elif params.choice is not None:
        structured = StructuredOutputsParams(choice=params.choice)
    elif params.grammar is not None:
        structured = StructuredOutputsParams(grammar=params.grammar)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    return VllmSamplingParams(**kwargs)
