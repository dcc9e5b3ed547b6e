"""Reading vLLM's per-position logprobs (``{token_id: Logprob}``, or a
position of its ``FlatLogprobs``): what results and checkpoints keep of them."""

from __future__ import annotations

from typing import Any


def logprob_of(position: Any, token_id: int) -> float | None:
    """The logprob of ``token_id`` at ``position`` (None: no position, or not in it)."""
    if position is None:
        return None
    entry = position.get(token_id)
    return None if entry is None else float(entry.logprob)


def sampled_logprobs(positions: Any, token_ids: Any) -> list[float]:
    """The logprob of each sampled token at its position (0.0 where vLLM gave
    none). One pass without a call per token: a checkpoint runs it over every
    generated token, beside vLLM's output handling."""
    return [
        0.0 if position is None or (entry := position.get(token_id)) is None else entry.logprob
        for position, token_id in zip(positions, token_ids)
    ]


def top_logprobs(position: Any, k: int) -> list[tuple[int, float]]:
    """The ``k`` best ``(token_id, logprob)`` of ``position``, by vLLM's rank."""
    ranked = sorted(position.items(), key=lambda item: (item[1].rank or 0, -item[1].logprob))
    return [(int(tid), float(lp.logprob)) for tid, lp in ranked if (lp.rank or 0) <= k][:k]
