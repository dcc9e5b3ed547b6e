"""Token streaming: worker → per-task Redis Stream → ``generate.stream`` and the gateway's SSE.

Most tests use the shared worker (``gen_worker``) and a gateway in front of
it. The worker-death test starts a worker of its own on its own queue (it
is killed), with a gateway and a Python producer streaming from it at once.
"""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from rollout_queue.tasks import generate, keys
from rollout_queue.tasks.errors import PromptTooLong, StreamInterrupted
from rollout_queue.tasks.schemas import GenerationResult, SampleDelta, StreamEvent
from rollout_queue.tasks.streaming import STREAM_HEADER, StreamFollower
from rollout_queue.workers.engine.streaming import TaskStream
from tests.conftest import MAX_MODEL_LEN, WorkerStarter, worker_registered
from tests.procs import Proc
from tests.test_api import MODEL, RESULT_TIMEOUT, Gateway, start_gateway

# A dead worker is seen when its registry key expires (the worker's
# registry_ttl_s, 10 s) plus one idle check (1 s); the rest is margin for
# this loaded 2-core machine.
DEATH_NOTICED_S = 60


# What the worker logs when it aborts prompts whose requester went away.
ABORTED_LINE = "their client went away"

VICTIM = "stream-victim@tests"
VICTIM_QUEUE = "stream-death"


@pytest.fixture(scope="module", autouse=True)
def victim(start_worker: WorkerStarter, model_a: Path) -> Proc:
    """The worker the death test kills, on a queue of its own: started when the
    module starts, so its engine loads while the other tests run."""
    return start_worker(model_a, VICTIM, queue=VICTIM_QUEUE, pool="stream-death", wait=False)


@pytest.fixture(scope="module")
def stream_gateway(redis_url: str, gen_worker: Proc) -> Iterator[Gateway]:
    gw = start_gateway("api-stream-gateway", redis_url, {})
    yield gw
    gw.proc.stop()


def _event(kind: str, seq: int, attempt: str = "a1", deltas: list[SampleDelta] | None = None) -> dict[str, str]:
    event = StreamEvent(kind=kind, attempt=attempt, seq=seq, worker="w@x", deltas=deltas or [])  # type: ignore[arg-type]
    return {"event": event.model_dump_json()}


def _delta(text: str) -> SampleDelta:
    return SampleDelta(prompt=0, sample=0, text=text, token_ids=[1])


# --------------------------------------------------------------------------
# The reader's rules (pure logic)
# --------------------------------------------------------------------------


def test_follower_hands_on_deltas_in_order_and_stops_at_end() -> None:
    follower = StreamFollower("t")
    got = [d.text for i, e in enumerate([
        _event("start", 0), _event("delta", 1, deltas=[_delta("a")]), _event("delta", 2, deltas=[_delta("b")]),
        _event("end", 3),
    ]) for d in follower.feed(f"{i}-0", e)]
    assert got == ["a", "b"] and follower.ended and follower.last_id == "3-0"


def test_follower_refuses_a_gap_left_by_the_stream_bound() -> None:
    follower = StreamFollower("t")
    follower.feed("1-0", _event("start", 0))
    with pytest.raises(StreamInterrupted, match="skipped from event 1 to 5"):
        follower.feed("2-0", _event("delta", 5, deltas=[_delta("x")]))


def test_follower_refuses_a_restart_after_delivering_tokens_but_follows_one_before() -> None:
    follower = StreamFollower("t")
    follower.feed("1-0", _event("start", 0, "a1"))
    follower.worker_gone()  # nothing delivered: wait for the redelivered attempt
    follower.feed("2-0", _event("start", 0, "a2"))
    assert [d.text for d in follower.feed("3-0", _event("delta", 1, "a2", [_delta("x")]))] == ["x"]
    assert follower.feed("4-0", _event("delta", 1, "a1", [_delta("old")])) == []  # a stale attempt
    with pytest.raises(StreamInterrupted, match="started again"):
        follower.feed("5-0", _event("start", 0, "a3"))
    with pytest.raises(StreamInterrupted, match="heartbeat expired"):
        follower.worker_gone()


# --------------------------------------------------------------------------
# The writer's coalescing (pure logic: a recording publisher, fake engine outputs)
# --------------------------------------------------------------------------


