"""Reading vLLM's logprobs: what results, streams and checkpoints keep of them.

vLLM hands a sample's (or a prompt's) logprobs either as a list of positions
(``{token_id: Logprob}`` each, ``None`` for a prompt's first token) or as a
``FlatLogprobs``: the same entries in a few flat lists (token ids, logprobs,
ranks, and each position's start and end in them). Workers ask for the flat
form (``SamplingParams(flat_logprobs=True)``): a 1,024-request batch then
builds a few lists per request instead of a dict and a ``Logprob`` per token,
objects the engine's Python would otherwise create, hold and have the garbage
collector walk until the sample ends. Every reader here takes both forms and
never turns a flat one back into dicts.

- :func:`sample_logprobs` — a sample's sampled-token logprobs, and its top k;
- :func:`prompt_logprobs` — the same for a prompt (``None`` where vLLM gives
  no position);
- :func:`extend` — a delta output's flat logprobs appended to the merged ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

TopK = list[tuple[int, float]]


def is_flat(logprobs: Any) -> bool:
    """Whether ``logprobs`` is vLLM's ``FlatLogprobs`` (duck-typed: no vLLM import)."""
    return hasattr(logprobs, "start_indices")


def _entries(logprobs: Any, index: int) -> dict[int, tuple[float, int | None]] | None:
    """Position ``index`` as ``{token_id: (logprob, rank)}``; None: vLLM has none there."""
    if is_flat(logprobs):
        start, end = logprobs.start_indices[index], logprobs.end_indices[index]
        if start == end:  # a position appended as None (a prompt's first token)
            return None
        ids, lps, ranks = logprobs.token_ids, logprobs.logprobs, logprobs.ranks
        return {ids[j]: (lps[j], ranks[j]) for j in range(start, end)}
    position = logprobs[index]
    if position is None:
        return None
    return {token_id: (entry.logprob, entry.rank) for token_id, entry in position.items()}


# What a top-k entry says for a token the request's structured output forbids
# (vLLM's logprob there is -inf, which JSON cannot carry): vLLM's OpenAI server
# answers the same.
FORBIDDEN_LOGPROB = -9999.0


def _top(entries: dict[int, tuple[float, int | None]], k: int) -> TopK:
    """The ``k`` best ``(token_id, logprob)``, by vLLM's rank."""
    ranked = sorted(entries.items(), key=lambda item: (item[1][1] or 0, -item[1][0]))
    return [(int(tid), max(float(lp), FORBIDDEN_LOGPROB)) for tid, (lp, rank) in ranked if (rank or 0) <= k][:k]


def _sampled(logprobs: Any, token_ids: Sequence[int], start: int, missing: float | None) -> list[float | None]:
    """The logprob of each token at its position (``token_ids[i]`` at position
    ``start + i``), ``missing`` where vLLM has none. One pass, no object per
    token: a checkpoint runs it over every generated token, beside vLLM's own
    output handling."""
    if is_flat(logprobs):
        starts, ends, ids, lps = logprobs.start_indices, logprobs.end_indices, logprobs.token_ids, logprobs.logprobs
        values: list[float | None] = []
        for index, token_id in enumerate(token_ids, start):
            first, end = starts[index], ends[index]
            if first < end and ids[first] == token_id:  # vLLM puts the sampled token first
                values.append(lps[first])
                continue
            try:
                values.append(lps[ids.index(token_id, first, end)])
            except ValueError:
                values.append(missing)
        return values
    return [
        missing if position is None or (entry := position.get(token_id)) is None else entry.logprob
        for position, token_id in zip(logprobs[start:start + len(token_ids)], token_ids)
    ]


def _read(
    logprobs: Any, token_ids: Sequence[int], k: int, start: int, missing: float | None,
) -> tuple[list[float | None], list[TopK | None] | None]:
    """The logprobs of ``token_ids`` from position ``start`` on (``missing``
    where vLLM gave none), and with ``k`` > 0 each position's top ``k`` (None
    where vLLM has no position)."""
    values = _sampled(logprobs, token_ids, start, missing)
    if k <= 0:
        return values, None
    top: list[TopK | None] = []
    for index in range(start, start + len(token_ids)):
        entries = _entries(logprobs, index)
        top.append(None if entries is None else _top(entries, k))
    return values, top


def sample_logprobs(
    logprobs: Any, token_ids: Sequence[int], k: int, start: int = 0,
) -> tuple[list[float], list[TopK] | None]:
    """A sample's logprobs of ``token_ids`` (its tokens from ``start`` on; 0.0
    where vLLM gave none), and with ``k`` > 0 each position's top ``k``. As
    many as vLLM has positions for: a checkpoint may read a sample whose
    tokens are merged and whose logprobs are not yet."""
    token_ids = token_ids[: max(0, len(logprobs) - start)]  # positions vLLM has not merged yet: none
    values, top = _read(logprobs, token_ids, k, start, 0.0)
    # With 0.0 for a missing logprob, no value is None; a sample has every position.
    return cast(list[float], values), None if top is None else [entries or [] for entries in top]


def prompt_logprobs(
    logprobs: Any, token_ids: Sequence[int], k: int,
) -> tuple[list[float | None], list[TopK | None] | None]:
    """A prompt's logprobs of its tokens (None where vLLM gave none: its first
    token), and with ``k`` > 0 each position's top ``k`` (None likewise)."""
    return _read(logprobs, token_ids[: len(logprobs)], k, 0, None)


def prompt_ranks(logprobs: Any, token_ids: Sequence[int]) -> list[int | None]:
    """The engine's rank of each prompt token at its position (1: the likeliest;
    None where vLLM gave no position or no rank)."""
    ranks: list[int | None] = []
    for index, token_id in enumerate(token_ids[: len(logprobs)]):
        entries = _entries(logprobs, index)
        found = None if entries is None else entries.get(token_id)
        ranks.append(None if found is None or found[1] is None else int(found[1]))
    return ranks


def extend(logprobs: Any, more: Any) -> None:
    """Append the flat logprobs ``more`` to the flat ``logprobs``, list by list.

    ``FlatLogprobs.extend`` builds a dict per position; this copies the lists.
    The positions' bounds go last, so a reader on another thread (a
    checkpoint) that takes ``len(logprobs)`` first only sees whole positions.
    """
    offset = len(logprobs.logprobs)  # ``more``'s entries start at 0 (a popped or sliced one)
    logprobs.token_ids.extend(more.token_ids)
    logprobs.logprobs.extend(more.logprobs)
    logprobs.ranks.extend(more.ranks)
    logprobs.decoded_tokens.extend(more.decoded_tokens)
    logprobs.end_indices.extend(end + offset for end in more.end_indices)
    logprobs.start_indices.extend(first + offset for first in more.start_indices)
