"""The warm-up's plan covers the shapes whose first batch compiles in vLLM
(workers/engine/warm_up.py); that a worker serves only after it ran is
tests/test_worker_life.py's."""

from __future__ import annotations

from rollout_queue.workers.engine.warm_up import LONG_PROMPT_TOKENS, long_prompt_ids, warm_up_plan


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]


def test_the_warm_up_meets_logprobs_alone_first_then_in_a_batch_of_several() -> None:
    alone, _, batch = warm_up_plan([5] * 304)
    assert len(alone) == 1 and alone[0].request.params.logprobs is not None
    assert sum(w.request.params.n for w in batch) >= 2
    assert sum(w.request.params.logprobs is not None for w in batch) >= 2


def test_the_warm_up_covers_short_and_long_greedy_and_sampled_with_and_without_logprobs() -> None:
    shapes = [w.request for round_ in warm_up_plan([5] * 304) for w in round_]
    lengths = {len(r.prompts[0]) if isinstance(r.prompts[0], list) else 0 for r in shapes}
    assert 304 in lengths and 0 in lengths
    assert {r.params.temperature == 0 for r in shapes} == {True, False}
    assert {r.params.logprobs is None for r in shapes} == {True, False}
    assert any(r.params.prompt_logprobs is not None for r in shapes)


def test_the_long_prompt_fits_half_the_context_at_most() -> None:
    assert len(long_prompt_ids(_Tokenizer(), 4096)) == LONG_PROMPT_TOKENS
    assert len(long_prompt_ids(_Tokenizer(), 128)) == 64


def test_the_long_prompt_is_a_multiple_of_16_tokens_and_runs_alone_once() -> None:
    """Triton compiles per class of an integer argument (1, a multiple of 16,
    other): a prompt of 16·k tokens alone is a class the other rounds miss."""
    assert len(long_prompt_ids(_Tokenizer(), 1000)) == 496
    assert len(long_prompt_ids(_Tokenizer(), 20)) == 10  # no multiple of 16 fits half of it
    rounds = warm_up_plan([5] * 304)
    alone_greedy = [w.request for round_ in rounds if len(round_) == 1 for w in round_
                    if w.request.params.temperature == 0]
    assert [len(r.prompts[0]) for r in alone_greedy] == [304]