class _RecordingPublisher:
    """Keeps the requests a ``TaskStream`` queues; the test plays the publisher thread."""

    def __init__(self) -> None:
        self.requests: list[tuple[TaskStream, str | None]] = []

    def request(self, stream: TaskStream, marker: str | None = None, written: Any = None) -> None:
        self.requests.append((stream, marker))

    def serve(self) -> list[StreamEvent]:
        """Take every queued request in order, as the publisher thread does."""
        requests, self.requests = self.requests, []
        return [StreamEvent.model_validate_json(event) for stream, marker in requests
                for _, event in stream.take(marker)]  # type: ignore[arg-type]


def _output(*tokens: int, finish: str | None = None) -> Any:
    """A delta ``RequestOutput`` of one sample, as the engine loop hands it on."""
    comp = SimpleNamespace(index=0, token_ids=list(tokens), text="".join(f"<{t}>" for t in tokens),
                           logprobs=None, finish_reason=finish, stop_reason=None)
    return SimpleNamespace(outputs=[comp])


def test_a_task_stream_writes_the_deltas_gathered_between_writes_as_one_event() -> None:
    publisher = _RecordingPublisher()
    stream = TaskStream(publisher, "rq:stream:t", "w@x", logprobs=None)  # type: ignore[arg-type]
    stream.emit("start")
    # Three engine steps of 100 prompts before the publisher runs, even before it
    # serves the start: they follow it, in one event.
    for step in range(3):
        for prompt in range(100):
            stream.on_output(prompt, _output(step))
    assert len(publisher.requests) == 2  # start, and one flush for 300 outputs
    start, delta = publisher.serve()
    assert (start.kind, start.seq, delta.kind, delta.seq) == ("start", 0, "delta", 1)
    assert [(d.prompt, d.token_ids) for d in delta.deltas] == [(p, [s]) for s in range(3) for p in range(100)]
    stream.on_output(7, _output(3, finish="length"))  # after a write: a new flush
    stream.emit("end")  # its request flushes what is pending first; the stale flush then finds nothing
    assert [(e.kind, e.seq, len(e.deltas)) for e in publisher.serve()] == [("delta", 2, 1), ("end", 3, 0)]


# --------------------------------------------------------------------------
# Python producers: generate.stream
# --------------------------------------------------------------------------


def test_generate_stream_yields_deltas_that_add_up_to_the_plain_result(gen_worker: Proc) -> None:
    # 64 tokens: outputs a lagging reader has not taken yet are merged into one
    # delta (vLLM's output collector), so a loaded machine sends fewer deltas
    # than tokens; 24 tokens left little room above the 4 asserted.
    prompts = ["Once upon a time", "2+2="]
    params = {"temperature": 0, "max_tokens": 64, "ignore_eos": True, "logprobs": 1}
    items = list(generate.stream(prompts, params, timeout=RESULT_TIMEOUT))
    deltas, final = items[:-1], items[-1]
    assert isinstance(final, GenerationResult) and all(isinstance(d, SampleDelta) for d in deltas)
    plain = GenerationResult.model_validate(generate.delay(prompts, params).get(timeout=RESULT_TIMEOUT))
    for index, output in enumerate(final.outputs):
        mine = [d for d in deltas if d.prompt == index]  # type: ignore[union-attr]
        assert len(mine) >= 4, f"prompt {index}: {len(mine)} deltas for 64 tokens: not streamed"
        sample = output.samples[0]
        assert "".join(d.text for d in mine) == sample.text  # type: ignore[union-attr]
        assert [t for d in mine for t in d.token_ids] == sample.token_ids  # type: ignore[union-attr]
        assert [lp for d in mine for lp in d.logprobs or []] == sample.logprobs  # type: ignore[union-attr]
        assert [d.finish_reason for d in mine][-1] == "length"  # type: ignore[union-attr]
        assert sample.token_ids == plain.outputs[index].samples[0].token_ids


