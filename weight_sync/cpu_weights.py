"""Plain linear weights on CPU: ``--cpu-weights plain``.

vLLM's CPU backend replaces every linear layer's weight, once loaded, with a
GEMM handle (oneDNN, or sgl's packed format for small ones) and drops the
plain tensor. A weight sync then has to rebuild each layer and pack it again
(layerwise reload): on the 2-core test machine that repacking is most of a
0.5B sync (docs/BENCHMARKS.md). With plain weights the layers keep their tensors and
multiply with ``torch.nn.functional.linear``: a sync loads directly, and
receives most tensors straight into the parameters (``weight_sync/inplace.py``).
The price is the packed GEMM's speed in generation (0.5B fp32 on the 2-core
test machine, 16 sequences: ~35 instead of ~58 tokens/s).

vLLM reads the choice in its engine's worker process, which imports this
project's worker extension before it loads the model; the worker's host
passes it there through the environment (``ENV``).
"""

from __future__ import annotations

import os
from typing import Any

ENV = "RQ_CPU_PLAIN_WEIGHTS"


def requested() -> bool:
    return os.environ.get(ENV) == "1"


def keep_plain_weights() -> None:
    """Make vLLM's CPU linear layers multiply their own (plain) weight tensors."""
    import torch
    from vllm.model_executor.layers import utils

    def plain_gemm(layer: Any, remove_weight: bool) -> None:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    utils.dispatch_cpu_unquantized_gemm = plain_gemm
