"""Reading vLLM's logprobs in both of its forms (pure logic, on vLLM's own containers).

The engine paths (results, streams, checkpoints with ``flat_logprobs``) run
through a real engine in test_generation, test_streaming and test_resume.
"""

from __future__ import annotations

import pytest
from vllm.logprobs import FlatLogprobs, Logprob

from rollout_queue.workers.engine import logprobs as lp

# Three positions as vLLM builds them with logprobs=2: the sampled token first
# (rank 3 at position 1, where it is not in the top 2), then the top 2.
POSITIONS = [
    {11: Logprob(-0.1, 1), 12: Logprob(-2.5, 2)},
    {13: Logprob(-3.0, 3), 14: Logprob(-0.2, 1), 15: Logprob(-1.9, 2)},
    {16: Logprob(-0.7, 2), 17: Logprob(-0.6, 1)},
]
SAMPLED = [11, 13, 16]


def flat(positions: list) -> FlatLogprobs:
    out = FlatLogprobs()
    for position in positions:
        out.append(position)
    return out


@pytest.mark.parametrize("form", [list, flat], ids=["dicts", "flat"])
def test_sample_logprobs_read_the_sampled_token_and_the_top_k_in_either_form(form) -> None:
    values, top = lp.sample_logprobs(form(POSITIONS), SAMPLED, 2)
    assert values == [-0.1, -3.0, -0.7]
    assert top == [[(11, -0.1), (12, -2.5)], [(14, -0.2), (15, -1.9)], [(17, -0.6), (16, -0.7)]]
    assert lp.sample_logprobs(form(POSITIONS), SAMPLED, 0) == ([-0.1, -3.0, -0.7], None)
    # From a start position (a checkpoint's chunk), and a token vLLM has no entry for.
    assert lp.sample_logprobs(form(POSITIONS), [14, 99], 1, start=1) == ([-0.2, 0.0], [[(14, -0.2)], [(17, -0.6)]])


@pytest.mark.parametrize("form", [list, flat], ids=["dicts", "flat"])
def test_tokens_beyond_the_merged_positions_get_no_logprobs(form) -> None:
    """A checkpoint can read a sample whose tokens are merged before its logprobs."""
    values, top = lp.sample_logprobs(form(POSITIONS), [*SAMPLED[1:], 18, 19], 1, start=1)
    assert values == [-3.0, -0.7] and len(top) == 2


@pytest.mark.parametrize("form", [list, flat], ids=["dicts", "flat"])
def test_prompt_logprobs_give_none_where_vllm_has_no_position(form) -> None:
    values, top = lp.prompt_logprobs(form([None, *POSITIONS[:2]]), [5, 11, 13], 1)
    assert values == [None, -0.1, -3.0]
    assert top == [None, [(11, -0.1)], [(14, -0.2)]]


def test_extend_joins_flat_logprobs_as_vllms_own_extend_does() -> None:
    mine, vllms = flat(POSITIONS[:1]), flat(POSITIONS[:1])
    more = flat(POSITIONS[1:])
    lp.extend(mine, more)
    vllms.extend(flat(POSITIONS[1:]))
    assert mine == vllms
    assert lp.sample_logprobs(mine, SAMPLED, 2) == lp.sample_logprobs(POSITIONS, SAMPLED, 2)
    lp.extend(mine, FlatLogprobs())  # an empty delta (a finish without tokens)
    assert mine == vllms