def test_a_streamed_task_of_many_prompts_writes_far_fewer_events_than_outputs(
    gen_worker: Proc, redis_client: Any
) -> None:
    # 32 prompts (the worker's max in flight: one batch) x 32 tokens: 32 delta
    # outputs a step, which the worker wrote as 32 events a step before the
    # coalescing (a 512-prompt task on a GPU outran its readers so).
    prompts, tokens = 32, 32
    task_id = "stream-coalesced-test"
    result = generate.apply_async(
        ([f"Story {i}:" for i in range(prompts)], {"max_tokens": tokens, "ignore_eos": True, "temperature": 0}),
        task_id=task_id, headers={STREAM_HEADER: True},
    )
    final = GenerationResult.model_validate(result.get(timeout=RESULT_TIMEOUT))
    key = keys.token_stream(task_id)
    events = [StreamEvent.model_validate_json(fields["event"]) for _, fields in redis_client.xrange(key)]
    redis_client.delete(key)
    assert [e.kind for e in events[:1] + events[-1:]] == ["start", "end"]
    assert [e.seq for e in events] == list(range(len(events)))
    assert {e.attempt for e in events} == {events[0].attempt}
    deltas = [d for e in events for d in e.deltas]
    delta_events = len(events) - 2
    print(f"\n{prompts} x {tokens} tokens: {len(deltas)} delta outputs in {delta_events} events")
    assert delta_events * 4 <= len(deltas), f"{delta_events} events for {len(deltas)} outputs: not coalesced"
    assert max(len({d.prompt for d in e.deltas}) for e in events) > 1
    for index, output in enumerate(final.outputs):
        mine = [d for d in deltas if d.prompt == index]
        assert [t for d in mine for t in d.token_ids] == output.samples[0].token_ids
        assert "".join(d.text for d in mine) == output.samples[0].text
        assert mine[-1].finish_reason == "length"


def test_generate_stream_raises_the_task_error_instead_of_hanging(gen_worker: Proc) -> None:
    with pytest.raises(PromptTooLong, match="max_model_len"):
        list(generate.stream(["ab " * MAX_MODEL_LEN], {"max_tokens": 4}, timeout=RESULT_TIMEOUT))


# --------------------------------------------------------------------------
# The gateway
# --------------------------------------------------------------------------


def test_streamed_chat_relays_each_delta_with_logprobs_and_token_ids(stream_gateway: Gateway) -> None:
    client = stream_gateway.client()
    # 64 tokens for at least 4 chunks: a lagging worker merges deltas (see above).
    kwargs: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 64,
        "temperature": 0, "logprobs": True, "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    # Every chunk after the role chunk carries tokens (some decode to no text).
    content = [c for c in chunks if c.choices and c.choices[0].delta.role is None]
    assert len(content) >= 4, f"{len(content)} content chunks for 64 tokens: not streamed"
    assert "".join(c.choices[0].delta.content or "" for c in content) == plain.choices[0].message.content
    token_ids = [t for c in content for t in c.choices[0].model_extra["token_ids"]]
    assert token_ids == plain.choices[0].model_extra["token_ids"]
    streamed_lps = [lp.logprob for c in content for lp in c.choices[0].logprobs.content]  # type: ignore[union-attr]
    assert streamed_lps == [lp.logprob for lp in plain.choices[0].logprobs.content]  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 64


def test_streamed_completion_with_n_2_keeps_each_choice_apart(stream_gateway: Gateway) -> None:
    client = stream_gateway.client()
    chunks = list(client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=32, temperature=1.0, seed=3, n=2, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ))
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            per_choice[choice.index] += choice.model_extra["token_ids"]
    assert [len(ids) for ids in per_choice.values()] == [32, 32]
    assert len(chunks) >= 4


def test_a_bad_streamed_request_gets_an_http_error_not_a_stream(stream_gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        stream_gateway.client().completions.create(
            model=MODEL, prompt="ab " * MAX_MODEL_LEN, max_tokens=4, stream=True
        )


def test_a_stream_whose_client_goes_away_has_its_generation_aborted(
    stream_gateway: Gateway, gen_worker: Proc
) -> None:
    from tests.test_api import _engine_stats

    # 48 x 480 tokens: many seconds of generation, so the abort lands mid-way
    # (4 x 400 ran to the end before it on a loaded CI machine, and 8 x 480 in
    # 2.3 s on a quiet one once the model ran in the engine-core process).
    samples, max_tokens = 48, MAX_MODEL_LEN - 32
    aborted_before = gen_worker.log_path.read_text(errors="replace").count(ABORTED_LINE)
    before = _engine_stats()["generated_tokens"]
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": max_tokens, "n": samples,
            "temperature": 1.0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stream_gateway.base}/v1/completions", json=body, timeout=RESULT_TIMEOUT) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first chunk: the worker is generating
    # Closed: the gateway aborts the task's prompts; the worker's requests end early.
    stream_gateway.proc.wait_until(lambda: _engine_stats()["inflight_requests"] == 0, RESULT_TIMEOUT,
                                   "the aborted stream's requests to end")
    generated = _engine_stats()["generated_tokens"] - before
    print(f"\nabandoned stream: {generated} of {samples * max_tokens} tokens generated")
    # The worker aborted the task's prompts (its own log line), and stopped
    # generating them early (the margin: how long the abort takes to land).
    gen_worker.wait_until(
        lambda: gen_worker.log_path.read_text(errors="replace").count(ABORTED_LINE) > aborted_before,
        RESULT_TIMEOUT, "the worker to log the abort")
    assert 0 < generated < samples * max_tokens * 0.9


# --------------------------------------------------------------------------
# A worker that dies mid-stream
# --------------------------------------------------------------------------


def test_a_worker_killed_mid_stream_ends_both_streams_with_an_error(
    redis_url: str, redis_client: Any, victim: Proc
) -> None:
    queue = VICTIM_QUEUE
    victim.wait_until(lambda: worker_registered(redis_client, VICTIM), 240, f"{VICTIM} to serve")
    gw = start_gateway("api-stream-death", redis_url, {"RQ_API_QUEUE": queue})
    # Long generations (16 samples x 480 tokens each): still running when the
    # kill lands. The gateway's stream starts first; the kill follows the
    # Python producer's first delta, so neither has had time to finish (seen
    # in CI with both started at once: the Python side's task ended before the
    # gateway's first chunk came).
    long = {"max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True, "temperature": 1.0, "n": 16}
    try:
        streaming = threading.Event()

        def python_stream() -> str:
            stream = generate.stream(["Once upon a time"], long, queue=queue, timeout=RESULT_TIMEOUT)
            next(stream)  # a first delta: the worker is streaming
            streaming.set()
            try:
                for _ in stream:
                    pass
            except StreamInterrupted as exc:
                return str(exc)
            return "ended without an error"

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            chunks = gw.client().completions.create(
                model=MODEL, prompt="Tell me a story", stream=True,
                **{k: v for k, v in long.items() if k != "ignore_eos"},
                extra_body={"ignore_eos": True},
            )
            next(iter(chunks))
            python_side = pool.submit(python_stream)
            assert streaming.wait(RESULT_TIMEOUT), "the Python producer's stream never started"
            killed_at = time.monotonic()
            victim.kill_tree(signal.SIGKILL)
            with pytest.raises(openai.APIError, match="stopped"):
                for _ in chunks:
                    pass
            noticed = time.monotonic() - killed_at
            assert noticed < DEATH_NOTICED_S
            assert "stopped" in python_side.result(timeout=DEATH_NOTICED_S)
        print(f"\nworker death noticed by the gateway stream after {noticed:.1f} s")
        # The task is redelivered by the reaper; its prompts are marked abandoned.
        assert gw.proc.alive()
    finally:
        gw.proc.stop()
        victim.stop()


def test_an_unread_stream_is_bounded_and_expires(gen_worker: Proc, redis_client: Any) -> None:
    task_id = "stream-unread-test"
    result = generate.apply_async(
        (["Once upon"], {"max_tokens": 8, "ignore_eos": True}), task_id=task_id, headers={STREAM_HEADER: True}
    )
    result.get(timeout=RESULT_TIMEOUT)
    key = keys.token_stream(task_id)
    entries = redis_client.xrange(key)
    kinds = [StreamEvent.model_validate_json(fields["event"]).kind for _, fields in entries]
    assert kinds[0] == "start" and kinds[-1] == "end" and "delta" in kinds
    assert 0 < redis_client.ttl(key) <= keys.TOKEN_STREAM_TTL_S
    redis_client.delete(key)
